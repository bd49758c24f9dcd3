# MiniMax-M3 per-head RMS norm (1 + w) + partial NeoX RoPE of q / k / indexer q / indexer k, with K|V
# insertion into the paged main cache and indexer-k insertion into the paged indexer cache: one fused TIRx
# kernel, the same decomposition as the verified CuTe DSL solution of this problem.
#
# Kernel qkv_norm_rope_insert: grid (29 heads, ceil(T / 64) token chunks), 256 threads = 16 half-warps.
# - CTA (h, c) handles head column h of the fused projection for 64 tokens (heads vary fastest, so a wave
#   reads contiguous rows of qkv). The head kind (q 0..15, k 16..19, v 20..23, indexer q 24..27, indexer k
#   28) is uniform in a CTA; the lane's 8 norm weights are loaded once.
# - Half-warp g handles tokens c*64 + 16u + g, u = 0..3; lane l (0..15) owns dims 8l..8l+7 (one 16-byte
#   load / store). All loads of the 4 tokens (head slice, position, the lane's 8 cos and 8 sin values) are
#   issued before any math; token indices past the end are clamped for loads and skipped for stores.
# - RMS norm in fp32 (4 xor shuffles over the 16 lanes), y = (x * rsqrt(mean + eps)) * (1 + w); NeoX RoPE on
#   dims 0..63: the partner of dim i < 32 is dim i + 32 = lane l ^ 4 (8 xor-4 shuffles); lanes 0..3:
#   y c - p s, lanes 4..7: y c + p s, lanes 8..15 pass through; one bf16 rounding at the store.
# - Stores: q -> q_out[t, h], indexer q -> iq_out[t, h - 24] (padding rows included); k / v ->
#   kv_cache[s // 64, h', s % 64, 0:128 | 128:256] and indexer k -> index_cache[s' // 64, s' % 64] only where
#   the slot is >= 0 (v copied unchanged as bf16).
# What limits it: DRAM bandwidth (61 MB read + 61 MB written, SOL ~25.6 us); the CuTe version of this
# design measured 42.7 us device time, and its end-to-end time was dominated by the host call path.
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches on torch's current stream.
# Only the compiled module is cached (symbolic sizes); q and indexer q are allocated per call.
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

Q_HEADS = 16
KV_HEADS = 4
INDEX_Q_HEADS = 4
HEAD_DIM = 128
ROTARY_DIM = 64
EPS = 1e-6
BLOCK_SIZE = 64
NHEADS = Q_HEADS + 2 * KV_HEADS + INDEX_Q_HEADS + 1     # 29
K0 = Q_HEADS                                             # first k head
V0 = K0 + KV_HEADS                                       # first v head
IQ0 = V0 + KV_HEADS                                      # first indexer-q head
IK = IQ0 + INDEX_Q_HEADS                                 # indexer-k head (28)
WIDTH = NHEADS * HEAD_DIM                                # 3712
VEC = 8
LANES = HEAD_DIM // VEC                                  # 16 lanes per head vector
THREADS = 256
GROUPS = THREADS // LANES                                # 16 half-warps
UNROLL = 4
TOK_PER_CTA = GROUPS * UNROLL                            # 64
INV_DIM = 1.0 / HEAD_DIM


