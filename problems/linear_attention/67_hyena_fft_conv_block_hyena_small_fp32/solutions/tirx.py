# Hyena order-2 operator (HyenaDNA-small: d_model 256, short filter 3) with the long causal convolution
# done by a hand-written FFT in TIRx (fp32), seven kernels.
#
# The causal linear convolution conv = h * z over L <= 32768 is evaluated with complex FFTs of fixed
# length N = 65536 = 256 x 256 (>= 2L - 1, so no wrap-around), four-step form
#   X[k1 + 256 k2] = sum_n2 W256^(n2 k2) [ W_N^(n2 k1) sum_n1 x[256 n1 + n2] W256^(n1 k1) ].
# Two batches share one complex sequence (z_{2p} + i z_{2p+1}); since h is real, the inverse transform
# of Z H returns both convolutions (real and imaginary parts). Every 256-point DFT is done by 16
# threads holding 16 points each: a radix-4 x radix-4 DFT16 in registers, a W256 twiddle, a transpose
# through a padded shared array (conflict-free), and a second DFT16.
#   k_twiddle  (once per device, cached: input-independent): W_N^m table, fp64 sin/cos -> fp32.
#   k_z        z = (short conv of stream 1) * (short conv of stream 2), tiles of 32 tokens x 32
#              channels transposed through shared memory into a packed complex workspace [p, c, t].
#   k_filter   long_filter as complex sequences (imaginary part 0) into the same workspace.
#   k_colf     forward column transforms (over n1) of all 768 sequences: a CTA = 16 columns of one
#              sequence, coalesced 128-byte row segments in and out.
#   k_row      per (channel, 16 rows k1): the filter row is transformed (W_N twiddle on load, DFT256 over
#              n2) and kept in registers (scaled by 1/N); then for both batch pairs: the same forward
#              transform, the pointwise product with H, the inverse DFT256 and the inverse twiddle, in
#              place.
#   k_coli     inverse column transforms; only n1 < 128 (t < L) is stored, packed [p, c, t].
#   k_gate     y = x0 * (conv + filter_bias * z), x0 = short conv of stream 0; tiles transposed back to
#              [B, L, 256] through shared memory.
# Numerics: fp32 throughout with correctly rounded twiddles (fp64 sin/cos). A CPU model of this
# four-step fp32 scheme gave a conv error comparable to the fp32 reference FFT (2.9e-6 vs 3.6e-6) and
# y errors dominated by the fp32 short-conv / gate arithmetic that the reference shares.
#
# What limits it / expected time: DRAM traffic of the passes (~2.7 GB: u read twice, the packed
# sequences, the 65536-point complex intermediates written / read once per pass), ~0.65 ms at
# 4.2 TB/s; the DFT arithmetic (~7 GFLOP fp32) is secondary. SOL (one read of u and the filter, one
# write of y) is ~0.12 ms. Expected several times faster than eager PyTorch (cuFFT passes plus about
# a dozen full-size elementwise kernels with [4, 768, 32770] temporaries). Next steps: keep one
# 65536-point sequence in a 4-CTA cluster's distributed shared memory (no intermediate round trips),
# and real-to-complex packing of the filter.
#
# Streams: all compiled functions are called with torch tensors; tvm-ffi installs torch's current
# stream as TVM's environment stream for each call, so the kernels run in order on it. Workspaces and
# the twiddle table are cached per (device, B, L); every workspace element read is written earlier in
# the same call.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

DM = 256                        # d_model
WIDTH = 3 * DM
NFFT = 65536
LMAX = NFFT // 2
THREADS = 256
SP = 273                        # complex pitch of one 16x16 transpose array (odd: conflict-free)


def _cst(v):
    return 0.0 if abs(v) < 1e-12 else (1.0 if abs(v - 1) < 1e-12 else (-1.0 if abs(v + 1) < 1e-12 else v))


_C16 = [_cst(math.cos(2 * math.pi * m / 16)) for m in range(16)]
_S16 = [_cst(math.sin(2 * math.pi * m / 16)) for m in range(16)]


def _pick(m, table):
    e = T.float32(table[15])
    for i in range(14, -1, -1):
        e = T.if_then_else(m == i, T.float32(table[i]), e)
    return e


def cos16(m):
    return _pick(m, _C16)


def sin16(m):
    return _pick(m, _S16)


