# GroupNorm (32 groups of 10 channels, eps 1e-5, per-channel affine) over NCHW fp32, one TIRx kernel.
#
# Algorithm (full size: x [16, 320, 64, 64], i.e. 512 (sample, group) slabs of 40960 contiguous floats)
# - Grid (32 groups, N samples), 1024 threads = 32 warps per CTA, one CTA per (sample, group) slab;
#   __launch_bounds__(1024, 1) caps the kernel at 64 registers.
# - The slab stays in registers: thread t loads floats i*4096 + 4t .. +3 for i = 0..9 with ten
#   16-byte vector loads (float4), all in flight at once (160 KiB per CTA). Iteration i is exactly
#   channel 10g + i, so the per-channel weight/bias are CTA-uniform broadcast loads.
# - Two-pass statistics from the registers (no cancellation): sum -> mean, then sum of (x - mean)^2
#   -> biased variance. Each pass: per-thread fp32 sum of 40 values (4-wide partials), 5 xor
#   shuffles per warp, lane 0 writes its warp's value to shared memory, one __syncthreads, then every
#   warp re-reduces the 32 warp partials with 5 more shuffles (every thread ends with the total; no
#   second barrier). A tree over 1024 partials: accurate fp32 reductions over 40960 values.
# - mean = sum / 40960 and rstd = 1 / sqrt(var + 1e-5) use PTX div.rn / sqrt.rn (TVM builds device
#   code with --use_fast_math, which would otherwise turn them into approximations).
# - y = (x - mean) * (rstd * w[c]) + b[c], 16-byte vector stores.
# Shapes other than C=320, H*W=4096 (e.g. the smoke size) take a generic kernel: same grid, 256
#   threads, three strided passes over global memory (sum, squared deviations, write), same math.
#
# Limits: pure DRAM streaming (read 84 MB, write 84 MB; floor ~35 us at 4.8 TB/s). One 1024-thread
# CTA per SM (the register file holds one 160 KiB slab), so the reduction gaps between a CTA's load
# and store phases are not hidden by another CTA, and 512 slabs on 132 SMs give 3.9 waves. Expected
# ~45 us (~75-80% of the DRAM floor); eager PyTorch runs a moments kernel plus an apply kernel
# (reads x twice), so this should beat it by ~1.5x.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi passes torch's current CUDA
# stream to the launch, so the kernel is ordered on torch's current stream.
# Only the compiled modules are cached (symbolic batch / pixel counts); the output is allocated per call.

import torch
import tvm
from tvm.script import tirx as T

GROUPS = 32
CHANNELS = 320
CPG = CHANNELS // GROUPS            # 10 channels per group
EPS = 1e-5
HW_FAST = 4096                      # pixels per channel of the specialised kernel (64 x 64)
THREADS = 1024
WARPS = THREADS // 32
VEC = 4                             # floats per 16-byte access
ITERS = CPG                         # 4096 pixels = 1024 threads x 4: one iteration per channel
SLAB = CPG * HW_FAST                # 40960 values per (sample, group)
G_THREADS = 256                     # generic kernel
G_WARPS = G_THREADS // 32


