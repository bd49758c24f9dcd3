# ConvNeXt V2 block MLP (pwconv 512 -> 2048, exact-erf GELU, global response normalization over the
# 14 x 14 positions, pwconv 2048 -> 512), fp32, channels-last, in TIRx: two fp32 FMA (SIMT) GEMM kernels
# and a small statistics kernel, the same decomposition as the verified CuTe DSL solution.
#
# GEMM (C = A @ B^T, A [M, K], B [N, K], K contiguous; K a multiple of 16):
# - CTA tile 128 x 128 x 16, 256 threads; thread (tx, ty) = (tid % 16, tid // 16) owns the 8 x 8 outputs at
#   rows 4ty..+3 and 64+4ty..+3, columns 4tx..+3 and 64+4tx..+3 (conflict-free float4 shared reads).
# - Next k-tile global -> registers (float4) while the current one is computed, stored k-major into the
#   other of two shared buffers; one barrier per k-tile. Two-level accumulation: a fresh partial per 64 k
#   values added into the running sums (as in the CuTe solution). The loads sit in their own block before
#   the math and the store after it is unconditional (see Limits for why).
# - GEMM 1 epilogue: h = GELU_erf(acc + b1) stored to h [M, 2048] (103 MB round trip), and the GRN sums of
#   h^2 per (image, column) over the tile's rows. DIFFERENCE from the CuTe solution: instead of atomic adds
#   into a zeroed [images, 2048] buffer (which the stats kernel then re-zeroed), each tile writes its
#   per-image-slot column sums to a partial buffer [row tiles, slots, 2048] (a 128-row tile touches at most
#   128 // 196 + 2 = 2 images); deterministic, no atomics, no zeroing dependency between calls.
# - Stats kernel (one CTA per image): G2 = sum of the partials of the (at most 2) tiles covering the image,
#   G = sqrt(G2), N = G / (mean over channels of G + 1e-6), written to nx [images, 2048].
# - GEMM 2: out = h' @ w2^T + b2, the A loader forms h' = gamma * (h * nx[image]) + beta + h on the fly
#   (h and nx loaded one tile ahead; gamma, beta and the formula applied after the math, at the store).
# - sqrt and the divisions use PTX sqrt.rn / div.rn (TVM builds device code with --use_fast_math).
# Limits: fp32 FMA issue rate (53 GFLOP, 0.79 ms at the 67 TFLOP/s peak) with one 256-thread CTA per SM
# (205 / 233 registers). H200 (2026-11-30) of the previous version: 1.695 ms device (1.834 end to end),
# 0.87x torch.compile (1.601 ms), 0.99x eager (1.821 ms); CuTe the same 1.696 ms. Its SASS (CPU compile,
# nvdisasm) showed every k-tile waiting for its global loads: in GEMM 1, with loads and shared stores
# both under "if kt + 1 < nk", the compiler moved the loads down next to the stores (after the math,
# ~10 instructions before their use); GEMM 2 formed h' ~20 instructions after its loads. Now the next
# tile's loads are first read ~1000 (GEMM 1) / ~300 (GEMM 2, where ptxas schedules the load block into
# the middle of the math) instructions later. Not yet measured; the same tile without such stalls ran at
# ~60% of fp32 peak in problem 29 (TIRx), ~1.3 ms of GEMM here, so ~1.4-1.5 ms at best with the stats
# kernel and epilogues (~1.1x torch.compile). TF32 / 3xTF32 are excluded by the tolerance.
# Host path: three compiled modules cached per (pixels per image), their jit() result cached (call path
# ~us), workspaces (h, partials, nx) cached per shape; per call only the output is allocated and three
# kernels are launched on torch's current stream. No synchronization, no per-call compile.
#
# Verification: the previous version passed on the H200; this one is compile-checked on CPU (sm_90a) and
# emulated on CPU (smoke size: max error 9.4e-7 vs allowance 2.7e-6; 3 images of 14 x 14, dim 64 / inner
# 256 with row and column tails: 1.1e-6 vs 4.3e-6); H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

THREADS = 256
BM = 128
BN = 128
BK = 16
PAD = BM + 4                   # shared row (k-major) length
FLUSH = 4                      # k tiles per partial (64 k values)
GRN_EPS = 1e-6
INV_SQRT2 = 1.0 / math.sqrt(2.0)
S_THREADS = 256
S_WARPS = S_THREADS // 32


