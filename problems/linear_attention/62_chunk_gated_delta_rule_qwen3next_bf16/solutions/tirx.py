# Gated delta rule prefill (Qwen3-Next: 32 value heads reading 16 q/k heads, d = 128, carried state,
# 4 x 4096 tokens) as one TIRx kernel: the exact token-by-token recurrence in fp32 on CUDA cores, with the
# state held in registers for the whole sequence. Same algorithm, launch geometry and state representation
# as the CuTe DSL solution of this problem (whose first version failed on the H200 on final_state
# precision, see below; the fixed CuTe DSL version is not yet GPU-run either).
#
# Why a recurrence and not the chunked (WY) tensor-core form: final_state is compared at fp32 precision
# (3x the fp32 reference's own error, ~2.4e-6 absolute at the full size), which bf16/TF32 tensor-core
# products cannot meet; on fp32 CUDA cores the chunked form costs at least as many FLOPs as the recurrence.
#
# Algebra per value head, for every value column v independently (columns never interact):
#     S <- a_t S,  dk_v = <S[:, v], kn>,  u_v = beta (v_v - dk_v),  S[:, v] += kn u_v,
#     o_v = <S_new[:, v], qn> = <a_t S_old[:, v], qn> + u_v <kn, qn>
# State representation: S_t = gamma (Sb + dS), gamma = product of a since the last fold. Per token
# gamma *= a_t, dk = gamma <Sb + dS, kn>, sq = gamma <Sb + dS, qn>, dS += kn (u / gamma). At the end of
# every 32-token block (or earlier if gamma < 2^-64) Sb <- gamma (Sb + dS), dS <- 0, gamma <- 1. The
# small dS keeps the per-token rounding small and the decay costs nothing per state element.
#
# Precision (the lesson of the CuTe DSL version's H200 failure): the state is multiplied by a_t on every
# token, so on slowly decaying heads (memory of thousands of tokens) any error of a_t is applied to the
# whole state again and again. The CuTe DSL version took a_t from a ~1-2 ulp fp32 exp and failed on
# final_state at 2.5x the allowance; a CPU model of the arithmetic showed 1.2x for a random 2-ulp error
# per a_t and 17x for a 1-ulp bias, 0.3-0.5x with a correctly rounded exp. TVM compiles device code with
# fast math (approximate fp32 exp, rsqrt, division), so here a_t = exp(g_t) and the inverse norms
# rsqrt(|x|^2 + 1e-6) are evaluated in fp64 and rounded once (both only in the per-block preparation),
# and 1 / gamma (per token) is the approximate reciprocal plus one FMA Newton step.
#
# Launch geometry
# - Grid (32 value heads, B) = 128 CTAs (one per SM), 256 threads = 8 warps. Warp w owns value columns
#   16w..16w+15; lane = 4p + ks owns columns v0 = 16w + 2p, v0 + 1 and the key rows k = 16j + 4ks + e
#   (j < 8, e < 4): 64 fp32 of Sb and 64 of dS in registers.
# - Tokens in blocks of 32. Raw q/k rows (head h // 2) and v rows (head h) come in with 16-byte cp.async
#   into a double-buffered shared tile (block i+1 in flight while block i is computed; rows past T are
#   clamped to the last token and never used); g and beta of the next block are prefetched into
#   registers. Each warp then prepares 4 tokens (warp-shuffle sums of squares, kn, scale * qn, <kn, qn>)
#   into fp32 shared tiles; warp 0 stores beta and a = exp(g).
# - Per token a thread reads its 32 kn and 32 qn values with 16-byte shared loads, 64 adds + 128 FMAs for
#   its partial dk / sq (4 accumulators each), 2 xor shuffles over the 4 ks lanes, then u, o and 64 FMAs
#   into dS. o goes to a shared 32 x 128 bf16 tile written to global with 16-byte stores per block.
# - Finally Sb (after the last fold) is stored to final_state (8-byte stores).
# Differences from the CuTe DSL version: exp and rsqrt in fp64 instead of the own fp32 Cody-Waite exp and
# the rsqrt Newton step (fp64 is the simpler accurate path under TVM's fast math and runs only 32 times
# per block); 1 / gamma by approximate reciprocal + Newton step instead of the correctly rounded one.
#
# Expected time: fp32-issue bound like the CuTe DSL kernel (~260 FP instructions per token and thread;
# estimated 1.3-1.4 ms): about 10x faster than eager PyTorch (13.5 ms) and torch.compile (20.4 ms), far
# from the tensor-core SOL (0.088 ms), which the fp32 state tolerance rules out.
#
# Host path: compiled once per process (batch and T symbolic); tvm-ffi runs the kernel on torch's current
# stream.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

