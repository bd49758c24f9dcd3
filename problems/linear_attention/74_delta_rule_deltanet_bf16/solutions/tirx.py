# DeltaNet delta rule (16 heads, d = 128, no decay, given initial state) as one TIRx kernel: the exact
# token-by-token recurrence in fp32 on CUDA cores, with the state held in registers for the whole
# sequence. Same algorithm, launch geometry and precision scheme as the CuTe DSL solution of this problem
# (which passed on the H200 at 0.579 ms device time).
#
# Why a recurrence and not the chunked (WY) tensor-core form: the final state is compared at fp32
# precision (3x the fp32 reference's own error), so bf16/TF32 tensor-core products are ruled out; on fp32
# CUDA cores the chunked form costs more FLOPs than the recurrence (per token and value column ~3*128
# FMAs for the recurrence vs ~4.5*128 for the C = 64 WY form).
#
# Algebra per head, for every value column v independently (columns never interact):
#     dk_v = <S[:, v], kn>,  sq_v = <S[:, v], qn>,  u_v = beta (v_v - dk_v),
#     S[:, v] += kn u_v,     o_v = sq_v + u_v <kn, qn>        (= S_new[:, v] . qn)
# Precision: a plain fp32 S += kn u rounds S 1024 times and lands at ~0.8x the allowance (torch emulation
# by the CuTe DSL author); so the state is kept as S = Sb + dS: the per-token updates go into dS and dS is
# folded into Sb once every 32 tokens. The dot products use Sb + dS.
#
# Launch geometry
# - Grid: one CTA per (batch, head) = 128 CTAs (one per SM), 256 threads = 8 warps. Warp w owns value
#   columns 16w..16w+15; lane = 4p + ks owns columns v0 = 16w + 2p, v0 + 1 and the key rows
#   k = 16j + 4ks + e (j < 8, e < 4): 64 fp32 of Sb and 64 of dS in registers.
# - Tokens in blocks of 32. Raw q/k/v rows (bf16) are fetched with 16-byte cp.async into a
#   double-buffered shared tile (block i+1 in flight while block i is computed; rows past T are clamped
#   to the last token and never used); beta is prefetched into a register. After a barrier each warp
#   normalizes 4 tokens (warp-shuffle sums of squares; kn = k / max(|k|, 1e-12),
#   qn = q / max(|q|, 1e-12) * 128^-0.5, <kn, qn>) into fp32 shared tiles.
# - Per token a thread reads its 32 kn and 32 qn values with 16-byte shared loads (the 4 lanes of a
#   column pair read 64 contiguous bytes), 64 adds + 128 FMAs for its partial dk/sq (4 accumulators
#   each), 2 xor shuffles over the 4 ks lanes, then u, o and 64 FMAs into dS. o goes to a shared
#   32 x 128 bf16 tile written to global with 16-byte stores after the block.
# - At the end, Sb + dS is stored to the final state (8-byte stores).
# Differences from the CuTe DSL version: the inverse norms 1 / max(|x|, 1e-12) are evaluated in fp64
# and rounded once, because TVM always compiles device code with fast math (approximate sqrt and
# division) and the final state is compared at fp32 precision; the CuTe DSL kernel used the accurate
# fp32 sqrt and division. The sums of squares stay fp32 warp reductions, as there.
#
# Expected time: like the CuTe DSL kernel (0.58 ms device on the H200): faster than eager PyTorch
# (3.0 ms) and torch.compile (2.6 ms), far from the tensor-core SOL (0.03 ms), which the fp32 state
# tolerance rules out; with only 8 warps per SM the per-token latency chain is partly exposed.
#
# Host path: compiled once per process (batch*heads and T symbolic); tvm-ffi runs the kernel on torch's
# current stream.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

HEADS = 16
D = 128
TB = 32                        # tokens per block (also the dS fold period)
THREADS = 256
NWARPS = THREADS // 32
KS = 4                         # lanes sharing a column pair (split of the key axis)
NJ = D // (4 * KS)             # 8 groups of 4 key rows per lane
NE = NJ * 4                    # 32 key rows per lane
Q_SCALE = D ** -0.5
NORM_EPS = 1e-12
CPR = D // 8                   # 16-byte chunks per bf16 row
RAW_PER_THREAD = TB * CPR // THREADS      # 2 chunks per tensor per thread
TOK_PER_WARP = TB // NWARPS               # 4 tokens normalized per warp


