# Backward of Kokoro PL-BERT's post-LayerNorm residual GELU feed-forward (hidden 768, intermediate 2048, 8192
# tokens), fp32: six fp32 FMA (SIMT) GEMMs, a LayerNorm-backward row kernel and column sums, in TIRx (no tensor
# cores: the allowance is 3x the fp32 reference's own error, which TF32 products, even 3xTF32, exceed).
#
# GEMM template: C[M, N] = sum_k A(m, k) B(k, n); A given as [M, K] ("mk") or [K, M] ("km"), B as [N, K] ("nk")
# or [K, N] ("kn"), all viewed as [rows, cols / 4, 4] so float4 accesses are provably aligned. CTA tile
# 128 x 128, 256 threads, 8 x 8 outputs per thread (rows 4ty..+3 / 64+4ty..+3, columns 4tx..+3 / 64+4tx..+3);
# K tiles of 16 in two k-major shared buffers, the next tile loaded global -> registers (float4) during the
# FMAs of the current one ("km"/"kn" tiles copied as float4, "mk"/"nk" tiles transposed on the store); one
# __syncthreads per tile; two-level accumulation (a fresh partial per 64 k values, added to the running sums).
# Kernels:
#  1. h = x @ w1^T + b1 (mk x nk), epilogue stores h and a = gelu_tanh(h) (tanh from an accurate expm1 and
#     div.rn; TVM builds with --use_fast_math).
#  2. z = x + a @ w2^T + b2 (mk x nk).
#  3. LayerNorm backward, one warp per token (24 channels per lane, 8 tokens per warp, 64 per CTA): mean,
#     biased variance (two passes from registers), rstd = 1 / sqrt(var + 1e-12) (sqrt.rn / div.rn),
#     dz = rstd (g gamma - mean(g gamma) - zhat mean(g gamma zhat)); per-CTA column partials of g zhat, g, dz
#     (8 tokens per lane in registers, then the 8 warps through shared memory).
#  4. da = dz @ w2 (mk x kn) with epilogue dh = da * gelu'(h) and per-CTA column partials of dh.
#  5. dw2 = dz^T @ a (km x kn, K = 8192).   6. dw1 = dh^T @ x (km x kn, K = 8192).
#  7. dx = dz + dh @ w1 (mk x kn).
#  8. column sums of the partials -> db1, db2, d_ln_weight, d_ln_bias (warp-strided 64-row partials, then a
#     shared-memory tree).
#
# Limits: 155 GFLOP on the fp32 FMA pipes (67 TFLOP/s peak): ~2.3 ms at peak, expected ~3-3.5 ms. The two
# weight-gradient GEMMs have only 6 x 16 = 96 output tiles (fewer than the 132 SMs; no split-K here). Eager
# PyTorch runs the same six products on cuBLAS SGEMM (fp32 FMA, tuned close to peak) plus ~25 elementwise and
# reduction passes over [8192, 2048] / [8192, 768] fp32 tensors, so this is expected to be around eager speed
# (within about +-20%): both are bound by the FMA pipes.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules; intermediates are allocated per call.

import math

import torch
import tvm
from tvm.script import tirx as T

EPS = 1e-12
THREADS = 256
BM = 128
BN = 128
BK = 16
PAD = BM + 4
FLUSH = 4
GELU_C = math.sqrt(2.0 / math.pi)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06
CS_COLS = 32
CS_CHUNK = 64
LN_ROWS = 64                   # tokens per LayerNorm-backward CTA