QK_HEADS = 16
V_HEADS = 32
D = 128
TB = 32                        # tokens per block (also the regular fold period)
THREADS = 256
NWARPS = THREADS // 32
KS = 4                         # lanes sharing a column pair (split of the key axis)
NJ = D // (4 * KS)             # 8 groups of 4 key rows per lane
NE = NJ * 4                    # 32 key rows per lane
L2_EPS = 1e-6
GAMMA_MIN = 2.0 ** -64         # fold early below this (keeps 1/gamma far from fp32 overflow)
CPR = D // 8                   # 16-byte chunks per bf16 row
RAW_PER_THREAD = TB * CPR // THREADS      # 2 chunks per tensor per thread
TOK_PER_WARP = TB // NWARPS               # 4 tokens prepared per warp


@T.prim_func
def gdr(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle, s0_h: T.handle,
        o_h: T.handle, st_h: T.handle, scale: T.float32):
    batch = T.int32()
    seqlen = T.int32()
    Q = T.match_buffer(q_h, (batch, seqlen, QK_HEADS, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (batch, seqlen, QK_HEADS, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (batch, seqlen, V_HEADS, D), "bfloat16", align=16)
    G = T.match_buffer(g_h, (batch, seqlen, V_HEADS), "float32")
    BETA = T.match_buffer(b_h, (batch, seqlen, V_HEADS), "bfloat16")
    S0 = T.match_buffer(s0_h, (batch, V_HEADS, D, D), "float32", align=16)
    O = T.match_buffer(o_h, (batch, seqlen, V_HEADS, D), "bfloat16", align=16)
    ST = T.match_buffer(st_h, (batch, V_HEADS, D, D), "float32", align=16)

    T.device_entry()
    hv, bb = T.cta_id([V_HEADS, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([NWARPS])
    lane = T.lane_id([32])

    Raw = T.alloc_shared((2, 3, TB, D), "bfloat16")     # [buffer, q/k/v, token, d]
    NK = T.alloc_shared((TB, D), "float32")
    NQ = T.alloc_shared((TB, D), "float32")
    Os = T.alloc_shared((TB, D), "bfloat16")
    KQ = T.alloc_shared((TB,), "float32")
    BS = T.alloc_shared((TB,), "float32")
    DEC = T.alloc_shared((TB,), "float32")

    Sb = T.alloc_local((NE * 2,), "float32")           # Sb[2 idx + c] = base state at (k(idx), v0 + c)
    dS = T.alloc_local((NE * 2,), "float32")           # increments since the last fold, over gamma
    kr = T.alloc_local((NE,), "float32")
    q4 = T.alloc_local((4,), "float32")
    acc = T.alloc_local((16,), "float32")               # [dk0, dk1, sq0, sq1] x 4 partials
    red = T.alloc_local((4,), "float32")
    sc = T.alloc_local((7,), "float32")                 # v0, v1, u0, u1, beta, kq, s
    gm = T.alloc_local((3,), "float32")                 # gamma, candidate gamma, 1 / gamma
    pre = T.alloc_local((2,), "float32")                # prefetched beta, g of the next block
    ob = T.alloc_local((8,), "bfloat16")
    rq = T.alloc_local((4,), "bfloat16")
    rk = T.alloc_local((4,), "bfloat16")
    fq = T.alloc_local((4,), "float32")
    fk = T.alloc_local((4,), "float32")
    ss = T.alloc_local((3,), "float32")                 # |q|^2 -> q scale, |k|^2 -> k scale, k.q

    hk: T.let[T.int32] = hv // (V_HEADS // QK_HEADS)
    p: T.let[T.int32] = lane // KS
    ks: T.let[T.int32] = lane % KS
    v0: T.let[T.int32] = warp * 16 + 2 * p
    nb: T.let[T.int32] = T.ceildiv(seqlen, TB)

    # ---- initial state -> registers (8-byte loads of the column pair)
    for j in T.unroll(NJ):
        for e in T.unroll(4):
            for c in T.vectorized(2):
                Sb[2 * (4 * j + e) + c] = S0[bb, hv, 16 * j + 4 * ks + e, v0 + c]
    for i in T.unroll(NE * 2):
        dS[i] = T.float32(0.0)
    gm[0] = T.float32(1.0)

    # ---- prologue: raw rows of block 0, beta and g
    for i in T.unroll(RAW_PER_THREAD):
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 0, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(Q[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hk, ((tid + THREADS * i) % CPR) * 8]),
            16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 1, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(K[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hk, ((tid + THREADS * i) % CPR) * 8]),
            16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 2, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(V[bb, T.min((tid + THREADS * i) // CPR, seqlen - 1), hv, ((tid + THREADS * i) % CPR) * 8]),
            16)
    T.ptx.cp.async_.commit_group()
    pre[0] = T.cast(BETA[bb, T.min(lane, seqlen - 1), hv], "float32")
    pre[1] = G[bb, T.min(lane, seqlen - 1), hv]
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
                        T.address_of(Q[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hk,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 1, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(K[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hk,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 2, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(V[bb, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1), hv,
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                pre[0] = T.cast(BETA[bb, T.min(t0 + TB + lane, seqlen - 1), hv], "float32")
                pre[1] = G[bb, T.min(t0 + TB + lane, seqlen - 1), hv]
            T.ptx.cp.async_.commit_group()
            n: T.let[T.int32] = T.min(seqlen - t0, TB)

            for tt in range(n):
                gm[1] = gm[0] * DEC[tt]
                if gm[1] < T.float32(GAMMA_MIN):
                    # fold with the old gamma (uniform branch: gamma is the same in every thread)
                    for i in T.unroll(NE * 2):
                        Sb[i] = (Sb[i] + dS[i]) * gm[0]
                        dS[i] = T.float32(0.0)
                    gm[1] = DEC[tt]
                gm[0] = gm[1]
                # 1 / gamma: approximate reciprocal (fast math) + one Newton step
                gm[2] = T.float32(1.0) / gm[0]
                gm[2] = gm[2] + gm[2] * (T.float32(1.0) - gm[0] * gm[2])
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
                    for e in T.unroll(4):
                        for c in T.unroll(2):
                            sc[6] = Sb[2 * (4 * j + e) + c] + dS[2 * (4 * j + e) + c]
                            acc[c * 4 + e] = acc[c * 4 + e] + sc[6] * kr[4 * j + e]
                            acc[(2 + c) * 4 + e] = acc[(2 + c) * 4 + e] + sc[6] * q4[e]
                for r in T.unroll(4):
                    red[r] = (acc[r * 4] + acc[r * 4 + 1]) + (acc[r * 4 + 2] + acc[r * 4 + 3])
                    red[r] = red[r] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[r], 1, 32, 32)
                    red[r] = red[r] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[r], 2, 32, 32)
                    red[r] = red[r] * gm[0]
                sc[2] = sc[4] * (sc[0] - red[0])
                sc[3] = sc[4] * (sc[1] - red[1])
                if ks == 0:
                    Os[tt, v0] = T.cast(red[2] + sc[2] * sc[5], "bfloat16")
                    Os[tt, v0 + 1] = T.cast(red[3] + sc[3] * sc[5], "bfloat16")
                sc[2] = sc[2] * gm[2]
                sc[3] = sc[3] * gm[2]
                for idx in T.unroll(NE):
                    dS[2 * idx] = dS[2 * idx] + kr[idx] * sc[2]
                    dS[2 * idx + 1] = dS[2 * idx + 1] + kr[idx] * sc[3]

            # fold the block: Sb <- gamma (Sb + dS)
            for i in T.unroll(NE * 2):
                Sb[i] = (Sb[i] + dS[i]) * gm[0]
                dS[i] = T.float32(0.0)
            gm[0] = T.float32(1.0)

            T.ptx.cp.async_.wait_group(0)
            T.cuda.cta_sync()
            # o tile -> global (16-byte stores, rows past T skipped)
            for i in T.unroll(RAW_PER_THREAD):
                if (tid + THREADS * i) // CPR < n:
                    for e in T.vectorized(8):
                        ob[e] = Os[(tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8 + e]
                    for e in T.vectorized(8):
                        O[bb, t0 + (tid + THREADS * i) // CPR, hv, ((tid + THREADS * i) % CPR) * 8 + e] = ob[e]

        if blk < nb:
            # prepare block blk from raw buffer blk % 2: warp w -> tokens 4w..4w+3
            pb: T.let[T.int32] = blk % 2
            for i in T.unroll(TOK_PER_WARP):
                for e in T.vectorized(4):
                    rq[e] = Raw[pb, 0, warp * TOK_PER_WARP + i, lane * 4 + e]
                for e in T.vectorized(4):
                    rk[e] = Raw[pb, 1, warp * TOK_PER_WARP + i, lane * 4 + e]
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
                # rsqrt(|x|^2 + eps) in fp64, rounded once (fast-math fp32 rsqrt is approximate)
                ss[0] = T.cast(T.float64(1.0) / T.sqrt(T.cast(ss[0] + T.float32(L2_EPS), "float64")), "float32") * scale
                ss[1] = T.cast(T.float64(1.0) / T.sqrt(T.cast(ss[1] + T.float32(L2_EPS), "float64")), "float32")
                ss[2] = T.float32(0.0)
                for e in T.unroll(4):
                    fq[e] = fq[e] * ss[0]
                    fk[e] = fk[e] * ss[1]
                    ss[2] = ss[2] + fq[e] * fk[e]
                for e in T.vectorized(4):
                    NQ[warp * TOK_PER_WARP + i, lane * 4 + e] = fq[e]
                for e in T.vectorized(4):
                    NK[warp * TOK_PER_WARP + i, lane * 4 + e] = fk[e]
                for s in T.unroll(5):
                    ss[2] = ss[2] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[2], 16 >> s, 32, 32)
                if lane == 0:
                    KQ[warp * TOK_PER_WARP + i] = ss[2]
            if warp == 0:
                BS[lane] = pre[0]
                # a = exp(g) in fp64, rounded once: per-token decay errors compound over the state's memory
                DEC[lane] = T.cast(T.exp(T.cast(pre[1], "float64")), "float32")
        T.cuda.cta_sync()

    # ---- final state (after the last fold S = Sb; 8-byte stores of the column pair)
    for j in T.unroll(NJ):
        for e in T.unroll(4):
            for c in T.vectorized(2):
                ST[bb, hv, 16 * j + 4 * ks + e, v0 + c] = Sb[2 * (4 * j + e) + c]


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
        exe = tvm.compile(tvm.IRModule({"main": gdr}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q, k, v, g, beta, initial_state, scale):
    b, t, hqk, d = q.shape
    hv = v.shape[2]
    assert (hqk, hv, d) == (QK_HEADS, V_HEADS, D)
    out = torch.empty((b, t, hv, d), dtype=v.dtype, device=q.device)
    if t == 0 or b == 0:
        return out, initial_state.to(torch.float32).clone()
    state = torch.empty((b, hv, D, D), dtype=torch.float32, device=q.device)
    _compiled()(q.contiguous(), k.contiguous(), v.contiguous(), g.to(torch.float32).contiguous(),
                beta.contiguous(), initial_state.to(torch.float32).contiguous(), out, state, float(scale))
    return out, state
