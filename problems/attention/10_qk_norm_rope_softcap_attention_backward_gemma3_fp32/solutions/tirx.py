# Backward of the Gemma 3 4B attention core (QK RMSNorm, rotary embedding, logit softcap 50, causal GQA 8 q /
# 4 kv heads of dim 256), fp32 throughout (no TF32, no tensor cores), in TIRx: FlashAttention-2 style recompute on
# the fp32 FMA pipes, six kernels launched back to back on torch's current stream. Same decomposition and tiling
# as the CuTe DSL solution:
# 1. prologue (grid B*S, 384 threads, warp per (token, head) row; lane l owns dims l + 32 m, so the rotate-half
#    partner d +- 128 is in the same lane): qr = rope(RMSNorm(q) (1 + w_q)), kr likewise, to fp32 workspaces
#    [B, H, S, 256]; zeroes the dq accumulator.
# 2. forward recompute (grid (S/32 query tiles, B*8), 256 threads, 167 KiB shared): K/V tiles of 32 rows
#    double-buffered with cp.async (rows padded to 260 floats, zero-filled past S); S = Qr Kr^T with 2 x 2
#    thread tiles (float4 reads, four interleaved partial sums per output), logits 50 tanh(S / 800), causal mask,
#    online softmax (16-lane shuffles, per-row rescale through shared memory), O = alpha O + (P V of the tile)
#    with 8 x 4 thread tiles (P^T in shared memory). Writes O, the row max m and 1 / l.
# 3. delta = rowsum(dO * O) (warp per row).
# 4. backward (grid (S/32 key tiles, B*4 kv heads), 256 threads, 208.5 KiB shared): K_j, V_j stay in shared memory,
#    dK_j and dV_j accumulate in registers; for both query heads of the group and every query tile i >= j (Qr_i,
#    dO_i double-buffered): S, dP = dO V^T, P = exp(logit - m) / l, dS = P (dP - delta)(1 - tanh^2) / 16,
#    dV += P^T dO, dK += dS^T Qr (each tile's 32-term sums first), dQ_i += dS Kr by fp32 atomics into the dq
#    accumulator. Key tile 0 (the heaviest) is block 0.
# 5. epilogue (grid B*S/16, 384 threads): unrope and RMSNorm backward for dq and dk, per-CTA partial sums of the
#    norm-weight gradients. 6. weight gradients: fixed-order tree sums of the partials (deterministic).
# DIFFERENCES from the CuTe solution (numerics only): TVM builds device code with --use_fast_math, which turns
# tanhf into tanh.approx (~2^-11 relative error) and expf / logf / division / rsqrt into approximations. So tanh
# comes from an accurate expm1 (polynomial near 0, range-reduced exp beyond) with div.rn, exp is range-reduced
# (2^k times a degree-7 polynomial), the forward stores the row max m and 1 / l (div.rn) instead of a
# log-sum-exp (no log), and 1 / rms uses sqrt.rn + div.rn.
# What limits it: fp32 FMA throughput on 7 causal matmul-equivalents (~1.2e11 FLOP, ~1.8 ms at peak); the 32 x 32
# tiles keep the S / dP products shared-memory bound, the backward runs 1 CTA (8 warps) per SM, and dq goes
# through ~2.7e8 fp32 atomic adds. The CuTe version of this design measured 6.72 ms of device time on the H200.
# Host path: six compiled executables called with torch tensors; workspaces cached per (device, B, S).
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator at smoke size; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

H = 8
KV = 4
G = H // KV
D = 256
EPS = 1e-6
SCALING = 256 ** -0.5
SOFTCAP = 50.0
LOGIT_C = SCALING / SOFTCAP
TT = 32                         # tile (query rows and key rows)
LD = D + 4                      # padded fp32 row stride of the shared tiles
LDP = TT + 4                    # padded stride of the P / dS tiles
THREADS = 256
ROWT = (H + KV) * 32            # 384 threads of the row kernels
DPL = D // 32                   # 8 dims per lane in the row kernels
TOK4 = 16                       # tokens per epilogue CTA
M_INIT = -1.0e30
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06
TILE = TT * LD
FWD_SMEM = 5 * TILE + TT * LDP + TT
BWD_SMEM = 6 * TILE + 3 * TT * LDP


