"""GroupNorm (32 groups of 10 channels, eps 1e-5, per-channel affine) over NCHW fp32 in CuTe DSL.

Same decomposition as the verified TIRx solution (one kernel, one DRAM pass).
- Full size x [16, 320, 64, 64]: 512 (sample, group) slabs of 40960 contiguous floats. Grid
  (32 groups, N samples), 1024 threads = 32 warps per CTA, one CTA per slab. The block size is a
  compile-time constant, so the kernel carries reqntid 1024 and ptxas caps it at 64 registers.
- The slab stays in registers: thread t loads pixels 4t..4t+3 of channel 10g+i for i = 0..9 with
  ten 128-bit loads, all issued before any use. Iteration i is exactly channel 10g+i, so weight
  and bias are CTA-uniform scalar loads.
- Two-pass statistics from the registers: sum -> mean, then sum of (x - mean)^2 -> biased
  variance. Each pass: 4-wide per-thread partials over the 10 vectors, butterfly warp reduction,
  lane 0 stores the warp value to shared memory (separate buffers per pass), one CTA barrier, then
  every warp butterfly-reduces the 32 warp values, so every thread holds the total.
- mean = sum / 40960 and rstd = 1 / sqrt(var + eps) with IEEE division and square root (no fast
  math / approximate rsqrt), as in the TIRx kernel that passed the fp64-anchored check.
- y = (x - mean) * (rstd * w[c]) + b[c], 128-bit stores.
Other pixel counts (the smoke size) use a generic kernel: same grid, 256 threads, three strided
passes over global memory (sum, squared deviations, normalize + write), same math.

Limits: DRAM streaming (84 MB read + 84 MB write, floor ~35 us). One 1024-thread CTA fills an
SM's register file, so a CTA's load, reduction and store phases are not overlapped by another
CTA; 512 slabs on 132 SMs = 3.9 waves. The TIRx version of this design ran in 46 us on the H200.
Verification: compile-checked on CPU (sm_90a cubin); H200 results: results/h200/ (by kernel sha256).
Host path: both kernels compiled once per process with tvm-ffi (fake tensors, dynamic batch and
pixel count), called with torch tensors directly on the caller's current torch stream.
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

GROUPS = 32
CHANNELS = 320
CPG = CHANNELS // GROUPS            # 10 channels per group
EPS = 1e-5
HW_FAST = 4096                      # pixels per channel of the specialised kernel (64 x 64)
THREADS = 1024
WARPS = THREADS // 32
VEC = 4                             # floats per 128-bit access
SLAB = CPG * HW_FAST                # 40960 values per (sample, group)
G_THREADS = 256                     # generic kernel
G_WARPS = G_THREADS // 32

assert HW_FAST == THREADS * VEC


def _add(a, b):
    return a + b


@cute.kernel
def _gn_fast_kernel(mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    g, n, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()

    smem = cutlass.utils.SmemAllocator()
    red_sum = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), byte_alignment=16)
    red_sq = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), byte_alignment=16)

    c0 = g * CPG
    xs = []
    for i in cutlass.range_constexpr(CPG):
        gX = cute.zipped_divide(mX[n, c0 + i, None], (VEC,))     # ((VEC), (HW/VEC))
        r = cute.make_rmem_tensor((VEC,), Float32)
        cute.autovec_copy(gX[(None, tidx)], r)
        xs.append(r.load())

    # pass 1: sum -> mean
    part = xs[0]
    for i in cutlass.range_constexpr(1, CPG):
        part = part + xs[i]
    s = part.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
    s = cute.arch.warp_reduction(s, _add)
    if lane == 0:
        red_sum[warp] = s
    cute.arch.barrier()
    tot = cute.arch.warp_reduction(red_sum[lane], _add)
    mean = tot / Float32(SLAB)

    # pass 2: sum of squared deviations -> biased variance
    d = xs[0] - mean
    part2 = d * d
    for i in cutlass.range_constexpr(1, CPG):
        d = xs[i] - mean
        part2 = part2 + d * d
    q = part2.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
    q = cute.arch.warp_reduction(q, _add)
    if lane == 0:
        red_sq[warp] = q
    cute.arch.barrier()
    totq = cute.arch.warp_reduction(red_sq[lane], _add)
    var = totq / Float32(SLAB)
    rstd = Float32(1.0) / cute.math.sqrt(var + Float32(EPS))

    # normalize + affine, channel 10g + i per iteration
    for i in cutlass.range_constexpr(CPG):
        scale = rstd * mW[c0 + i]
        shift = mB[c0 + i]
        gY = cute.zipped_divide(mY[n, c0 + i, None], (VEC,))
        ro = cute.make_rmem_tensor((VEC,), Float32)
        ro.store((xs[i] - mean) * scale + shift)
        cute.autovec_copy(ro, gY[(None, tidx)])


@cute.kernel
def _gn_generic_kernel(mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    g, n, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    hw = mX.shape[2]
    slab = hw * CPG
    nk = (slab + G_THREADS - 1) // G_THREADS
    c0 = g * CPG

    smem = cutlass.utils.SmemAllocator()
    red_sum = smem.allocate_tensor(Float32, cute.make_layout((G_WARPS,)), byte_alignment=16)
    red_sq = smem.allocate_tensor(Float32, cute.make_layout((G_WARPS,)), byte_alignment=16)

    acc = Float32(0.0)
    for k in range(nk):
        idx = k * G_THREADS + tidx
        if idx < slab:
            acc = acc + mX[n, c0 + idx // hw, idx % hw]
    acc = cute.arch.warp_reduction(acc, _add)
    if lane == 0:
        red_sum[warp] = acc
    cute.arch.barrier()
    tot = red_sum[0]
    for w in cutlass.range_constexpr(1, G_WARPS):
        tot = tot + red_sum[w]
    mean = tot / Float32(slab)

    accq = Float32(0.0)
    for k in range(nk):
        idx = k * G_THREADS + tidx
        if idx < slab:
            dv = mX[n, c0 + idx // hw, idx % hw] - mean
            accq = accq + dv * dv
    accq = cute.arch.warp_reduction(accq, _add)
    if lane == 0:
        red_sq[warp] = accq
    cute.arch.barrier()
    totq = red_sq[0]
    for w in cutlass.range_constexpr(1, G_WARPS):
        totq = totq + red_sq[w]
    var = totq / Float32(slab)
    rstd = Float32(1.0) / cute.math.sqrt(var + Float32(EPS))

    for k in range(nk):
        idx = k * G_THREADS + tidx
        if idx < slab:
            c = c0 + idx // hw
            p = idx % hw
            mY[n, c, p] = (mX[n, c, p] - mean) * (rstd * mW[c]) + mB[c]


@cute.jit
def _gn_fast(mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
    _gn_fast_kernel(mX, mW, mB, mY).launch(
        grid=[GROUPS, mX.shape[0], 1], block=[THREADS, 1, 1], smem=1024, stream=stream)


@cute.jit
def _gn_generic(mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
    _gn_generic_kernel(mX, mW, mB, mY).launch(
        grid=[GROUPS, mX.shape[0], 1], block=[G_THREADS, 1, 1], smem=512, stream=stream)


_COMPILED = {}


def _get_compiled():
    fns = _COMPILED.get("k")
    if fns is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        nb = cute.sym_int32()
        x = make_fake_compact_tensor(Float32, (nb, CHANNELS, HW_FAST), stride_order=(2, 1, 0), assumed_align=16)
        y = make_fake_compact_tensor(Float32, (nb, CHANNELS, HW_FAST), stride_order=(2, 1, 0), assumed_align=16)
        w = make_fake_compact_tensor(Float32, (CHANNELS,), assumed_align=4)
        b = make_fake_compact_tensor(Float32, (CHANNELS,), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fast = cute.compile(_gn_fast, x, w, b, y, stream, options="--enable-tvm-ffi")
        nb2, hw = cute.sym_int32(), cute.sym_int32()
        xg = make_fake_compact_tensor(Float32, (nb2, CHANNELS, hw), stride_order=(2, 1, 0), assumed_align=4)
        yg = make_fake_compact_tensor(Float32, (nb2, CHANNELS, hw), stride_order=(2, 1, 0), assumed_align=4)
        generic = cute.compile(_gn_generic, xg, w, b, yg, stream, options="--enable-tvm-ffi")
        fns = (fast, generic)
        _COMPILED["k"] = fns
    return fns


def solve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    fast, generic = _get_compiled()
    n, c, h, w = x.shape
    xf = x.contiguous().view(n, c, h * w)
    out = torch.empty_like(xf)
    if n > 0 and h * w > 0:
        kern = fast if h * w == HW_FAST else generic
        kern(xf, weight.contiguous(), bias.contiguous(), out)
    return out.view(n, c, h, w)
