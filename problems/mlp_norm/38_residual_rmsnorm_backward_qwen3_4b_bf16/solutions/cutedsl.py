"""Residual-add + RMSNorm backward (hidden 2560, bf16 in/out, fp32 math) in CuTe DSL.

Algorithm (two kernels launched back to back by one compiled host function)
Kernel 1 (rows): grid G = min(T, 396) CTAs (3 per SM on 132 SMs: 62 registers), 320 threads
(10 warps).
- Thread t owns columns 8t..8t+7 of every row (one 128-bit access per tensor per row); CTA b
  takes rows b, b + G, ..., so its thread's weight and d_weight partials (8 fp32) stay in
  registers for the whole kernel. (Two rows per iteration needed ~94 registers -> 1 CTA per SM;
  one row with 30 resident warps per SM keeps ~60 KB of loads in flight per SM instead.)
- Per row: 128-bit loads of dy, d_residual, x, residual (kept as bf16 in registers until used),
  s = x + r in fp32; one fused reduction pass of sum(s^2) and sum(dy * w * s): per thread ->
  warp butterfly -> 10 warp partials in shared memory (double-buffered by iteration parity, so
  one CTA barrier per row) -> every warp re-reduces the 10 partials with a butterfly (identical
  totals in all threads).
  rstd = rsqrt(sum(s^2)/H + eps); mean(dy w shat) = rstd * sum(dy w s) / H;
  ds = d_res + rstd * (dy w - shat * mean), shat = s * rstd, rounded to bf16 (128-bit stores);
  d_weight partial += dy * shat.
- Each CTA writes its 2560 fp32 partials to a workspace [G, 2560] (cached per device and G).
Kernel 2 (d_weight): 80 CTAs x 256 threads; CTA j sums columns 32j..32j+31 over the G partials
(warp w takes partial rows w, w+8, ..; lane = column, 128-byte coalesced loads), 8 warp sums
combined through shared memory in a fixed order (deterministic), rounded to bf16.
What limits it: DRAM bandwidth: 4 x 84 MB read + 84 MB written = 419 MB (87 us at 4.8 TB/s);
the workspace adds ~8 MB of traffic. Expected ~100 us.
Host path: compiled once per process with tvm-ffi (symbolic row count and G), torch tensors
passed directly on the caller's current stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

HIDDEN = 2560
EPS = 1e-6
VEC = 8
THREADS = HIDDEN // VEC            # 320: one 8-column chunk per thread
NWARPS = THREADS // 32             # 10
ROWS = 1                           # rows per iteration (2 needs ~94 registers: 1 CTA per SM)
NVAL = 2 * ROWS                    # reduced values per iteration: (sum s^2, sum g w s) per row
SMS = 132
CTAS_PER_SM = 3
RED_THREADS = 256
RED_COLS = 32
RED_WARPS = RED_THREADS // 32


@cute.jit
def _raw(row: cute.Tensor, chunk: Int32) -> cute.Tensor:
    """128-bit load of bf16 elements [8*chunk, 8*chunk+8) of a row into registers (kept as bf16)."""
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(cute.zipped_divide(row, (VEC,))[(None, chunk)], r)
    return r


@cute.kernel
def _rows_kernel(mDY: cute.Tensor, mDR: cute.Tensor, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor,
                 mDS: cute.Tensor, mP: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    nrows = mX.shape[0]
    npairs = (nrows + ROWS - 1) // ROWS     # row groups of ROWS rows

    smem = cutlass.utils.SmemAllocator()
    red = smem.allocate_tensor(Float32, cute.make_layout((2, NWARPS, NVAL), stride=(NWARPS * NVAL, NVAL, 1)),
                               byte_alignment=16)

    w = _raw(mW, tidx)
    dw = cute.make_rmem_tensor((VEC,), Float32)
    dw.fill(0.0)

    it = Int32(0)
    for pr in cutlass.range(bidx, npairs, gdim):
        # issue all loads of the pair first; dy and d_res stay bf16 in registers until used
        rows = []
        dys = []
        drs = []
        xs = []
        rs = []
        for k in cutlass.range_constexpr(ROWS):
            r = pr * ROWS + k
            rows.append(r)
            rc = cutlass.min(r, nrows - 1)
            dys.append(_raw(mDY[rc, None], tidx))
            xs.append(_raw(mX[rc, None], tidx))
            rs.append(_raw(mR[rc, None], tidx))
            drs.append(_raw(mDR[rc, None], tidx))
        wf = w.load().to(Float32)
        ss = []
        vals = []
        for k in cutlass.range_constexpr(ROWS):
            s = xs[k].load().to(Float32) + rs[k].load().to(Float32)
            gw = dys[k].load().to(Float32) * wf
            ss.append(s)
            vals.append((s * s).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            vals.append((gw * s).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
        par = it % 2
        for v in cutlass.range_constexpr(NVAL):
            red_v = cute.arch.warp_reduction(vals[v], lambda a, b: a + b)
            if lane == 0:
                red[par, warp, v] = red_v
        cute.arch.barrier()
        # lane i < 10 of every warp picks warp i's partial; a butterfly gives every lane the total
        # (bitwise identical in all lanes and warps)
        tot = []
        src = cutlass.min(lane, NWARPS - 1)
        for v in cutlass.range_constexpr(NVAL):
            part = Float32(cutlass.select_(lane < NWARPS, red[par, src, v], Float32(0.0)))
            tot.append(cute.arch.warp_reduction(part, lambda a, b: a + b))
        for k in cutlass.range_constexpr(ROWS):
            rstd = cute.math.rsqrt(tot[2 * k] * (1.0 / HIDDEN) + EPS)
            mean = rstd * tot[2 * k + 1] * (1.0 / HIDDEN)
            g = dys[k].load().to(Float32)
            shat = ss[k] * rstd
            ds = drs[k].load().to(Float32) + rstd * (g * wf - shat * mean)
            if rows[k] < nrows:
                ro = cute.make_rmem_tensor((VEC,), BFloat16)
                ro.store(ds.to(BFloat16))
                cute.autovec_copy(ro, cute.zipped_divide(mDS[rows[k], None], (VEC,))[(None, tidx)])
                dw.store(dw.load() + g * shat)
        it = it + 1

    cute.autovec_copy(dw, cute.zipped_divide(mP[bidx, None], (VEC,))[(None, tidx)])


@cute.kernel
def _dw_kernel(mP: cute.Tensor, mDW: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    nparts = mP.shape[0]
    col = bidx * RED_COLS + lane

    smem = cutlass.utils.SmemAllocator()
    red = smem.allocate_tensor(Float32, cute.make_layout((RED_WARPS, RED_COLS), stride=(RED_COLS, 1)),
                               byte_alignment=16)
    acc = Float32(0.0)
    for k in cutlass.range(warp, nparts, RED_WARPS, unroll=4):
        acc = acc + mP[k, col]
    red[warp, lane] = acc
    cute.arch.barrier()
    if warp == 0:
        tot = red[0, lane]
        for i in cutlass.range_constexpr(1, RED_WARPS):
            tot = tot + red[i, lane]
        mDW[col] = tot.to(BFloat16)


@cute.jit
def _bwd(mDY: cute.Tensor, mDR: cute.Tensor, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor,
         mDS: cute.Tensor, mP: cute.Tensor, mDW: cute.Tensor, stream: cuda.CUstream):
    nparts = mP.shape[0]
    _rows_kernel(mDY, mDR, mX, mR, mW, mDS, mP).launch(
        grid=[nparts, 1, 1], block=[THREADS, 1, 1], smem=2 * NWARPS * NVAL * 4 + 64, stream=stream,
        )
    _dw_kernel(mP, mDW).launch(grid=[HIDDEN // RED_COLS, 1, 1], block=[RED_THREADS, 1, 1],
                               smem=RED_WARPS * RED_COLS * 4 + 64, stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows, parts = cute.sym_int32(), cute.sym_int32()
        mats = [make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
                for _ in range(5)]
        w = make_fake_compact_tensor(BFloat16, (HIDDEN,), assumed_align=16)
        p = make_fake_compact_tensor(Float32, (parts, HIDDEN), stride_order=(1, 0), assumed_align=16)
        dw = make_fake_compact_tensor(BFloat16, (HIDDEN,), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_bwd, mats[0], mats[1], mats[2], mats[3], w, mats[4], p, dw, stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _workspace(device, parts):
    key = (str(device), parts)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = torch.empty((parts, HIDDEN), dtype=torch.float32, device=device)
        _WORKSPACE[key] = ws
    return ws


def solve(dy: torch.Tensor, d_residual: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
          weight: torch.Tensor):
    assert x.shape[-1] == HIDDEN and x.dtype == torch.bfloat16
    shape = x.shape
    dy2, dr2, x2, r2 = (t.reshape(-1, HIDDEN) for t in (dy, d_residual, x, residual))
    rows = x2.shape[0]
    ds = torch.empty_like(x2)
    dw = torch.empty((HIDDEN,), dtype=weight.dtype, device=x.device)
    parts = max(1, min((rows + ROWS - 1) // ROWS, SMS * CTAS_PER_SM))
    _get_compiled()(dy2, dr2, x2, r2, weight, ds, _workspace(x.device, parts), dw)
    return ds.view(shape), dw