# ------------------------------------------------------------------------------------------------ helpers
@T.macro
def exp_acc(rb, ri, x, e):
    # rb[ri] = exp(x) for x <= 0 (clamped to [-87, 0]): 2^k p(r), r = x - k ln2, |r| <= ln2 / 2, degree-7 Taylor
    e[0] = T.min(T.max(x, T.float32(-87.0)), T.float32(0.0))
    e[1] = T.floor(e[0] * T.float32(LOG2E) + T.float32(0.5))
    e[2] = (e[0] - e[1] * T.float32(LN2_HI)) - e[1] * T.float32(LN2_LO)
    e[3] = T.float32(1.0 / 5040.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 720.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 120.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 24.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 6.0)
    e[3] = e[3] * e[2] + T.float32(0.5)
    e[3] = e[3] * e[2] + T.float32(1.0)
    e[3] = e[3] * e[2] + T.float32(1.0)
    rb[ri] = e[3] * T.reinterpret("float32", T.shift_left(T.cast(e[1], "int32") + 127, 23))


@T.macro
def tanh_acc(rb, ri, u, e):
    # rb[ri] = tanh(u) = sign(u) (-m / (2 + m)), m = expm1(-2|u|) (polynomial for |2u| < ln2 / 2, exp - 1 beyond)
    e[4] = T.max(T.float32(-2.0) * T.abs(u), T.float32(-87.0))
    if e[4] > T.float32(-0.34657359027997264):
        e[5] = T.float32(1.0 / 3628800.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 362880.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 40320.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 5040.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 720.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 120.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 24.0)
        e[5] = e[5] * e[4] + T.float32(1.0 / 6.0)
        e[5] = e[5] * e[4] + T.float32(0.5)
        e[5] = e[5] * e[4] + T.float32(1.0)
        e[6] = e[5] * e[4]
    else:
        exp_acc(e, 6, e[4], e)
        e[6] = e[6] - T.float32(1.0)
    T.ptx.div.rn.f32(e[7], T.float32(0.0) - e[6], T.float32(2.0) + e[6])
    rb[ri] = T.if_then_else(u < T.float32(0.0), T.float32(0.0) - e[7], e[7])