@T.macro
def dft16(xr, xi, tr, ti, yr, yi, sgn):
    # y[k] = sum_n x[n] exp(sgn * 2 pi i n k / 16); radix 4 x 4, all indices constant after unrolling.
    for n0 in T.unroll(4):
        tr[n0] = (xr[n0] + xr[n0 + 8]) + (xr[n0 + 4] + xr[n0 + 12])
        ti[n0] = (xi[n0] + xi[n0 + 8]) + (xi[n0 + 4] + xi[n0 + 12])
        tr[n0 + 8] = (xr[n0] + xr[n0 + 8]) - (xr[n0 + 4] + xr[n0 + 12])
        ti[n0 + 8] = (xi[n0] + xi[n0 + 8]) - (xi[n0 + 4] + xi[n0 + 12])
        # k1 = 1, 3: (x0 - x2) +/- (sgn i)(x1 - x3)
        tr[n0 + 4] = (xr[n0] - xr[n0 + 8]) - T.float32(sgn) * (xi[n0 + 4] - xi[n0 + 12])
        ti[n0 + 4] = (xi[n0] - xi[n0 + 8]) + T.float32(sgn) * (xr[n0 + 4] - xr[n0 + 12])
        tr[n0 + 12] = (xr[n0] - xr[n0 + 8]) + T.float32(sgn) * (xi[n0 + 4] - xi[n0 + 12])
        ti[n0 + 12] = (xi[n0] - xi[n0 + 8]) - T.float32(sgn) * (xr[n0 + 4] - xr[n0 + 12])
    for n0 in T.unroll(4):
        for k1 in T.unroll(4):
            if n0 * k1 > 0:
                yr[0] = tr[n0 + 4 * k1] * cos16(n0 * k1) - T.float32(sgn) * ti[n0 + 4 * k1] * sin16(n0 * k1)
                ti[n0 + 4 * k1] = ti[n0 + 4 * k1] * cos16(n0 * k1) + T.float32(sgn) * tr[n0 + 4 * k1] * sin16(n0 * k1)
                tr[n0 + 4 * k1] = yr[0]
    for k1 in T.unroll(4):
        yr[k1] = (tr[4 * k1] + tr[4 * k1 + 2]) + (tr[4 * k1 + 1] + tr[4 * k1 + 3])
        yi[k1] = (ti[4 * k1] + ti[4 * k1 + 2]) + (ti[4 * k1 + 1] + ti[4 * k1 + 3])
        yr[k1 + 8] = (tr[4 * k1] + tr[4 * k1 + 2]) - (tr[4 * k1 + 1] + tr[4 * k1 + 3])
        yi[k1 + 8] = (ti[4 * k1] + ti[4 * k1 + 2]) - (ti[4 * k1 + 1] + ti[4 * k1 + 3])
        yr[k1 + 4] = (tr[4 * k1] - tr[4 * k1 + 2]) - T.float32(sgn) * (ti[4 * k1 + 1] - ti[4 * k1 + 3])
        yi[k1 + 4] = (ti[4 * k1] - ti[4 * k1 + 2]) + T.float32(sgn) * (tr[4 * k1 + 1] - tr[4 * k1 + 3])
        yr[k1 + 12] = (tr[4 * k1] - tr[4 * k1 + 2]) + T.float32(sgn) * (ti[4 * k1 + 1] - ti[4 * k1 + 3])
        yi[k1 + 12] = (ti[4 * k1] - ti[4 * k1 + 2]) - T.float32(sgn) * (tr[4 * k1 + 1] - tr[4 * k1 + 3])


@T.macro
def fft256_step1(xr, xi, tr, ti, yr, yi, W, S, base, j, sgn):
    # thread j of a 16-thread group holds x[j + 16 m] in xr/xi[m]; DFT16 over m, twiddle W256^(sgn j k),
    # store to S[base + k * 17 + j]
    dft16(xr, xi, tr, ti, yr, yi, sgn)
    for k in T.unroll(16):
        S[base + k * 17 + j, 0] = yr[k] * W[j * k, 0] - T.float32(sgn) * (-yi[k] * W[j * k, 1])
        S[base + k * 17 + j, 1] = yi[k] * W[j * k, 0] + T.float32(sgn) * (-yr[k] * W[j * k, 1])


