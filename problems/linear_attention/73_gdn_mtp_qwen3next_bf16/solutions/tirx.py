# Gated DeltaNet multi-token (draft verification) step (Qwen3-Next, 8 q/k heads, 16 v heads, head dim
# 128) as one TIRx kernel: every per-token state is written straight from registers.
#
# Algorithm
# - The value columns of a head's state are independent: with S = state^T [K, V], column v obeys
#   S[:, v] <- a S[:, v];  S[:, v] += k beta (v_v - S[:, v].k);  o_v = scale S[:, v].q.
#   Grid: (4 value slices of 32 columns, 16 value heads, B requests), 256 threads = 8 warps; warp w
#   owns columns 4w .. 4w+3 of the slice. Lane l owns column 4w + l // 8 and its 16 k-rows
#   {32 j + 4 (l % 8) + i : j, i < 4}: the pool state (k-last, each column one contiguous 512-byte row)
#   is read with 4 16-byte loads per lane, and each per-token state is written with 4 16-byte stores
#   per lane; per store instruction the 8 lanes of a column cover one contiguous 128-byte line.
# - Per chunk of up to 8 tokens (one chunk at the full size, T = 4): warp t % 8 prepares token t:
#   it loads k and q of head h // 2 (8 bytes per lane), sums the squares over the warp (5 xor
#   shuffles), and stores the L2-normalized k and scale * normalized q as fp32 in shared memory,
#   together with the CTA's 32 v values and the gates alpha = exp(-exp(A_log) softplus(a + dt_bias)),
#   beta = sigmoid(b). rsqrt and the gates are evaluated in fp64 and rounded once (TVM compiles with
#   --use_fast_math, whose fp32 exp/rsqrt are approximate; the states are compared at fp32 precision).
#   One __syncthreads, then every lane runs the tokens of the chunk in the reference's order:
#   S = a S; p = S.k (4 independent FMA chains, then 3 xor shuffles over the column's 8 lanes);
#   d = beta (v - p); S = S + d k (fma); o = S.(scale q) (same reduction); store S; lane 0 of the
#   column puts o in shared memory. After a second barrier the outputs of the chunk are written as
#   16-byte bf16 vectors (64 contiguous bytes per token and CTA).
# - The pool is only read (gathered through initial_state_indices); nothing is written back to it.
#
# What limits it: DRAM traffic. 32 pool states are read (33.5 MB) and 4 x 32 states written
# (134 MB); everything else is < 1 MB. SOL ~35 us at 4.8 TB/s; expected ~40-50 us (stores issued
# back to back, 16 KiB of state loads in flight per CTA, 3-4 CTAs per SM). Expected several times
# faster than eager PyTorch (a Python loop over the tokens with ~10 kernels each plus the gather, and
# every state materialized twice).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi's call path installs
# torch's current stream as TVM's environment stream for the call, so the kernel is ordered with
# the surrounding torch work. Only the compiled module is cached (symbolic batch / tokens / pool).
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

HQ = 8
HV = 16
D = 128
COLS = 32                       # value columns per CTA
NSLICE = D // COLS              # 4
THREADS = 256
WARPS = THREADS // 32
KG = 8                          # lanes per column
KP = D // KG                    # state rows per lane (16)
TCH = 8                         # tokens per chunk (one warp prepares one token)
L2_EPS = 1e-6


