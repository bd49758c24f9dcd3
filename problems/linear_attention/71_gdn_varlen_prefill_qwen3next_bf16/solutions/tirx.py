# Gated DeltaNet varlen prefill (Qwen3-Next, 8 q/k heads, 16 v heads, head dim 128) as one TIRx
# kernel: the exact token-by-token recurrence, with the state kept in registers.
#
# Algorithm
# - The value columns of a head's state are independent: with S = state^T [K, V], column v obeys
#   S[:, v] <- a S[:, v] + k * beta (v_v - a S[:, v].k)   and   o_v = S[:, v].(scale q).
#   Grid: (8 value slices of 16 columns, 16 value heads, N sequences), 128 threads = 4 warps per
#   CTA; each warp owns 4 columns. Lane l of a warp owns column 4 warp + l // 8 and the 16 k-rows
#   {32 j + 4 (l % 8) + i : j, i < 4} of it (16-byte groups interleaved so that the 8 lanes of a
#   column read 8 distinct bank quads of shared memory; the other 24 lanes of the warp read the same
#   addresses as broadcasts). The carried state is read from / written to the k-last fp32 layout
#   with 16-byte vector accesses (each column is one contiguous 512-byte row).
# - Per token: partial dots S.k and S.q over the lane's 16 rows (4 independent FMA chains each),
#   summed over the column's 8 lanes with 3 xor shuffles (offsets 4, 2, 1);
#   d = beta (v - a S.k); o = a S.q + (k.q) d (= S_new.q, so no second pass over the updated
#   state); then the rank-1 update of the lane's 16 state entries.
# - State precision: fp32 rounding of the state on every one of ~900 sequential steps adds up
#   (a CPU emulation of this recurrence in plain fp32 reached the 3x tolerance on new_state on one
#   seed of five). The state is therefore a compensated pair hi + lo (float-float): per entry
#   kd' = a lo + k d; hi' = fma(a, hi, kd'); lo' = fma(a, hi, -hi') + kd' (the fma residual is the
#   exact rounding error of a hi, up to the tiny rounding of kd'), with explicit PTX fma.rn so that
#   the residual is not lost to a compiler rewrite. new_state = hi + lo. The dots use hi only.
#   (Emulated error with this scheme: ~1.8e-8 on new_state vs a tolerance of >= 8e-8.)
# - Token staging: tokens are processed in blocks of 16. For each block the CTA stages, in shared
#   memory, k and scale*q as fp32 [16 x 128] (16-byte global loads, 2+2 per thread), the CTA's 16
#   columns of v, the gates alpha = exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b)
#   (computed in fp64 from the bf16/fp32 inputs: --use_fast_math, which TVM always passes, would
#   make fp32 expf approximate) and k.q (16-lane shuffle reduction). Double-buffered: the global
#   loads of block n+1 are issued before the token loop of block n and written to the other buffer
#   after it; one __syncthreads per block. Outputs of a block go through shared memory and are
#   written one block later as 16-byte bf16 vectors (a CTA owns 32 contiguous bytes per token).
# - Sequences are independent CTAs (the grid's z index); a CTA reads its bounds from cu_seqlens, so
#   there is no host synchronisation. Empty sequences copy their state.
#
# What limits it / expected time: the recurrence is sequential over the 890 tokens of the longest
# sequence; its 16 heads x 8 slices = 128 CTAs put one warp on (almost) every scheduler of the
# H200, and each token costs a warp ~140 issued instructions (32 FMA of dots, 80 of the
# compensated update, loads, 6 shuffles) plus the shuffle latency, i.e. ~150 cycles -> ~70 us for
# the whole call. The SOL model (chunked WY form on tensor cores, 2.5 GFLOP / 20 MB) is ~4 us; the
# next step towards it is the chunked form (intra-chunk triangular solve in parallel over chunks,
# then a chunk-sequential state pass with 64-token matrix products), which cuts the sequential
# depth from 890 steps to 14 but needs fp32-accurate products (the state is compared at fp32
# precision, so bf16/TF32 tensor-core products are not usable for the state path).
# Expected far faster than eager PyTorch (a Python loop over sequences and chunks, hundreds of
# small kernels and a triangular solve).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi's call path installs
# torch's current stream as TVM's environment stream for the call, so the kernel is ordered with
# the surrounding torch work. Only the compiled module is cached (symbolic token / sequence counts).
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