@T.macro
def fft256_step2(xr, xi, tr, ti, yr, yi, S, base, kk, sgn):
    # thread kk: DFT16 over j of S[base + kk * 17 + j]; yr/yi[rr] = output index kk + 16 rr
    for j in T.unroll(16):
        xr[j] = S[base + kk * 17 + j, 0]
        xi[j] = S[base + kk * 17 + j, 1]
    dft16(xr, xi, tr, ti, yr, yi, sgn)


@T.prim_func
def k_twiddle(w_h: T.handle):
    WN = T.match_buffer(w_h, (NFFT, 2), "float32")
    T.device_entry()
    blk = T.cta_id([NFFT // THREADS])
    tid = T.thread_id([THREADS])
    m: T.let[T.int32] = blk * THREADS + tid
    # exp(-2 pi i m / N), in fp64 and rounded once
    WN[m, 0] = T.cast(T.cos(T.float64(2.0 * math.pi / NFFT) * T.cast(m, "float64")), "float32")
    WN[m, 1] = T.cast(T.float64(0.0) - T.sin(T.float64(2.0 * math.pi / NFFT) * T.cast(m, "float64")), "float32")


@T.prim_func
def k_z(u_h: T.handle, sw_h: T.handle, sb_h: T.handle, zc_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    nseq = T.int32()
    U = T.match_buffer(u_h, (batch, seqlen, WIDTH), "float32", align=16)
    SW = T.match_buffer(sw_h, (WIDTH, 3), "float32")
    SB = T.match_buffer(sb_h, (WIDTH,), "float32")
    ZC = T.match_buffer(zc_h, (nseq, seqlen, 2), "float32", align=16)

    T.device_entry()
    tb, cb, p = T.cta_id([T.ceildiv(seqlen, 32), DM // 32, batch // 2])
    tid = T.thread_id([THREADS])
    zs = T.alloc_shared((32, 33, 2), "float32")
    a = T.alloc_local((2,), "float32")
    ov = T.alloc_local((8,), "float32")

    cl: T.let[T.int32] = tid % 32
    c: T.let[T.int32] = cb * 32 + cl
    for tt in T.unroll(4):
        tl: T.let[T.int32] = tid // 32 + tt * 8
        t: T.let[T.int32] = tb * 32 + tl
        for bb in T.unroll(2):
            if t < seqlen:
                # uc = bias + (w0 u[t-2] + w1 u[t-1] + w2 u[t]) for streams 1 (x1) and 2 (v)
                for s in T.unroll(2):
                    # the reference's order: bias + ((w0 u[t-2] + w1 u[t-1]) + w2 u[t])
                    a[s] = T.float32(0.0)
                    if t >= 2:
                        a[s] = SW[DM * (s + 1) + c, 0] * U[p * 2 + bb, t - 2, DM * (s + 1) + c]
                    if t >= 1:
                        a[s] = a[s] + SW[DM * (s + 1) + c, 1] * U[p * 2 + bb, t - 1, DM * (s + 1) + c]
                    a[s] = a[s] + SW[DM * (s + 1) + c, 2] * U[p * 2 + bb, t, DM * (s + 1) + c]
                    a[s] = SB[DM * (s + 1) + c] + a[s]
                zs[cl, tl, bb] = a[0] * a[1]
            else:
                zs[cl, tl, bb] = T.float32(0.0)
    T.cuda.cta_sync()
    cw: T.let[T.int32] = tid // 8
    t4: T.let[T.int32] = (tid % 8) * 4
    for i in T.unroll(4):
        ov[i * 2] = zs[cw, t4 + i, 0]
        ov[i * 2 + 1] = zs[cw, t4 + i, 1]
    for i in T.unroll(4):
        if tb * 32 + t4 + i < seqlen:
            for e in T.vectorized(2):
                ZC[p * DM + cb * 32 + cw, tb * 32 + t4 + i, e] = ov[i * 2 + e]


@T.prim_func
def k_filter(h_h: T.handle, zc_h: T.handle):
    seqlen = T.int32()
    nseq = T.int32()
    HF = T.match_buffer(h_h, (DM, seqlen), "float32")
    ZC = T.match_buffer(zc_h, (nseq, seqlen, 2), "float32", align=16)
    T.device_entry()
    tb, c = T.cta_id([T.ceildiv(seqlen, THREADS), DM])
    tid = T.thread_id([THREADS])
    if tb * THREADS + tid < seqlen:
        ZC[nseq - DM + c, tb * THREADS + tid, 0] = HF[c, tb * THREADS + tid]
        ZC[nseq - DM + c, tb * THREADS + tid, 1] = T.float32(0.0)


@T.prim_func
def k_colf(zc_h: T.handle, w_h: T.handle, a_h: T.handle):
    seqlen = T.int32()
    nseq = T.int32()
    ZC = T.match_buffer(zc_h, (nseq, seqlen, 2), "float32", align=16)
    WN = T.match_buffer(w_h, (NFFT, 2), "float32", align=16)
    A = T.match_buffer(a_h, (nseq, 256, 256, 2), "float32", align=16)

    T.device_entry()
    cblk, q = T.cta_id([16, nseq])
    tid = T.thread_id([THREADS])
    S = T.alloc_shared((16 * SP, 2), "float32")
    W = T.alloc_shared((256, 2), "float32")
    xr = T.alloc_local((16,), "float32")
    xi = T.alloc_local((16,), "float32")
    tr = T.alloc_local((16,), "float32")
    ti = T.alloc_local((16,), "float32")
    yr = T.alloc_local((16,), "float32")
    yi = T.alloc_local((16,), "float32")

    col: T.let[T.int32] = tid % 16
    j: T.let[T.int32] = tid // 16
    n2: T.let[T.int32] = cblk * 16 + col
    W[tid, 0] = WN[tid * 256, 0]
    W[tid, 1] = WN[tid * 256, 1]
    for m in T.unroll(16):
        if (j + 16 * m) * 256 + n2 < seqlen:
            for e in T.vectorized(2):
                tr[e] = ZC[q, (j + 16 * m) * 256 + n2, e]
            xr[m] = tr[0]
            xi[m] = tr[1]
        else:
            xr[m] = T.float32(0.0)
            xi[m] = T.float32(0.0)
    T.cuda.cta_sync()
    fft256_step1(xr, xi, tr, ti, yr, yi, W, S, col * SP, j, -1)
    T.cuda.cta_sync()
    fft256_step2(xr, xi, tr, ti, yr, yi, S, col * SP, j, -1)
    for rr in T.unroll(16):
        for e in T.vectorized(2):
            xr[e] = T.if_then_else(e == 0, yr[rr], yi[rr])
        for e in T.vectorized(2):
            A[q, j + 16 * rr, n2, e] = xr[e]


@T.prim_func
def k_row(a_h: T.handle, w_h: T.handle):
    nseq = T.int32()
    A = T.match_buffer(a_h, (nseq, 256, 256, 2), "float32", align=16)
    WN = T.match_buffer(w_h, (NFFT, 2), "float32", align=16)

    T.device_entry()
    rblk, c = T.cta_id([16, DM])
    tid = T.thread_id([THREADS])
    S = T.alloc_shared((16 * SP, 2), "float32")
    W = T.alloc_shared((256, 2), "float32")
    xr = T.alloc_local((16,), "float32")
    xi = T.alloc_local((16,), "float32")
    tr = T.alloc_local((16,), "float32")
    ti = T.alloc_local((16,), "float32")
    yr = T.alloc_local((16,), "float32")
    yi = T.alloc_local((16,), "float32")
    hr = T.alloc_local((16,), "float32")
    hi = T.alloc_local((16,), "float32")
    v2 = T.alloc_local((2,), "float32")

    grp: T.let[T.int32] = tid // 16
    jj: T.let[T.int32] = tid % 16
    k1: T.let[T.int32] = rblk * 16 + grp
    base: T.let[T.int32] = grp * SP
    W[tid, 0] = WN[tid * 256, 0]
    W[tid, 1] = WN[tid * 256, 1]
    T.cuda.cta_sync()

    for s in range(nseq // DM):
        # s = 0: the filter of channel c (sequence nseq - 256 + c); s >= 1: batch pair s - 1
        q: T.let[T.int32] = T.if_then_else(s == 0, nseq - DM + c, (s - 1) * DM + c)
        for m in T.unroll(16):
            for e in T.vectorized(2):
                v2[e] = A[q, k1, jj + 16 * m, e]
            # forward four-step twiddle W_N^(n2 k1)
            xr[m] = v2[0] * WN[((jj + 16 * m) * k1) % NFFT, 0] - v2[1] * WN[((jj + 16 * m) * k1) % NFFT, 1]
            xi[m] = v2[1] * WN[((jj + 16 * m) * k1) % NFFT, 0] + v2[0] * WN[((jj + 16 * m) * k1) % NFFT, 1]
        fft256_step1(xr, xi, tr, ti, yr, yi, W, S, base, jj, -1)
        T.cuda.cta_sync()
        fft256_step2(xr, xi, tr, ti, yr, yi, S, base, jj, -1)
        T.cuda.cta_sync()
        if s == 0:
            for rr in T.unroll(16):
                hr[rr] = yr[rr] * T.float32(1.0 / NFFT)
                hi[rr] = yi[rr] * T.float32(1.0 / NFFT)
        else:
            # product with H (thread jj holds spectrum indices jj + 16 rr of this row), then the
            # inverse DFT256 from that distribution
            for rr in T.unroll(16):
                xr[rr] = yr[rr] * hr[rr] - yi[rr] * hi[rr]
                xi[rr] = yr[rr] * hi[rr] + yi[rr] * hr[rr]
            fft256_step1(xr, xi, tr, ti, yr, yi, W, S, base, jj, 1)
            T.cuda.cta_sync()
            fft256_step2(xr, xi, tr, ti, yr, yi, S, base, jj, 1)
            T.cuda.cta_sync()
            for nb in T.unroll(16):
                # inverse four-step twiddle W_N^(-n2 k1), n2 = jj + 16 nb
                v2[0] = yr[nb] * WN[((jj + 16 * nb) * k1) % NFFT, 0] + yi[nb] * WN[((jj + 16 * nb) * k1) % NFFT, 1]
                v2[1] = yi[nb] * WN[((jj + 16 * nb) * k1) % NFFT, 0] - yr[nb] * WN[((jj + 16 * nb) * k1) % NFFT, 1]
                for e in T.vectorized(2):
                    A[q, k1, jj + 16 * nb, e] = v2[e]


@T.prim_func
def k_coli(a_h: T.handle, w_h: T.handle, cv_h: T.handle):
    seqlen = T.int32()
    nseq = T.int32()
    ndat = T.int32()
    A = T.match_buffer(a_h, (nseq, 256, 256, 2), "float32", align=16)
    WN = T.match_buffer(w_h, (NFFT, 2), "float32", align=16)
    CV = T.match_buffer(cv_h, (ndat, seqlen, 2), "float32", align=16)

    T.device_entry()
    cblk, q = T.cta_id([16, ndat])
    tid = T.thread_id([THREADS])
    S = T.alloc_shared((16 * SP, 2), "float32")
    W = T.alloc_shared((256, 2), "float32")
    xr = T.alloc_local((16,), "float32")
    xi = T.alloc_local((16,), "float32")
    tr = T.alloc_local((16,), "float32")
    ti = T.alloc_local((16,), "float32")
    yr = T.alloc_local((16,), "float32")
    yi = T.alloc_local((16,), "float32")
    v2 = T.alloc_local((2,), "float32")

    col: T.let[T.int32] = tid % 16
    j: T.let[T.int32] = tid // 16
    n2: T.let[T.int32] = cblk * 16 + col
    W[tid, 0] = WN[tid * 256, 0]
    W[tid, 1] = WN[tid * 256, 1]
    for m in T.unroll(16):
        for e in T.vectorized(2):
            v2[e] = A[q, j + 16 * m, n2, e]
        xr[m] = v2[0]
        xi[m] = v2[1]
    T.cuda.cta_sync()
    fft256_step1(xr, xi, tr, ti, yr, yi, W, S, col * SP, j, 1)
    T.cuda.cta_sync()
    fft256_step2(xr, xi, tr, ti, yr, yi, S, col * SP, j, 1)
    for rr in T.unroll(8):
        if (j + 16 * rr) * 256 + n2 < seqlen:
            for e in T.vectorized(2):
                v2[e] = T.if_then_else(e == 0, yr[rr], yi[rr])
            for e in T.vectorized(2):
                CV[q, (j + 16 * rr) * 256 + n2, e] = v2[e]


@T.prim_func
def k_gate(u_h: T.handle, sw_h: T.handle, sb_h: T.handle, fb_h: T.handle, zc_h: T.handle, cv_h: T.handle,
           y_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    nseq = T.int32()
    ndat = T.int32()
    U = T.match_buffer(u_h, (batch, seqlen, WIDTH), "float32", align=16)
    SW = T.match_buffer(sw_h, (WIDTH, 3), "float32")
    SB = T.match_buffer(sb_h, (WIDTH,), "float32")
    FB = T.match_buffer(fb_h, (DM,), "float32")
    ZC = T.match_buffer(zc_h, (nseq, seqlen, 2), "float32", align=16)
    CV = T.match_buffer(cv_h, (ndat, seqlen, 2), "float32", align=16)
    Y = T.match_buffer(y_h, (batch, seqlen, DM), "float32", align=16)

    T.device_entry()
    tb, cb, p = T.cta_id([T.ceildiv(seqlen, 32), DM // 32, batch // 2])
    tid = T.thread_id([THREADS])
    cs = T.alloc_shared((32, 33, 2), "float32")
    zs = T.alloc_shared((32, 33, 2), "float32")
    a = T.alloc_local((1,), "float32")

    cw: T.let[T.int32] = tid // 8
    t4: T.let[T.int32] = (tid % 8) * 4
    for i in T.unroll(4):
        for e in T.unroll(2):
            if tb * 32 + t4 + i < seqlen:
                cs[cw, t4 + i, e] = CV[p * DM + cb * 32 + cw, tb * 32 + t4 + i, e]
                zs[cw, t4 + i, e] = ZC[p * DM + cb * 32 + cw, tb * 32 + t4 + i, e]
    T.cuda.cta_sync()
    cl: T.let[T.int32] = tid % 32
    c: T.let[T.int32] = cb * 32 + cl
    for tt in T.unroll(4):
        tl: T.let[T.int32] = tid // 32 + tt * 8
        t: T.let[T.int32] = tb * 32 + tl
        if t < seqlen:
            for bb in T.unroll(2):
                a[0] = T.float32(0.0)
                if t >= 2:
                    a[0] = SW[c, 0] * U[p * 2 + bb, t - 2, c]
                if t >= 1:
                    a[0] = a[0] + SW[c, 1] * U[p * 2 + bb, t - 1, c]
                a[0] = a[0] + SW[c, 2] * U[p * 2 + bb, t, c]
                a[0] = SB[c] + a[0]
                Y[p * 2 + bb, t, c] = a[0] * (cs[cl, tl, bb] + FB[c] * zs[cl, tl, bb])


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}
_KERNELS = (k_twiddle, k_z, k_filter, k_colf, k_row, k_coli, k_gate)


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
                     for f in _KERNELS)
        _CACHE["exes"] = exes
    return exes


def _tables(device: torch.device, batch: int, seqlen: int):
    key = ("ws", str(device), batch, seqlen)
    ws = _CACHE.get(key)
    if ws is None:
        wkey = ("twiddle", str(device))
        wn = _CACHE.get(wkey)
        if wn is None:
            wn = torch.empty((NFFT, 2), dtype=torch.float32, device=device)
            _compiled()[0](wn)                     # input-independent constant table
            _CACHE[wkey] = wn
        ndat = (batch // 2) * DM
        zc = torch.empty((ndat + DM, seqlen, 2), dtype=torch.float32, device=device)
        a = torch.empty((ndat + DM, 256, 256, 2), dtype=torch.float32, device=device)
        cv = torch.empty((ndat, seqlen, 2), dtype=torch.float32, device=device)
        ws = (wn, zc, a, cv)
        _CACHE[key] = ws
    return ws


def solve(u: torch.Tensor, short_weight: torch.Tensor, short_bias: torch.Tensor, long_filter: torch.Tensor,
          filter_bias: torch.Tensor) -> torch.Tensor:
    batch, seqlen, width = u.shape
    if width != WIDTH or seqlen > LMAX or batch % 2 != 0:
        raise ValueError("this kernel handles width 768, L <= 32768 and an even batch")
    _, kz, kf, kcf, krow, kci, kg = _compiled()
    y = torch.empty((batch, seqlen, DM), dtype=u.dtype, device=u.device)
    if batch == 0 or seqlen == 0:
        return y
    wn, zc, a, cv = _tables(u.device, batch, seqlen)
    u = u.contiguous()
    sw = short_weight.contiguous().float()
    sb = short_bias.contiguous().float()
    kz(u, sw, sb, zc)
    kf(long_filter.contiguous().float(), zc)
    kcf(zc, wn, a)
    krow(a, wn)
    kci(a, wn, cv)
    kg(u, sw, sb, filter_bias.contiguous().float(), zc, cv, y)
    return y
