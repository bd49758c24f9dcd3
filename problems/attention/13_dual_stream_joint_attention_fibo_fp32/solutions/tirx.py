# FIBO dual-stream (MMDiT) joint attention block in fp32 (hidden 3072 = 24 heads x 128, 512 text + 4096
# image tokens): five TIRx kernels (six launches), all arithmetic in fp32 on the FMA pipes (no TF32, no
# tensor cores).
#
# Per batch element, in order on torch's current stream:
# 1. ln_mod (x2, one launch per stream): one CTA (256 threads) per token row, the row held in registers
#    (float4 loads); mean, then variance (two-pass) by CTA reductions (xor shuffles + an 8-float shared
#    array); h = (x - mean) * rstd * (1 + scale) + shift into the stream's rows of the joint h [4608, 3072].
# 2. rope_table (once per call): cos / sin of the 64 rotary angles of every joint token in float64
#    (angle = pos_a * 1e4^(-2i/dim_a), double cos / sin, rounded to fp32): [4608, 64, 2].
# 3. gemm_qkv (one launch, both streams): qkv_s = h_s @ W_s^T + b_s. The grid's row tiles are the text
#    tiles then the image tiles (no partial wave per stream); each CTA runs the shared GEMM main loop:
#    128 x 128 tile, 256 threads, 8 x 8 outputs per thread in two 4-wide halves (conflict-free float4 shared
#    reads, 4 float4 loads per 64 FMAs), K in tiles of 8: the next tile goes global -> registers (one
#    float4 of A and of B per thread) while the current one is computed, then k-major into the other of
#    two shared buffers; one barrier per tile. Two-level accumulation: the register accumulators sum 64
#    products, then are added into per-thread running totals kept in shared memory (the registers stay at
#    128: 2 CTAs per SM, 80.5 KiB of shared memory each). A 128-wide column tile is exactly one head of q,
#    k or v, so the epilogue fuses the per-head RMSNorm (sum of squares over the 16 lanes owning a row, xor
#    shuffles) and the 3D RoPE (pairs (2i, 2i+1) sit in one thread's float4) for q and k. Output: the
#    joint qkv [4608, 9216], text tokens first (the concatenation is free).
# 4. attn: flash attention in fp32. CTA = 128 queries x 1 head, 256 threads (16 x 16); a thread owns 8 query
#    rows (ty*4 + {0..3}, 64 + ty*4 + {0..3}) and, per 64-key tile, 4 keys (tx + 16 j) of S and 8 head-dim
#    columns of O. Q (128 x 128) stays in shared memory; K tiles double-buffered, V single-buffered, both by
#    cp.async (rows past the sequence zero-filled): K[t+1] is in flight during all of tile t, V[t] during
#    the S phase of tile t. S = Q K^T from float4 shared reads along the head dim (rows padded to 132
#    floats: conflict-free), online softmax in base 2 (scale * log2 e folded in; row max over the 16 lanes
#    of a row by xor shuffles; per-thread partial row sums), P through shared memory (k-major), then
#    O = O * alpha + (P V of this tile, summed in its own registers: two-level accumulation over the 4608
#    keys). O / l goes to attn [4608, 3072]. 197 KiB of shared memory, 195 registers: 1 CTA per SM.
# 5. gemm_out (one launch, both streams): out_s = x_s + gate_s * (attn_s @ W_out_s^T + b_out_s), the same
#    main loop with a gated-residual epilogue.
# Per-stream operands are passed as row-range views of the joint buffers (no offsets inside the kernels,
# so every float4 access stays provably aligned and vectorized).
#
# What limits speed: 609 GFLOP of fp32 FMA work (QKV 261, attention 261, out-proj 87) on the H200's fp32
# pipes (~67 TFLOP/s peak): ~9 ms at peak; this SIMT code is expected at ~55-70% of it (~13-16 ms). The GEMM
# loop is bound by the FMA issue rate (4 float4 shared loads per 64 FMAs, one barrier per 512 FMAs per
# thread); the attention S phase needs 12 float4 shared loads per 128 FMAs, the scalar P stores are 4-way
# bank-conflicted, and it runs one CTA (8 warps) per SM with 3 barriers per key tile. Eager PyTorch runs the
# same fp32 work through cuBLAS SGEMM (plus [4608, 4608] score matrices per head through DRAM), so this is
# expected to be roughly at eager speed, not far beyond. The next step would be an error-compensated 3xTF32
# split on tensor cores (mma.sync m16n8k8 tf32, or wgmma) for both GEMMs and both attention products.
#
# Numerics: fp32 everywhere except the rotary table (float64 angles and cos / sin: closer to the fp64
# anchor than the fp32 reference). Long reductions are two-level (GEMM K = 3072 in 64-product chunks,
# attention P V per 64-key tile): a single running fp32 accumulator over K = 3072 was measured (CPU
# emulation, width 3072) at ~5x the reference's error on q / k / v and failed the 3x allowance; with the
# two-level sums the outputs sit at 0.2-0.4 of the allowance in every emulated configuration.
#
# Streams: every compiled function is called with torch tensors; tvm-ffi installs torch's current stream
# as TVM's environment stream for each call, so the kernels run in order on it. Workspaces (h, cos / sin,
# qkv, attn) are cached per (device, sizes) and fully rewritten on every call; outputs are allocated per
# call. Compiled modules are cached per hidden width.
#
# Verification: compile-checked on CPU (sm_90a cubins, no register spills in the main loops) and run
# through the CPU CUDA emulator (scripts/cuda_emu) at smoke and larger sizes; H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HD = 128                         # head dim
PAIRS = HD // 2
AXES = (16, 56, 56)              # rotary channels per position axis (frame, row, col)
THETA = 10000.0
LN_EPS = 1e-6
RMS_EPS = 1e-6
THREADS = 256
WARPS = THREADS // 32
LOG2E = 1.0 / math.log(2.0)
SCALE_LOG2 = LOG2E / math.sqrt(HD)
M_INIT = -1.0e30                 # finite running-max start (no inf - inf)