@T.macro
def load_hs(TL, slot, SRC, b, h, r0, seq, tid):
    # rows r0 .. r0+31 of SRC[b, h] ([B, heads, S, 256]) -> TL[slot] by cp.async (zero past seq)
    for it in T.unroll(TT * (D // 4) // THREADS):
        lr: T.let[T.int32] = (tid + it * THREADS) // (D // 4)
        lc: T.let[T.int32] = (tid + it * THREADS) % (D // 4)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(TL[slot, lr, lc * 4]), T.address_of(SRC[b, h, T.min(r0 + lr, seq - 1), lc * 4]), 16,
            T.if_then_else(r0 + lr < seq, T.uint32(16), T.uint32(0)))


@T.macro
def load_sh(TL, slot, SRC, b, h, r0, seq, tid):
    # rows r0 .. r0+31 of SRC[b, :, h] ([B, S, heads, 256]) -> TL[slot] by cp.async (zero past seq)
    for it in T.unroll(TT * (D // 4) // THREADS):
        lr: T.let[T.int32] = (tid + it * THREADS) // (D // 4)
        lc: T.let[T.int32] = (tid + it * THREADS) % (D // 4)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(TL[slot, lr, lc * 4]), T.address_of(SRC[b, T.min(r0 + lr, seq - 1), h, lc * 4]), 16,
            T.if_then_else(r0 + lr < seq, T.uint32(16), T.uint32(0)))


@T.macro
def gemm_nt(acc, TL, sa, sb, tm, tn, part, av, bv):
    # acc[r * 2 + c] = sum_d TL[sa, tm + 16 r, d] TL[sb, tn + 16 c, d]; four interleaved partial sums (d mod 4)
    for e in T.unroll(16):
        part[e] = T.float32(0.0)
    for k4 in range(D // 4):
        for r in T.unroll(2):
            for i in T.vectorized(4):
                av[r * 4 + i] = TL[sa, tm + 16 * r, k4 * 4 + i]
            for i in T.vectorized(4):
                bv[r * 4 + i] = TL[sb, tn + 16 * r, k4 * 4 + i]
        for r in T.unroll(2):
            for c in T.unroll(2):
                for e in T.unroll(4):
                    part[(r * 2 + c) * 4 + e] = part[(r * 2 + c) * 4 + e] + av[r * 4 + e] * bv[c * 4 + e]
    for rc in T.unroll(4):
        acc[rc] = (part[rc * 4] + part[rc * 4 + 1]) + (part[rc * 4 + 2] + part[rc * 4 + 3])


@T.macro
def gemm_tn(acc, A, TL, sb, om, on, af, bfv):
    # acc[i * 4 + j] += sum_k A[k, 8 om + i] TL[sb, k, 4 on + j]   (k < 32)
    for k in range(TT):
        for i in T.vectorized(4):
            af[i] = A[k, 8 * om + i]
        for i in T.vectorized(4):
            af[4 + i] = A[k, 8 * om + 4 + i]
        for i in T.vectorized(4):
            bfv[i] = TL[sb, k, 4 * on + i]
        for i in T.unroll(8):
            for j in T.unroll(4):
                acc[i * 4 + j] = acc[i * 4 + j] + af[i] * bfv[j]


@T.macro
def row_inv_rms(x, red, lane):
    # red[1] = 1 / sqrt(mean(x^2) + eps) over the warp's row (sqrt.rn, div.rn)
    red[0] = T.float32(0.0)
    for m in T.unroll(DPL):
        red[0] = red[0] + x[m] * x[m]
    for sh in T.unroll(5):
        red[0] = red[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[0], 16 >> sh, 32, 32)
    T.ptx.sqrt.rn.f32(red[2], red[0] * T.float32(1.0 / D) + T.float32(EPS))
    T.ptx.div.rn.f32(red[1], T.float32(1.0), red[2])


# ------------------------------------------------------------------------------------------------ kernel 1
@T.prim_func
def prologue(q_h: T.handle, k_h: T.handle, wq_h: T.handle, wk_h: T.handle, cos_h: T.handle, sin_h: T.handle,
             qr_h: T.handle, kr_h: T.handle, dqa_h: T.handle):
    batch = T.int32()
    seq = T.int32()
    Q = T.match_buffer(q_h, (batch, seq, H, D), "float32", align=16)
    K = T.match_buffer(k_h, (batch, seq, KV, D), "float32", align=16)
    WQ = T.match_buffer(wq_h, (D,), "float32")
    WK = T.match_buffer(wk_h, (D,), "float32")
    COS = T.match_buffer(cos_h, (seq, D), "float32")
    SIN = T.match_buffer(sin_h, (seq, D), "float32")
    QR = T.match_buffer(qr_h, (batch, H, seq, D), "float32", align=16)
    KR = T.match_buffer(kr_h, (batch, KV, seq, D), "float32", align=16)
    DQA = T.match_buffer(dqa_h, (batch, H, seq, D), "float32", align=16)

    T.device_entry()
    bs = T.cta_id([batch * seq])
    tid = T.thread_id([ROWT])

    x = T.alloc_local((DPL,), "float32")
    xn = T.alloc_local((DPL,), "float32")
    red = T.alloc_local((3,), "float32")

    b: T.let[T.int32] = bs // seq
    s: T.let[T.int32] = bs % seq
    lane: T.let[T.int32] = tid % 32
    w: T.let[T.int32] = tid // 32

    for m in T.unroll(DPL):
        if w < H:
            x[m] = Q[b, s, w, lane + 32 * m]
        else:
            x[m] = K[b, s, w - H, lane + 32 * m]
    row_inv_rms(x, red, lane)
    for m in T.unroll(DPL):
        xn[m] = (x[m] * red[1]) * (T.float32(1.0) + T.if_then_else(w < H, WQ[lane + 32 * m], WK[lane + 32 * m]))
    for m in T.unroll(DPL):
        d: T.let[T.int32] = lane + 32 * m
        rh: T.let[T.float32] = T.if_then_else(m < DPL // 2, T.float32(0.0) - xn[(m + DPL // 2) % DPL],
                                              xn[(m + DPL // 2) % DPL])
        val: T.let[T.float32] = xn[m] * COS[s, d] + rh * SIN[s, d]
        if w < H:
            QR[b, w, s, d] = val
            DQA[b, w, s, d] = T.float32(0.0)
        else:
            KR[b, w - H, s, d] = val


# ------------------------------------------------------------------------------------------------ kernel 2
@T.prim_func
def forward(qr_h: T.handle, kr_h: T.handle, v_h: T.handle, o_h: T.handle, mx_h: T.handle, li_h: T.handle):
    batch = T.int32()
    seq = T.int32()
    QR = T.match_buffer(qr_h, (batch, H, seq, D), "float32", align=16)
    KR = T.match_buffer(kr_h, (batch, KV, seq, D), "float32", align=16)
    V = T.match_buffer(v_h, (batch, seq, KV, D), "float32", align=16)
    O = T.match_buffer(o_h, (batch, H, seq, D), "float32", align=16)
    MX = T.match_buffer(mx_h, (batch, H, seq), "float32")
    LI = T.match_buffer(li_h, (batch, H, seq), "float32")

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
    qt, bh = T.cta_id([T.ceildiv(seq, TT), batch * H])
    tid = T.thread_id([THREADS])

    pool = T.alloc_buffer((FWD_SMEM,), "float32", scope="shared.dyn")
    TL = T.decl_buffer((5, TT, LD), "float32", data=pool.data, elem_offset=0)     # Q, K0, K1, V0, V1
    PT = T.decl_buffer((TT, LDP), "float32", data=pool.data, elem_offset=5 * TILE)
    AL = T.decl_buffer((TT,), "float32", data=pool.data, elem_offset=5 * TILE + TT * LDP)

    acc = T.alloc_local((32,), "float32")
    ot = T.alloc_local((32,), "float32")
    sc = T.alloc_local((4,), "float32")
    part = T.alloc_local((16,), "float32")
    av = T.alloc_local((8,), "float32")
    bv = T.alloc_local((8,), "float32")
    af = T.alloc_local((8,), "float32")
    bfv = T.alloc_local((4,), "float32")
    rm = T.alloc_local((2,), "float32")
    rl = T.alloc_local((2,), "float32")
    t = T.alloc_local((8,), "float32")
    ex = T.alloc_local((8,), "float32")

    b: T.let[T.int32] = bh // H
    h: T.let[T.int32] = bh % H
    kvh: T.let[T.int32] = h // G
    i0: T.let[T.int32] = qt * TT
    tm: T.let[T.int32] = tid // 16
    tn: T.let[T.int32] = tid % 16
    om: T.let[T.int32] = tid // 64
    on: T.let[T.int32] = tid % 64

    load_hs(TL, 0, QR, b, h, i0, seq, tid)
    load_hs(TL, 1, KR, b, kvh, 0, seq, tid)
    load_sh(TL, 3, V, b, kvh, 0, seq, tid)
    T.ptx.cp.async_.commit_group()

    for e in T.unroll(32):
        acc[e] = T.float32(0.0)
    for r in T.unroll(2):
        rm[r] = T.float32(M_INIT)
        rl[r] = T.float32(0.0)

    for j in range(qt + 1):
        if j < qt:
            load_hs(TL, 1 + (j + 1) % 2, KR, b, kvh, (j + 1) * TT, seq, tid)
            load_sh(TL, 3 + (j + 1) % 2, V, b, kvh, (j + 1) * TT, seq, tid)
        T.ptx.cp.async_.commit_group()
        T.ptx.cp.async_.wait_group(1)
        T.cuda.cta_sync()
        gemm_nt(sc, TL, 0, 1 + j % 2, tm, tn, part, av, bv)
        for r in T.unroll(2):
            qi: T.let[T.int32] = i0 + tm + 16 * r
            t[0] = T.float32(M_INIT)
            for c in T.unroll(2):
                tanh_acc(t, 1, sc[r * 2 + c] * T.float32(LOGIT_C), ex)
                sc[r * 2 + c] = T.if_then_else(j * TT + tn + 16 * c <= T.min(qi, seq - 1),
                                               T.float32(SOFTCAP) * t[1], T.float32(M_INIT))
                t[0] = T.max(t[0], sc[r * 2 + c])
            for sh in T.unroll(4):
                t[0] = T.max(t[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, t[0], 8 >> sh, 32, 32))
            t[2] = T.max(rm[r], t[0])                    # new running max
            exp_acc(t, 3, rm[r] - t[2], ex)              # alpha
            rm[r] = t[2]
            t[4] = T.float32(0.0)
            for c in T.unroll(2):
                exp_acc(t, 5, sc[r * 2 + c] - t[2], ex)
                t[5] = T.if_then_else(j * TT + tn + 16 * c <= T.min(qi, seq - 1), t[5], T.float32(0.0))
                PT[tn + 16 * c, tm + 16 * r] = t[5]
                t[4] = t[4] + t[5]
            for sh in T.unroll(4):
                t[4] = t[4] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, t[4], 8 >> sh, 32, 32)
            rl[r] = rl[r] * t[3] + t[4]
            if tn == 0:
                AL[tm + 16 * r] = t[3]
        T.cuda.cta_sync()
        # two-level accumulation: this tile's 32-term products first, then acc = alpha acc + tile
        for e in T.unroll(32):
            ot[e] = T.float32(0.0)
        gemm_tn(ot, PT, TL, 3 + j % 2, om, on, af, bfv)
        for i in T.unroll(8):
            t[6] = AL[8 * om + i]
            for jj in T.unroll(4):
                acc[i * 4 + jj] = acc[i * 4 + jj] * t[6] + ot[i * 4 + jj]
        T.cuda.cta_sync()

    # row sums to shared memory, then O / l, the row max and 1 / l
    for r in T.unroll(2):
        if tn == 0:
            AL[tm + 16 * r] = rl[r]
            if i0 + tm + 16 * r < seq:
                T.ptx.div.rn.f32(t[7], T.float32(1.0), rl[r])
                MX[b, h, i0 + tm + 16 * r] = rm[r]
                LI[b, h, i0 + tm + 16 * r] = t[7]
    T.cuda.cta_sync()
    for i in T.unroll(8):
        if i0 + 8 * om + i < seq:
            T.ptx.div.rn.f32(t[6], T.float32(1.0), AL[8 * om + i])
            for jj in T.unroll(4):
                ot[jj] = acc[i * 4 + jj] * t[6]
            for jj in T.vectorized(4):
                O[b, h, i0 + 8 * om + i, 4 * on + jj] = ot[jj]


# ------------------------------------------------------------------------------------------------ kernel 3
@T.prim_func
def delta_kernel(o_h: T.handle, do_h: T.handle, dl_h: T.handle):
    batch = T.int32()
    seq = T.int32()
    O = T.match_buffer(o_h, (batch, H, seq, D), "float32", align=16)
    DO = T.match_buffer(do_h, (batch, seq, H, D), "float32", align=16)
    DL = T.match_buffer(dl_h, (batch, H, seq), "float32")

    T.device_entry()
    blk = T.cta_id([T.ceildiv(batch * H * seq, THREADS // 32)])
    tid = T.thread_id([THREADS])
    red = T.alloc_local((1,), "float32")

    row: T.let[T.int32] = blk * (THREADS // 32) + tid // 32
    lane: T.let[T.int32] = tid % 32
    if row < batch * H * seq:
        b: T.let[T.int32] = row // (H * seq)
        h: T.let[T.int32] = (row // seq) % H
        s: T.let[T.int32] = row % seq
        red[0] = T.float32(0.0)
        for m in T.unroll(DPL):
            red[0] = red[0] + DO[b, s, h, lane + 32 * m] * O[b, h, s, lane + 32 * m]
        for sh in T.unroll(5):
            red[0] = red[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[0], 16 >> sh, 32, 32)
        if lane == 0:
            DL[b, h, s] = red[0]


# ------------------------------------------------------------------------------------------------ kernel 4
@T.prim_func
def backward(qr_h: T.handle, kr_h: T.handle, v_h: T.handle, do_h: T.handle, mx_h: T.handle, li_h: T.handle,
             dl_h: T.handle, dqa_h: T.handle, dkr_h: T.handle, dv_h: T.handle):
    batch = T.int32()
    seq = T.int32()
    QR = T.match_buffer(qr_h, (batch, H, seq, D), "float32", align=16)
    KR = T.match_buffer(kr_h, (batch, KV, seq, D), "float32", align=16)
    V = T.match_buffer(v_h, (batch, seq, KV, D), "float32", align=16)
    DO = T.match_buffer(do_h, (batch, seq, H, D), "float32", align=16)
    MX = T.match_buffer(mx_h, (batch, H, seq), "float32")
    LI = T.match_buffer(li_h, (batch, H, seq), "float32")
    DL = T.match_buffer(dl_h, (batch, H, seq), "float32")
    DQA = T.match_buffer(dqa_h, (batch, H, seq, D), "float32", align=16)
    DKR = T.match_buffer(dkr_h, (batch, KV, seq, D), "float32", align=16)
    DV = T.match_buffer(dv_h, (batch, seq, KV, D), "float32", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
    jt, bk = T.cta_id([T.ceildiv(seq, TT), batch * KV])
    tid = T.thread_id([THREADS])

    pool = T.alloc_buffer((BWD_SMEM,), "float32", scope="shared.dyn")
    TL = T.decl_buffer((6, TT, LD), "float32", data=pool.data, elem_offset=0)     # K, V, Q0, Q1, dO0, dO1
    SP = T.decl_buffer((TT, LDP), "float32", data=pool.data, elem_offset=6 * TILE)
    SDS = T.decl_buffer((TT, LDP), "float32", data=pool.data, elem_offset=6 * TILE + TT * LDP)
    SDST = T.decl_buffer((TT, LDP), "float32", data=pool.data, elem_offset=6 * TILE + 2 * TT * LDP)

    dv = T.alloc_local((32,), "float32")
    dk = T.alloc_local((32,), "float32")
    tv = T.alloc_local((32,), "float32")
    sc = T.alloc_local((4,), "float32")
    dp = T.alloc_local((4,), "float32")
    part = T.alloc_local((16,), "float32")
    av = T.alloc_local((8,), "float32")
    bv = T.alloc_local((8,), "float32")
    af = T.alloc_local((8,), "float32")
    bfv = T.alloc_local((4,), "float32")
    t = T.alloc_local((8,), "float32")
    ex = T.alloc_local((8,), "float32")

    b: T.let[T.int32] = bk // KV
    kvh: T.let[T.int32] = bk % KV
    j0: T.let[T.int32] = jt * TT
    n_i: T.let[T.int32] = T.ceildiv(seq, TT) - jt
    tm: T.let[T.int32] = tid // 16
    tn: T.let[T.int32] = tid % 16
    om: T.let[T.int32] = tid // 64
    on: T.let[T.int32] = tid % 64

    load_hs(TL, 0, KR, b, kvh, j0, seq, tid)
    load_sh(TL, 1, V, b, kvh, j0, seq, tid)
    # iteration it covers head g = it / n_i, query tile i = jt + it % n_i
    load_hs(TL, 2, QR, b, kvh * G, j0, seq, tid)
    load_sh(TL, 4, DO, b, kvh * G, j0, seq, tid)
    T.ptx.cp.async_.commit_group()

    for e in T.unroll(32):
        dv[e] = T.float32(0.0)
        dk[e] = T.float32(0.0)

    for it in range(G * n_i):
        if it + 1 < G * n_i:
            load_hs(TL, 2 + (it + 1) % 2, QR, b, kvh * G + (it + 1) // n_i, (jt + (it + 1) % n_i) * TT, seq, tid)
            load_sh(TL, 4 + (it + 1) % 2, DO, b, kvh * G + (it + 1) // n_i, (jt + (it + 1) % n_i) * TT, seq, tid)
        T.ptx.cp.async_.commit_group()
        T.ptx.cp.async_.wait_group(1)
        T.cuda.cta_sync()
        h: T.let[T.int32] = kvh * G + it // n_i
        i0: T.let[T.int32] = (jt + it % n_i) * TT

        gemm_nt(sc, TL, 2 + it % 2, 0, tm, tn, part, av, bv)
        gemm_nt(dp, TL, 4 + it % 2, 1, tm, tn, part, av, bv)
        for r in T.unroll(2):
            qi: T.let[T.int32] = i0 + tm + 16 * r
            qc: T.let[T.int32] = T.min(qi, seq - 1)
            for c in T.unroll(2):
                tanh_acc(t, 1, sc[r * 2 + c] * T.float32(LOGIT_C), ex)
                exp_acc(t, 2, T.float32(SOFTCAP) * t[1] - MX[b, h, qc], ex)
                t[3] = T.if_then_else(qi < seq, T.if_then_else(j0 + tn + 16 * c <= qi, t[2] * LI[b, h, qc],
                                                                T.float32(0.0)), T.float32(0.0))
                t[4] = t[3] * (dp[r * 2 + c] - DL[b, h, qc]) * (T.float32(1.0) - t[1] * t[1]) * T.float32(SCALING)
                SP[tm + 16 * r, tn + 16 * c] = t[3]
                SDS[tm + 16 * r, tn + 16 * c] = t[4]
                SDST[tn + 16 * c, tm + 16 * r] = t[4]
        T.cuda.cta_sync()

        # two-level accumulation of dV / dK (per-tile 32-term sums, then added to the running totals)
        for e in T.unroll(32):
            tv[e] = T.float32(0.0)
        gemm_tn(tv, SP, TL, 4 + it % 2, om, on, af, bfv)
        for e in T.unroll(32):
            dv[e] = dv[e] + tv[e]
            tv[e] = T.float32(0.0)
        gemm_tn(tv, SDS, TL, 2 + it % 2, om, on, af, bfv)
        for e in T.unroll(32):
            dk[e] = dk[e] + tv[e]
            tv[e] = T.float32(0.0)
        gemm_tn(tv, SDST, TL, 0, om, on, af, bfv)
        for i in T.unroll(8):
            if i0 + 8 * om + i < seq:
                for jj in T.unroll(4):
                    T.cuda.atomic_add(T.address_of(DQA[b, h, i0 + 8 * om + i, 4 * on + jj]), tv[i * 4 + jj])
        T.cuda.cta_sync()

    for i in T.unroll(8):
        if j0 + 8 * om + i < seq:
            for jj in T.vectorized(4):
                DV[b, j0 + 8 * om + i, kvh, 4 * on + jj] = dv[i * 4 + jj]
            for jj in T.vectorized(4):
                DKR[b, kvh, j0 + 8 * om + i, 4 * on + jj] = dk[i * 4 + jj]


# ------------------------------------------------------------------------------------------------ kernel 5
@T.prim_func
def epilogue(q_h: T.handle, k_h: T.handle, wq_h: T.handle, wk_h: T.handle, cos_h: T.handle, sin_h: T.handle,
             dqa_h: T.handle, dkr_h: T.handle, dq_h: T.handle, dk_h: T.handle, part_h: T.handle):
    batch = T.int32()
    seq = T.int32()
    npart = T.int32()
    Q = T.match_buffer(q_h, (batch, seq, H, D), "float32", align=16)
    K = T.match_buffer(k_h, (batch, seq, KV, D), "float32", align=16)
    WQ = T.match_buffer(wq_h, (D,), "float32")
    WK = T.match_buffer(wk_h, (D,), "float32")
    COS = T.match_buffer(cos_h, (seq, D), "float32")
    SIN = T.match_buffer(sin_h, (seq, D), "float32")
    DQA = T.match_buffer(dqa_h, (batch, H, seq, D), "float32", align=16)
    DKR = T.match_buffer(dkr_h, (batch, KV, seq, D), "float32", align=16)
    DQ = T.match_buffer(dq_h, (batch, seq, H, D), "float32", align=16)
    DK = T.match_buffer(dk_h, (batch, seq, KV, D), "float32", align=16)
    PART = T.match_buffer(part_h, (npart, 2, D), "float32")

    T.device_entry()
    blk = T.cta_id([npart])
    tid = T.thread_id([ROWT])

    SPART = T.alloc_shared((H + KV, D), "float32")
    wt = T.alloc_local((DPL,), "float32")
    pt = T.alloc_local((DPL,), "float32")
    x = T.alloc_local((DPL,), "float32")
    g = T.alloc_local((DPL,), "float32")
    gs = T.alloc_local((DPL,), "float32")
    u1 = T.alloc_local((DPL,), "float32")
    u = T.alloc_local((DPL,), "float32")
    xh = T.alloc_local((DPL,), "float32")
    red = T.alloc_local((4,), "float32")

    lane: T.let[T.int32] = tid % 32
    w: T.let[T.int32] = tid // 32
    for m in T.unroll(DPL):
        wt[m] = T.if_then_else(w < H, WQ[lane + 32 * m], WK[lane + 32 * m])
        pt[m] = T.float32(0.0)
    for tk in range(TOK4):
        tok: T.let[T.int32] = blk * TOK4 + tk
        if tok < batch * seq:
            b: T.let[T.int32] = tok // seq
            s: T.let[T.int32] = tok % seq
            for m in T.unroll(DPL):
                if w < H:
                    x[m] = Q[b, s, w, lane + 32 * m]
                    g[m] = DQA[b, w, s, lane + 32 * m]
                else:
                    x[m] = K[b, s, w - H, lane + 32 * m]
                    g[m] = DKR[b, w - H, s, lane + 32 * m]
            row_inv_rms(x, red, lane)
            # unrope: g cos - rotate_half(g sin)
            for m in T.unroll(DPL):
                gs[m] = g[m] * SIN[s, lane + 32 * m]
            for m in T.unroll(DPL):
                u1[m] = g[m] * COS[s, lane + 32 * m] - T.if_then_else(
                    m < DPL // 2, T.float32(0.0) - gs[(m + DPL // 2) % DPL], gs[(m + DPL // 2) % DPL])
            # RMSNorm backward
            red[3] = T.float32(0.0)
            for m in T.unroll(DPL):
                xh[m] = x[m] * red[1]
                u[m] = u1[m] * (T.float32(1.0) + wt[m])
                red[3] = red[3] + u[m] * xh[m]
                pt[m] = pt[m] + u1[m] * xh[m]
            for sh in T.unroll(5):
                red[3] = red[3] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[3], 16 >> sh, 32, 32)
            for m in T.unroll(DPL):
                if w < H:
                    DQ[b, s, w, lane + 32 * m] = red[1] * (u[m] - xh[m] * (red[3] * T.float32(1.0 / D)))
                else:
                    DK[b, s, w - H, lane + 32 * m] = red[1] * (u[m] - xh[m] * (red[3] * T.float32(1.0 / D)))
    for m in T.unroll(DPL):
        SPART[w, lane + 32 * m] = pt[m]
    T.cuda.cta_sync()
    # CTA partials: q heads (rows 0..7) and k heads (rows 8..11), pairwise
    if tid < D:
        PART[blk, 0, tid] = ((SPART[0, tid] + SPART[1, tid]) + (SPART[2, tid] + SPART[3, tid])) + \
            ((SPART[4, tid] + SPART[5, tid]) + (SPART[6, tid] + SPART[7, tid]))
        PART[blk, 1, tid] = (SPART[8, tid] + SPART[9, tid]) + (SPART[10, tid] + SPART[11, tid])


# ------------------------------------------------------------------------------------------------ kernel 6
@T.prim_func
def wgrad(part_h: T.handle, dwq_h: T.handle, dwk_h: T.handle):
    npart = T.int32()
    PART = T.match_buffer(part_h, (npart, 2, D), "float32")
    DWQ = T.match_buffer(dwq_h, (D,), "float32")
    DWK = T.match_buffer(dwk_h, (D,), "float32")

    T.device_entry()
    which = T.cta_id([2])
    tid = T.thread_id([4 * D])
    SACC = T.alloc_shared((8, D), "float32")
    red = T.alloc_local((2,), "float32")

    d: T.let[T.int32] = tid % D
    grp: T.let[T.int32] = tid // D
    # 8 strided groups of partials per dim, each a short sequential sum, then a 3-level tree
    for hh in T.unroll(2):
        red[0] = T.float32(0.0)
        for p in range(T.ceildiv(npart - (grp * 2 + hh), 8)):
            red[0] = red[0] + PART[grp * 2 + hh + 8 * p, which, d]
        SACC[grp * 2 + hh, d] = red[0]
    T.cuda.cta_sync()
    if tid < D:
        red[1] = ((SACC[0, d] + SACC[1, d]) + (SACC[2, d] + SACC[3, d])) + \
            ((SACC[4, d] + SACC[5, d]) + (SACC[6, d] + SACC[7, d]))
        if which == 0:
            DWQ[d] = red[1]
        else:
            DWK[d] = red[1]


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
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (prologue, forward, delta_kernel, backward, epilogue, wgrad))
        _CACHE["exes"] = exes
    return exes


def _workspace(device, b, s):
    key = ("ws", str(device), b, s)
    ws = _CACHE.get(key)
    if ws is None:
        f = dict(dtype=torch.float32, device=device)
        ws = (torch.empty((b, H, s, D), **f), torch.empty((b, KV, s, D), **f), torch.empty((b, H, s, D), **f),
              torch.empty((b, H, s), **f), torch.empty((b, H, s), **f), torch.empty((b, H, s), **f),
              torch.empty((b, H, s, D), **f), torch.empty((b, KV, s, D), **f),
              torch.empty(((b * s + TOK4 - 1) // TOK4, 2, D), **f))
        _CACHE[key] = ws
    return ws


def solve(q, k, v, q_norm_weight, k_norm_weight, cos, sin, dout):
    k_pro, k_fwd, k_delta, k_bwd, k_epi, k_wg = _compiled()
    b, s, h, d = q.shape
    assert (h, d, k.shape[2]) == (H, D, KV)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dwq = torch.empty_like(q_norm_weight)
    dwk = torch.empty_like(k_norm_weight)
    if b == 0 or s == 0:
        dwq.zero_()
        dwk.zero_()
        return dq, dk, dv, dwq, dwk
    qr, kr, o, mx, li, delta, dqa, dkr, part = _workspace(q.device, b, s)
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    wq, wk = q_norm_weight.contiguous(), k_norm_weight.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    k_pro(q, k, wq, wk, cos, sin, qr, kr, dqa)
    k_fwd(qr, kr, v, o, mx, li)
    k_delta(o, dout, delta)
    k_bwd(qr, kr, v, dout, mx, li, delta, dqa, dkr, dv)
    k_epi(q, k, wq, wk, cos, sin, dqa, dkr, dq, dk, part)
    k_wg(part, dwq, dwk)
    return dq, dk, dv, dwq, dwk
