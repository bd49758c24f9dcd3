# Kimi Delta Attention (KDA: delta rule with a per-key-channel decay; 16 heads, d = 128, zero initial
# state) as one TIRx kernel: the exact token-by-token recurrence in fp32 on CUDA cores, with the state
# held in registers for the whole sequence. Same algorithm and launch geometry as the CuTe DSL solution
# of this problem (which passed on the H200 at 0.664 ms device time).
#
# Algebra per head, for every value column v independently (the decay acts on the key axis only, so
# columns never interact), a_t = exp(g_t):
#     S[:, v] <- a_t * S[:, v]  (per key row),   dk_v = <S[:, v], kn>,  sq_v = <S[:, v], qn>,
#     u_v = beta (v_v - dk_v),   S[:, v] += kn u_v,   o_v = sq_v + u_v <kn, qn>   (= S_new[:, v] . qn)
# Only o (bf16) is compared, so a plain fp32 state is accurate enough (it passed on the H200 in the
# CuTe DSL version).
#
# Launch geometry
# - Grid: one CTA per (head, batch) = 128 CTAs, 256 threads = 8 warps. Warp w owns value columns
#   16w..16w+15; lane = 4p + ks owns columns v0 = 16w + 2p, v0 + 1 and the key rows
#   k = 16j + 4ks + e (j < 8, e < 4): 64 fp32 of S in registers.
# - Tokens in blocks of 32. Raw q/k/v/g rows (bf16) are fetched with 16-byte cp.async into a
#   double-buffered shared tile (block i+1 in flight while block i is computed; rows past T are
#   clamped to the last token and never used). After a barrier each warp prepares 4 tokens (warp
#   shuffle sums of squares; kn = k / max(|k|, 1e-12), qn = q / max(|q|, 1e-12) * 128^-0.5, <kn, qn>,
#   a = exp(g)) into fp32 shared tiles.
# - Per token a thread reads its 32 a, kn and qn values with 16-byte shared loads (the 4 lanes of a
#   column pair read 64 contiguous bytes), decays its 64 state values, 128 FMAs of partial dots
#   (4 accumulators each for dk and sq), 2 xor shuffles over the 4 ks lanes, then u, o and 64 FMAs
#   into S. o goes to a shared 32 x 128 bf16 tile written to global with 16-byte stores after the block.
# Differences from the CuTe DSL version: none in the algorithm. TVM always compiles device code with
# fast math, so exp, sqrt and the divisions of the normalization are the approximate hardware versions
# (relative error ~1e-7, far below the bf16 output tolerance).
#
# Expected time: like the CuTe DSL kernel (0.66 ms device on the H200): far faster than eager PyTorch
# (15.5 ms) and torch.compile (12.8 ms), far from the tensor-core SOL (0.035 ms), because the recurrence
# is evaluated token by token on CUDA cores with only 8 warps per SM.
#
# Host path: compiled once per process (batch and T symbolic); tvm-ffi runs the kernel on torch's
# current stream.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

HEADS = 16
D = 128
TB = 32                        # tokens per block
THREADS = 256
NWARPS = THREADS // 32
KS = 4                         # lanes sharing a column pair (split of the key axis)
NJ = D // (4 * KS)             # 8 groups of 4 key rows per lane
NE = NJ * 4                    # 32 key rows per lane
Q_SCALE = D ** -0.5
NORM_EPS = 1e-12
CPR = D // 8                   # 16-byte chunks per bf16 row
RAW_PER_THREAD = TB * CPR // THREADS      # 2 chunks per tensor per thread
TOK_PER_WARP = TB // NWARPS               # 4 tokens prepared per warp