@T.prim_func
def groupnorm_fast(x_handle: T.handle, w_handle: T.handle, b_handle: T.handle, y_handle: T.handle):
    batch = T.int32()
    X = T.match_buffer(x_handle, (batch, CHANNELS, HW_FAST), "float32", align=16)
    W = T.match_buffer(w_handle, (CHANNELS,), "float32")
    B = T.match_buffer(b_handle, (CHANNELS,), "float32")
    Y = T.match_buffer(y_handle, (batch, CHANNELS, HW_FAST), "float32", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
    g, n = T.cta_id([GROUPS, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    xv = T.alloc_local((ITERS * VEC,), "float32")
    part = T.alloc_local((VEC,), "float32")
    acc = T.alloc_local((1,), "float32")
    stat = T.alloc_local((4,), "float32")       # mean, rstd, scale, shift
    red_sum = T.alloc_shared((WARPS,), "float32")
    red_sq = T.alloc_shared((WARPS,), "float32")

    for i in T.unroll(ITERS):
        for j in T.vectorized(VEC):
            xv[i * VEC + j] = X[n, g * CPG + i, tid * VEC + j]

    # pass 1: sum -> mean
    for j in T.unroll(VEC):
        part[j] = xv[j]
    for i in T.unroll(ITERS - 1):
        for j in T.unroll(VEC):
            part[j] = part[j] + xv[(i + 1) * VEC + j]
    acc[0] = (part[0] + part[1]) + (part[2] + part[3])
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    if lane == 0:
        red_sum[warp] = acc[0]
    T.cuda.cta_sync()
    acc[0] = red_sum[lane]
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    T.ptx.div.rn.f32(stat[0], acc[0], T.float32(SLAB))

    # pass 2: sum of squared deviations -> biased variance
    for j in T.unroll(VEC):
        part[j] = (xv[j] - stat[0]) * (xv[j] - stat[0])
    for i in T.unroll(ITERS - 1):
        for j in T.unroll(VEC):
            part[j] = part[j] + (xv[(i + 1) * VEC + j] - stat[0]) * (xv[(i + 1) * VEC + j] - stat[0])
    acc[0] = (part[0] + part[1]) + (part[2] + part[3])
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    if lane == 0:
        red_sq[warp] = acc[0]
    T.cuda.cta_sync()
    acc[0] = red_sq[lane]
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    T.ptx.div.rn.f32(stat[1], acc[0], T.float32(SLAB))
    T.ptx.sqrt.rn.f32(stat[2], stat[1] + T.float32(EPS))
    T.ptx.div.rn.f32(stat[1], T.float32(1.0), stat[2])

    # normalize + affine, channel 10g + i per iteration
    for i in T.unroll(ITERS):
        stat[2] = stat[1] * W[g * CPG + i]
        stat[3] = B[g * CPG + i]
        for j in T.unroll(VEC):
            xv[i * VEC + j] = (xv[i * VEC + j] - stat[0]) * stat[2] + stat[3]
        for j in T.vectorized(VEC):
            Y[n, g * CPG + i, tid * VEC + j] = xv[i * VEC + j]


@T.prim_func
def groupnorm_generic(x_handle: T.handle, w_handle: T.handle, b_handle: T.handle, y_handle: T.handle):
    batch = T.int32()
    hw = T.int32()
    X = T.match_buffer(x_handle, (batch, CHANNELS, hw), "float32")
    W = T.match_buffer(w_handle, (CHANNELS,), "float32")
    B = T.match_buffer(b_handle, (CHANNELS,), "float32")
    Y = T.match_buffer(y_handle, (batch, CHANNELS, hw), "float32")

    T.device_entry()
    g, n = T.cta_id([GROUPS, batch])
    tid = T.thread_id([G_THREADS])
    warp = T.warp_id([G_WARPS])
    lane = T.lane_id([32])

    acc = T.alloc_local((1,), "float32")
    stat = T.alloc_local((4,), "float32")
    d = T.alloc_local((1,), "float32")
    red_sum = T.alloc_shared((G_WARPS,), "float32")
    red_sq = T.alloc_shared((G_WARPS,), "float32")

    slab: T.let[T.int32] = CPG * hw
    acc[0] = T.float32(0.0)
    for k in range(T.ceildiv(slab, G_THREADS)):
        if k * G_THREADS + tid < slab:
            acc[0] = acc[0] + X[n, g * CPG + (k * G_THREADS + tid) // hw, (k * G_THREADS + tid) % hw]
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    if lane == 0:
        red_sum[warp] = acc[0]
    T.cuda.cta_sync()
    acc[0] = red_sum[0]
    for w in T.unroll(G_WARPS - 1):
        acc[0] = acc[0] + red_sum[w + 1]
    T.ptx.div.rn.f32(stat[0], acc[0], T.cast(slab, "float32"))

    acc[0] = T.float32(0.0)
    for k in range(T.ceildiv(slab, G_THREADS)):
        if k * G_THREADS + tid < slab:
            d[0] = X[n, g * CPG + (k * G_THREADS + tid) // hw, (k * G_THREADS + tid) % hw] - stat[0]
            acc[0] = acc[0] + d[0] * d[0]
    for s in T.unroll(5):
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
    if lane == 0:
        red_sq[warp] = acc[0]
    T.cuda.cta_sync()
    acc[0] = red_sq[0]
    for w in T.unroll(G_WARPS - 1):
        acc[0] = acc[0] + red_sq[w + 1]
    T.ptx.div.rn.f32(stat[1], acc[0], T.cast(slab, "float32"))
    T.ptx.sqrt.rn.f32(stat[2], stat[1] + T.float32(EPS))
    T.ptx.div.rn.f32(stat[1], T.float32(1.0), stat[2])

    for k in range(T.ceildiv(slab, G_THREADS)):
        if k * G_THREADS + tid < slab:
            Y[n, g * CPG + (k * G_THREADS + tid) // hw, (k * G_THREADS + tid) % hw] = (
                (X[n, g * CPG + (k * G_THREADS + tid) // hw, (k * G_THREADS + tid) % hw] - stat[0])
                * (stat[1] * W[g * CPG + (k * G_THREADS + tid) // hw])
                + B[g * CPG + (k * G_THREADS + tid) // hw])


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
                     for f in (groupnorm_fast, groupnorm_generic))
        _CACHE["exes"] = exes
    return exes


def solve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    fast, generic = _compiled()
    n, c, h, w = x.shape
    xf = x.contiguous().view(n, c, h * w)
    out = torch.empty_like(xf)
    if n > 0 and h * w > 0:
        kern = fast if h * w == HW_FAST else generic
        kern(xf, weight.contiguous(), bias.contiguous(), out)
    return out.view(n, c, h, w)