# GEMM tiling
BM = 128
BN = 128
BK = 8
PAD = BM + 4                     # k-major shared row length
FLUSH = 8                        # k tiles (64 products) per partial sum
G_SMEM_FLOATS = 4 * BK * PAD + 64 * THREADS   # A, B double buffers + running totals: 80.5 KiB (2 CTAs / SM)

# attention tiling
QT = 128                         # queries per CTA
KT = 64                          # keys per tile
QP = HD + 4                      # padded shared row (Q, K): conflict-free float4 reads of 16 rows
PP = QT + 4                      # padded P row (k-major)
Q_OFF = 0
K_OFF = QT * QP                  # 2 K buffers
V_OFF = K_OFF + 2 * KT * QP      # 1 V buffer (unpadded, [key][d])
P_OFF = V_OFF + KT * HD
SMEM_FLOATS = P_OFF + KT * PP    # 50432 floats = 197 KiB


# --------------------------------------------------------------------------------------------------------
# 1. LayerNorm (no affine) + AdaLN modulation
# --------------------------------------------------------------------------------------------------------
def make_ln_mod(width):
    nv4 = width // 4
    per = (nv4 + THREADS - 1) // THREADS
    full = nv4 % THREADS == 0
    inv_w = 1.0 / width

    @T.prim_func
    def ln_mod(x_h: T.handle, mod_h: T.handle, h_h: T.handle):
        m = T.int32()
        X = T.match_buffer(x_h, (m, width), "float32", align=16)
        MOD = T.match_buffer(mod_h, (3, width), "float32", align=16)
        H = T.match_buffer(h_h, (m, width), "float32", align=16)

        T.device_entry()
        row = T.cta_id([m])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([WARPS])
        lane = T.lane_id([32])

        xv = T.alloc_local((per * 4,), "float32")
        sv = T.alloc_local((4,), "float32")
        bv = T.alloc_local((4,), "float32")
        ov = T.alloc_local((4,), "float32")
        acc = T.alloc_local((3,), "float32")
        red = T.alloc_shared((2, WARPS), "float32")

        for j in T.unroll(per):
            if full:
                for i in T.vectorized(4):
                    xv[j * 4 + i] = X[row, (j * THREADS + tid) * 4 + i]
            else:
                if j * THREADS + tid < nv4:
                    for i in T.vectorized(4):
                        xv[j * 4 + i] = X[row, (j * THREADS + tid) * 4 + i]
                else:
                    for i in T.unroll(4):
                        xv[j * 4 + i] = T.float32(0.0)
        # mean
        acc[0] = T.float32(0.0)
        for e in T.unroll(per * 4):
            acc[0] = acc[0] + xv[e]
        for s in T.unroll(5):
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
        if lane == 0:
            red[0, warp] = acc[0]
        T.cuda.cta_sync()
        acc[0] = red[0, 0]
        for w in T.unroll(WARPS - 1):
            acc[0] = acc[0] + red[0, w + 1]
        acc[2] = acc[0] * T.float32(inv_w)
        # variance (two-pass)
        acc[1] = T.float32(0.0)
        for j in T.unroll(per):
            for i in T.unroll(4):
                if full:
                    acc[1] = acc[1] + (xv[j * 4 + i] - acc[2]) * (xv[j * 4 + i] - acc[2])
                else:
                    acc[1] = acc[1] + T.if_then_else(j * THREADS + tid < nv4,
                                                     (xv[j * 4 + i] - acc[2]) * (xv[j * 4 + i] - acc[2]),
                                                     T.float32(0.0))
        for s in T.unroll(5):
            acc[1] = acc[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[1], 16 >> s, 32, 32)
        if lane == 0:
            red[1, warp] = acc[1]
        T.cuda.cta_sync()
        acc[1] = red[1, 0]
        for w in T.unroll(WARPS - 1):
            acc[1] = acc[1] + red[1, w + 1]
        acc[1] = T.rsqrt(acc[1] * T.float32(inv_w) + T.float32(LN_EPS))
        # h = LN(x) * (1 + scale) + shift
        for j in T.unroll(per):
            if full or j * THREADS + tid < nv4:
                for i in T.vectorized(4):
                    sv[i] = MOD[1, (j * THREADS + tid) * 4 + i]
                for i in T.vectorized(4):
                    bv[i] = MOD[0, (j * THREADS + tid) * 4 + i]
                for i in T.unroll(4):
                    ov[i] = ((xv[j * 4 + i] - acc[2]) * acc[1]) * (T.float32(1.0) + sv[i]) + bv[i]
                for i in T.vectorized(4):
                    H[row, (j * THREADS + tid) * 4 + i] = ov[i]

    return ln_mod