@T.prim_func
def gdn_mtp(q_h: T.handle, k_h: T.handle, v_h: T.handle, st_h: T.handle, idx_h: T.handle, alog_h: T.handle,
            a_h: T.handle, dtb_h: T.handle, b_h: T.handle, o_h: T.handle, ns_h: T.handle, scale: T.float32):
    batch = T.int32()
    ntok = T.int32()
    pool = T.int32()
    Q = T.match_buffer(q_h, (batch, ntok, HQ, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (batch, ntok, HQ, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (batch, ntok, HV, D), "bfloat16", align=16)
    ST = T.match_buffer(st_h, (pool, HV, D, D), "float32", align=16)
    IDX = T.match_buffer(idx_h, (batch,), "int32")
    ALOG = T.match_buffer(alog_h, (HV,), "float32")
    A = T.match_buffer(a_h, (batch, ntok, HV), "bfloat16")
    DTB = T.match_buffer(dtb_h, (HV,), "float32")
    B = T.match_buffer(b_h, (batch, ntok, HV), "bfloat16")
    O = T.match_buffer(o_h, (batch, ntok, HV, D), "bfloat16", align=16)
    NS = T.match_buffer(ns_h, (batch, ntok, HV, D, D), "float32", align=16)

    T.device_entry()
    vs, h, bi = T.cta_id([NSLICE, HV, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    Kh = T.alloc_shared((TCH, D), "float32")
    Qh = T.alloc_shared((TCH, D), "float32")
    Vs = T.alloc_shared((TCH, COLS), "float32")
    Gs = T.alloc_shared((TCH, 2), "float32")
    Os = T.alloc_shared((TCH, COLS), "float32")

    s = T.alloc_local((KP,), "float32")
    kr = T.alloc_local((KP,), "float32")
    qr = T.alloc_local((KP,), "float32")
    pk = T.alloc_local((4,), "float32")
    sc = T.alloc_local((4,), "float32")             # p, d, alpha, o
    kv = T.alloc_local((4,), "bfloat16")
    qv = T.alloc_local((4,), "bfloat16")
    kf = T.alloc_local((4,), "float32")
    qf = T.alloc_local((4,), "float32")
    ss = T.alloc_local((2,), "float32")
    gd = T.alloc_local((3,), "float64")
    ob = T.alloc_local((8,), "bfloat16")
    of = T.alloc_local((8,), "float32")

    hk: T.let[T.int32] = h // (HV // HQ)
    kg: T.let[T.int32] = lane % KG
    col: T.let[T.int32] = warp * 4 + lane // KG
    vcol: T.let[T.int32] = vs * COLS + col
    slot: T.let[T.int32] = IDX[bi]

    # pool state of this lane's 16 entries (loads in flight during the first chunk's preparation)
    for j in T.unroll(4):
        for i in T.vectorized(4):
            s[j * 4 + i] = ST[slot, h, vcol, j * 32 + kg * 4 + i]

    for ch in range(T.ceildiv(ntok, TCH)):
        # ---- preparation: warp w handles token ch * 8 + w
        tp: T.let[T.int32] = ch * TCH + warp
        if tp < ntok:
            for i in T.vectorized(4):
                kv[i] = K[bi, tp, hk, lane * 4 + i]
            for i in T.vectorized(4):
                qv[i] = Q[bi, tp, hk, lane * 4 + i]
        else:
            for i in T.unroll(4):
                kv[i] = T.bfloat16(0.0)
                qv[i] = T.bfloat16(0.0)
        ss[0] = T.float32(0.0)
        ss[1] = T.float32(0.0)
        for i in T.unroll(4):
            kf[i] = T.cast(kv[i], "float32")
            qf[i] = T.cast(qv[i], "float32")
            ss[0] = ss[0] + kf[i] * kf[i]
            ss[1] = ss[1] + qf[i] * qf[i]
        for r in T.unroll(5):   # all warps shuffle (idle ones on zeros): converged, uniform control flow
            ss[0] = ss[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[0], 16 >> r, 32, 32)
            ss[1] = ss[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[1], 16 >> r, 32, 32)
        if tp < ntok:
            # rsqrt(sum + eps) in fp64, rounded once to fp32 (the reference's fp32 rsqrt is accurate)
            ss[0] = T.cast(T.float64(1.0) / T.sqrt(T.cast(ss[0] + T.float32(L2_EPS), "float64")), "float32")
            ss[1] = T.cast(T.float64(1.0) / T.sqrt(T.cast(ss[1] + T.float32(L2_EPS), "float64")), "float32")
            for i in T.unroll(4):
                kf[i] = kf[i] * ss[0]
                qf[i] = (qf[i] * ss[1]) * scale
            for i in T.vectorized(4):
                Kh[warp, lane * 4 + i] = kf[i]
            for i in T.vectorized(4):
                Qh[warp, lane * 4 + i] = qf[i]
            Vs[warp, lane] = T.cast(V[bi, tp, h, vs * COLS + lane], "float32")
            if lane == 0:
                gd[0] = T.cast(T.cast(A[bi, tp, h], "float32"), "float64") + T.cast(DTB[h], "float64")
                gd[1] = T.if_then_else(gd[0] > T.float64(20.0), gd[0], T.log1p(T.exp(gd[0])))
                gd[2] = T.float64(0.0) - T.exp(T.cast(ALOG[h], "float64")) * gd[1]
                Gs[warp, 0] = T.cast(T.exp(gd[2]), "float32")
                Gs[warp, 1] = T.cast(T.float64(1.0) / (T.float64(1.0) + T.exp(T.float64(0.0) - T.cast(T.cast(B[bi, tp, h], "float32"), "float64"))), "float32")
        T.cuda.cta_sync()

        # ---- the recurrence over the chunk's tokens
        for tl in range(T.min(TCH, ntok - ch * TCH)):
            t: T.let[T.int32] = ch * TCH + tl
            for j in T.unroll(4):
                for i in T.vectorized(4):
                    kr[j * 4 + i] = Kh[tl, j * 32 + kg * 4 + i]
                for i in T.vectorized(4):
                    qr[j * 4 + i] = Qh[tl, j * 32 + kg * 4 + i]
            sc[2] = Gs[tl, 0]
            for e in T.unroll(KP):
                s[e] = sc[2] * s[e]
            for j in T.unroll(4):
                pk[j] = s[j * 4] * kr[j * 4]
                for i in T.unroll(3):
                    pk[j] = pk[j] + s[j * 4 + i + 1] * kr[j * 4 + i + 1]
            sc[0] = (pk[0] + pk[1]) + (pk[2] + pk[3])
            for r in T.unroll(3):
                sc[0] = sc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[0], 4 >> r, 32, 32)
            sc[1] = Gs[tl, 1] * (Vs[tl, col] - sc[0])
            for e in T.unroll(KP):
                s[e] = s[e] + sc[1] * kr[e]
            for j in T.unroll(4):
                for i in T.vectorized(4):
                    NS[bi, t, h, vcol, j * 32 + kg * 4 + i] = s[j * 4 + i]
            for j in T.unroll(4):
                pk[j] = s[j * 4] * qr[j * 4]
                for i in T.unroll(3):
                    pk[j] = pk[j] + s[j * 4 + i + 1] * qr[j * 4 + i + 1]
            sc[3] = (pk[0] + pk[1]) + (pk[2] + pk[3])
            for r in T.unroll(3):
                sc[3] = sc[3] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[3], 4 >> r, 32, 32)
            if kg == 0:
                Os[tl, col] = sc[3]
        T.cuda.cta_sync()

        # ---- outputs of the chunk: thread -> (token tid // 4, 8 columns)
        to: T.let[T.int32] = ch * TCH + tid // 4
        if tid < TCH * 4:
            if to < ntok:
                for i in T.vectorized(4):
                    of[i] = Os[tid // 4, (tid % 4) * 8 + i]
                for i in T.vectorized(4):
                    of[4 + i] = Os[tid // 4, (tid % 4) * 8 + 4 + i]
                for i in T.unroll(8):
                    ob[i] = T.cast(of[i], "bfloat16")
                for i in T.vectorized(8):
                    O[bi, to, h, vs * COLS + (tid % 4) * 8 + i] = ob[i]


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
        exe = tvm.compile(tvm.IRModule({"main": gdn_mtp}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor,
          initial_state_indices: torch.Tensor, A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
          b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    exe = _compiled()
    batch, ntok = q.shape[0], q.shape[1]
    output = torch.empty((batch, ntok, HV, D), dtype=q.dtype, device=q.device)
    states = torch.empty((batch, ntok, HV, D, D), dtype=torch.float32, device=q.device)
    if batch == 0 or ntok == 0:
        return output, states
    idx = initial_state_indices if initial_state_indices.dtype == torch.int32 else initial_state_indices.to(torch.int32)
    exe(q.contiguous(), k.contiguous(), v.contiguous(), initial_state.contiguous(), idx.contiguous(),
        A_log.contiguous().float(), a.contiguous(), dt_bias.contiguous().float(), b.contiguous(), output, states,
        float(scale))
    return output, states
