# RMSNorm over rows of 128 bf16 channels (Qwen3 per-head q/k norm), one TIRx kernel.
#
# Algorithm
# - Grid: ceil(R / 16) CTAs of 256 threads; CTA c owns rows 16c .. 16c+15.
# - A row is owned by a group of 16 consecutive lanes (half a warp): lane l of the group holds
#   channels 8l .. 8l+7, loaded with one 16-byte vector load (8 bf16, uint4 in the generated CUDA);
#   a warp therefore reads two whole rows = 512 contiguous bytes per load instruction.
# - The weight slice (8 bf16) is read with one 16-byte vector load as well (cache hit after the
#   first CTAs).
# - Sum of squares in fp32, reduced inside the 16-lane group with 4 xor shuffles (offsets
#   8, 4, 2, 1 never leave the group, so all 32 lanes stay converged; no shared memory, no barrier).
# - y = bf16((x * rsqrt(sum / 128 + 1e-6)) * float(w)) in the reference's order, one 16-byte
#   vector store per lane. Rows past R (only if R is not a multiple of 16) load zeros and skip
#   the store; the shuffles stay unconditional.
# Memory bound: 266 MB moved once, no staging.
# Expected faster than eager PyTorch (several kernels with fp32 intermediates in DRAM). Each
# thread has only one 16-byte load in flight (32 KiB per SM at full occupancy); if the H200
# measurement falls short of the DRAM floor, 2 rows per 16-lane group (32 rows per CTA) is the
# next step.
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

HIDDEN = 128
EPS = 1e-6
THREADS = 256
VEC = 8                                # bf16 per 16-byte access
LANES_PER_ROW = HIDDEN // VEC          # 16
ROWS_PER_CTA = THREADS // LANES_PER_ROW  # 16
INV_HIDDEN = 1.0 / HIDDEN


@T.prim_func
def rmsnorm_h128(x_handle: T.handle, w_handle: T.handle, y_handle: T.handle):
    n_rows = T.int32()
    X = T.match_buffer(x_handle, (n_rows, HIDDEN), "bfloat16", align=16)
    W = T.match_buffer(w_handle, (HIDDEN,), "bfloat16", align=16)
    Y = T.match_buffer(y_handle, (n_rows, HIDDEN), "bfloat16", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 8})   # full occupancy: 2048 threads per SM
    cta = T.cta_id([T.ceildiv(n_rows, ROWS_PER_CTA)])
    tid = T.thread_id([THREADS])

    xv = T.alloc_local((VEC,), "bfloat16")
    wv = T.alloc_local((VEC,), "bfloat16")
    xf = T.alloc_local((VEC,), "float32")
    acc = T.alloc_local((1,), "float32")

    row: T.let[T.int32] = cta * ROWS_PER_CTA + tid // LANES_PER_ROW
    col: T.let[T.int32] = (tid % LANES_PER_ROW) * VEC

    if row < n_rows:
        for i in T.vectorized(VEC):
            xv[i] = X[row, col + i]
    else:
        for i in T.unroll(VEC):
            xv[i] = T.bfloat16(0.0)
    for i in T.vectorized(VEC):
        wv[i] = W[col + i]

    acc[0] = T.float32(0.0)
    for i in T.unroll(VEC):
        xf[i] = T.cast(xv[i], "float32")
        acc[0] = acc[0] + xf[i] * xf[i]
    # reduce over the 16 lanes of this row's group (xor offsets 8, 4, 2, 1)
    for s in T.unroll(4):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 8 >> s, 32, 32)
    acc[0] = T.rsqrt(acc[0] * T.float32(INV_HIDDEN) + T.float32(EPS))

    for i in T.unroll(VEC):
        xv[i] = T.cast(xf[i] * acc[0] * T.cast(wv[i], "float32"), "bfloat16")
    if row < n_rows:
        for i in T.vectorized(VEC):
            Y[row, col + i] = xv[i]


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
        exe = tvm.compile(tvm.IRModule({"main": rmsnorm_h128}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    exe = _compiled()
    x = hidden_states.contiguous()
    w = weight.contiguous()
    out = torch.empty_like(x)
    exe(x, w, out)
    return out
