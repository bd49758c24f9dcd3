"""RMSNorm over rows of 128 bf16 (520128 rows) in CuTe DSL.

Algorithm
- 16 threads per row, each owning 8 contiguous bf16 (one 128-bit ld.global.v4 / st.global.v4);
  a warp covers 2 consecutive rows = 512 contiguous bytes per access.
- CTA = 256 threads = 16 row groups; each group handles ROWS_PER_GROUP (1) row(s), rows
  base + j*16 + group, so a CTA covers 16 rows (x and w: 2 independent 128-bit loads per thread).
  Grid = ceil(R / 16) CTAs (32508 for the full size).
- Sum of squares in fp32: 8 products per thread, then a butterfly shuffle reduction inside the
  16-lane group (offsets 8,4,2,1), no shared memory and no CTA barrier.
- y = x * rsqrt(sum/128 + eps) * w in fp32, rounded to bf16, 128-bit store.
- Tail rows: loads use a row index clamped to R-1 (always in bounds, every lane takes part in the
  shuffles), stores are predicated on row < R.
Host path: compiled once per process (tvm-ffi, fake tensors with a dynamic row count), called with
the torch tensors directly; the launch uses the caller's current torch stream (tvm-ffi env stream).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

HIDDEN = 128
EPS = 1e-6
VEC = 8                                   # bf16 per 128-bit access
LANES = HIDDEN // VEC                     # 16 threads per row
THREADS = 256
GROUPS = THREADS // LANES                 # 16 row groups per CTA
ROWS_PER_GROUP = 1                        # 2 and 4 measured slightly slower on H200
ROWS_PER_CTA = GROUPS * ROWS_PER_GROUP    # 16


@cute.kernel
def _rmsnorm_kernel(mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nrows = mX.shape[0]
    grp = tidx // LANES
    lane = tidx % LANES

    gX = cute.zipped_divide(mX, (1, VEC))     # ((1, VEC), (R, LANES))
    gO = cute.zipped_divide(mO, (1, VEC))
    gW = cute.zipped_divide(mW, (VEC,))       # ((VEC), (LANES))

    xs = []
    sss = []
    rows = []
    for j in cutlass.range_constexpr(ROWS_PER_GROUP):
        r = bidx * ROWS_PER_CTA + j * GROUPS + grp
        rc = cutlass.min(r, nrows - 1)
        rx = cute.make_rmem_tensor((1, VEC), BFloat16)
        cute.autovec_copy(gX[(None, (rc, lane))], rx)
        v = rx.load().to(Float32)
        xs.append(v)
        sss.append((v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
        rows.append(r)

    rw = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(gW[(None, lane)], rw)
    w = rw.load().to(Float32)

    for j in cutlass.range_constexpr(ROWS_PER_GROUP):
        ss = cute.arch.warp_reduction(sss[j], lambda a, b: a + b, threads_in_group=LANES)
        inv = cute.math.rsqrt(ss * (1.0 / HIDDEN) + EPS)
        ro = cute.make_rmem_tensor((1, VEC), BFloat16)
        ro.store((xs[j] * inv * w.reshape((1, VEC))).to(BFloat16))
        if rows[j] < nrows:
            cute.autovec_copy(ro, gO[(None, (rows[j], lane))])


@cute.jit
def _rmsnorm(mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
    nrows = mX.shape[0]
    _rmsnorm_kernel(mX, mW, mO).launch(
        grid=[(nrows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows = cute.sym_int32()
        x = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(BFloat16, (HIDDEN,), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_rmsnorm, x, w, o, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert hidden_states.shape[-1] == HIDDEN
    x = hidden_states.reshape(-1, HIDDEN)
    out = torch.empty_like(x)
    if x.shape[0] > 0:
        _get_compiled()(x, weight, out)
    return out.view(hidden_states.shape)
