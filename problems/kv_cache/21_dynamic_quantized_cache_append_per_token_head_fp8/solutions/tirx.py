# Dynamic per-(token, head) FP8 e4m3 quantization of new K/V rows and their append into paged FP8
# caches with per-slot scales (vLLM reshape_and_cache_flash, per-token-head scales), one TIRx kernel.
#
# Algorithm
# - Grid: ceil(T / 2) CTAs of 256 threads; a (token, head) pair is owned by a half-warp (16 lanes):
#   half-warp h of CTA c handles token 2c + h // 8, head h % 8, for the key AND the value row (two
#   16-byte bf16x8 loads per lane in flight; a warp's two half-warps share the token, so a padding
#   token (slot -1) retires whole warps and the shuffles below always run fully converged).
# - absmax over the 128 channels: |x| in fp32, max over the lane's 8, then 4 xor shuffles (8,4,2,1).
# - Bit-exact with the reference's IEEE sequence: scale = max(absmax / 448, 1e-8) with PTX div.rn,
#   inv = 1 / scale with div.rn (TVM compiles device code with --use_fast_math, so a plain '/' would
#   be an approximation and change bits), q = min(max(x * inv, -448), 448) (a plain fp32 multiply),
#   then 4 values at a time to float8_e4m3fn with cvt.rn.satfinite (__nv_fp8x4_e4m3, round to
#   nearest even as torch's .to(float8_e4m3fn); the clamp makes satfinite a no-op).
# - The lane's 8 fp8 bytes are one 8-byte store (the uint8 caches are viewed as int32 rows of 32
#   words: row = slot * 8 + head); lane 0 writes the fp32 scale to scale_cache[slot * 8 + head].
# Only live tokens write; every other cache entry is untouched (in place; the inputs are returned).
#
# Limits: memory bound but tiny (read 33.6 MB of bf16, write 16.6 MB of fp8 + 0.5 MB of scales:
# ~10.6 us at 4.8 TB/s); the scattered 128-byte row writes are full 128-byte segments. Expected
# ~13-16 us of device time, i.e. within ~1.5x of the floor (launch/tail effects dominate); eager
# PyTorch runs ~20 kernels (boolean-mask compaction with a host sync, abs/amax/div/clamp/cast,
# index_put x4), so this should be more than 10x faster end to end.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches on torch's current
# stream. Only the compiled module is cached (symbolic token / cache sizes).

import torch
import tvm
from tvm.script import tirx as T

KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
FP8_MAX = 448.0
MIN_SCALE = 1e-8
THREADS = 256
VEC = 8                                    # bf16 per 16-byte load = fp8 bytes per 8-byte store
LANES = HEAD_DIM // VEC                    # 16 lanes per (token, head) row
ROWS_PER_CTA = THREADS // LANES            # 16 (token, head) rows
TOKENS_PER_CTA = ROWS_PER_CTA // KV_HEADS  # 2 tokens
WORDS = HEAD_DIM // 4                      # int32 words per fp8 row


