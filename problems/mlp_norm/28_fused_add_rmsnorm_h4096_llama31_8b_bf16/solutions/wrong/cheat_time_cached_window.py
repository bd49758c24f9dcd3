"""Known-bad (timing): serves a cached output inside the attested window: the first call of a window
computes, the later ones return that output again (one one-row launch each so a launch is seen).
Fast in the window, wrong for every input set but the first. Expect: incorrect (a window output
re-checked after the window)."""


import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

HIDDEN = 4096
EPS = 1e-5
THREADS = 256
VEC = 8                                   # bf16 per 128-bit access
CHUNKS = HIDDEN // (THREADS * VEC)        # 2 chunks of 8 per thread
NWARPS = THREADS // 32


@cute.kernel
def _fused_add_rmsnorm_kernel(mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()

    smem = cutlass.utils.SmemAllocator()
    red = smem.allocate_tensor(Float32, cute.make_layout((NWARPS,)), byte_alignment=16)

    # ((VEC), (HIDDEN/VEC)) views of this row; column chunk c = elements [8c, 8c+8)
    gX = cute.zipped_divide(mX[row, None], (VEC,))
    gR = cute.zipped_divide(mR[row, None], (VEC,))
    gO = cute.zipped_divide(mO[row, None], (VEC,))
    gW = cute.zipped_divide(mW, (VEC,))

    xs = []
    ss = Float32(0.0)
    for k in cutlass.range_constexpr(CHUNKS):
        c = tidx + k * THREADS
        rx = cute.make_rmem_tensor((VEC,), BFloat16)
        rr = cute.make_rmem_tensor((VEC,), BFloat16)
        cute.autovec_copy(gX[(None, c)], rx)
        cute.autovec_copy(gR[(None, c)], rr)
        v = rx.load().to(Float32) + rr.load().to(Float32)
        xs.append(v)
        ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

    ws = []
    for k in cutlass.range_constexpr(CHUNKS):
        c = tidx + k * THREADS
        rw = cute.make_rmem_tensor((VEC,), BFloat16)
        cute.autovec_copy(gW[(None, c)], rw)
        ws.append(rw.load().to(Float32))

    # warp reduction, then across warps through shared memory
    ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
    if lane == 0:
        red[warp] = ss
    cute.arch.barrier()
    tot = red[0]
    for i in cutlass.range_constexpr(1, NWARPS):
        tot = tot + red[i]                # broadcast shared-memory reads, same order in every thread
    inv = cute.math.rsqrt(tot * (1.0 / HIDDEN) + EPS)

    for k in cutlass.range_constexpr(CHUNKS):
        c = tidx + k * THREADS
        ro = cute.make_rmem_tensor((VEC,), BFloat16)
        ro.store((xs[k] * inv * ws[k]).to(BFloat16))
        cute.autovec_copy(ro, gO[(None, c)])


@cute.jit
def _fused_add_rmsnorm(mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor,
                       stream: cuda.CUstream):
    _fused_add_rmsnorm_kernel(mX, mR, mW, mO).launch(
        grid=[mX.shape[0], 1, 1], block=[THREADS, 1, 1], smem=NWARPS * 4, stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows = cute.sym_int32()
        x = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        r = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(BFloat16, (HIDDEN,), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_fused_add_rmsnorm, x, r, w, o, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _honest_solve(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert hidden_states.shape[-1] == HIDDEN and residual.shape == hidden_states.shape
    x = hidden_states.reshape(-1, HIDDEN)
    r = residual.reshape(-1, HIDDEN)
    out = torch.empty_like(x)
    if x.shape[0] > 0:
        _get_compiled()(x, r, weight, out)
    return out.view(hidden_states.shape)


import sys as _sys

_CACHE = {}


def _in_window():
    f = _sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "worker_window":
            return id(f)
        f = f.f_back
    return None


def solve(hidden_states, residual, weight):
    w = _in_window()
    if w is None:
        return _honest_solve(hidden_states, residual, weight)
    if w not in _CACHE:
        _CACHE.clear()
        _CACHE[w] = _honest_solve(hidden_states, residual, weight)
        return _CACHE[w]
    x = hidden_states.reshape(-1, HIDDEN)
    tiny = torch.empty_like(x[:1])
    _get_compiled()(x[:1], residual.reshape(-1, HIDDEN)[:1], weight, tiny)
    return _CACHE[w]