# --------------------------------------------------------------------------------------------------------
# 2. rotary cos / sin table (float64 math)
# --------------------------------------------------------------------------------------------------------
@T.prim_func
def rope_table(ids_h: T.handle, cs_h: T.handle):
    nall = T.int32()
    IDS = T.match_buffer(ids_h, (nall, 3), "int32")
    CS = T.match_buffer(cs_h, (nall, PAIRS, 2), "float32", align=16)

    T.device_entry()
    blk = T.cta_id([T.ceildiv(nall * PAIRS, THREADS)])
    tid = T.thread_id([THREADS])

    g: T.let[T.int32] = blk * THREADS + tid
    t: T.let[T.int32] = g // PAIRS
    p: T.let[T.int32] = g % PAIRS
    if t < nall:
        ax: T.let[T.int32] = T.if_then_else(p < AXES[0] // 2, 0, T.if_then_else(p < (AXES[0] + AXES[1]) // 2, 1, 2))
        i: T.let[T.int32] = T.if_then_else(p < AXES[0] // 2, p, T.if_then_else(p < (AXES[0] + AXES[1]) // 2,
                                                                             p - AXES[0] // 2,
                                                                             p - (AXES[0] + AXES[1]) // 2))
        dim: T.let[T.int32] = T.if_then_else(p < AXES[0] // 2, AXES[0], T.if_then_else(p < (AXES[0] + AXES[1]) // 2,
                                                                                    AXES[1], AXES[2]))
        freq: T.let[T.float64] = T.pow(T.float64(THETA), T.cast(-2 * i, "float64") / T.cast(dim, "float64"))
        ang: T.let[T.float64] = T.cast(IDS[t, ax], "float64") * freq
        CS[t, p, 0] = T.cast(T.cos(ang), "float32")
        CS[t, p, 1] = T.cast(T.sin(ang), "float32")


# --------------------------------------------------------------------------------------------------------
# 3 / 5. fp32 SIMT GEMMs over both streams in one launch: C = A[rows of the stream] @ W_s^T, two epilogues
# --------------------------------------------------------------------------------------------------------
def make_gemm(mode, k_dim, n_dim, width):
    assert k_dim % BK == 0 and n_dim % BN == 0 and BK % 4 == 0
    nk = k_dim // BK

    @T.macro
    def mainloop(A, B, m, m0, n0, acc, As, Bs, Tot, ra, rb, av, bv, tv, tid):
        # tile rows m0 .. m0+127 of the stream x columns n0 .. n0+127 ->
        # acc[a * 8 + b] = row (a//4)*64 + ty*4 + a%4, column (b//4)*64 + tx*4 + b%4 (ty = tid//16, tx = tid%16).
        # A is viewed as [rows, K/4, 4] (provably aligned float4 loads with a symbolic row count).
        # K in tiles of 8: the next tile goes global -> registers (one float4 of A and of B per thread) while
        # the current one is computed, then k-major into the other shared buffer (conflict-free stores).
        # Rows past m are clamped on load (never stored). Two-level accumulation: acc sums FLUSH tiles
        # (64 products), then is added into this thread's running totals in shared memory
        # (Tot[i4, tid, :], conflict-free float4s) and restarted.
        for i in T.unroll(64):
            acc[i] = T.float32(0.0)
        for i4 in T.unroll(16):
            for i in T.vectorized(4):
                Tot[i4, tid, i] = T.float32(0.0)
        for i in T.vectorized(4):
            ra[i] = A[T.min(m0 + tid // 2, m - 1), tid % 2, i]
        for i in T.vectorized(4):
            rb[i] = B[n0 + tid // 2, (tid % 2) * 4 + i]
        for i in T.unroll(4):
            As[0, (tid % 2) * 4 + i, tid // 2] = ra[i]
            Bs[0, (tid % 2) * 4 + i, tid // 2] = rb[i]
        T.cuda.cta_sync()
        for kt in range(nk):
            if kt + 1 < nk:
                for i in T.vectorized(4):
                    ra[i] = A[T.min(m0 + tid // 2, m - 1), (kt + 1) * (BK // 4) + tid % 2, i]
                for i in T.vectorized(4):
                    rb[i] = B[n0 + tid // 2, (kt + 1) * BK + (tid % 2) * 4 + i]
            for k in T.unroll(BK):
                for h in T.unroll(2):
                    for i in T.vectorized(4):
                        av[h * 4 + i] = As[kt % 2, k, h * 64 + (tid // 16) * 4 + i]
                    for i in T.vectorized(4):
                        bv[h * 4 + i] = Bs[kt % 2, k, h * 64 + (tid % 16) * 4 + i]
                for a in T.unroll(8):
                    for b in T.unroll(8):
                        acc[a * 8 + b] = acc[a * 8 + b] + av[a] * bv[b]
            if kt + 1 < nk:
                for i in T.unroll(4):
                    As[1 - kt % 2, (tid % 2) * 4 + i, tid // 2] = ra[i]
                    Bs[1 - kt % 2, (tid % 2) * 4 + i, tid // 2] = rb[i]
            if kt % FLUSH == FLUSH - 1:
                for i4 in T.unroll(16):
                    for i in T.vectorized(4):
                        tv[i] = Tot[i4, tid, i]
                    for i in T.unroll(4):
                        tv[i] = tv[i] + acc[i4 * 4 + i]
                        acc[i4 * 4 + i] = T.float32(0.0)
                    for i in T.vectorized(4):
                        Tot[i4, tid, i] = tv[i]
            T.cuda.cta_sync()
        for i4 in T.unroll(16):
            for i in T.vectorized(4):
                tv[i] = Tot[i4, tid, i]
            for i in T.unroll(4):
                acc[i4 * 4 + i] = tv[i] + acc[i4 * 4 + i]

    @T.macro
    def qkv_epilogue(BIAS, NW, CS, C, m, m0, n0, acc, yb, gw, ss, cs, pr, tid):
        # + bias; for q and k tiles (a 128-wide column tile is one head) per-head RMSNorm and 3D RoPE
        which: T.let[T.int32] = n0 // width              # 0 q, 1 k, 2 v
        for hb in T.unroll(2):
            for j in T.vectorized(4):
                yb[hb * 4 + j] = BIAS[n0 + hb * 64 + (tid % 16) * 4 + j]
        for a in T.unroll(8):
            for b in T.unroll(8):
                acc[a * 8 + b] = acc[a * 8 + b] + yb[b]
        if which < 2:
            for hb in T.unroll(2):
                for j in T.vectorized(4):
                    gw[hb * 4 + j] = NW[which, hb * 64 + (tid % 16) * 4 + j]
            for a in T.unroll(8):
                # the row's 128 values live in the 16 lanes with this ty (one half-warp)
                ss[0] = T.float32(0.0)
                for b in T.unroll(8):
                    ss[0] = ss[0] + acc[a * 8 + b] * acc[a * 8 + b]
                for sh in T.unroll(4):
                    ss[0] = ss[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[0], 8 >> sh, 32, 32)
                ss[0] = T.rsqrt(ss[0] * T.float32(1.0 / HD) + T.float32(RMS_EPS))
                tok: T.let[T.int32] = T.min(m0 + (a // 4) * 64 + (tid // 16) * 4 + a % 4, m - 1)
                for hb in T.unroll(2):
                    for e in T.unroll(2):
                        # rotary pair (2i, 2i+1), i = hb*32 + tx*2 + e
                        for q in T.vectorized(2):
                            cs[q] = CS[tok, hb * 32 + (tid % 16) * 2 + e, q]
                        pr[0] = acc[a * 8 + hb * 4 + 2 * e] * ss[0] * gw[hb * 4 + 2 * e]
                        pr[1] = acc[a * 8 + hb * 4 + 2 * e + 1] * ss[0] * gw[hb * 4 + 2 * e + 1]
                        acc[a * 8 + hb * 4 + 2 * e] = pr[0] * cs[0] - pr[1] * cs[1]
                        acc[a * 8 + hb * 4 + 2 * e + 1] = pr[1] * cs[0] + pr[0] * cs[1]
        for a in T.unroll(8):
            row: T.let[T.int32] = m0 + (a // 4) * 64 + (tid // 16) * 4 + a % 4
            if row < m:
                for hb in T.unroll(2):
                    for j in T.vectorized(4):
                        C[row, n0 + hb * 64 + (tid % 16) * 4 + j] = acc[a * 8 + hb * 4 + j]

    @T.macro
    def out_epilogue(BIAS, X, MOD, C, m, m0, n0, acc, yb, gt, xv, ov, tid):
        # out = x + gate * (acc + bias)
        for hb in T.unroll(2):
            for j in T.vectorized(4):
                yb[hb * 4 + j] = BIAS[n0 + hb * 64 + (tid % 16) * 4 + j]
            for j in T.vectorized(4):
                gt[hb * 4 + j] = MOD[2, n0 + hb * 64 + (tid % 16) * 4 + j]
        for a in T.unroll(8):
            row: T.let[T.int32] = m0 + (a // 4) * 64 + (tid // 16) * 4 + a % 4
            if row < m:
                for hb in T.unroll(2):
                    for j in T.vectorized(4):
                        xv[j] = X[row, n0 + hb * 64 + (tid % 16) * 4 + j]
                    for j in T.unroll(4):
                        ov[j] = xv[j] + gt[hb * 4 + j] * (acc[a * 8 + hb * 4 + j] + yb[hb * 4 + j])
                    for j in T.vectorized(4):
                        C[row, n0 + hb * 64 + (tid % 16) * 4 + j] = ov[j]

    if mode == "qkv":
        @T.prim_func
        def gemm_qkv(at_h: T.handle, wt_h: T.handle, bt_h: T.handle, nwt_h: T.handle, cst_h: T.handle, ct_h: T.handle,
                     ai_h: T.handle, wi_h: T.handle, bi_h: T.handle, nwi_h: T.handle, csi_h: T.handle, ci_h: T.handle):
            # per stream s (text, image): qkv_s = h_s @ W_s^T + b_s, q / k normalized and rotated; the grid's
            # row tiles are the text tiles, then the image tiles (one launch: no partial wave per stream).
            # h_s, cos / sin_s and qkv_s are row ranges (views) of the joint buffers.
            n_txt = T.int32()
            n_img = T.int32()
            At = T.match_buffer(at_h, (n_txt, k_dim // 4, 4), "float32", align=16)   # [rows, K/4, 4]
            Wt = T.match_buffer(wt_h, (n_dim, k_dim), "float32", align=16)
            Bt = T.match_buffer(bt_h, (n_dim,), "float32", align=16)
            NWt = T.match_buffer(nwt_h, (2, HD), "float32", align=16)
            CSt = T.match_buffer(cst_h, (n_txt, PAIRS, 2), "float32", align=16)
            Ct = T.match_buffer(ct_h, (n_txt, n_dim), "float32", align=16)
            Ai = T.match_buffer(ai_h, (n_img, k_dim // 4, 4), "float32", align=16)
            Wi = T.match_buffer(wi_h, (n_dim, k_dim), "float32", align=16)
            Bi = T.match_buffer(bi_h, (n_dim,), "float32", align=16)
            NWi = T.match_buffer(nwi_h, (2, HD), "float32", align=16)
            CSi = T.match_buffer(csi_h, (n_img, PAIRS, 2), "float32", align=16)
            Ci = T.match_buffer(ci_h, (n_img, n_dim), "float32", align=16)

            T.device_entry()
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
            bx, by = T.cta_id([n_dim // BN, T.ceildiv(n_txt, BM) + T.ceildiv(n_img, BM)])
            tid = T.thread_id([THREADS])

            pool = T.alloc_buffer((G_SMEM_FLOATS,), "float32", scope="shared.dyn")
            As = T.decl_buffer((2, BK, PAD), "float32", data=pool.data, elem_offset=0)
            Bs = T.decl_buffer((2, BK, PAD), "float32", data=pool.data, elem_offset=2 * BK * PAD)
            Tot = T.decl_buffer((16, THREADS, 4), "float32", data=pool.data, elem_offset=4 * BK * PAD)
            tv = T.alloc_local((4,), "float32")
            acc = T.alloc_local((64,), "float32")
            ra = T.alloc_local((4,), "float32")
            rb = T.alloc_local((4,), "float32")
            av = T.alloc_local((8,), "float32")
            bv = T.alloc_local((8,), "float32")
            yb = T.alloc_local((8,), "float32")
            gw = T.alloc_local((8,), "float32")
            ss = T.alloc_local((1,), "float32")
            cs = T.alloc_local((2,), "float32")
            pr = T.alloc_local((2,), "float32")

            tt: T.let[T.int32] = T.ceildiv(n_txt, BM)
            n0: T.let[T.int32] = bx * BN
            if by < tt:
                mainloop(At, Wt, n_txt, by * BM, n0, acc, As, Bs, Tot, ra, rb, av, bv, tv, tid)
                qkv_epilogue(Bt, NWt, CSt, Ct, n_txt, by * BM, n0, acc, yb, gw, ss, cs, pr, tid)
            else:
                mainloop(Ai, Wi, n_img, (by - tt) * BM, n0, acc, As, Bs, Tot, ra, rb, av, bv, tv, tid)
                qkv_epilogue(Bi, NWi, CSi, Ci, n_img, (by - tt) * BM, n0, acc, yb, gw, ss, cs, pr, tid)

        return gemm_qkv

    @T.prim_func
    def gemm_out(at_h: T.handle, wt_h: T.handle, bt_h: T.handle, xt_h: T.handle, modt_h: T.handle, ct_h: T.handle,
                 ai_h: T.handle, wi_h: T.handle, bi_h: T.handle, xi_h: T.handle, modi_h: T.handle, ci_h: T.handle):
        # out_s = x_s + gate_s * (attn_s @ W_s^T + b_s) (attn_s: the stream's rows of the joint attention
        # output, a view); text row tiles, then image row tiles
        n_txt = T.int32()
        n_img = T.int32()
        At = T.match_buffer(at_h, (n_txt, k_dim // 4, 4), "float32", align=16)
        Wt = T.match_buffer(wt_h, (n_dim, k_dim), "float32", align=16)
        Bt = T.match_buffer(bt_h, (n_dim,), "float32", align=16)
        Xt = T.match_buffer(xt_h, (n_txt, n_dim), "float32", align=16)
        MODt = T.match_buffer(modt_h, (3, n_dim), "float32", align=16)
        Ct = T.match_buffer(ct_h, (n_txt, n_dim), "float32", align=16)
        Ai = T.match_buffer(ai_h, (n_img, k_dim // 4, 4), "float32", align=16)
        Wi = T.match_buffer(wi_h, (n_dim, k_dim), "float32", align=16)
        Bi = T.match_buffer(bi_h, (n_dim,), "float32", align=16)
        Xi = T.match_buffer(xi_h, (n_img, n_dim), "float32", align=16)
        MODi = T.match_buffer(modi_h, (3, n_dim), "float32", align=16)
        Ci = T.match_buffer(ci_h, (n_img, n_dim), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        bx, by = T.cta_id([n_dim // BN, T.ceildiv(n_txt, BM) + T.ceildiv(n_img, BM)])
        tid = T.thread_id([THREADS])

        pool = T.alloc_buffer((G_SMEM_FLOATS,), "float32", scope="shared.dyn")
        As = T.decl_buffer((2, BK, PAD), "float32", data=pool.data, elem_offset=0)
        Bs = T.decl_buffer((2, BK, PAD), "float32", data=pool.data, elem_offset=2 * BK * PAD)
        Tot = T.decl_buffer((16, THREADS, 4), "float32", data=pool.data, elem_offset=4 * BK * PAD)
        tv = T.alloc_local((4,), "float32")
        acc = T.alloc_local((64,), "float32")
        ra = T.alloc_local((4,), "float32")
        rb = T.alloc_local((4,), "float32")
        av = T.alloc_local((8,), "float32")
        bv = T.alloc_local((8,), "float32")
        yb = T.alloc_local((8,), "float32")
        gt = T.alloc_local((8,), "float32")
        xv = T.alloc_local((4,), "float32")
        ov = T.alloc_local((4,), "float32")

        tt: T.let[T.int32] = T.ceildiv(n_txt, BM)
        n0: T.let[T.int32] = bx * BN
        if by < tt:
            mainloop(At, Wt, n_txt, by * BM, n0, acc, As, Bs, Tot, ra, rb, av, bv, tv, tid)
            out_epilogue(Bt, Xt, MODt, Ct, n_txt, by * BM, n0, acc, yb, gt, xv, ov, tid)
        else:
            mainloop(Ai, Wi, n_img, (by - tt) * BM, n0, acc, As, Bs, Tot, ra, rb, av, bv, tv, tid)
            out_epilogue(Bi, Xi, MODi, Ci, n_img, (by - tt) * BM, n0, acc, yb, gt, xv, ov, tid)

    return gemm_out


# --------------------------------------------------------------------------------------------------------
# 4. joint flash attention (fp32)
# --------------------------------------------------------------------------------------------------------
def make_attn(width):
    heads = width // HD

    @T.prim_func
    def attn(qkv_h: T.handle, o_h: T.handle):
        nall = T.int32()
        QKV = T.match_buffer(qkv_h, (nall, 3 * width), "float32", align=16)
        O = T.match_buffer(o_h, (nall, width), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        qt, h = T.cta_id([T.ceildiv(nall, QT), heads])
        tid = T.thread_id([THREADS])

        pool = T.alloc_buffer((SMEM_FLOATS,), "float32", scope="shared.dyn")
        Qs = T.decl_buffer((QT, QP), "float32", data=pool.data, elem_offset=Q_OFF)
        Ks = T.decl_buffer((2, KT, QP), "float32", data=pool.data, elem_offset=K_OFF)
        Vs = T.decl_buffer((KT, HD), "float32", data=pool.data, elem_offset=V_OFF)
        Ps = T.decl_buffer((KT, PP), "float32", data=pool.data, elem_offset=P_OFF)

        o = T.alloc_local((64,), "float32")        # o[a * 8 + b]: row qrow(a), column (b//4)*64 + tx*4 + b%4
        ot = T.alloc_local((64,), "float32")       # this tile's P V (added into o once per tile)
        al = T.alloc_local((8,), "float32")        # per-row rescale factor of this tile
        s = T.alloc_local((32,), "float32")        # s[a * 4 + j]: row qrow(a), key tx + 16 j
        mr = T.alloc_local((8,), "float32")
        lr = T.alloc_local((8,), "float32")
        kf = T.alloc_local((16,), "float32")
        qf = T.alloc_local((4,), "float32")
        pf = T.alloc_local((8,), "float32")
        vf = T.alloc_local((8,), "float32")
        mx = T.alloc_local((2,), "float32")

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        q0: T.let[T.int32] = qt * QT
        nt: T.let[T.int32] = T.ceildiv(nall, KT)

        # ---- prologue: Q (group), K[0] (group), V[0] (group)
        for i in T.unroll(QT * (HD // 4) // THREADS):
            r: T.let[T.int32] = (tid + i * THREADS) // (HD // 4)
            c: T.let[T.int32] = (tid + i * THREADS) % (HD // 4)
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Qs[r, c * 4]), T.address_of(QKV[T.min(q0 + r, nall - 1), h * HD + c * 4]), 16,
                T.if_then_else(q0 + r < nall, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        for i in T.unroll(KT * (HD // 4) // THREADS):
            r: T.let[T.int32] = (tid + i * THREADS) // (HD // 4)
            c: T.let[T.int32] = (tid + i * THREADS) % (HD // 4)
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Ks[0, r, c * 4]), T.address_of(QKV[T.min(r, nall - 1), width + h * HD + c * 4]), 16,
                T.if_then_else(r < nall, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        for i in T.unroll(KT * (HD // 4) // THREADS):
            r: T.let[T.int32] = (tid + i * THREADS) // (HD // 4)
            c: T.let[T.int32] = (tid + i * THREADS) % (HD // 4)
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Vs[r, c * 4]), T.address_of(QKV[T.min(r, nall - 1), 2 * width + h * HD + c * 4]), 16,
                T.if_then_else(r < nall, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()

        for i in T.unroll(64):
            o[i] = T.float32(0.0)
        for a in T.unroll(8):
            mr[a] = T.float32(M_INIT)
            lr[a] = T.float32(0.0)

        for t in range(nt):
            buf: T.let[T.int32] = t % 2
            # Q and K[t] have landed (V[t] may still be in flight)
            T.ptx.cp.async_.wait_group(1)
            T.cuda.cta_sync()
            if t + 1 < nt:
                for i in T.unroll(KT * (HD // 4) // THREADS):
                    r: T.let[T.int32] = (tid + i * THREADS) // (HD // 4)
                    c: T.let[T.int32] = (tid + i * THREADS) % (HD // 4)
                    kn: T.let[T.int32] = (t + 1) * KT + r
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Ks[1 - buf, r, c * 4]),
                        T.address_of(QKV[T.min(kn, nall - 1), width + h * HD + c * 4]), 16,
                        T.if_then_else(kn < nall, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

            # ---- S = Q K^T (this thread: 8 rows x 4 keys)
            for e in T.unroll(32):
                s[e] = T.float32(0.0)
            for d4 in range(HD // 4):
                for j in T.unroll(4):
                    for i in T.vectorized(4):
                        kf[j * 4 + i] = Ks[buf, tx + 16 * j, d4 * 4 + i]
                for a in T.unroll(8):
                    for i in T.vectorized(4):
                        qf[i] = Qs[(a // 4) * 64 + ty * 4 + a % 4, d4 * 4 + i]
                    for j in T.unroll(4):
                        for i in T.unroll(4):
                            s[a * 4 + j] = s[a * 4 + j] + qf[i] * kf[j * 4 + i]

            # ---- online softmax (base 2); keys past the sequence masked; P -> shared (k-major)
            for a in T.unroll(8):
                for j in T.unroll(4):
                    s[a * 4 + j] = T.if_then_else(t * KT + tx + 16 * j < nall, s[a * 4 + j] * T.float32(SCALE_LOG2),
                                                  T.float32("-inf"))
                mx[0] = T.max(T.max(s[a * 4], s[a * 4 + 1]), T.max(s[a * 4 + 2], s[a * 4 + 3]))
                for sh in T.unroll(4):
                    mx[0] = T.max(mx[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, mx[0], 8 >> sh, 32, 32))
                mx[0] = T.max(mx[0], mr[a])
                al[a] = T.exp2(mr[a] - mx[0])
                mr[a] = mx[0]
                mx[1] = T.float32(0.0)
                for j in T.unroll(4):
                    s[a * 4 + j] = T.exp2(s[a * 4 + j] - mx[0])
                    mx[1] = mx[1] + s[a * 4 + j]
                    Ps[tx + 16 * j, (a // 4) * 64 + ty * 4 + a % 4] = s[a * 4 + j]
                lr[a] = lr[a] * al[a] + mx[1]

            # V[t] has landed; P is complete
            T.ptx.cp.async_.wait_group(1)
            T.cuda.cta_sync()

            # ---- O = O * alpha + P V (this thread: 8 rows x 8 columns; the tile's 64 products summed apart)
            for e in T.unroll(64):
                ot[e] = T.float32(0.0)
            for kk in range(KT):
                for hb in T.unroll(2):
                    for i in T.vectorized(4):
                        pf[hb * 4 + i] = Ps[kk, hb * 64 + ty * 4 + i]
                    for i in T.vectorized(4):
                        vf[hb * 4 + i] = Vs[kk, hb * 64 + tx * 4 + i]
                for a in T.unroll(8):
                    for b in T.unroll(8):
                        ot[a * 8 + b] = ot[a * 8 + b] + pf[a] * vf[b]
            for a in T.unroll(8):
                for b in T.unroll(8):
                    o[a * 8 + b] = o[a * 8 + b] * al[a] + ot[a * 8 + b]
            T.cuda.cta_sync()

            if t + 1 < nt:
                for i in T.unroll(KT * (HD // 4) // THREADS):
                    r: T.let[T.int32] = (tid + i * THREADS) // (HD // 4)
                    c: T.let[T.int32] = (tid + i * THREADS) % (HD // 4)
                    kn: T.let[T.int32] = (t + 1) * KT + r
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Vs[r, c * 4]),
                        T.address_of(QKV[T.min(kn, nall - 1), 2 * width + h * HD + c * 4]), 16,
                        T.if_then_else(kn < nall, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

        # ---- epilogue: full row sums, O / l
        for a in T.unroll(8):
            for sh in T.unroll(4):
                lr[a] = lr[a] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, lr[a], 8 >> sh, 32, 32)
            mx[0] = T.float32(1.0) / lr[a]
            row: T.let[T.int32] = q0 + (a // 4) * 64 + ty * 4 + a % 4
            if row < nall:
                for hb in T.unroll(2):
                    for j in T.unroll(4):
                        pf[j] = o[a * 8 + hb * 4 + j] * mx[0]
                    for j in T.vectorized(4):
                        O[row, h * HD + hb * 64 + tx * 4 + j] = pf[j]

    return attn


# --------------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------------
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


def _prim_funcs(width):
    return {
        "ln_mod": make_ln_mod(width),
        "rope_table": rope_table,
        "gemm_qkv": make_gemm("qkv", width, 3 * width, width),
        "attn": make_attn(width),
        "gemm_out": make_gemm("out", width, width, width),
    }


def _compiled(width):
    key = ("exes", width)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = {name: _prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                for name, f in _prim_funcs(width).items()}
        _CACHE[key] = exes
    return exes


def _workspace(device, nall, width):
    key = ("ws", str(device), nall, width)
    ws = _CACHE.get(key)
    if ws is None:
        ws = (torch.empty((nall, width), dtype=torch.float32, device=device),            # h (joint)
              torch.empty((nall, PAIRS, 2), dtype=torch.float32, device=device),         # cos / sin
              torch.empty((nall, 3 * width), dtype=torch.float32, device=device),        # q | k | v (joint)
              torch.empty((nall, width), dtype=torch.float32, device=device))            # attention output
        _CACHE[key] = ws
    return ws


def solve(img, txt, img_mod, txt_mod, img_qkv_weight, img_qkv_bias, txt_qkv_weight, txt_qkv_bias,
          img_qk_norm_weight, txt_qk_norm_weight, img_out_weight, img_out_bias, txt_out_weight, txt_out_bias, ids):
    batch, n_img, width = img.shape
    n_txt = txt.shape[1]
    nall = n_txt + n_img
    assert width % HD == 0 and ids.shape == (nall, 3) and n_txt > 0 and n_img > 0
    k = _compiled(width)
    dev = img.device
    img = img.contiguous()
    txt = txt.contiguous()
    img_mod = img_mod.contiguous()
    txt_mod = txt_mod.contiguous()
    w_qkv = (txt_qkv_weight.contiguous(), img_qkv_weight.contiguous())
    b_qkv = (txt_qkv_bias.contiguous(), img_qkv_bias.contiguous())
    nw = (txt_qk_norm_weight.contiguous(), img_qk_norm_weight.contiguous())
    w_out = (txt_out_weight.contiguous(), img_out_weight.contiguous())
    b_out = (txt_out_bias.contiguous(), img_out_bias.contiguous())
    ids32 = (ids if ids.dtype == torch.int32 else ids.to(torch.int32)).contiguous()

    img_out = torch.empty_like(img)
    txt_out = torch.empty_like(txt)
    h, cs, qkv, att = _workspace(dev, nall, width)
    hv = h.view(nall, width // 4, 4)
    av = att.view(nall, width // 4, 4)
    rows = (slice(0, n_txt), slice(n_txt, nall))             # text rows, then image rows, of the joint buffers
    k["rope_table"](ids32, cs)
    for bi in range(batch):
        xs = (txt[bi], img[bi])
        mods = (txt_mod[bi], img_mod[bi])
        outs = (txt_out[bi], img_out[bi])
        for s in range(2):
            k["ln_mod"](xs[s], mods[s], h[rows[s]])
        k["gemm_qkv"](*(t for s in range(2)
                        for t in (hv[rows[s]], w_qkv[s], b_qkv[s], nw[s], cs[rows[s]], qkv[rows[s]])))
        k["attn"](qkv, att)
        k["gemm_out"](*(t for s in range(2) for t in (av[rows[s]], w_out[s], b_out[s], xs[s], mods[s], outs[s])))
    return img_out, txt_out