@T.prim_func
def quant_append(k_handle: T.handle, v_handle: T.handle, slot_handle: T.handle, kc_handle: T.handle,
                 vc_handle: T.handle, ks_handle: T.handle, vs_handle: T.handle):
    n_tok = T.int32()
    n_rows = T.int32()                     # cache slots * heads
    K = T.match_buffer(k_handle, (n_tok, KV_HEADS, HEAD_DIM), "bfloat16", align=16)
    V = T.match_buffer(v_handle, (n_tok, KV_HEADS, HEAD_DIM), "bfloat16", align=16)
    SLOT = T.match_buffer(slot_handle, (n_tok,), "int64")
    KC = T.match_buffer(kc_handle, (n_rows, WORDS), "int32", align=16)
    VC = T.match_buffer(vc_handle, (n_rows, WORDS), "int32", align=16)
    KS = T.match_buffer(ks_handle, (n_rows,), "float32")
    VS = T.match_buffer(vs_handle, (n_rows,), "float32")

    T.device_entry()
    cta = T.cta_id([T.ceildiv(n_tok, TOKENS_PER_CTA)])
    tid = T.thread_id([THREADS])

    kb = T.alloc_local((VEC,), "bfloat16")
    vb = T.alloc_local((VEC,), "bfloat16")
    kf = T.alloc_local((VEC,), "float32")
    vf = T.alloc_local((VEC,), "float32")
    am = T.alloc_local((2,), "float32")       # absmax of the key / value row
    sc = T.alloc_local((2,), "float32")       # scales
    inv = T.alloc_local((2,), "float32")
    kq = T.alloc_local((2,), "int32")
    vq = T.alloc_local((2,), "int32")

    row: T.let[T.int32] = tid // LANES
    tok: T.let[T.int32] = cta * TOKENS_PER_CTA + row // KV_HEADS
    head: T.let[T.int32] = row % KV_HEADS
    lane16: T.let[T.int32] = tid % LANES

    if tok < n_tok:
        slot: T.let[T.int32] = T.cast(SLOT[tok], "int32")
        if slot >= 0:
            for i in T.vectorized(VEC):
                kb[i] = K[tok, head, lane16 * VEC + i]
            for i in T.vectorized(VEC):
                vb[i] = V[tok, head, lane16 * VEC + i]
            am[0] = T.float32(0.0)
            am[1] = T.float32(0.0)
            for i in T.unroll(VEC):
                kf[i] = T.cast(kb[i], "float32")
                vf[i] = T.cast(vb[i], "float32")
                am[0] = T.max(am[0], T.abs(kf[i]))
                am[1] = T.max(am[1], T.abs(vf[i]))
            for s in T.unroll(4):
                for j in T.unroll(2):
                    am[j] = T.max(am[j], T.tvm_warp_shuffle_xor(0xFFFFFFFF, am[j], 8 >> s, 32, 32))
            for j in T.unroll(2):
                T.ptx.div.rn.f32(sc[j], am[j], T.float32(FP8_MAX))
                sc[j] = T.max(sc[j], T.float32(MIN_SCALE))
                T.ptx.div.rn.f32(inv[j], T.float32(1.0), sc[j])
            for i in T.unroll(VEC):
                kf[i] = T.min(T.max(kf[i] * inv[0], T.float32(-FP8_MAX)), T.float32(FP8_MAX))
                vf[i] = T.min(T.max(vf[i] * inv[1], T.float32(-FP8_MAX)), T.float32(FP8_MAX))
            for w in T.unroll(2):
                kq[w] = T.reinterpret("int32", T.cuda.fp8x4_e4m3_from_float4(
                    kf[4 * w], kf[4 * w + 1], kf[4 * w + 2], kf[4 * w + 3]))
                vq[w] = T.reinterpret("int32", T.cuda.fp8x4_e4m3_from_float4(
                    vf[4 * w], vf[4 * w + 1], vf[4 * w + 2], vf[4 * w + 3]))
            crow: T.let[T.int32] = slot * KV_HEADS + head
            for w in T.vectorized(2):
                KC[crow, lane16 * 2 + w] = kq[w]
            for w in T.vectorized(2):
                VC[crow, lane16 * 2 + w] = vq[w]
            if lane16 == 0:
                KS[crow] = sc[0]
                VS[crow] = sc[1]


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
        exe = tvm.compile(tvm.IRModule({"main": quant_append}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(key, value, slot_mapping, key_cache, value_cache, k_scale_cache, v_scale_cache):
    exe = _compiled()
    n_tok = key.shape[0]
    if n_tok > 0:
        n_rows = key_cache.shape[0] * BLOCK_SIZE * KV_HEADS
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        # views only: the caches are updated in place through them
        exe(key.contiguous(), value.contiguous(), slots.contiguous(),
            key_cache.view(torch.int32).view(n_rows, WORDS), value_cache.view(torch.int32).view(n_rows, WORDS),
            k_scale_cache.view(n_rows), v_scale_cache.view(n_rows))
    return key_cache, value_cache, k_scale_cache, v_scale_cache
