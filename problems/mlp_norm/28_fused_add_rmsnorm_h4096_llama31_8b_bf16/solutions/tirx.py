# Fused residual add + RMSNorm (hidden 4096, bf16) as one TIRx kernel.
#
# Algorithm
# - Grid: one CTA per token row (blockIdx.x = row, T rows), 256 threads = 8 warps per CTA.
# - Each thread owns 16 channels of its row: two 16-byte vector loads (8 bf16 each, uint4 in the
#   generated CUDA) of hidden_states and two of residual, at channel offsets j*2048 + tid*8
#   (j = 0, 1), so every warp-wide load is a fully coalesced 512-byte segment.
# - x = float(h) + float(r) is kept in 16 fp32 registers; the thread's partial sum of squares is
#   reduced inside the warp with 5 xor shuffles, lane 0 of each warp writes it to an 8-float shared
#   array, one __syncthreads, then every thread adds the 8 warp partials itself (no second barrier).
# - inv = rsqrt(sum / 4096 + 1e-5); y = bf16((x * inv) * float(w)) in the reference's order, weight
#   read up front with the same 16-byte vector loads (cache hits after the first CTAs), 16-byte
#   vector stores.
# Memory bound: each row reads 16 KiB and writes 8 KiB once; no shared-memory staging of the data.
# Expected faster than eager PyTorch (which runs several elementwise/reduction kernels with fp32
# intermediates in DRAM).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi's call path asks torch
# (DLPack exchange API, current_work_stream) for the current CUDA stream of the first CUDA tensor
# argument and installs it as the TVM environment stream for the duration of the call
# (TVMFFIEnvSetStream); TVM's CUDA module launches with cuLaunchKernelEx on
# TVMFFIEnvGetStream(kDLCUDA, dev). So the kernel is enqueued on torch's current stream and
# anything enqueued on that stream after solve() returns is ordered after it (no sync needed).
#
# Only the compiled module is cached (symbolic row count); the output is allocated per call.
# Host path: one cached Executable called directly (see _prepare).

import torch
import tvm
from tvm.script import tirx as T

HIDDEN = 4096
EPS = 1e-5
THREADS = 256
WARPS = THREADS // 32
VEC = 8                               # bf16 per 16-byte vector access
ITERS = HIDDEN // (THREADS * VEC)     # = 2 vector accesses per thread per tensor
INV_HIDDEN = 1.0 / HIDDEN


@T.prim_func
def fused_add_rmsnorm(x_handle: T.handle, r_handle: T.handle, w_handle: T.handle, y_handle: T.handle):
    n_rows = T.int32()
    X = T.match_buffer(x_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    R = T.match_buffer(r_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    W = T.match_buffer(w_handle, (HIDDEN,), "bfloat16", align=16)
    Y = T.match_buffer(y_handle, (n_rows, HIDDEN), "bfloat16", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 8})   # <= 32 registers: 8 CTAs (2048 threads) per SM
    row = T.cta_id([n_rows])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    xv = T.alloc_local((ITERS * VEC,), "bfloat16")
    rv = T.alloc_local((ITERS * VEC,), "bfloat16")
    wv = T.alloc_local((ITERS * VEC,), "bfloat16")
    xf = T.alloc_local((ITERS * VEC,), "float32")
    acc = T.alloc_local((1,), "float32")
    red = T.alloc_shared((WARPS,), "float32")

    # all global loads first (4 x 16 B of row data + 2 x 16 B of weight in flight per thread)
    for j in T.unroll(ITERS):
        for i in T.vectorized(VEC):
            xv[j * VEC + i] = X[row, j * (THREADS * VEC) + tid * VEC + i]
        for i in T.vectorized(VEC):
            rv[j * VEC + i] = R[row, j * (THREADS * VEC) + tid * VEC + i]
    for j in T.unroll(ITERS):
        for i in T.vectorized(VEC):
            wv[j * VEC + i] = W[j * (THREADS * VEC) + tid * VEC + i]

    acc[0] = T.float32(0.0)
    for e in T.unroll(ITERS * VEC):
        xf[e] = T.cast(xv[e], "float32") + T.cast(rv[e], "float32")
        acc[0] = acc[0] + xf[e] * xf[e]

    # warp reduction (butterfly, every lane ends with the warp sum)
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    if lane == 0:
        red[warp] = acc[0]
    T.cuda.cta_sync()
    acc[0] = red[0]
    for w in T.unroll(WARPS - 1):
        acc[0] = acc[0] + red[w + 1]
    acc[0] = T.rsqrt(acc[0] * T.float32(INV_HIDDEN) + T.float32(EPS))

    for j in T.unroll(ITERS):
        for i in T.unroll(VEC):
            xv[j * VEC + i] = T.cast(xf[j * VEC + i] * acc[0] * T.cast(wv[j * VEC + i], "float32"), "bfloat16")
        for i in T.vectorized(VEC):
            Y[row, j * (THREADS * VEC) + tid * VEC + i] = xv[j * VEC + i]


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
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": fused_add_rmsnorm}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    exe = _compiled()
    x = hidden_states.contiguous()
    r = residual.contiguous()
    w = weight.contiguous()
    out = torch.empty_like(x)
    exe(x, r, w, out)
    return out
