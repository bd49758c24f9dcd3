# Backward of the Step1X-Edit DiT image-stream MLP (hidden 3072, intermediate 12288, tanh GELU) in fp32: four
# fp32 FMA (SIMT) GEMMs and two column-sum kernels in TIRx (no tensor cores: the problem's allowance is 3x the
# fp32 reference's own error, which TF32 products, even 3xTF32, exceed).
#
# GEMM template (C[M, N] = sum_k A(m, k) B(k, n), A given as [M, K] ("mk") or [K, M] ("km"), B as [K, N];
# operands viewed as [rows, cols / 4, 4] so float4 accesses are provably aligned):
# - CTA tile 128 x 128, 256 threads, each thread 8 x 8 outputs (rows 4ty..+3, 64+4ty..+3; columns 4tx..+3,
#   64+4tx..+3); K tiles of 16 held k-major in two shared buffers; the next tile is loaded global -> registers
#   (float4) during the FMAs of the current one ("km" and B tiles are copied as float4, "mk" tiles are
#   transposed on the store); one __syncthreads per tile; 4 float4 shared loads per 64 FMAs.
# - Two-level accumulation: a fresh partial per 64 k values is added to the running sums.
# Kernels (T = 4096 tokens, H = 3072, I = 12288):
# 1. d_act = dout @ w2 (mk x kn, K = H) with epilogue: reads h, t = tanh(c (h + 0.044715 h^3)) (tanh from an
#    accurate expm1 and div.rn; TVM builds with --use_fast_math), stores dh = d_act * gelu'(h) and
#    act = 0.5 h (1 + t), and the CTA's column sums of dh (8 rows per thread, then 16 threads through shared
#    memory) to a [T / 128, I] partial buffer.
# 2. dw2 = dout^T @ act (km x kn, K = T).   3. dw1 = dh^T @ x (km x kn, K = T).   4. dx = dh @ w1 (mk x kn, K = I).
# 5. column sums: db1 from the dh partials, db2 from dout (64-row partial sums, warp per row stripe, then a
#    shared-memory tree).
#
# Limits: 1.24 TFLOP on the fp32 FMA pipes (67 TFLOP/s peak): ~18.5 ms at peak, expected ~25-28 ms. Eager
# PyTorch also runs fp32 cuBLAS SGEMMs (tuned close to the FMA peak) plus ~15 elementwise passes over
# [4096, 12288] fp32 tensors, so this is expected to be near eager speed (within about +-15%): both are bound
# by the same FMA pipes, and this register-blocked SIMT GEMM is somewhat less efficient than cuBLAS while the
# fused epilogues save the elementwise passes.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules; intermediates (dh, act, partials) are allocated per call.

import math

import torch
import tvm
from tvm.script import tirx as T

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
CS_COLS = 32                   # column-sum kernel: columns per CTA
CS_CHUNK = 64                  # rows per partial in the column sums


