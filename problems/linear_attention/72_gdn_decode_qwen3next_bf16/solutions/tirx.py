# Gated DeltaNet single-token decode (Qwen3-Next, 16 value heads, 8 q/k heads, d = 128) in TIRx. Same
# algorithm and launch geometry as the CuTe DSL solution of this problem (which passed on the H200 at
# 0.035 ms device time, 80% of the DRAM speed of light).
#
# Observation: with the state in k-last layout S[v, :] (one 512-byte fp32 row per value index v), every
# row is updated independently:
#     pred_v  = alpha * <S[v,:], kn>          delta_v = beta * (v_v - pred_v)
#     S'[v,:] = alpha * S[v,:] + delta_v * kn o_v = scale * <S'[v,:], qn>
# so the kernel is a single streaming pass over the state (read once, written once, in place).
#
# Algorithm
# - Grid (4 row blocks, 16 value heads, B requests); 256 threads = 16 groups of 16 lanes. CTA
#   (rb, h, b) updates rows rb*32 + g and rb*32 + 16 + g of state[b, h] (group g), 4096 CTAs in all.
# - Lane l of a group owns the state columns 4l..4l+3 and 64+4l..64+4l+3 (two 16-byte fp32 chunks, so a
#   half-warp's 16-byte loads cover 256 contiguous bytes of a row). All four 16-byte state loads of a
#   thread are issued before any math (64 bytes in flight per thread).
# - q/k head h // 2: each lane loads the matching 2 x 4 bf16 of q and k (8-byte loads); the sums of
#   squares are reduced over the 16 lanes with xor shuffles, giving kn = k * rsqrt(|k|^2 + 1e-6) and qn
#   likewise, in fp32 registers. Each CTA recomputes them (256 B of q/k per CTA, L2-resident).
# - Per row: <S, kn> (8 FMAs + 4 shuffles), delta, the rank-one update, <S', qn> (8 FMAs + 4 shuffles);
#   S' is stored with 16-byte stores into the input state (problem.yaml allows the in-place update,
#   input 3), lane 0 stores o_v (bf16).
# Differences from the CuTe DSL version: the gates alpha = exp(-exp(A_log) * softplus(a + dt_bias))
# and beta = sigmoid(b) are computed in fp64 (cast to fp32), because TVM always compiles device code
# with fast math (approximate fp32 exp) and new_state is compared at fp32 precision; the CuTe DSL kernel
# used the accurate fp32 functions. rsqrt is the hardware approximation in both.
# What limits it: DRAM bandwidth - 64 MiB of state read + 64 MiB written (134 MB in all); SOL ~0.028 ms,
# the CuTe DSL kernel measured 0.035 ms of device time; expected about the same. Faster than eager
# (0.80 ms) and torch.compile (0.99 ms); the end-to-end time is dominated by the host path at this size.
#
# Host path: compiled once per process (symbolic batch); tvm-ffi runs the kernel on torch's current
# stream. The state is passed as given (it must be a contiguous fp32 tensor, as produced by the
# problem) so that the in-place update lands in the caller's tensor.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

QK_HEADS = 8
V_HEADS = 16
D = 128
L2_EPS = 1e-6
LANES = 16                     # lanes per state row
THREADS = 256
GROUPS = THREADS // LANES      # 16 row groups per CTA
ROWS_PER_GROUP = 2
ROWS_PER_CTA = GROUPS * ROWS_PER_GROUP   # 32
ROW_BLOCKS = D // ROWS_PER_CTA           # 4