@T.prim_func
def qkv_norm_rope_insert(x_h: T.handle, wq_h: T.handle, wk_h: T.handle, wiq_h: T.handle, wik_h: T.handle,
                         pos_h: T.handle, cs_h: T.handle, slot_h: T.handle, islot_h: T.handle, kv_h: T.handle,
                         ic_h: T.handle, q_h: T.handle, iq_h: T.handle):
    ntok = T.int32()
    npos = T.int32()
    nblk = T.int32()
    niblk = T.int32()
    X = T.match_buffer(x_h, (ntok, WIDTH), "bfloat16", align=16)
    WQ = T.match_buffer(wq_h, (HEAD_DIM,), "bfloat16", align=16)
    WK = T.match_buffer(wk_h, (HEAD_DIM,), "bfloat16", align=16)
    WIQ = T.match_buffer(wiq_h, (HEAD_DIM,), "bfloat16", align=16)
    WIK = T.match_buffer(wik_h, (HEAD_DIM,), "bfloat16", align=16)
    POS = T.match_buffer(pos_h, (ntok,), "int64")
    CS = T.match_buffer(cs_h, (npos, ROTARY_DIM), "bfloat16", align=16)
    SLOT = T.match_buffer(slot_h, (ntok,), "int64")
    ISLOT = T.match_buffer(islot_h, (ntok,), "int64")
    KV = T.match_buffer(kv_h, (nblk, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM), "bfloat16", align=16)
    IC = T.match_buffer(ic_h, (niblk, BLOCK_SIZE, HEAD_DIM), "bfloat16", align=16)
    QO = T.match_buffer(q_h, (ntok, Q_HEADS, HEAD_DIM), "bfloat16", align=16)
    IQO = T.match_buffer(iq_h, (ntok, INDEX_Q_HEADS, HEAD_DIM), "bfloat16", align=16)

    T.device_entry()
    h, c = T.cta_id([NHEADS, T.ceildiv(ntok, TOK_PER_CTA)])
    tid = T.thread_id([THREADS])

    xb = T.alloc_local((UNROLL * VEC,), "bfloat16")
    cb = T.alloc_local((UNROLL * VEC,), "bfloat16")
    sb = T.alloc_local((UNROLL * VEC,), "bfloat16")
    wb = T.alloc_local((VEC,), "bfloat16")
    w1 = T.alloc_local((VEC,), "float32")
    y = T.alloc_local((VEC,), "float32")
    p = T.alloc_local((VEC,), "float32")
    ob = T.alloc_local((VEC,), "bfloat16")
    acc = T.alloc_local((1,), "float32")
    sl = T.alloc_local((1,), "int64")

    g: T.let[T.int32] = tid // LANES
    lane: T.let[T.int32] = tid % LANES
    col: T.let[T.int32] = lane * VEC
    # RoPE role of this lane: dims 0..31 (lanes 0-3) rotate with -sin, dims 32..63 (lanes 4-7) with +sin
    sgn: T.let[T.float32] = T.if_then_else(lane < 4, T.float32(-1.0), T.float32(1.0))

    # ---- (1 + w) of this CTA's head kind (v: unused)
    if h < K0:
        for i in T.vectorized(VEC):
            wb[i] = WQ[col + i]
    elif h < V0:
        for i in T.vectorized(VEC):
            wb[i] = WK[col + i]
    elif h < IQ0:
        for i in T.unroll(VEC):
            wb[i] = T.bfloat16(0.0)
    elif h < IK:
        for i in T.vectorized(VEC):
            wb[i] = WIQ[col + i]
    else:
        for i in T.vectorized(VEC):
            wb[i] = WIK[col + i]
    for i in T.unroll(VEC):
        w1[i] = T.cast(wb[i], "float32") + T.float32(1.0)

    # ---- all loads of the 4 tokens first
    for u in T.unroll(UNROLL):
        tc: T.let[T.int32] = T.min(c * TOK_PER_CTA + u * GROUPS + g, ntok - 1)
        for i in T.vectorized(VEC):
            xb[u * VEC + i] = X[tc, h * HEAD_DIM + col + i]
        pos: T.let[T.int32] = T.cast(POS[tc], "int32")
        for i in T.vectorized(VEC):
            cb[u * VEC + i] = CS[pos, (lane % 4) * VEC + i]
        for i in T.vectorized(VEC):
            sb[u * VEC + i] = CS[pos, ROTARY_DIM // 2 + (lane % 4) * VEC + i]

    if h >= V0 and h < IQ0:
        # ---- v: unchanged copy into the main cache (V half of the row)
        for u in T.unroll(UNROLL):
            t: T.let[T.int32] = c * TOK_PER_CTA + u * GROUPS + g
            if t < ntok:
                sl[0] = SLOT[t]
                if sl[0] >= T.int64(0):
                    for i in T.vectorized(VEC):
                        KV[T.cast(sl[0] // T.int64(BLOCK_SIZE), "int32"), h - V0,
                           T.cast(sl[0] % T.int64(BLOCK_SIZE), "int32"), HEAD_DIM + col + i] = xb[u * VEC + i]
    else:
        for u in T.unroll(UNROLL):
            # ---- RMS norm (fp32) and NeoX RoPE on dims 0..63
            acc[0] = T.float32(0.0)
            for i in T.unroll(VEC):
                y[i] = T.cast(xb[u * VEC + i], "float32")
                acc[0] = acc[0] + y[i] * y[i]
            for s in T.unroll(4):
                acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 8 >> s, 32, 32)
            acc[0] = T.rsqrt(acc[0] * T.float32(INV_DIM) + T.float32(EPS))
            for i in T.unroll(VEC):
                y[i] = (y[i] * acc[0]) * w1[i]
            for i in T.unroll(VEC):
                p[i] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, y[i], 4, 32, 32)
            for i in T.unroll(VEC):
                ob[i] = T.cast(T.if_then_else(
                    lane < 8,
                    y[i] * T.cast(cb[u * VEC + i], "float32") + sgn * (p[i] * T.cast(sb[u * VEC + i], "float32")),
                    y[i]), "bfloat16")
            # ---- stores
            t2: T.let[T.int32] = c * TOK_PER_CTA + u * GROUPS + g
            if t2 < ntok:
                if h < K0:
                    for i in T.vectorized(VEC):
                        QO[t2, h, col + i] = ob[i]
                elif h < V0:
                    sl[0] = SLOT[t2]
                    if sl[0] >= T.int64(0):
                        for i in T.vectorized(VEC):
                            KV[T.cast(sl[0] // T.int64(BLOCK_SIZE), "int32"), h - K0,
                               T.cast(sl[0] % T.int64(BLOCK_SIZE), "int32"), col + i] = ob[i]
                elif h < IK:
                    for i in T.vectorized(VEC):
                        IQO[t2, h - IQ0, col + i] = ob[i]
                else:
                    sl[0] = ISLOT[t2]
                    if sl[0] >= T.int64(0):
                        for i in T.vectorized(VEC):
                            IC[T.cast(sl[0] // T.int64(BLOCK_SIZE), "int32"),
                               T.cast(sl[0] % T.int64(BLOCK_SIZE), "int32"), col + i] = ob[i]


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; caching jit() once makes the host call path ~0.2 us.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled():
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": qkv_norm_rope_insert}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def _i64(t: torch.Tensor) -> torch.Tensor:
    return (t if t.dtype == torch.int64 else t.to(torch.int64)).contiguous()


def solve(qkv, q_norm_weight, k_norm_weight, index_q_norm_weight, index_k_norm_weight, positions, cos_sin_cache,
          slot_mapping, index_slot_mapping, kv_cache, index_cache):
    exe = _compiled()
    ntok = qkv.shape[0]
    assert qkv.shape[1] == WIDTH and qkv.dtype == torch.bfloat16
    assert kv_cache.is_contiguous() and index_cache.is_contiguous()
    q = torch.empty((ntok, Q_HEADS, HEAD_DIM), dtype=qkv.dtype, device=qkv.device)
    iq = torch.empty((ntok, INDEX_Q_HEADS, HEAD_DIM), dtype=qkv.dtype, device=qkv.device)
    if ntok > 0:
        exe(qkv.contiguous(), q_norm_weight.contiguous(), k_norm_weight.contiguous(),
            index_q_norm_weight.contiguous(), index_k_norm_weight.contiguous(), _i64(positions),
            cos_sin_cache.contiguous(), _i64(slot_mapping), _i64(index_slot_mapping), kv_cache, index_cache, q, iq)
    return q, iq, kv_cache, index_cache