def make_sgemm(a_layout, mode):
    """C = A @ B with B given as [K, N]. mode 'store': C = acc.
    mode 'dh_act': C (d_act) -> C = d_act * gelu'(H), ACT = gelu(H), PART = column sums over this CTA's rows."""

    @T.prim_func
    def sgemm(a_handle: T.handle, b_handle: T.handle, h_handle: T.handle, c_handle: T.handle, act_handle: T.handle,
              part_handle: T.handle):
        m = T.int32()
        kd = T.int32()             # K
        m4 = T.int32()
        n4 = T.int32()             # N / 4
        k4 = T.int32()
        n_part = T.int32()
        if a_layout == "mk":
            A = T.match_buffer(a_handle, (m, k4, 4), "float32", align=16)
        else:
            A = T.match_buffer(a_handle, (kd, m4, 4), "float32", align=16)
        B = T.match_buffer(b_handle, (kd, n4, 4), "float32", align=16)
        HH = T.match_buffer(h_handle, (m, n4, 4), "float32", align=16)
        C = T.match_buffer(c_handle, (m, n4, 4), "float32", align=16)
        ACT = T.match_buffer(act_handle, (m, n4, 4), "float32", align=16)
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
        k_dim: T.let[T.int32] = kd
        nk: T.let[T.int32] = T.ceildiv(k_dim, BK)
        # loaders. "mk": float4 f = u*256 + tid -> row f // 4 (+64u), k 4 (f % 4); stored transposed.
        #          "km" and B: float4 f = u*256 + tid -> k f // 32 (+8u), column 4 (f % 32); stored as float4.
        rr: T.let[T.int32] = tid // 4
        rk: T.let[T.int32] = (tid % 4) * 4
        ck: T.let[T.int32] = tid // 32
        cc: T.let[T.int32] = (tid % 32) * 4

        for i in T.unroll(64):
            acc[i] = T.float32(0.0)
            tot[i] = T.float32(0.0)

        # ---------------- tile loads: global -> registers (tile kt) ----------------
        for kt in range(nk + 1):
            # iteration kt: load tile kt into registers (if any), compute tile kt - 1, store tile kt
            if kt < nk:
                for u in T.unroll(2):
                    if a_layout == "mk":
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[T.min(m0 + rr + u * 64, m - 1), T.min((kt * BK + rk) // 4, k4 - 1), i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(kt * BK + rk < k_dim, ra[u * 4 + i], T.float32(0.0))
                    else:
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[T.min(kt * BK + ck + u * 8, kd - 1), T.min((m0 + cc) // 4, m4 - 1), i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(kt * BK + ck + u * 8 < k_dim, ra[u * 4 + i], T.float32(0.0))
                    for i in T.vectorized(4):
                        rb[u * 4 + i] = B[T.min(kt * BK + ck + u * 8, kd - 1), T.min((n0 + cc) // 4, n4 - 1), i]
                    for i in T.unroll(4):
                        rb[u * 4 + i] = T.if_then_else(kt * BK + ck + u * 8 < k_dim, rb[u * 4 + i], T.float32(0.0))
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
            for a in T.unroll(8):
                row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                if row < m and col < n:
                    if mode == "dh_act":
                        for j in T.vectorized(4):
                            y[4 + j] = HH[row, col // 4, j]
                        for j in T.unroll(4):
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
                            # act = 0.5 h (1 + t); dgelu = 0.5 (1 + t) + 0.5 h (1 - t^2) c (1 + 3 * 0.044715 h^2)
                            y[8 + j] = T.float32(0.5) * y[4 + j] * (T.float32(1.0) + e[2])
                            y[j] = tot[a * 8 + hb * 4 + j] * (
                                T.float32(0.5) * (T.float32(1.0) + e[2])
                                + T.float32(0.5) * y[4 + j] * (T.float32(1.0) - e[2] * e[2]) * T.float32(GELU_C)
                                * (T.float32(1.0) + T.float32(3.0 * 0.044715) * y[4 + j] * y[4 + j]))
                            cs[hb * 4 + j] = cs[hb * 4 + j] + y[j]
                        for j in T.vectorized(4):
                            C[row, col // 4, j] = y[j]
                        for j in T.vectorized(4):
                            ACT[row, col // 4, j] = y[8 + j]
                    else:
                        for j in T.unroll(4):
                            y[j] = tot[a * 8 + hb * 4 + j]
                        for j in T.vectorized(4):
                            C[row, col // 4, j] = y[j]
        if mode == "dh_act":
            # column sums of dh over this CTA's 128 rows -> PART[by, n0 ..]
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
    # warp w sums rows w, w + 8, ...: 64-row partials (4 interleaved accumulators, loads unrolled so they are
    # all in flight), added into the running sum
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


def _compiled():
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (make_sgemm("mk", "dh_act"), make_sgemm("km", "store"), make_sgemm("mk", "store"), colsum)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE["exes"] = exes
    return exes


def _v4(t):
    return t.view(t.shape[0], t.shape[1] // 4, 4)


def solve(dout, x, h, w1, w2):
    g_dh, g_tn, g_nn, csum = _compiled()
    tokens, hidden = x.shape
    inter = w1.shape[0]
    assert hidden % 4 == 0 and inter % 4 == 0 and tokens > 0
    dev = x.device
    f32 = torch.float32
    dy, xs, hs = dout.contiguous(), x.contiguous(), h.contiguous()
    w1c, w2c = w1.contiguous(), w2.contiguous()
    m_tiles = (tokens + BM - 1) // BM
    dh = torch.empty((tokens, inter), dtype=f32, device=dev)
    act = torch.empty((tokens, inter), dtype=f32, device=dev)
    part = torch.empty((m_tiles, inter), dtype=f32, device=dev)
    dx = torch.empty((tokens, hidden), dtype=f32, device=dev)
    dw1 = torch.empty((inter, hidden), dtype=f32, device=dev)
    db1 = torch.empty((inter,), dtype=f32, device=dev)
    dw2 = torch.empty((hidden, inter), dtype=f32, device=dev)
    db2 = torch.empty((hidden,), dtype=f32, device=dev)
    # 1. dh = (dout @ w2) * gelu'(h), act = gelu(h), column partials of dh
    g_dh(_v4(dy), _v4(w2c), _v4(hs), _v4(dh), _v4(act), part)
    # 2. dw2 = dout^T @ act   3. dw1 = dh^T @ x   4. dx = dh @ w1
    # (the unused h / act / partial operands of the 'store' GEMMs are given the output tensor)
    g_tn(_v4(dy), _v4(act), _v4(dw2), _v4(dw2), _v4(dw2), dw2)
    g_tn(_v4(dh), _v4(xs), _v4(dw1), _v4(dw1), _v4(dw1), dw1)
    g_nn(_v4(dh), _v4(w1c), _v4(dx), _v4(dx), _v4(dx), dx)
    # 5. bias gradients
    csum(part, db1)
    csum(dy, db2)
    return dx, dw1, db1, dw2, db2
