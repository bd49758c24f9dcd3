# Per-head RMSNorm of a fused QKV projection (8 heads x 192, q/k learned scales, v scale-free), fp32,
# one TIRx kernel.
#
# Algorithm
# - The input is viewed as V = frames * 24 head vectors of 192 fp32 (768 B each): vector v belongs to
#   frame v // 24, slot (q/k/v) (v % 24) // 8, head v % 8. The outputs live in one [3, frames*8, 192]
#   buffer; q, k, v are its three (contiguous) slices, so a vector's output row is [slot, frame*8+head].
# - Grid: ceil(V / 32) CTAs of 256 threads. A vector is owned by a half-warp (16 lanes); lane l holds
#   elements 4l..4l+3, 64+4l.. and 128+4l.. (three 16-byte float4 loads, each a contiguous 256-byte
#   segment per half-warp). Half-warp h of CTA c handles vectors 32c + h and 32c + 16 + h: 6 vector
#   loads in flight per thread; __launch_bounds__(256, 4) (<= 64 registers) keeps 96 KiB of loads in
#   flight per SM.
# - Sum of squares in fp32 (12 per lane), reduced over the 16 lanes with 4 xor shuffles (offsets
#   8,4,2,1 never leave the half-warp; all 32 lanes stay converged).
# - r = 1 / sqrt(sum / 192 + 1e-6) with PTX div.rn / sqrt.rn (TVM builds device code with
#   --use_fast_math, whose rsqrt/div approximations cost ~2 ulp at the largest outputs, too close to
#   the fp32 tolerance), then y = (x * r) * w in the reference's order, where w is q_weight, k_weight
#   or 1 by the vector's slot (a half-warp-uniform branch; the weight float4s are L1 hits). float4 stores.
# - Vectors past V (only if V is not a multiple of 32) load zeros and skip the store.
#
# Limits: DRAM streaming, read 221 MB + write 221 MB once (floor ~92 us at 4.8 TB/s); expected within
# ~10-15% of it. Eager PyTorch runs ~8 elementwise/reduction kernels with fp32 temporaries.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches on torch's current
# stream. Only the compiled module is cached (symbolic vector count; n_out = n_vec / 3); outputs are allocated per call.

import torch
import tvm
from tvm.script import tirx as T

HEADS = 8
SLOTS = 3
HEAD_DIM = 192
EPS = 1e-6
THREADS = 256
VEC = 4                                   # floats per 16-byte access
LANES = 16                                # lanes per head vector
CHUNKS = HEAD_DIM // (LANES * VEC)        # 3 float4 per lane
HALF_WARPS = THREADS // LANES             # 16
VPH = 2                                   # vectors per half-warp
VPC = HALF_WARPS * VPH                    # 32 vectors per CTA
VPF = SLOTS * HEADS                       # 24 vectors per frame


@T.prim_func
def qkv_rmsnorm(x_handle: T.handle, qw_handle: T.handle, kw_handle: T.handle, o_handle: T.handle):
    n_vec = T.int32()
    n_out = T.int32()
    X = T.match_buffer(x_handle, (n_vec, HEAD_DIM), "float32", align=16)
    QW = T.match_buffer(qw_handle, (HEAD_DIM,), "float32", align=16)
    KW = T.match_buffer(kw_handle, (HEAD_DIM,), "float32", align=16)
    O = T.match_buffer(o_handle, (SLOTS, n_out, HEAD_DIM), "float32", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 4})   # <= 64 registers, no spills
    cta = T.cta_id([T.ceildiv(n_vec, VPC)])
    tid = T.thread_id([THREADS])

    xv = T.alloc_local((VPH * CHUNKS * VEC,), "float32")
    wv = T.alloc_local((CHUNKS * VEC,), "float32")
    acc = T.alloc_local((VPH,), "float32")
    r = T.alloc_local((VPH,), "float32")
    tmp = T.alloc_local((1,), "float32")

    h: T.let[T.int32] = tid // LANES
    col: T.let[T.int32] = (tid % LANES) * VEC

    for u in T.unroll(VPH):
        if cta * VPC + u * HALF_WARPS + h < n_vec:
            for c in T.unroll(CHUNKS):
                for i in T.vectorized(VEC):
                    xv[(u * CHUNKS + c) * VEC + i] = X[cta * VPC + u * HALF_WARPS + h, c * (LANES * VEC) + col + i]
        else:
            for c in T.unroll(CHUNKS):
                for i in T.unroll(VEC):
                    xv[(u * CHUNKS + c) * VEC + i] = T.float32(0.0)
    for u in T.unroll(VPH):
        acc[u] = T.float32(0.0)
        for e in T.unroll(CHUNKS * VEC):
            acc[u] = acc[u] + xv[u * CHUNKS * VEC + e] * xv[u * CHUNKS * VEC + e]
    for s in T.unroll(4):
        for u in T.unroll(VPH):
            acc[u] = acc[u] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[u], 8 >> s, 32, 32)
    for u in T.unroll(VPH):
        T.ptx.div.rn.f32(tmp[0], acc[u], T.float32(HEAD_DIM))
        T.ptx.sqrt.rn.f32(r[u], tmp[0] + T.float32(EPS))
        T.ptx.div.rn.f32(r[u], T.float32(1.0), r[u])

    for u in T.unroll(VPH):
        if cta * VPC + u * HALF_WARPS + h < n_vec:
            vec: T.let[T.int32] = cta * VPC + u * HALF_WARPS + h
            slot: T.let[T.int32] = (vec % VPF) // HEADS
            orow: T.let[T.int32] = (vec // VPF) * HEADS + vec % HEADS
            # weight slice of this vector's slot (uniform per half-warp; L1-resident after first use)
            if slot == 0:
                for c in T.unroll(CHUNKS):
                    for i in T.vectorized(VEC):
                        wv[c * VEC + i] = QW[c * (LANES * VEC) + col + i]
            elif slot == 1:
                for c in T.unroll(CHUNKS):
                    for i in T.vectorized(VEC):
                        wv[c * VEC + i] = KW[c * (LANES * VEC) + col + i]
            else:
                for e in T.unroll(CHUNKS * VEC):
                    wv[e] = T.float32(1.0)
            for e in T.unroll(CHUNKS * VEC):
                xv[u * CHUNKS * VEC + e] = (xv[u * CHUNKS * VEC + e] * r[u]) * wv[e]
            for c in T.unroll(CHUNKS):
                for i in T.vectorized(VEC):
                    O[slot, orow, c * (LANES * VEC) + col + i] = xv[(u * CHUNKS + c) * VEC + i]


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
        exe = tvm.compile(tvm.IRModule({"main": qkv_rmsnorm}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor):
    exe = _compiled()
    batch, frames, width = qkv.shape
    x = qkv.contiguous().view(batch * frames * SLOTS * HEADS, HEAD_DIM)
    out = torch.empty((SLOTS, batch, frames, HEADS, HEAD_DIM), dtype=qkv.dtype, device=qkv.device)
    if batch * frames > 0:
        exe(x, q_weight.contiguous(), k_weight.contiguous(), out.view(SLOTS, batch * frames * HEADS, HEAD_DIM))
    return out[0], out[1], out[2]