@T.prim_func
def deltanet(q_h: T.handle, k_h: T.handle, v_h: T.handle, b_h: T.handle, s0_h: T.handle, o_h: T.handle,
             st_h: T.handle):
    nbh = T.int32()
    seqlen = T.int32()
    Q = T.match_buffer(q_h, (nbh, seqlen, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (nbh, seqlen, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (nbh, seqlen, D), "bfloat16", align=16)
    BETA = T.match_buffer(b_h, (nbh, seqlen), "bfloat16")
    S0 = T.match_buffer(s0_h, (nbh, D, D), "float32", align=16)
    O = T.match_buffer(o_h, (nbh, seqlen, D), "bfloat16", align=16)
    ST = T.match_buffer(st_h, (nbh, D, D), "float32", align=16)

    T.device_entry()
    bh = T.cta_id([nbh])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([NWARPS])
    lane = T.lane_id([32])

    Raw = T.alloc_shared((2, 3, TB, D), "bfloat16")     # [buffer, q/k/v, token, d]
    NK = T.alloc_shared((TB, D), "float32")
    NQ = T.alloc_shared((TB, D), "float32")
    Os = T.alloc_shared((TB, D), "bfloat16")
    KQ = T.alloc_shared((TB,), "float32")
    BS = T.alloc_shared((TB,), "float32")

    Sb = T.alloc_local((NE * 2,), "float32")           # Sb[2 idx + c] = S[k(idx), v0 + c] (base)
    dS = T.alloc_local((NE * 2,), "float32")           # increments since the last fold
    kr = T.alloc_local((NE,), "float32")
    q4 = T.alloc_local((4,), "float32")
    acc = T.alloc_local((16,), "float32")               # [dk0, dk1, sq0, sq1] x 4 partials
    red = T.alloc_local((4,), "float32")
    sc = T.alloc_local((7,), "float32")                 # v0, v1, u0, u1, beta, kq, s
    breg = T.alloc_local((1,), "float32")
    ob = T.alloc_local((8,), "bfloat16")
    rq = T.alloc_local((4,), "bfloat16")
    rk = T.alloc_local((4,), "bfloat16")
    fq = T.alloc_local((4,), "float32")
    fk = T.alloc_local((4,), "float32")
    ss = T.alloc_local((3,), "float32")                 # |q|^2 -> q scale, |k|^2 -> k scale, k.q

    p: T.let[T.int32] = lane // KS
    ks: T.let[T.int32] = lane % KS
    v0: T.let[T.int32] = warp * 16 + 2 * p
    nb: T.let[T.int32] = T.ceildiv(seqlen, TB)

    # ---- initial state -> registers (8-byte loads of the column pair)
    for j in T.unroll(NJ):
        for e in T.unroll(4):
            for c in T.vectorized(2):
                Sb[2 * (4 * j + e) + c] = S0[bh, 16 * j + 4 * ks + e, v0 + c]
    for i in T.unroll(NE * 2):
        dS[i] = T.float32(0.0)

    # ---- prologue: raw rows of block 0, beta
    for i in T.unroll(RAW_PER_THREAD):
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 0, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(Q[bh, T.min((tid + THREADS * i) // CPR, seqlen - 1), ((tid + THREADS * i) % CPR) * 8]), 16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 1, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(K[bh, T.min((tid + THREADS * i) // CPR, seqlen - 1), ((tid + THREADS * i) % CPR) * 8]), 16)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Raw[0, 2, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
            T.address_of(V[bh, T.min((tid + THREADS * i) // CPR, seqlen - 1), ((tid + THREADS * i) % CPR) * 8]), 16)
    T.ptx.cp.async_.commit_group()
    breg[0] = T.cast(BETA[bh, T.min(lane, seqlen - 1)], "float32")
    T.ptx.cp.async_.wait_group(0)
    T.cuda.cta_sync()

    # blk == 0 normalizes block 0; blk >= 1 computes block blk - 1 and normalizes block blk.
    for blk in range(nb + 1):
        if blk > 0:
            cb: T.let[T.int32] = (blk - 1) % 2
            t0: T.let[T.int32] = (blk - 1) * TB
            if blk < nb:
                # raw rows of block blk into the other buffer, in flight during the token loop
                for i in T.unroll(RAW_PER_THREAD):
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 0, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(Q[bh, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1),
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 1, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(K[bh, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1),
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Raw[1 - cb, 2, (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8]),
                        T.address_of(V[bh, T.min(t0 + TB + (tid + THREADS * i) // CPR, seqlen - 1),
                                       ((tid + THREADS * i) % CPR) * 8]), 16)
                breg[0] = T.cast(BETA[bh, T.min(t0 + TB + lane, seqlen - 1)], "float32")
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
                    for e in T.unroll(4):
                        for c in T.unroll(2):
                            sc[6] = Sb[2 * (4 * j + e) + c] + dS[2 * (4 * j + e) + c]
                            acc[c * 4 + e] = acc[c * 4 + e] + sc[6] * kr[4 * j + e]
                            acc[(2 + c) * 4 + e] = acc[(2 + c) * 4 + e] + sc[6] * q4[e]
                for r in T.unroll(4):
                    red[r] = (acc[r * 4] + acc[r * 4 + 1]) + (acc[r * 4 + 2] + acc[r * 4 + 3])
                    red[r] = red[r] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[r], 1, 32, 32)
                    red[r] = red[r] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[r], 2, 32, 32)
                sc[2] = sc[4] * (sc[0] - red[0])
                sc[3] = sc[4] * (sc[1] - red[1])
                for idx in T.unroll(NE):
                    dS[2 * idx] = dS[2 * idx] + kr[idx] * sc[2]
                    dS[2 * idx + 1] = dS[2 * idx + 1] + kr[idx] * sc[3]
                if ks == 0:
                    Os[tt, v0] = T.cast(red[2] + sc[2] * sc[5], "bfloat16")
                    Os[tt, v0 + 1] = T.cast(red[3] + sc[3] * sc[5], "bfloat16")

            # fold the block's increments into the base state
            for i in T.unroll(NE * 2):
                Sb[i] = Sb[i] + dS[i]
                dS[i] = T.float32(0.0)

            T.ptx.cp.async_.wait_group(0)
            T.cuda.cta_sync()
            # o tile -> global (16-byte stores, rows past T skipped)
            for i in T.unroll(RAW_PER_THREAD):
                if (tid + THREADS * i) // CPR < n:
                    for e in T.vectorized(8):
                        ob[e] = Os[(tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8 + e]
                    for e in T.vectorized(8):
                        O[bh, t0 + (tid + THREADS * i) // CPR, ((tid + THREADS * i) % CPR) * 8 + e] = ob[e]

        if blk < nb:
            # normalize block blk from raw buffer blk % 2: warp w -> tokens 4w..4w+3
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
                # inverse norms in fp64, rounded once (fast-math fp32 sqrt / division are approximate)
                ss[0] = T.cast(T.float64(Q_SCALE) / T.max(T.sqrt(T.cast(ss[0], "float64")), T.float64(NORM_EPS)),
                               "float32")
                ss[1] = T.cast(T.float64(1.0) / T.max(T.sqrt(T.cast(ss[1], "float64")), T.float64(NORM_EPS)),
                               "float32")
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
                BS[lane] = breg[0]
        T.cuda.cta_sync()

    # ---- final state (8-byte stores of the column pair)
    for j in T.unroll(NJ):
        for e in T.unroll(4):
            for c in T.vectorized(2):
                ST[bh, 16 * j + 4 * ks + e, v0 + c] = Sb[2 * (4 * j + e) + c] + dS[2 * (4 * j + e) + c]


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
        exe = tvm.compile(tvm.IRModule({"main": deltanet}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q, k, v, beta, initial_state):
    b, h, t, d = q.shape
    assert (h, d) == (HEADS, D) and v.shape[-1] == D
    out = torch.empty((b, h, t, D), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out, initial_state.to(torch.float32).clone()
    state = torch.empty((b, h, D, D), dtype=torch.float32, device=q.device)
    _compiled()(q.contiguous().view(b * h, t, D), k.contiguous().view(b * h, t, D),
                v.contiguous().view(b * h, t, D), beta.contiguous().view(b * h, t),
                initial_state.contiguous().view(b * h, D, D), out.view(b * h, t, D), state.view(b * h, D, D))
    return out, state