def nslot_for(hw):
    return BM // hw + 2            # images a 128-row tile can touch


def make_gemm(mode, hw):
    """mode 'gelu_stats': C = gelu(A @ B^T + bias), AUX0 = partial sums [tiles * NSLOT, N / 4, 4];
    mode 'grn': A' = AUX1 * (A * AUX0[row // hw]) + AUX2 + A, C = A' @ B^T + bias."""
    NSLOT = nslot_for(hw)

    @T.prim_func
    def gemm(a_handle: T.handle, b_handle: T.handle, bias_handle: T.handle, c_handle: T.handle,
             x0_handle: T.handle, x1_handle: T.handle, x2_handle: T.handle):
        m = T.int32()
        n = T.int32()
        k4 = T.int32()
        n4 = T.int32()
        p0 = T.int32()
        p1 = T.int32()
        q1 = T.int32()
        q2 = T.int32()
        A = T.match_buffer(a_handle, (m, k4, 4), "float32", align=16)
        B = T.match_buffer(b_handle, (n, k4, 4), "float32", align=16)
        BIAS = T.match_buffer(bias_handle, (n,), "float32")
        C = T.match_buffer(c_handle, (m, n4, 4), "float32", align=16)
        AUX0 = T.match_buffer(x0_handle, (p0, p1, 4), "float32", align=16)
        AUX1 = T.match_buffer(x1_handle, (q1, 4), "float32", align=16)
        AUX2 = T.match_buffer(x2_handle, (q2, 4), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx, by = T.cta_id([T.ceildiv(n, BN), T.ceildiv(m, BM)])
        tid = T.thread_id([THREADS])

        As = T.alloc_shared((2, BK, PAD), "float32")
        Bs = T.alloc_shared((2, BK, PAD), "float32")
        red = T.alloc_shared((16, BN), "float32")
        acc = T.alloc_local((64,), "float32")
        tot = T.alloc_local((64,), "float32")
        ra = T.alloc_local((8,), "float32")
        rb = T.alloc_local((8,), "float32")
        av = T.alloc_local((8,), "float32")
        bv = T.alloc_local((8,), "float32")
        gx = T.alloc_local((12,), "float32")
        nxv = T.alloc_local((8,), "float32")
        y = T.alloc_local((8,), "float32")
        ps = T.alloc_local((8,), "float32")

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        m0: T.let[T.int32] = by * BM
        n0: T.let[T.int32] = bx * BN
        nk: T.let[T.int32] = (k4 * 4) // BK
        lrow0: T.let[T.int32] = tid // 4
        lk: T.let[T.int32] = (tid % 4) * 4

        for i in T.unroll(64):
            acc[i] = T.float32(0.0)
            tot[i] = T.float32(0.0)

        # ---- tile 0 -> registers -> buffer 0 ----
        for u in T.unroll(2):
            for i in T.vectorized(4):
                ra[u * 4 + i] = A[T.min(m0 + lrow0 + u * 64, m - 1), lk // 4, i]
            for i in T.vectorized(4):
                rb[u * 4 + i] = B[T.min(n0 + lrow0 + u * 64, n - 1), lk // 4, i]
            if mode == "grn":
                for i in T.vectorized(4):
                    gx[i] = AUX0[T.min(m0 + lrow0 + u * 64, m - 1) // hw, lk // 4, i]
                for i in T.vectorized(4):
                    gx[4 + i] = AUX1[lk // 4, i]
                for i in T.vectorized(4):
                    gx[8 + i] = AUX2[lk // 4, i]
                for i in T.unroll(4):
                    ra[u * 4 + i] = gx[4 + i] * (ra[u * 4 + i] * gx[i]) + gx[8 + i] + ra[u * 4 + i]
        for u in T.unroll(2):
            for i in T.unroll(4):
                As[0, lk + i, lrow0 + u * 64] = ra[u * 4 + i]
                Bs[0, lk + i, lrow0 + u * 64] = rb[u * 4 + i]
        T.cuda.cta_sync()

        for kt in range(nk):
            # next tile: raw global loads in their own block before the math; the transform and the shared
            # store after the math are unconditional (on the last tile they write stale values into the
            # buffer nobody reads again). With loads and stores both under "if kt + 1 < nk" the compiler
            # moved the loads down to the stores, after the math, and every tile waited for DRAM/L2.
            kq: T.let[T.int32] = T.min(((kt + 1) * BK + lk) // 4, k4 - 1)
            if kt + 1 < nk:
                for u in T.unroll(2):
                    for i in T.vectorized(4):
                        ra[u * 4 + i] = A[T.min(m0 + lrow0 + u * 64, m - 1), kq, i]
                    for i in T.vectorized(4):
                        rb[u * 4 + i] = B[T.min(n0 + lrow0 + u * 64, n - 1), kq, i]
                    if mode == "grn":
                        for i in T.vectorized(4):
                            nxv[u * 4 + i] = AUX0[T.min(m0 + lrow0 + u * 64, m - 1) // hw, kq, i]
            cur: T.let[T.int32] = kt % 2
            for k in T.unroll(BK):
                for h in T.unroll(2):
                    for i in T.vectorized(4):
                        av[h * 4 + i] = As[cur, k, h * 64 + ty * 4 + i]
                    for i in T.vectorized(4):
                        bv[h * 4 + i] = Bs[cur, k, h * 64 + tx * 4 + i]
                for a in T.unroll(8):
                    for b in T.unroll(8):
                        acc[a * 8 + b] = acc[a * 8 + b] + av[a] * bv[b]
            # the GRN transform of A only now, after the math, then the store into the other buffer
            if mode == "grn":
                for i in T.vectorized(4):
                    gx[4 + i] = AUX1[kq, i]
                for i in T.vectorized(4):
                    gx[8 + i] = AUX2[kq, i]
                for u in T.unroll(2):
                    for i in T.unroll(4):
                        ra[u * 4 + i] = gx[4 + i] * (ra[u * 4 + i] * nxv[u * 4 + i]) + gx[8 + i] + ra[u * 4 + i]
            for u in T.unroll(2):
                for i in T.unroll(4):
                    As[1 - cur, lk + i, lrow0 + u * 64] = ra[u * 4 + i]
                    Bs[1 - cur, lk + i, lrow0 + u * 64] = rb[u * 4 + i]
            T.cuda.cta_sync()
            if kt % FLUSH == FLUSH - 1:
                for i in T.unroll(64):
                    tot[i] = tot[i] + acc[i]
                    acc[i] = T.float32(0.0)

        for i in T.unroll(64):
            tot[i] = tot[i] + acc[i]

        # ---- epilogue: bias (+ GELU), float4 stores; tot[] then holds the stored values ----
        for hb in T.unroll(2):
            col: T.let[T.int32] = n0 + hb * 64 + tx * 4
            for j in T.unroll(4):
                y[j] = BIAS[T.min(col + j, n - 1)]
            for a in T.unroll(8):
                row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                for j in T.unroll(4):
                    y[4 + j] = tot[a * 8 + hb * 4 + j] + y[j]
                    if mode == "gelu_stats":
                        y[4 + j] = T.float32(0.5) * y[4 + j] * (T.float32(1.0) + T.erf(y[4 + j] * T.float32(INV_SQRT2)))
                    tot[a * 8 + hb * 4 + j] = y[4 + j]
                if row < m and col < n:
                    for j in T.vectorized(4):
                        C[row, col // 4, j] = y[4 + j]

        if mode == "gelu_stats":
            # per image slot s (image m0 // hw + s): column sums of h^2 over this tile's rows of that image,
            # over the 16 threads of a column through shared memory, written to AUX0[by, s, col]
            for s in T.unroll(NSLOT):
                for c in T.unroll(8):
                    ps[c] = T.float32(0.0)
                for a in T.unroll(8):
                    row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                    if row < m and row // hw - m0 // hw == s:
                        for c in T.unroll(8):
                            ps[c] = ps[c] + tot[a * 8 + c] * tot[a * 8 + c]
                for c in T.unroll(8):
                    red[ty, (c // 4) * 64 + tx * 4 + c % 4] = ps[c]
                T.cuda.cta_sync()
                if tid < BN:
                    ps[0] = red[0, tid]
                    for t in T.unroll(15):
                        ps[0] = ps[0] + red[t + 1, tid]
                    if n0 + tid < n:
                        AUX0[by * NSLOT + s, (n0 + tid) // 4, (n0 + tid) % 4] = ps[0]
                T.cuda.cta_sync()

    return gemm


def make_stats(hw):
    NSLOT = nslot_for(hw)

    @T.prim_func
    def stats(p_handle: T.handle, nx_handle: T.handle):
        tiles = T.int32()
        nimg = T.int32()
        n = T.int32()
        P = T.match_buffer(p_handle, (tiles, NSLOT, n), "float32")
        NX = T.match_buffer(nx_handle, (nimg, n), "float32")

        T.device_entry()
        im = T.cta_id([nimg])
        tid = T.thread_id([S_THREADS])
        warp = T.warp_id([S_WARPS])
        lane = T.lane_id([32])
        red = T.alloc_shared((S_WARPS,), "float32")
        acc = T.alloc_local((1,), "float32")
        g2 = T.alloc_local((1,), "float32")
        gv = T.alloc_local((1,), "float32")
        den = T.alloc_local((2,), "float32")

        t0: T.let[T.int32] = (im * hw) // BM
        t1: T.let[T.int32] = ((im + 1) * hw - 1) // BM
        acc[0] = T.float32(0.0)
        for k in range(T.ceildiv(n, S_THREADS)):
            if k * S_THREADS + tid < n:
                g2[0] = T.float32(0.0)
                for t in range(t1 - t0 + 1):
                    g2[0] = g2[0] + P[t0 + t, im - ((t0 + t) * BM) // hw, k * S_THREADS + tid]
                T.ptx.sqrt.rn.f32(gv[0], g2[0])
                NX[im, k * S_THREADS + tid] = gv[0]
                acc[0] = acc[0] + gv[0]
        for s in T.unroll(5):
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
        if lane == 0:
            red[warp] = acc[0]
        T.cuda.cta_sync()
        acc[0] = red[0]
        for w in T.unroll(S_WARPS - 1):
            acc[0] = acc[0] + red[w + 1]
        T.ptx.div.rn.f32(den[0], acc[0], T.cast(n, "float32"))
        den[1] = den[0] + T.float32(GRN_EPS)
        for k in range(T.ceildiv(n, S_THREADS)):
            if k * S_THREADS + tid < n:
                T.ptx.div.rn.f32(gv[0], NX[im, k * S_THREADS + tid], den[1])
                NX[im, k * S_THREADS + tid] = gv[0]

    return stats


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}
_WORKSPACE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; for an already runnable module jit() re-walks the import tree on
    # every call (tens of us of Python). Caching its result keeps the call path at about a microsecond.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else
        pass
    return exe


def _compiled(hw):
    exes = _CACHE.get(hw)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (make_gemm("gelu_stats", hw), make_stats(hw), make_gemm("grn", hw))
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[hw] = exes
    return exes


def solve(x, w1, b1, grn_gamma, grn_beta, w2, b2):
    nimg, hh, ww, dim = x.shape
    inner = w1.shape[0]
    hw = hh * ww
    assert dim % BK == 0 and inner % BK == 0
    g1, st, g2 = _compiled(hw)
    rows = nimg * hw
    x2 = x.contiguous().view(rows, dim // 4, 4)
    out = torch.empty((nimg, hh, ww, dim), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    key = (x.device, nimg, hw, dim, inner)
    ws = _WORKSPACE.get(key)
    if ws is None:
        tiles = (rows + BM - 1) // BM
        ws = (torch.empty((rows, inner // 4, 4), dtype=torch.float32, device=x.device),        # h
              torch.empty((tiles, nslot_for(hw), inner), dtype=torch.float32, device=x.device),  # GRN partials
              torch.empty((nimg, inner), dtype=torch.float32, device=x.device))                # nx
        _WORKSPACE[key] = ws
    h, part, nx = ws
    b1c = b1.contiguous()
    g1(x2, w1.contiguous().view(inner, dim // 4, 4), b1c, h, part.view(-1, inner // 4, 4), b1c.view(-1, 4), b1c.view(-1, 4))
    st(part, nx)
    g2(h, w2.contiguous().view(dim, inner // 4, 4), b2.contiguous(), out.view(rows, dim // 4, 4),
       nx.view(nimg, inner // 4, 4), grn_gamma.contiguous().view(-1, 4), grn_beta.contiguous().view(-1, 4))
    return out