HQ = 8
HV = 16
D = 128
TB = 16                         # tokens per staged block
COLS = 16                       # value columns per CTA
NSLICE = D // COLS              # 8 CTAs per (sequence, head)
THREADS = 128
WARPS = THREADS // 32
KG = 8                          # lanes per column
KP = D // KG                    # state rows per lane (16)
VEC = 8                         # bf16 per 16-byte access


@T.prim_func
def gdn_prefill(q_h: T.handle, k_h: T.handle, v_h: T.handle, st_h: T.handle, alog_h: T.handle, a_h: T.handle,
                dtb_h: T.handle, b_h: T.handle, cu_h: T.handle, o_h: T.handle, ns_h: T.handle, scale: T.float32):
    total = T.int32()
    nseq = T.int32()
    Q = T.match_buffer(q_h, (total, HQ, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (total, HQ, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (total, HV, D), "bfloat16", align=16)
    ST = T.match_buffer(st_h, (nseq, HV, D, D), "float32", align=16)
    ALOG = T.match_buffer(alog_h, (HV,), "float32")
    A = T.match_buffer(a_h, (total, HV), "bfloat16")
    DTB = T.match_buffer(dtb_h, (HV,), "float32")
    B = T.match_buffer(b_h, (total, HV), "bfloat16")
    CU = T.match_buffer(cu_h, (nseq + 1,), "int64")
    O = T.match_buffer(o_h, (total, HV, D), "bfloat16", align=16)
    NS = T.match_buffer(ns_h, (nseq, HV, D, D), "float32", align=16)

    T.device_entry()
    vs, h, sq = T.cta_id([NSLICE, HV, nseq])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    Ks = T.alloc_shared((2, TB, D), "float32")
    Qs = T.alloc_shared((2, TB, D), "float32")
    Vs = T.alloc_shared((2, TB, COLS), "float32")
    Gs = T.alloc_shared((2, 3, TB), "float32")      # alpha, beta, k.(scale q)
    Os = T.alloc_shared((2, TB, COLS), "float32")

    hi = T.alloc_local((KP,), "float32")
    lo = T.alloc_local((KP,), "float32")
    kr = T.alloc_local((KP,), "float32")
    qr = T.alloc_local((KP,), "float32")
    pk = T.alloc_local((4,), "float32")
    pq = T.alloc_local((4,), "float32")
    sc = T.alloc_local((6,), "float32")             # p1, p2, d, o, kd', alpha
    fm = T.alloc_local((2,), "float32")             # fma results
    kraw = T.alloc_local((2 * VEC,), "bfloat16")
    qraw = T.alloc_local((2 * VEC,), "bfloat16")
    vraw = T.alloc_local((VEC,), "bfloat16")
    graw = T.alloc_local((2,), "bfloat16")
    kf = T.alloc_local((VEC,), "float32")
    qf = T.alloc_local((VEC,), "float32")
    part = T.alloc_local((1,), "float32")
    ob = T.alloc_local((VEC,), "bfloat16")
    of = T.alloc_local((VEC,), "float32")
    gd = T.alloc_local((3,), "float64")

    hk: T.let[T.int32] = h // (HV // HQ)
    kg: T.let[T.int32] = lane % KG
    col: T.let[T.int32] = warp * 4 + lane // KG      # column within the CTA's slice
    vcol: T.let[T.int32] = vs * COLS + col           # value column of the head
    bos: T.let[T.int32] = T.cast(CU[sq], "int32")
    eos: T.let[T.int32] = T.cast(CU[sq + 1], "int32")
    seqlen: T.let[T.int32] = eos - bos
    nblk: T.let[T.int32] = T.ceildiv(seqlen, TB)
    # staging roles
    s_tok: T.let[T.int32] = tid // 16                # + 8 r: token of this thread's k/q vectors
    s_c: T.let[T.int32] = (tid % 16) * VEC
    v_tok: T.let[T.int32] = tid // 2                 # v / output rows (threads 0..31)
    v_c: T.let[T.int32] = (tid % 2) * VEC

    # carried state of this lane's 16 entries
    for j in T.unroll(4):
        for i in T.vectorized(4):
            hi[j * 4 + i] = ST[sq, h, vcol, j * 32 + kg * 4 + i]
    for e in T.unroll(KP):
        lo[e] = T.float32(0.0)

    for blk in range(nblk + 1):
        # blk == 0: prologue (stage block 0). blk >= 1: process block blk - 1 from buffer (blk - 1) % 2
        # while block blk is loaded, then stage block blk into buffer blk % 2.
        tb: T.let[T.int32] = bos + blk * TB
        if blk < nblk:
            for r in T.unroll(2):
                if tb + s_tok + 8 * r < eos:
                    for i in T.vectorized(VEC):
                        kraw[r * VEC + i] = K[tb + s_tok + 8 * r, hk, s_c + i]
                    for i in T.vectorized(VEC):
                        qraw[r * VEC + i] = Q[tb + s_tok + 8 * r, hk, s_c + i]
                else:
                    for i in T.unroll(VEC):
                        kraw[r * VEC + i] = T.bfloat16(0.0)
                        qraw[r * VEC + i] = T.bfloat16(0.0)
            if tid < 2 * TB:
                if tb + v_tok < eos:
                    for i in T.vectorized(VEC):
                        vraw[i] = V[tb + v_tok, h, vs * COLS + v_c + i]
                else:
                    for i in T.unroll(VEC):
                        vraw[i] = T.bfloat16(0.0)
            if tid < TB:
                if tb + tid < eos:
                    graw[0] = A[tb + tid, h]
                    graw[1] = B[tb + tid, h]
                else:
                    graw[0] = T.bfloat16(0.0)
                    graw[1] = T.bfloat16(0.0)

        if blk > 0:
            cur: T.let[T.int32] = (blk - 1) % 2
            ntok: T.let[T.int32] = T.min(TB, seqlen - (blk - 1) * TB)
            for t in range(ntok):
                for j in T.unroll(4):
                    for i in T.vectorized(4):
                        kr[j * 4 + i] = Ks[cur, t, j * 32 + kg * 4 + i]
                    for i in T.vectorized(4):
                        qr[j * 4 + i] = Qs[cur, t, j * 32 + kg * 4 + i]
                for j in T.unroll(4):
                    pk[j] = hi[j * 4] * kr[j * 4]
                    pq[j] = hi[j * 4] * qr[j * 4]
                    for i in T.unroll(3):
                        pk[j] = pk[j] + hi[j * 4 + i + 1] * kr[j * 4 + i + 1]
                        pq[j] = pq[j] + hi[j * 4 + i + 1] * qr[j * 4 + i + 1]
                sc[0] = (pk[0] + pk[1]) + (pk[2] + pk[3])
                sc[1] = (pq[0] + pq[1]) + (pq[2] + pq[3])
                for s in T.unroll(3):
                    sc[0] = sc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[0], 4 >> s, 32, 32)
                    sc[1] = sc[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[1], 4 >> s, 32, 32)
                sc[5] = Gs[cur, 0, t]
                sc[2] = Gs[cur, 1, t] * (Vs[cur, t, col] - sc[5] * sc[0])
                sc[3] = sc[5] * sc[1] + Gs[cur, 2, t] * sc[2]
                if kg == 0:
                    Os[cur, t, col] = sc[3]
                for e in T.unroll(KP):
                    sc[4] = sc[5] * lo[e] + kr[e] * sc[2]
                    T.ptx.fma.rn.f32(fm[0], sc[5], hi[e], sc[4])
                    T.ptx.fma.rn.f32(fm[1], sc[5], hi[e], T.float32(0.0) - fm[0])
                    lo[e] = fm[1] + sc[4]
                    hi[e] = fm[0]
            if blk > 1:
                # outputs of block blk - 2 (buffer blk % 2, complete since the last barrier)
                pt: T.let[T.int32] = bos + (blk - 2) * TB
                if tid < 2 * TB:
                    if pt + v_tok < eos:
                        for i in T.vectorized(4):
                            of[i] = Os[blk % 2, v_tok, v_c + i]
                        for i in T.vectorized(4):
                            of[4 + i] = Os[blk % 2, v_tok, v_c + 4 + i]
                        for i in T.unroll(VEC):
                            ob[i] = T.cast(of[i], "bfloat16")
                        for i in T.vectorized(VEC):
                            O[pt + v_tok, h, vs * COLS + v_c + i] = ob[i]

        if blk < nblk:
            nb: T.let[T.int32] = blk % 2
            for r in T.unroll(2):
                part[0] = T.float32(0.0)
                for i in T.unroll(VEC):
                    kf[i] = T.cast(kraw[r * VEC + i], "float32")
                    qf[i] = T.cast(qraw[r * VEC + i], "float32") * scale
                    part[0] = part[0] + kf[i] * qf[i]
                for i in T.vectorized(4):
                    Ks[nb, s_tok + 8 * r, s_c + i] = kf[i]
                for i in T.vectorized(4):
                    Ks[nb, s_tok + 8 * r, s_c + 4 + i] = kf[4 + i]
                for i in T.vectorized(4):
                    Qs[nb, s_tok + 8 * r, s_c + i] = qf[i]
                for i in T.vectorized(4):
                    Qs[nb, s_tok + 8 * r, s_c + 4 + i] = qf[4 + i]
                for s in T.unroll(4):
                    part[0] = part[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, part[0], 8 >> s, 32, 32)
                if tid % 16 == 0:
                    Gs[nb, 2, s_tok + 8 * r] = part[0]
            if tid < 2 * TB:
                for i in T.unroll(VEC):
                    kf[i] = T.cast(vraw[i], "float32")
                for i in T.vectorized(4):
                    Vs[nb, v_tok, v_c + i] = kf[i]
                for i in T.vectorized(4):
                    Vs[nb, v_tok, v_c + 4 + i] = kf[4 + i]
            if tid < TB:
                # gates in fp64 (fast-math fp32 exp would be approximate)
                gd[0] = T.cast(T.cast(graw[0], "float32"), "float64") + T.cast(DTB[h], "float64")
                gd[1] = T.if_then_else(gd[0] > T.float64(20.0), gd[0], T.log1p(T.exp(gd[0])))
                gd[2] = T.float64(0.0) - T.exp(T.cast(ALOG[h], "float64")) * gd[1]
                Gs[nb, 0, tid] = T.cast(T.exp(gd[2]), "float32")
                Gs[nb, 1, tid] = T.cast(T.float64(1.0) / (T.float64(1.0) + T.exp(T.float64(0.0) - T.cast(T.cast(graw[1], "float32"), "float64"))), "float32")
        T.cuda.cta_sync()

    # outputs of the last block (buffer (nblk - 1) % 2)
    if nblk > 0:
        lt: T.let[T.int32] = bos + (nblk - 1) * TB
        if tid < 2 * TB:
            if lt + v_tok < eos:
                for i in T.vectorized(4):
                    of[i] = Os[(nblk - 1) % 2, v_tok, v_c + i]
                for i in T.vectorized(4):
                    of[4 + i] = Os[(nblk - 1) % 2, v_tok, v_c + 4 + i]
                for i in T.unroll(VEC):
                    ob[i] = T.cast(of[i], "bfloat16")
                for i in T.vectorized(VEC):
                    O[lt + v_tok, h, vs * COLS + v_c + i] = ob[i]

    for e in T.unroll(KP):
        hi[e] = hi[e] + lo[e]
    for j in T.unroll(4):
        for i in T.vectorized(4):
            NS[sq, h, vcol, j * 32 + kg * 4 + i] = hi[j * 4 + i]


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
        exe = tvm.compile(tvm.IRModule({"main": gdn_prefill}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, A_log: torch.Tensor,
          a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor, cu_seqlens: torch.Tensor,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    exe = _compiled()
    total = q.shape[0]
    nseq = cu_seqlens.shape[0] - 1
    output = torch.empty((total, HV, D), dtype=q.dtype, device=q.device)
    new_state = torch.empty((nseq, HV, D, D), dtype=torch.float32, device=q.device)
    if nseq == 0:
        return output, new_state
    cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    exe(q.contiguous(), k.contiguous(), v.contiguous(), state.contiguous().float(), A_log.contiguous().float(),
        a.contiguous(), dt_bias.contiguous().float(), b.contiguous(), cu.contiguous(), output, new_state,
        float(scale))
    return output, new_state