def make_sgemm(a_layout, b_layout, mode):
    """Epilogue modes (aux is [M, N] unless noted):
    'h_act': C = acc + bias, AUXO = gelu_tanh(C).      'z': C = acc + bias + AUX.
    'dh':    C = acc * gelu_tanh'(AUX), PART[by] = column sums of C over the CTA's rows.
    'store': C = acc.                                   'dx': C = acc + AUX."""

    @T.prim_func
    def sgemm(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle, aux_handle: T.handle,
              auxo_handle: T.handle, bias_handle: T.handle, part_handle: T.handle, kd: T.int32):
        ar = T.int32()
        ac4 = T.int32()
        br = T.int32()
        bc4 = T.int32()
        m = T.int32()
        n4 = T.int32()
        n_part = T.int32()
        n_bias = T.int32()
        A = T.match_buffer(a_handle, (ar, ac4, 4), "float32", align=16)
        B = T.match_buffer(b_handle, (br, bc4, 4), "float32", align=16)
        C = T.match_buffer(c_handle, (m, n4, 4), "float32", align=16)
        AUX = T.match_buffer(aux_handle, (m, n4, 4), "float32", align=16)
        AUXO = T.match_buffer(auxo_handle, (m, n4, 4), "float32", align=16)
        BIAS = T.match_buffer(bias_handle, (n_bias,), "float32")
        PART = T.match_buffer(part_handle, (n_part, n4 * 4), "float32")

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx, by = T.cta_id([T.ceildiv(n4 * 4, BN), T.ceildiv(m, BM)])
        tid = T.thread_id([THREADS])

        As = T.alloc_shared((2, BK, PAD), "float32")
        Bs = T.alloc_shared((2, BK, PAD), "float32")
        csum = T.alloc_shared((16, BN), "float32")
        acc = T.alloc_local((64,), "float32")
        tot = T.alloc_local((64,), "float32")
        ra = T.alloc_local((8,), "float32")
        rb = T.alloc_local((8,), "float32")
        av = T.alloc_local((8,), "float32")
        bv = T.alloc_local((8,), "float32")
        y = T.alloc_local((12,), "float32")
        e = T.alloc_local((6,), "float32")
        cs = T.alloc_local((8,), "float32")

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        m0: T.let[T.int32] = by * BM
        n0: T.let[T.int32] = bx * BN
        n: T.let[T.int32] = n4 * 4
        nk: T.let[T.int32] = T.ceildiv(kd, BK)
        rr: T.let[T.int32] = tid // 4          # row-major tiles: row (+64u), k 4 (tid % 4)
        rk: T.let[T.int32] = (tid % 4) * 4
        ck: T.let[T.int32] = tid // 32         # k-major tiles: k (+8u), column 4 (tid % 32)
        cc: T.let[T.int32] = (tid % 32) * 4

        for i in T.unroll(64):
            acc[i] = T.float32(0.0)
            tot[i] = T.float32(0.0)

        for kt in range(nk + 1):
            # iteration kt: tile kt -> registers, FMAs on tile kt - 1, tile kt -> shared buffer kt % 2
            if kt < nk:
                for u in T.unroll(2):
                    if a_layout == "mk":
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[T.min(m0 + rr + u * 64, ar - 1), T.min((kt * BK + rk) // 4, ac4 - 1), i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(kt * BK + rk < kd, ra[u * 4 + i], T.float32(0.0))
                    else:
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[T.min(kt * BK + ck + u * 8, ar - 1), T.min((m0 + cc) // 4, ac4 - 1), i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(kt * BK + ck + u * 8 < kd, ra[u * 4 + i], T.float32(0.0))
                    if b_layout == "nk":
                        for i in T.vectorized(4):
                            rb[u * 4 + i] = B[T.min(n0 + rr + u * 64, br - 1), T.min((kt * BK + rk) // 4, bc4 - 1), i]
                        for i in T.unroll(4):
                            rb[u * 4 + i] = T.if_then_else(kt * BK + rk < kd, rb[u * 4 + i], T.float32(0.0))
                    else:
                        for i in T.vectorized(4):
                            rb[u * 4 + i] = B[T.min(kt * BK + ck + u * 8, br - 1), T.min((n0 + cc) // 4, bc4 - 1), i]
                        for i in T.unroll(4):
                            rb[u * 4 + i] = T.if_then_else(kt * BK + ck + u * 8 < kd, rb[u * 4 + i], T.float32(0.0))
            if kt > 0:
                cur: T.let[T.int32] = (kt - 1) % 2
                for k in T.unroll(BK):
                    for hh in T.unroll(2):
                        for i in T.vectorized(4):
                            av[hh * 4 + i] = As[cur, k, hh * 64 + ty * 4 + i]
                        for i in T.vectorized(4):
                            bv[hh * 4 + i] = Bs[cur, k, hh * 64 + tx * 4 + i]
                    for a in T.unroll(8):
                        for b in T.unroll(8):
                            acc[a * 8 + b] = acc[a * 8 + b] + av[a] * bv[b]
                if (kt - 1) % FLUSH == FLUSH - 1:
                    for i in T.unroll(64):
                        tot[i] = tot[i] + acc[i]
                        acc[i] = T.float32(0.0)
            if kt < nk:
                for u in T.unroll(2):
                    if a_layout == "mk":
                        for i in T.unroll(4):
                            As[kt % 2, rk + i, rr + u * 64] = ra[u * 4 + i]
                    else:
                        for i in T.vectorized(4):
                            As[kt % 2, ck + u * 8, cc + i] = ra[u * 4 + i]
                    if b_layout == "nk":
                        for i in T.unroll(4):
                            Bs[kt % 2, rk + i, rr + u * 64] = rb[u * 4 + i]
                    else:
                        for i in T.vectorized(4):
                            Bs[kt % 2, ck + u * 8, cc + i] = rb[u * 4 + i]
            T.cuda.cta_sync()

        for i in T.unroll(64):
            tot[i] = tot[i] + acc[i]

        # ---------------- epilogue ----------------
        for hb in T.unroll(2):
            col: T.let[T.int32] = n0 + hb * 64 + tx * 4
            for j in T.unroll(4):
                cs[hb * 4 + j] = T.float32(0.0)
                if mode == "h_act" or mode == "z":
                    y[8 + j] = BIAS[T.min(col + j, n_bias - 1)]
            for a in T.unroll(8):
                row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                if row < m and col < n:
                    if mode == "h_act" or mode == "dh":
                        for j in T.unroll(4):
                            if mode == "h_act":
                                y[4 + j] = tot[a * 8 + hb * 4 + j] + y[8 + j]
                            else:
                                y[4 + j] = AUX[row, col // 4, j]
                            # t = tanh(c (h + 0.044715 h^3)); tanh(|u|) = -m / (2 + m), m = expm1(-2|u|)
                            e[0] = T.float32(GELU_C) * (y[4 + j] + T.float32(0.044715) * y[4 + j] * y[4 + j] * y[4 + j])
                            e[1] = T.max(T.float32(-2.0) * T.abs(e[0]), T.float32(-87.0))
                            if e[1] > T.float32(-0.34657359027997264):
                                e[2] = T.float32(1.0 / 3628800.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 362880.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 40320.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 5040.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 720.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 120.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 24.0)
                                e[2] = e[2] * e[1] + T.float32(1.0 / 6.0)
                                e[2] = e[2] * e[1] + T.float32(0.5)
                                e[2] = e[2] * e[1] + T.float32(1.0)
                                e[3] = e[2] * e[1]
                            else:
                                e[4] = T.floor(e[1] * T.float32(LOG2E) + T.float32(0.5))
                                e[5] = (e[1] - e[4] * T.float32(LN2_HI)) - e[4] * T.float32(LN2_LO)
                                e[2] = T.float32(1.0 / 5040.0)
                                e[2] = e[2] * e[5] + T.float32(1.0 / 720.0)
                                e[2] = e[2] * e[5] + T.float32(1.0 / 120.0)
                                e[2] = e[2] * e[5] + T.float32(1.0 / 24.0)
                                e[2] = e[2] * e[5] + T.float32(1.0 / 6.0)
                                e[2] = e[2] * e[5] + T.float32(0.5)
                                e[2] = e[2] * e[5] + T.float32(1.0)
                                e[2] = e[2] * e[5] + T.float32(1.0)
                                e[3] = e[2] * T.reinterpret("float32", T.shift_left(T.cast(e[4], "int32") + 127, 23)) - T.float32(1.0)
                            T.ptx.div.rn.f32(e[2], T.float32(0.0) - e[3], T.float32(2.0) + e[3])
                            e[2] = T.if_then_else(e[0] < T.float32(0.0), T.float32(0.0) - e[2], e[2])
                            if mode == "h_act":
                                y[j] = T.float32(0.5) * y[4 + j] * (T.float32(1.0) + e[2])
                            else:
                                y[j] = tot[a * 8 + hb * 4 + j] * (
                                    T.float32(0.5) * (T.float32(1.0) + e[2])
                                    + T.float32(0.5) * y[4 + j] * (T.float32(1.0) - e[2] * e[2]) * T.float32(GELU_C)
                                    * (T.float32(1.0) + T.float32(3.0 * 0.044715) * y[4 + j] * y[4 + j]))
                                cs[hb * 4 + j] = cs[hb * 4 + j] + y[j]
                        if mode == "h_act":
                            for j in T.vectorized(4):
                                C[row, col // 4, j] = y[4 + j]
                            for j in T.vectorized(4):
                                AUXO[row, col // 4, j] = y[j]
                        else:
                            for j in T.vectorized(4):
                                C[row, col // 4, j] = y[j]
                    else:
                        if mode == "z" or mode == "dx":
                            for j in T.vectorized(4):
                                y[4 + j] = AUX[row, col // 4, j]
                        for j in T.unroll(4):
                            if mode == "z":
                                y[j] = y[4 + j] + tot[a * 8 + hb * 4 + j] + y[8 + j]
                            elif mode == "dx":
                                y[j] = y[4 + j] + tot[a * 8 + hb * 4 + j]
                            else:
                                y[j] = tot[a * 8 + hb * 4 + j]
                        for j in T.vectorized(4):
                            C[row, col // 4, j] = y[j]
        if mode == "dh":
            for hb in T.unroll(2):
                for j in T.unroll(4):
                    csum[ty, hb * 64 + tx * 4 + j] = cs[hb * 4 + j]
            T.cuda.cta_sync()
            if tid < BN:
                e[0] = T.float32(0.0)
                for r in T.unroll(16):
                    e[0] = e[0] + csum[r, tid]
                if n0 + tid < n:
                    PART[by, n0 + tid] = e[0]

    return sgemm


def make_ln_backward(hidden):
    n4 = hidden // 4
    per_lane = (n4 + 31) // 32          # float4 per lane (the last ones masked when hidden % 128 != 0)

    @T.prim_func
    def ln_backward(z_handle: T.handle, g_handle: T.handle, gamma_handle: T.handle, dz_handle: T.handle,
                    part_handle: T.handle):
        n_tok = T.int32()
        n_blk = T.int32()
        Z = T.match_buffer(z_handle, (n_tok, hidden // 4, 4), "float32", align=16)
        G = T.match_buffer(g_handle, (n_tok, hidden // 4, 4), "float32", align=16)
        GM = T.match_buffer(gamma_handle, (hidden // 4, 4), "float32", align=16)
        DZ = T.match_buffer(dz_handle, (n_tok, hidden // 4, 4), "float32", align=16)
        PART = T.match_buffer(part_handle, (3, n_blk, hidden), "float32")

        T.device_entry()
        cta = T.cta_id([n_blk])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])
        zv = T.alloc_local((per_lane * 4,), "float32")
        gv = T.alloc_local((per_lane * 4,), "float32")
        gm = T.alloc_local((per_lane * 4,), "float32")
        p_w = T.alloc_local((per_lane * 4,), "float32")     # column partials: g * zhat
        p_b = T.alloc_local((per_lane * 4,), "float32")     # g
        p_z = T.alloc_local((per_lane * 4,), "float32")     # dz
        st = T.alloc_local((6,), "float32")
        red = T.alloc_shared((8, hidden), "float32")

        for c in T.unroll(per_lane):
            for i in T.vectorized(4):
                gm[c * 4 + i] = GM[T.min(c * 32 + lane, n4 - 1), i]
        for e in T.unroll(per_lane * 4):
            p_w[e] = T.float32(0.0)
            p_b[e] = T.float32(0.0)
            p_z[e] = T.float32(0.0)

        for q in range(LN_ROWS // 8):
            row: T.let[T.int32] = cta * LN_ROWS + warp * (LN_ROWS // 8) + q
            if row < n_tok:
                for c in T.unroll(per_lane):
                    for i in T.vectorized(4):
                        zv[c * 4 + i] = Z[row, T.min(c * 32 + lane, n4 - 1), i]
                    for i in T.vectorized(4):
                        gv[c * 4 + i] = G[row, T.min(c * 32 + lane, n4 - 1), i]
                    for i in T.unroll(4):
                        zv[c * 4 + i] = T.if_then_else(c * 32 + lane < n4, zv[c * 4 + i], T.float32(0.0))
                        gv[c * 4 + i] = T.if_then_else(c * 32 + lane < n4, gv[c * 4 + i], T.float32(0.0))
                st[0] = T.float32(0.0)
                for e in T.unroll(per_lane * 4):
                    st[0] = st[0] + zv[e]
                for s in T.unroll(5):
                    st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
                T.ptx.div.rn.f32(st[1], st[0], T.float32(hidden))          # mean
                st[0] = T.float32(0.0)
                for e in T.unroll(per_lane * 4):
                    zv[e] = T.if_then_else((e // 4) * 32 + lane < n4, zv[e] - st[1], T.float32(0.0))   # zc
                    st[0] = st[0] + zv[e] * zv[e]
                for s in T.unroll(5):
                    st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
                T.ptx.div.rn.f32(st[2], st[0], T.float32(hidden))
                T.ptx.sqrt.rn.f32(st[3], st[2] + T.float32(EPS))
                T.ptx.div.rn.f32(st[2], T.float32(1.0), st[3])             # rstd
                st[0] = T.float32(0.0)
                st[3] = T.float32(0.0)
                for e in T.unroll(per_lane * 4):
                    zv[e] = zv[e] * st[2]                                   # zhat
                    st[0] = st[0] + gv[e] * gm[e]
                    st[3] = st[3] + gv[e] * gm[e] * zv[e]
                for s in T.unroll(5):
                    st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
                    st[3] = st[3] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[3], 16 >> s, 32, 32)
                T.ptx.div.rn.f32(st[4], st[0], T.float32(hidden))          # mean(gg)
                T.ptx.div.rn.f32(st[5], st[3], T.float32(hidden))          # mean(gg * zhat)
                for e in T.unroll(per_lane * 4):
                    p_w[e] = p_w[e] + gv[e] * zv[e]
                    p_b[e] = p_b[e] + gv[e]
                    gv[e] = st[2] * ((gv[e] * gm[e] - st[4]) - zv[e] * st[5])
                    p_z[e] = p_z[e] + gv[e]
                for c in T.unroll(per_lane):
                    if c * 32 + lane < n4:
                        for i in T.vectorized(4):
                            DZ[row, c * 32 + lane, i] = gv[c * 4 + i]

        # column partials of the CTA: 8 warps through shared memory, one array at a time
        for which in T.unroll(3):
            for c in T.unroll(per_lane):
                if c * 32 + lane < n4:
                    for i in T.unroll(4):
                        if which == 0:
                            red[warp, (c * 32 + lane) * 4 + i] = p_w[c * 4 + i]
                        elif which == 1:
                            red[warp, (c * 32 + lane) * 4 + i] = p_b[c * 4 + i]
                        else:
                            red[warp, (c * 32 + lane) * 4 + i] = p_z[c * 4 + i]
            T.cuda.cta_sync()
            for u in T.unroll((hidden + THREADS - 1) // THREADS):
                if u * THREADS + tid < hidden:
                    st[0] = ((red[0, u * THREADS + tid] + red[1, u * THREADS + tid]) + (red[2, u * THREADS + tid] + red[3, u * THREADS + tid])) + \
                            ((red[4, u * THREADS + tid] + red[5, u * THREADS + tid]) + (red[6, u * THREADS + tid] + red[7, u * THREADS + tid]))
                    PART[which, cta, u * THREADS + tid] = st[0]
            T.cuda.cta_sync()

    return ln_backward


@T.prim_func
def colsum(src_handle: T.handle, dst_handle: T.handle):
    rows = T.int32()
    cols = T.int32()
    S = T.match_buffer(src_handle, (rows, cols), "float32")
    D = T.match_buffer(dst_handle, (cols,), "float32")
    T.device_entry()
    cb = T.cta_id([T.ceildiv(cols, CS_COLS)])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])
    p4 = T.alloc_local((4,), "float32")
    part = T.alloc_local((1,), "float32")
    red = T.alloc_shared((8, CS_COLS), "float32")
    c: T.let[T.int32] = T.min(cb * CS_COLS + lane, cols - 1)
    part[0] = T.float32(0.0)
    for ch in range(T.ceildiv(rows, 8 * CS_CHUNK)):
        for q in T.unroll(4):
            p4[q] = T.float32(0.0)
        for r in T.unroll(CS_CHUNK):
            p4[r % 4] = p4[r % 4] + T.if_then_else((ch * CS_CHUNK + r) * 8 + warp < rows,
                                                   S[T.min((ch * CS_CHUNK + r) * 8 + warp, rows - 1), c], T.float32(0.0))
        part[0] = part[0] + ((p4[0] + p4[1]) + (p4[2] + p4[3]))
    red[warp, lane] = part[0]
    T.cuda.cta_sync()
    if warp == 0:
        part[0] = ((red[0, lane] + red[1, lane]) + (red[2, lane] + red[3, lane])) + \
                  ((red[4, lane] + red[5, lane]) + (red[6, lane] + red[7, lane]))
        if cb * CS_COLS + lane < cols:
            D[cb * CS_COLS + lane] = part[0]


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


def _compiled(hidden=768):
    key = ("exes", hidden)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (make_sgemm("mk", "nk", "h_act"), make_sgemm("mk", "nk", "z"), make_ln_backward(hidden),
                 make_sgemm("mk", "kn", "dh"), make_sgemm("km", "kn", "store"), make_sgemm("mk", "kn", "dx"),
                 colsum)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def _v4(t):
    return t.view(t.shape[0], t.shape[1] // 4, 4)


def solve(dy, x, w1, b1, w2, b2, ln_weight):
    shape = x.shape
    hidden = shape[-1]
    inter = w1.shape[0]
    assert hidden % 4 == 0 and inter % 4 == 0
    _compiled()                                    # the full-size build, also when called at another size
    g_h, g_z, ln_bwd, g_dh, g_tn, g_dx, csum = _compiled(hidden)
    dev = x.device
    f32 = torch.float32
    xs = x.contiguous().view(-1, hidden)
    g = dy.contiguous().view(-1, hidden)
    tokens = xs.shape[0]
    w1c, w2c = w1.contiguous(), w2.contiguous()
    m_tiles = (tokens + BM - 1) // BM
    n_ln = (tokens + LN_ROWS - 1) // LN_ROWS
    h = torch.empty((tokens, inter), dtype=f32, device=dev)
    a = torch.empty((tokens, inter), dtype=f32, device=dev)
    z = torch.empty((tokens, hidden), dtype=f32, device=dev)
    dz = torch.empty((tokens, hidden), dtype=f32, device=dev)
    ln_part = torch.empty((3, n_ln, hidden), dtype=f32, device=dev)
    dh = torch.empty((tokens, inter), dtype=f32, device=dev)
    dh_part = torch.empty((m_tiles, inter), dtype=f32, device=dev)
    dx = torch.empty((tokens, hidden), dtype=f32, device=dev)
    dw1 = torch.empty((inter, hidden), dtype=f32, device=dev)
    db1 = torch.empty((inter,), dtype=f32, device=dev)
    dw2 = torch.empty((hidden, inter), dtype=f32, device=dev)
    db2 = torch.empty((hidden,), dtype=f32, device=dev)
    dlnw = torch.empty((hidden,), dtype=f32, device=dev)
    dlnb = torch.empty((hidden,), dtype=f32, device=dev)
    # forward recomputation (unused operands of a mode are given a tensor of the right shape)
    g_h(_v4(xs), _v4(w1c), _v4(h), _v4(h), _v4(a), b1.contiguous(), h, hidden)
    g_z(_v4(a), _v4(w2c), _v4(z), _v4(xs), _v4(z), b2.contiguous(), z, inter)
    # LayerNorm backward
    ln_bwd(_v4(z), _v4(g), ln_weight.contiguous().view(hidden // 4, 4), _v4(dz), ln_part)
    # feed-forward backward
    g_dh(_v4(dz), _v4(w2c), _v4(dh), _v4(h), _v4(dh), db1, dh_part, hidden)
    g_tn(_v4(dz), _v4(a), _v4(dw2), _v4(dw2), _v4(dw2), db1, dw2, tokens)
    g_tn(_v4(dh), _v4(xs), _v4(dw1), _v4(dw1), _v4(dw1), db1, dw1, tokens)
    g_dx(_v4(dh), _v4(w1c), _v4(dx), _v4(dz), _v4(dx), db1, dx, inter)
    csum(dh_part, db1)
    csum(ln_part[2], db2)
    csum(ln_part[0], dlnw)
    csum(ln_part[1], dlnb)
    return dx.view(shape), dw1, db1, dw2, db2, dlnw, dlnb
