# GLM-4.5-Air attention pre-processing (TP 2: 48 q heads, 4 kv heads, head dim 128, bf16): per-head
# Q/K RMSNorm, partial NeoX RoPE on the first 64 dims, and the paged KV-cache write, one TIRx kernel.
#
# Algorithm
# - Grid: one CTA per token, 256 threads = 16 half-warps. A head row (128 bf16 = 256 B) is owned by a
#   half-warp; lane l (0..15 within it) holds dims 8l .. 8l+7 (one 16-byte load).
#   Half-warp h handles q heads h, h+16, h+32 and, for h < 8, kv row 48+h (h < 4: k head h,
#   4 <= h < 8: v head h-4). The kv kind is warp-uniform (warps 0-1: k, 2-3: v), so the shuffles
#   below always run with all 32 lanes converged.
# - All loads first: up to 4 head rows per lane (64 B in flight), the lane's 8 q/k norm weights, and
#   the token's cos/sin row (lane l reads cos/sin entries 8(l%4) .. +7).
# - Per q/k row: sum of squares in fp32 (4 xor shuffles over the half-warp), r = rsqrt(mean + 1e-5),
#   y = (x * r) * w; RoPE: the NeoX partner of dim i < 32 is dim i + 32, i.e. lane l <-> lane l ^ 4
#   for lanes 0..7, fetched with 8 xor-4 shuffles; lanes 0-3: y c - p s, lanes 4-7: y c + p s,
#   lanes 8-15 (dims 64..127) pass through. Rounded to bf16 once, 16-byte stores.
# - q rows go to q_out[token, head]; if slot >= 0, the k rows go to kv_cache[0] row slot*4 + head and
#   the v rows are copied unchanged to kv_cache[1] (in place; other cache entries untouched).
#
# Limits: DRAM streaming: read 58.7 MB of qkv (+0.5 MB of cos/sin rows), write 50.3 MB of q and
# 8.4 MB of cache rows: floor ~25 us at 4.8 TB/s. Expected ~30-35 us. Eager PyTorch runs ~40 small
# kernels with fp32 temporaries (norm, rope via cat, boolean-mask index_put with a host sync).
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches on torch's current
# stream. Only the compiled module is cached (symbolic sizes); the q output is allocated per call.

import torch
import tvm
from tvm.script import tirx as T

Q_HEADS = 48
KV_HEADS = 4
HEAD_DIM = 128
ROTARY_DIM = 64
EPS = 1e-5
BLOCK_SIZE = 16
WIDTH = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM     # 7168
THREADS = 256
VEC = 8                                          # bf16 per 16-byte access
LANES = HEAD_DIM // VEC                          # 16 lanes per head row
HALF_WARPS = THREADS // LANES                    # 16
Q_PER_HW = Q_HEADS // HALF_WARPS                 # 3 q heads per half-warp
INV_DIM = 1.0 / HEAD_DIM


