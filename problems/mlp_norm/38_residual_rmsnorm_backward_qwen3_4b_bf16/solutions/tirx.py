# Residual-add + RMSNorm backward (Qwen3 4B, hidden 2560, bf16 in/out, fp32 math) as two TIRx kernels.
#
# Same algorithm as the CuTe DSL solution (which passed on the H200 at 0.114 ms device time):
# Kernel 1 (rows), persistent: grid G = min(T, 396) CTAs (3 per SM on 132 SMs, launch bounds ask for
#   <= 64 registers), 320 threads = 10 warps. Thread t owns columns 8t..8t+7 of every row (one 16-byte
#   bf16x8 access per tensor per row, 512 contiguous bytes per warp); CTA b takes rows b, b+G, b+2G, ...,
#   so its 8 weights and its 8 fp32 d_weight partials stay in registers for the whole kernel.
#   Per row: 16-byte loads of dy, d_residual, x, residual; s = x + r in fp32; the two sums
#   S1 = sum s^2 and S2 = sum dy w s in one pass (mean(dy w shat) = rstd * S2 / H): xor-shuffle warp
#   butterfly, 10 warp partials per sum to shared memory double-buffered by iteration parity (one
#   __syncthreads per row), every thread adds the 10 partials in the same order (identical totals).
#   rstd = rsqrt(S1/H + eps); ds = d_res + rstd (dy w - shat * rstd S2 / H), shat = s rstd, rounded once
#   to bf16, 16-byte stores; d_weight partial += dy * shat.
#   Each CTA writes its 2560 fp32 partials to a workspace row [G, 2560] (cached per device and G).
# Kernel 2 (d_weight): 80 CTAs x 256 threads; CTA j sums columns 32j..32j+31 over the G partial rows
#   (warp w takes rows w, w+8, ...; lane = column: 128-byte coalesced loads), the 8 warp sums are added
#   through shared memory in a fixed order (deterministic), rounded to bf16.
# Differences from the CuTe DSL version: the per-thread 8-element sums are sequential fp32 adds instead of
#   the DSL's reduce; the 10 warp partials are added sequentially by every thread instead of a second
#   butterfly; the row loop is a fixed trip count ceil(T / G) with a CTA-uniform guard. None of these
#   changes the memory traffic.
# Limits: DRAM: 4 x 84 MB read + 84 MB written = 419 MB (87 us at 4.8 TB/s) plus ~8 MB of workspace
#   traffic. Expected ~110-120 us of device time like the CuTe DSL kernels; far faster than eager PyTorch
#   (1.97 ms) and torch.compile (1.38 ms), which materialise fp32 temporaries.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator of the generated CUDA; not
# yet run on the H200.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on
# torch's current stream. Cached: the two compiled modules (symbolic row count and G) and the workspace.

import torch
import tvm
from tvm.script import tirx as T

HIDDEN = 2560
EPS = 1e-6
VEC = 8                          # bf16 per 16-byte access
THREADS = HIDDEN // VEC          # 320: one 8-column chunk per thread
WARPS = THREADS // 32            # 10
SMS = 132
CTAS_PER_SM = 3
RED_THREADS = 256
RED_COLS = 32
RED_WARPS = RED_THREADS // 32
INV_H = 1.0 / HIDDEN