@T.prim_func
def gdn_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, s_h: T.handle, alog_h: T.handle, a_h: T.handle,
               dtb_h: T.handle, b_h: T.handle, o_h: T.handle, scale: T.float32):
    batch = T.int32()
    Q = T.match_buffer(q_h, (batch, 1, QK_HEADS, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (batch, 1, QK_HEADS, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (batch, 1, V_HEADS, D), "bfloat16", align=16)
    S = T.match_buffer(s_h, (batch, V_HEADS, D, D), "float32", align=16)
    ALOG = T.match_buffer(alog_h, (V_HEADS,), "float32")
    A = T.match_buffer(a_h, (batch, 1, V_HEADS), "bfloat16")
    DTB = T.match_buffer(dtb_h, (V_HEADS,), "float32")
    B = T.match_buffer(b_h, (batch, 1, V_HEADS), "bfloat16")
    O = T.match_buffer(o_h, (batch, 1, V_HEADS, D), "bfloat16", align=16)

    T.device_entry()
    rb, h, b = T.cta_id([ROW_BLOCKS, V_HEADS, batch])
    tid = T.thread_id([THREADS])

    st = T.alloc_local((16,), "float32")        # st[(2 j + c) 4 + i] = S[row j, 64 c + 4 l + i]
    qr = T.alloc_local((8,), "bfloat16")
    kr = T.alloc_local((8,), "bfloat16")
    qn = T.alloc_local((8,), "float32")
    kn = T.alloc_local((8,), "float32")
    sc = T.alloc_local((6,), "float32")         # qss, kss, alpha, beta, dot, delta
    gd = T.alloc_local((2,), "float64")

    g: T.let[T.int32] = tid // LANES
    l: T.let[T.int32] = tid % LANES
    hk: T.let[T.int32] = h // (V_HEADS // QK_HEADS)

    # state loads first (rows rb*32 + g + 16 j, chunks l and l + 16)
    for j in T.unroll(ROWS_PER_GROUP):
        for c in T.unroll(2):
            for i in T.vectorized(4):
                st[(j * 2 + c) * 4 + i] = S[b, h, rb * ROWS_PER_CTA + j * GROUPS + g, c * 64 + l * 4 + i]

    # q / k of this lane's columns, L2-normalized over the 16 lanes of the group
    for c in T.unroll(2):
        for i in T.vectorized(4):
            qr[c * 4 + i] = Q[b, 0, hk, c * 64 + l * 4 + i]
        for i in T.vectorized(4):
            kr[c * 4 + i] = K[b, 0, hk, c * 64 + l * 4 + i]
    sc[0] = T.float32(0.0)
    sc[1] = T.float32(0.0)
    for e in T.unroll(8):
        qn[e] = T.cast(qr[e], "float32")
        kn[e] = T.cast(kr[e], "float32")
        sc[0] = sc[0] + qn[e] * qn[e]
        sc[1] = sc[1] + kn[e] * kn[e]
    for s in T.unroll(4):
        sc[0] = sc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[0], 8 >> s, 32, 32)
        sc[1] = sc[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[1], 8 >> s, 32, 32)
    sc[0] = T.rsqrt(sc[0] + T.float32(L2_EPS))
    sc[1] = T.rsqrt(sc[1] + T.float32(L2_EPS))
    for e in T.unroll(8):
        qn[e] = qn[e] * sc[0]
        kn[e] = kn[e] * sc[1]

    # gates in fp64 (fast-math fp32 exp would be approximate)
    gd[0] = T.cast(T.cast(A[b, 0, h], "float32"), "float64") + T.cast(DTB[h], "float64")
    gd[1] = T.if_then_else(gd[0] > T.float64(20.0), gd[0], T.log1p(T.exp(gd[0])))
    sc[2] = T.cast(T.exp(T.float64(0.0) - T.exp(T.cast(ALOG[h], "float64")) * gd[1]), "float32")
    sc[3] = T.cast(T.float64(1.0) / (T.float64(1.0) + T.exp(T.float64(0.0) - T.cast(T.cast(B[b, 0, h], "float32"), "float64"))), "float32")

    for j in T.unroll(ROWS_PER_GROUP):
        sc[4] = T.float32(0.0)
        for e in T.unroll(8):
            sc[4] = sc[4] + st[j * 8 + e] * kn[e]
        for s in T.unroll(4):
            sc[4] = sc[4] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[4], 8 >> s, 32, 32)
        sc[5] = sc[3] * (T.cast(V[b, 0, h, rb * ROWS_PER_CTA + j * GROUPS + g], "float32") - sc[2] * sc[4])
        for e in T.unroll(8):
            st[j * 8 + e] = st[j * 8 + e] * sc[2] + kn[e] * sc[5]
        for c in T.unroll(2):
            for i in T.vectorized(4):
                S[b, h, rb * ROWS_PER_CTA + j * GROUPS + g, c * 64 + l * 4 + i] = st[(j * 2 + c) * 4 + i]
        sc[4] = T.float32(0.0)
        for e in T.unroll(8):
            sc[4] = sc[4] + st[j * 8 + e] * qn[e]
        for s in T.unroll(4):
            sc[4] = sc[4] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[4], 8 >> s, 32, 32)
        if l == 0:
            O[b, 0, h, rb * ROWS_PER_CTA + j * GROUPS + g] = T.cast(sc[4] * scale, "bfloat16")


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
        exe = tvm.compile(tvm.IRModule({"main": gdn_decode}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q, k, v, state, A_log, a, dt_bias, b, scale):
    batch = q.shape[0]
    out = torch.empty((batch, 1, V_HEADS, D), dtype=q.dtype, device=q.device)
    if batch > 0:
        _compiled()(q.contiguous(), k.contiguous(), v.contiguous(), state, A_log.contiguous(), a.contiguous(),
                    dt_bias.contiguous(), b.contiguous(), out, float(scale))
    return out, state