@T.prim_func
def qk_norm_rope_cache(qkv_handle: T.handle, pos_handle: T.handle, qw_handle: T.handle, kw_handle: T.handle,
                       cs_handle: T.handle, slot_handle: T.handle, kv_handle: T.handle, q_handle: T.handle):
    n_tok = T.int32()
    max_pos = T.int32()
    n_rows = T.int32()                            # cache blocks * 16 * 4
    QKV = T.match_buffer(qkv_handle, (n_tok, WIDTH), "bfloat16", align=16)
    POS = T.match_buffer(pos_handle, (n_tok,), "int64")
    QW = T.match_buffer(qw_handle, (HEAD_DIM,), "bfloat16", align=16)
    KW = T.match_buffer(kw_handle, (HEAD_DIM,), "bfloat16", align=16)
    CS = T.match_buffer(cs_handle, (max_pos, ROTARY_DIM), "bfloat16", align=16)
    SLOT = T.match_buffer(slot_handle, (n_tok,), "int64")
    KV = T.match_buffer(kv_handle, (2, n_rows, HEAD_DIM), "bfloat16", align=16)
    QO = T.match_buffer(q_handle, (n_tok, Q_HEADS, HEAD_DIM), "bfloat16", align=16)

    T.device_entry()
    tok = T.cta_id([n_tok])
    tid = T.thread_id([THREADS])

    xb = T.alloc_local(((Q_PER_HW + 1) * VEC,), "bfloat16")
    qwb = T.alloc_local((VEC,), "bfloat16")
    kwb = T.alloc_local((VEC,), "bfloat16")
    cb = T.alloc_local((VEC,), "bfloat16")
    sb = T.alloc_local((VEC,), "bfloat16")
    y = T.alloc_local((VEC,), "float32")
    p = T.alloc_local((VEC,), "float32")
    ob = T.alloc_local((VEC,), "bfloat16")
    acc = T.alloc_local((1,), "float32")

    h: T.let[T.int32] = tid // LANES
    lane: T.let[T.int32] = tid % LANES
    col: T.let[T.int32] = lane * VEC
    pos: T.let[T.int32] = T.cast(POS[tok], "int32")
    slot: T.let[T.int32] = T.cast(SLOT[tok], "int32")
    # RoPE role of this lane: dims 0..31 (lanes 0-3) rotate with -sin, dims 32..63 (lanes 4-7) with +sin
    sgn: T.let[T.float32] = T.if_then_else(lane < 4, T.float32(-1.0), T.float32(1.0))

    # ---- all loads up front ----
    for u in T.unroll(Q_PER_HW):
        for i in T.vectorized(VEC):
            xb[u * VEC + i] = QKV[tok, (h + u * HALF_WARPS) * HEAD_DIM + col + i]
    if h < 2 * KV_HEADS:
        for i in T.vectorized(VEC):
            xb[Q_PER_HW * VEC + i] = QKV[tok, (Q_HEADS + h) * HEAD_DIM + col + i]
    for i in T.vectorized(VEC):
        qwb[i] = QW[col + i]
    for i in T.vectorized(VEC):
        kwb[i] = KW[col + i]
    for i in T.vectorized(VEC):
        cb[i] = CS[pos, (lane % 4) * VEC + i]
    for i in T.vectorized(VEC):
        sb[i] = CS[pos, ROTARY_DIM // 2 + (lane % 4) * VEC + i]

    # ---- q heads: norm, rope, store ----
    for u in T.unroll(Q_PER_HW):
        acc[0] = T.float32(0.0)
        for i in T.unroll(VEC):
            y[i] = T.cast(xb[u * VEC + i], "float32")
            acc[0] = acc[0] + y[i] * y[i]
        for s in T.unroll(4):
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 8 >> s, 32, 32)
        acc[0] = T.rsqrt(acc[0] * T.float32(INV_DIM) + T.float32(EPS))
        for i in T.unroll(VEC):
            y[i] = (y[i] * acc[0]) * T.cast(qwb[i], "float32")
        for i in T.unroll(VEC):
            p[i] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, y[i], 4, 32, 32)
        for i in T.unroll(VEC):
            ob[i] = T.cast(T.if_then_else(lane < 8,
                                          y[i] * T.cast(cb[i], "float32") + sgn * (p[i] * T.cast(sb[i], "float32")),
                                          y[i]), "bfloat16")
        for i in T.vectorized(VEC):
            QO[tok, h + u * HALF_WARPS, col + i] = ob[i]

    # ---- k heads (half-warps 0-3, warps 0-1): norm, rope, cache write ----
    if h < KV_HEADS:
        acc[0] = T.float32(0.0)
        for i in T.unroll(VEC):
            y[i] = T.cast(xb[Q_PER_HW * VEC + i], "float32")
            acc[0] = acc[0] + y[i] * y[i]
        for s in T.unroll(4):
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 8 >> s, 32, 32)
        acc[0] = T.rsqrt(acc[0] * T.float32(INV_DIM) + T.float32(EPS))
        for i in T.unroll(VEC):
            y[i] = (y[i] * acc[0]) * T.cast(kwb[i], "float32")
        for i in T.unroll(VEC):
            p[i] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, y[i], 4, 32, 32)
        for i in T.unroll(VEC):
            ob[i] = T.cast(T.if_then_else(lane < 8,
                                          y[i] * T.cast(cb[i], "float32") + sgn * (p[i] * T.cast(sb[i], "float32")),
                                          y[i]), "bfloat16")
        if slot >= 0:
            for i in T.vectorized(VEC):
                KV[0, slot * KV_HEADS + h, col + i] = ob[i]
    elif h < 2 * KV_HEADS:
        # ---- v heads (half-warps 4-7, warps 2-3): unchanged copy into the cache ----
        if slot >= 0:
            for i in T.vectorized(VEC):
                KV[1, slot * KV_HEADS + h - KV_HEADS, col + i] = xb[Q_PER_HW * VEC + i]


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
        exe = tvm.compile(tvm.IRModule({"main": qk_norm_rope_cache}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(qkv, positions, q_norm_weight, k_norm_weight, cos_sin_cache, slot_mapping, kv_cache):
    exe = _compiled()
    n_tok = qkv.shape[0]
    q = torch.empty((n_tok, Q_HEADS, HEAD_DIM), dtype=qkv.dtype, device=qkv.device)
    if n_tok > 0:
        pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        n_rows = kv_cache.shape[1] * BLOCK_SIZE * KV_HEADS
        exe(qkv.contiguous(), pos.contiguous(), q_norm_weight.contiguous(), k_norm_weight.contiguous(),
            cos_sin_cache.contiguous(), slots.contiguous(), kv_cache.view(2, n_rows, HEAD_DIM), q)
    return q, kv_cache