@T.prim_func
def rows_kernel(dy_handle: T.handle, dr_handle: T.handle, x_handle: T.handle, r_handle: T.handle,
                w_handle: T.handle, ds_handle: T.handle, part_handle: T.handle):
    n_rows = T.int32()
    n_cta = T.int32()
    DY = T.match_buffer(dy_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    DR = T.match_buffer(dr_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    X = T.match_buffer(x_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    R = T.match_buffer(r_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    W = T.match_buffer(w_handle, (HIDDEN,), "bfloat16", align=16)
    DS = T.match_buffer(ds_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    PART = T.match_buffer(part_handle, (n_cta, HIDDEN), "float32", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": CTAS_PER_SM})   # <= 64 registers: 960 threads per SM
    cta = T.cta_id([n_cta])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    wb = T.alloc_local((VEC,), "bfloat16")
    dyb = T.alloc_local((VEC,), "bfloat16")
    drb = T.alloc_local((VEC,), "bfloat16")
    xb = T.alloc_local((VEC,), "bfloat16")
    rb = T.alloc_local((VEC,), "bfloat16")
    ob = T.alloc_local((VEC,), "bfloat16")
    sf = T.alloc_local((VEC,), "float32")
    dw = T.alloc_local((VEC,), "float32")
    acc = T.alloc_local((2,), "float32")
    st = T.alloc_local((2,), "float32")          # rstd, rstd * S2 / H
    red = T.alloc_shared((2, 2, WARPS), "float32")

    for i in T.vectorized(VEC):
        wb[i] = W[tid * VEC + i]
    for i in T.unroll(VEC):
        dw[i] = T.float32(0.0)

    for k in range(T.ceildiv(n_rows, n_cta)):
        row: T.let[T.int32] = cta + k * n_cta
        if row < n_rows:                         # CTA-uniform: the barrier below is reached by all or none
            for i in T.vectorized(VEC):
                dyb[i] = DY[row, tid * VEC + i]
            for i in T.vectorized(VEC):
                xb[i] = X[row, tid * VEC + i]
            for i in T.vectorized(VEC):
                rb[i] = R[row, tid * VEC + i]
            for i in T.vectorized(VEC):
                drb[i] = DR[row, tid * VEC + i]
            acc[0] = T.float32(0.0)
            acc[1] = T.float32(0.0)
            for i in T.unroll(VEC):
                sf[i] = T.cast(xb[i], "float32") + T.cast(rb[i], "float32")
                acc[0] = acc[0] + sf[i] * sf[i]
                acc[1] = acc[1] + (T.cast(dyb[i], "float32") * T.cast(wb[i], "float32")) * sf[i]
            for sh in T.unroll(5):
                for j in T.unroll(2):
                    acc[j] = acc[j] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[j], 16 >> sh, 32, 32)
            if lane == 0:
                red[k % 2, 0, warp] = acc[0]
                red[k % 2, 1, warp] = acc[1]
            T.cuda.cta_sync()
            for j in T.unroll(2):
                acc[j] = red[k % 2, j, 0]
                for w in T.unroll(WARPS - 1):
                    acc[j] = acc[j] + red[k % 2, j, w + 1]
            st[0] = T.rsqrt(acc[0] * T.float32(INV_H) + T.float32(EPS))
            st[1] = st[0] * acc[1] * T.float32(INV_H)
            for i in T.unroll(VEC):
                ob[i] = T.cast(T.cast(drb[i], "float32")
                               + st[0] * (T.cast(dyb[i], "float32") * T.cast(wb[i], "float32")
                                          - (sf[i] * st[0]) * st[1]), "bfloat16")
                dw[i] = dw[i] + T.cast(dyb[i], "float32") * (sf[i] * st[0])
            for i in T.vectorized(VEC):
                DS[row, tid * VEC + i] = ob[i]

    for q in T.unroll(VEC // 4):
        for i in T.vectorized(4):
            PART[cta, tid * VEC + q * 4 + i] = dw[q * 4 + i]


@T.prim_func
def dw_kernel(part_handle: T.handle, dw_handle: T.handle):
    n_cta = T.int32()
    PART = T.match_buffer(part_handle, (n_cta, HIDDEN), "float32")
    DW = T.match_buffer(dw_handle, (HIDDEN,), "bfloat16")

    T.device_entry()
    cb = T.cta_id([HIDDEN // RED_COLS])
    tid = T.thread_id([RED_THREADS])
    warp = T.warp_id([RED_WARPS])
    lane = T.lane_id([32])
    acc = T.alloc_local((4,), "float32")
    tot = T.alloc_local((1,), "float32")
    red = T.alloc_shared((RED_WARPS, RED_COLS), "float32")

    for j in T.unroll(4):
        acc[j] = T.float32(0.0)
    for r in range(T.ceildiv(n_cta, RED_WARPS * 4)):
        for j in T.unroll(4):
            if (r * 4 + j) * RED_WARPS + warp < n_cta:
                acc[j] = acc[j] + PART[(r * 4 + j) * RED_WARPS + warp, cb * RED_COLS + lane]
    red[warp, lane] = (acc[0] + acc[1]) + (acc[2] + acc[3])
    T.cuda.cta_sync()
    if warp == 0:
        tot[0] = red[0, lane]
        for w in T.unroll(RED_WARPS - 1):
            tot[0] = tot[0] + red[w + 1, lane]
        DW[cb * RED_COLS + lane] = T.cast(tot[0], "bfloat16")


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; for a module that is already runnable (llvm host + cuda
    # device code) jit() re-walks the import tree on every call (tens of us of Python). Caching the
    # result the way jit() itself does for exported modules makes the call path ~0.2 us.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled():
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (rows_kernel, dw_kernel))
        _CACHE["exes"] = exes
    return exes


def _workspace(device, parts):
    key = ("ws", str(device), parts)
    ws = _CACHE.get(key)
    if ws is None:
        ws = _CACHE[key] = torch.empty((parts, HIDDEN), dtype=torch.float32, device=device)
    return ws


def solve(dy: torch.Tensor, d_residual: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
          weight: torch.Tensor):
    assert x.shape[-1] == HIDDEN and x.dtype == torch.bfloat16
    rows_k, dw_k = _compiled()
    shape = x.shape
    dy2, dr2, x2, r2 = (t.reshape(-1, HIDDEN).contiguous() for t in (dy, d_residual, x, residual))
    rows = x2.shape[0]
    ds = torch.empty_like(x2)
    dw = torch.empty((HIDDEN,), dtype=weight.dtype, device=x.device)
    parts = max(1, min(rows, SMS * CTAS_PER_SM))
    part = _workspace(x.device, parts)
    if rows > 0:
        rows_k(dy2, dr2, x2, r2, weight.contiguous(), ds, part)
    else:
        part.zero_()
    dw_k(part, dw)
    return ds.view(shape), dw