@T.prim_func
def kda(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle, o_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    Q = T.match_buffer(q_h, (batch, seqlen, HEADS, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (batch, seqlen, HEADS, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (batch, seqlen, HEADS, D), "bfloat16", align=16)
    G = T.match_buffer(g_h, (batch, seqlen, HEADS, D), "bfloat16", align=16)
    BETA = T.match_buffer(b_h, (batch, seqlen, HEADS), "bfloat16")
    O = T.match_buffer(o_h, (batch, seqlen, HEADS, D), "bfloat16", align=16)

    T.device_entry()
    hh, bb = T.cta_id([HEADS, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([NWARPS])
    lane = T.lane_id([32])

    Raw = T.alloc_shared((2, 4, TB, D), "bfloat16")     # [buffer, q/k/v/g, token, d]
    NK = T.alloc_shared((TB, D), "float32")
    NQ = T.alloc_shared((TB, D), "float32")
    AS = T.alloc_shared((TB, D), "float32")
    Os = T.alloc_shared((TB, D), "bfloat16")
    KQ = T.alloc_shared((TB,), "float32")
    BS = T.alloc_shared((TB,), "float32")

    S = T.alloc_local((NE * 2,), "float32")            # S[2 idx + c] = S[k(idx), v0 + c]
    kr = T.alloc_local((NE,), "float32")
    q4 = T.alloc_local((4,), "float32")
    a4 = T.alloc_local((4,), "float32")
    acc = T.alloc_local((16,), "float32")               # [dk0, dk1, sq0, sq1] x 4 partials
    red = T.alloc_local((4,), "float32")
    sc = T.alloc_local((6,), "float32")                 # v0, v1, u0, u1, beta, kq
    breg = T.alloc_local((1,), "float32")
    ob = T.alloc_local((8,), "bfloat16")
    rq = T.alloc_local((4,), "bfloat16")
    rk = T.alloc_local((4,), "bfloat16")
    rg = T.alloc_local((4,), "bfloat16")
    fq = T.alloc_local((4,), "float32")
    fk = T.alloc_local((4,), "float32")
    fa = T.alloc_local((4,), "float32")
    ss = T.alloc_local((3,), "float32")                 # |q|^2, |k|^2, k.q

    p: T.let[T.int32] = lane // KS
    ks: T.let[T.int32] = lane % KS
    v0: T.let[T.int32] = warp * 16 + 2 * p
    nb: T.let[T.int32] = T.ceildiv(seqlen, TB)

    for i in T.unroll(NE * 2):
        S[i] = T.float32(0.0)

    # ---- prologue: raw rows of block 0, beta, prepare block 0
    for i in T.unroll(RAW_PER_THREAD):
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 0, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(Q[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hh, ((tid + THREADS * i) % CPR) * 8]), 16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 1, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(K[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hh, ((tid + THREADS * i) % CPR) * 8]), 16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 2, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(V[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hh, ((tid + THREADS * i) % CPR) * 8]), 16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 3, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(G[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hh, ((tid + THREADS * i) % CPR) * 8]), 16)
    T.ptx.cp.async_.commit_group()
    breg[0] = T.cast(BETA[bb, T.min(lane, seqlen - 1), hh], "float32")
    T.ptx.cp.async_.wait_group(0)
    T.cuda.cta_sync()

    # blk == 0 prepares block 0; blk >= 1 computes block blk - 1 and prepares block blk.
    for blk in range(nb + 1):
        if blk > 0:
            cb: T.let[T.int32] = (blk - 1) % 2
            t0: T.let[T.int32] = (blk - 1) * TB
            if blk < nb:
                # raw rows of block blk into the other buffer, in flight during the token loop
                for i in T.unroll(RAW_PER_THREAD):
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 0, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(Q[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hh,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 1, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(K[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hh,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 2, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(V[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hh,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 3, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(G[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hh,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                breg[0] = T.cast(BETA[bb, T.min(t0 + TB + lane, seqlen - 1), hh], "float32")
            T.ptx.cp.async_.commit_group()
            n: T.let[T.int32] = T.min(seqlen - t0, TB)

            for tt in range(n):
                sc[4] = BS[tt]
                sc[5] = KQ[tt]
                sc[0] = T.cast(Raw[cb, 2, tt, v0], "float32")
                sc[1] = T.cast(Raw[cb, 2, tt, v0 + 1], "float32")
                for r in T.unroll(16):
                    acc[r] = T.float32(0.0)
                for j in T.unroll(NJ):
                    for e in T.vectorized(4):
                        kr[4 * j + e] = NK[tt, 16 * j + 4 * ks + e]
                    for e in T.vectorized(4):
                        q4[e] = NQ[tt, 16 * j + 4 * ks + e]
                    for e in T.vectorized(4):
                        a4[e] = AS[tt, 16 * j + 4 * ks + e]
                    for e in T.unroll(4):
                        for c in T.unroll(2):
                            S[2 * (4 * j + e) + c] = S[2 * (4 * j + e) + c] * a4[e]
                            acc[c * 4 + e] = acc[c * 4 + e] + S[2 * (4 * j + e) + c] * kr[4 * j + e]
                            acc[(2 + c) * 4 + e] = acc[(2 + c) * 4 + e] + S[2 * (4 * j + e) + c] * q4[e]
                for r in T.unroll(4):
                    red[r] = (acc[r * 4] + acc[r * 4 + 1]) + (acc[r * 4 + 2] + acc[r * 4 + 3])
                    red[r] = red[r] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[r], 1, 32, 32)
                    red[r] = red[r] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[r], 2, 32, 32)
                sc[2] = sc[4] * (sc[0] - red[0])
                sc[3] = sc[4] * (sc[1] - red[1])
                for idx in T.unroll(NE):
                    S[2 * idx] = S[2 * idx] + kr[idx] * sc[2]
                    S[2 * idx + 1] = S[2 * idx + 1] + kr[idx] * sc[3]
                if ks == 0:
                    Os[tt, v0] = T.cast(red[2] + sc[2] * sc[5], "bfloat16")
                    Os[tt, v0 + 1] = T.cast(red[3] + sc[3] * sc[5], "bfloat16")

            T.ptx.cp.async_.wait_group(0)
            T.cuda.cta_sync()
            # o tile -> global (16-byte stores, rows past T skipped)
            for i in T.unroll(RAW_PER_THREAD):
                if (tid + THREADS * i) // CPR < n:
                    for e in T.vectorized(8):
                        ob[e] = Os[(tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8 + e]
                    for e in T.vectorized(8):
                        O[bb, t0 + (tid + THREADS * i) // CPR, hh, ((tid + THREADS * i) % CPR) * 8 + e] = ob[e]

        if blk < nb:
            # prepare block blk from raw buffer blk % 2: warp w -> tokens 4w..4w+3
            pb: T.let[T.int32] = blk % 2
            for i in T.unroll(TOK_PER_WARP):
                for e in T.vectorized(4):
                    rq[e] = Raw[pb, 0, warp * TOK_PER_WARP + i, lane * 4 + e]
                for e in T.vectorized(4):
                    rk[e] = Raw[pb, 1, warp * TOK_PER_WARP + i, lane * 4 + e]
                for e in T.vectorized(4):
                    rg[e] = Raw[pb, 3, warp * TOK_PER_WARP + i, lane * 4 + e]
                ss[0] = T.float32(0.0)
                ss[1] = T.float32(0.0)
                for e in T.unroll(4):
                    fq[e] = T.cast(rq[e], "float32")
                    fk[e] = T.cast(rk[e], "float32")
                    ss[0] = ss[0] + fq[e] * fq[e]
                    ss[1] = ss[1] + fk[e] * fk[e]
                for s in T.unroll(5):
                    ss[0] = ss[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[0], 16 >> s, 32, 32)
                    ss[1] = ss[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[1], 16 >> s, 32, 32)
                ss[0] = T.float32(Q_SCALE) / T.max(T.sqrt(ss[0]), T.float32(NORM_EPS))
                ss[1] = T.float32(1.0) / T.max(T.sqrt(ss[1]), T.float32(NORM_EPS))
                ss[2] = T.float32(0.0)
                for e in T.unroll(4):
                    fq[e] = fq[e] * ss[0]
                    fk[e] = fk[e] * ss[1]
                    fa[e] = T.exp(T.cast(rg[e], "float32"))
                    ss[2] = ss[2] + fq[e] * fk[e]
                for e in T.vectorized(4):
                    NQ[warp * TOK_PER_WARP + i, lane * 4 + e] = fq[e]
                for e in T.vectorized(4):
                    NK[warp * TOK_PER_WARP + i, lane * 4 + e] = fk[e]
                for e in T.vectorized(4):
                    AS[warp * TOK_PER_WARP + i, lane * 4 + e] = fa[e]
                for s in T.unroll(5):
                    ss[2] = ss[2] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[2], 16 >> s, 32, 32)
                if lane == 0:
                    KQ[warp * TOK_PER_WARP + i] = ss[2]
            if warp == 0:
                BS[lane] = breg[0]
        T.cuda.cta_sync()


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; caching jit() once keeps the host call path short.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled():
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": kda}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q, k, v, g, beta):
    b, t, h, d = q.shape
    assert (h, d) == (HEADS, D)
    out = torch.empty((b, t, h, d), dtype=v.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    _compiled()(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), out)
    return out
