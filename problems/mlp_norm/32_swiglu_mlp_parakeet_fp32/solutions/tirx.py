# SwiGLU feed-forward in fp32 at Parakeet geometry (T = 6000 tokens, hidden 1024, intermediate 4096):
# [g | u] = x @ Wgu^T + b_gu; a = silu(g) * u; out = a @ Wd^T + b_d. Two SIMT fp32 GEMM kernels in TIRx.
#
# LIKELY SLOWER THAN EAGER PYTORCH AND torch.compile: every product must be an fp32 FMA (the problem
# statement rules out TF32 and 3xTF32 tensor-core products at this allowance), and eager runs library fp32
# GEMMs at ~62% of the fp32 peak (3.6 ms). The CuTe DSL version of this decomposition took 5.17 ms device
# time (44% of peak); the TIRx version of the same SIMT template reached 61% of peak on problem 29, which
# here would be ~3.7 ms: about eager speed at best.
#
# Same GEMM template as the CuTe DSL solution (C = A @ B^T, both operands K-contiguous):
# - CTA tile 128 x 128, K in tiles of 16, 256 threads; thread (tx, ty) owns the 8 x 8 outputs at rows
#   4ty..+3 and 64+4ty..+3, columns 4tx..+3 and 64+4tx..+3 (the 64-apart halves keep the float4 shared
#   reads conflict-free).
# - The next k-tile goes global -> registers (float4) while the current one is computed, then is stored
#   k-major (transposed, rows padded to 132 floats) into the other of two shared buffers; one barrier per
#   k-tile; per k a thread does 4 float4 shared loads for 64 FMAs.
# - Two-level accumulation: a fresh 8 x 8 partial per 64 k values is added into the running sums.
# Differences from the CuTe solution, and why:
# - The loader moves 4 k for two rows 64 apart per thread (float4 f = u * 256 + tid -> row f // 4), as in
#   the TIRx template that measured 61% of peak on problem 29 (the CuTe 8-k-per-row loader measured 48% on
#   the same problem).
# - The gate moves into GEMM 1's epilogue: CTA column tile bx reads gate rows 64bx..64bx+63 as its left
#   64 B rows and up rows I+64bx..+63 as its right 64, so each thread's left 4 columns and right 4 columns
#   are the gate and up values of the same 4 output columns. The epilogue writes a = silu(g + bg) * (u + bu)
#   [T, 4096] (98 MB instead of the 197 MB pre-activation), each exp/division is done once instead of once
#   per GEMM 2 column tile (8x), and GEMM 2 is a plain GEMM + bias.
# - silu uses an accurate exp (Cody-Waite range reduction, degree-7 polynomial, exact power of two) and a
#   round-to-nearest division, because TVM builds device code with fast math (approximate exp / division).
# Edge tiles: rows past T are clamped on load and masked on store; hidden and intermediate must be
# multiples of 128 and 64 (both sizes of this problem are).
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator (scripts/cuda_emu)
# at smoke size and at a custom size with several tiles and a row tail; H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules per (hidden, intermediate); the activation workspace per
# (device, tokens, intermediate), as in the CuTe solution.

import torch
import tvm
from tvm.script import tirx as T

THREADS = 256
BM = 128
BN = 128
BK = 16
PAD = BM + 4                   # shared row (k-major) length in floats
FLUSH = 4                      # k tiles per partial (64 k values)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


def make_sgemm(mode, k_dim, inter):
    """mode 'swiglu': C[M, inter] = silu(A Bg^T + bg) * (A Bu^T + bu) with B = [Bg; Bu] ([2 * inter, K]);
    mode 'bias': C[M, N] = A B^T + bias."""
    k4 = k_dim // 4
    nk = k_dim // BK
    assert k_dim % BK == 0

    @T.prim_func
    def sgemm(a_handle: T.handle, b_handle: T.handle, bias_handle: T.handle, c_handle: T.handle):
        m = T.int32()
        n = T.int32()                # rows of B
        n4 = T.int32()               # columns of C / 4
        A = T.match_buffer(a_handle, (m, k4, 4), "float32", align=16)
        B = T.match_buffer(b_handle, (n, k4, 4), "float32", align=16)
        BIAS = T.match_buffer(bias_handle, (n,), "float32")
        C = T.match_buffer(c_handle, (m, n4, 4), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx, by = T.cta_id([T.ceildiv(n, BN), T.ceildiv(m, BM)])
        tid = T.thread_id([THREADS])

        As = T.alloc_shared((2, BK, PAD), "float32")
        Bs = T.alloc_shared((2, BK, PAD), "float32")
        acc = T.alloc_local((64,), "float32")
        tot = T.alloc_local((64,), "float32")
        ra = T.alloc_local((8,), "float32")
        rb = T.alloc_local((8,), "float32")
        av = T.alloc_local((8,), "float32")
        bv = T.alloc_local((8,), "float32")
        arow = T.alloc_local((2,), "int32")
        brow = T.alloc_local((2,), "int32")
        y = T.alloc_local((12,), "float32")
        e = T.alloc_local((6,), "float32")

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        m0: T.let[T.int32] = by * BM
        # loader: float4 f = u * 256 + tid of a 128 x 16 tile -> tile row u * 64 + tid // 4, k 4 * (tid % 4)
        lrow0: T.let[T.int32] = tid // 4
        lk: T.let[T.int32] = (tid % 4) * 4

        for u in T.unroll(2):
            arow[u] = T.min(m0 + u * 64 + lrow0, m - 1)
            if mode == "swiglu":
                # left half of the B tile: gate rows 64 bx + r; right half: up rows inter + 64 bx + r
                brow[u] = u * inter + bx * 64 + lrow0
            else:
                brow[u] = T.min(bx * BN + u * 64 + lrow0, n - 1)
        for i in T.unroll(64):
            acc[i] = T.float32(0.0)
            tot[i] = T.float32(0.0)

        # ---- k-tile 0 -> registers -> buffer 0 ----
        for u in T.unroll(2):
            for i in T.vectorized(4):
                ra[u * 4 + i] = A[arow[u], lk // 4, i]
            for i in T.vectorized(4):
                rb[u * 4 + i] = B[brow[u], lk // 4, i]
        for u in T.unroll(2):
            for i in T.unroll(4):
                As[0, lk + i, lrow0 + u * 64] = ra[u * 4 + i]
                Bs[0, lk + i, lrow0 + u * 64] = rb[u * 4 + i]
        T.cuda.cta_sync()

        for kt in range(nk):
            if kt + 1 < nk:
                for u in T.unroll(2):
                    for i in T.vectorized(4):
                        ra[u * 4 + i] = A[arow[u], (kt + 1) * (BK // 4) + lk // 4, i]
                    for i in T.vectorized(4):
                        rb[u * 4 + i] = B[brow[u], (kt + 1) * (BK // 4) + lk // 4, i]
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
            if kt + 1 < nk:
                for u in T.unroll(2):
                    for i in T.unroll(4):
                        As[1 - cur, lk + i, lrow0 + u * 64] = ra[u * 4 + i]
                        Bs[1 - cur, lk + i, lrow0 + u * 64] = rb[u * 4 + i]
            T.cuda.cta_sync()
            if kt % FLUSH == FLUSH - 1:
                for i in T.unroll(64):
                    tot[i] = tot[i] + acc[i]
                    acc[i] = T.float32(0.0)

        if nk % FLUSH != 0:
            for i in T.unroll(64):
                tot[i] = tot[i] + acc[i]

        # ---- epilogue ----
        if mode == "swiglu":
            # thread's column j < 4 of the left half is gate column 64 bx + 4 tx + j, of the right half
            # the up value of the same column
            col: T.let[T.int32] = bx * 64 + tx * 4
            for j in T.unroll(4):
                y[j] = BIAS[col + j]
                y[4 + j] = BIAS[inter + col + j]
            for a in T.unroll(8):
                row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                for j in T.unroll(4):
                    # g = gate pre-activation; silu(g) = g / (1 + exp(-g)) with an accurate exp
                    e[0] = tot[a * 8 + j] + y[j]
                    e[1] = T.min(T.max(T.float32(0.0) - e[0], T.float32(-87.0)), T.float32(88.0))
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
                    e[3] = e[2] * T.reinterpret("float32", T.shift_left(T.cast(e[4], "int32") + 127, 23))
                    T.ptx.div.rn.f32(e[2], e[0], T.float32(1.0) + e[3])
                    y[8 + j] = e[2] * (tot[a * 8 + 4 + j] + y[4 + j])
                if row < m:
                    for j in T.vectorized(4):
                        C[row, bx * 16 + tx, j] = y[8 + j]
        else:
            for hb in T.unroll(2):
                col: T.let[T.int32] = bx * BN + hb * 64 + tx * 4
                for j in T.unroll(4):
                    y[j] = BIAS[T.min(col + j, n - 1)]
                for a in T.unroll(8):
                    row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                    for j in T.unroll(4):
                        y[4 + j] = tot[a * 8 + hb * 4 + j] + y[j]
                    if row < m and col < n:
                        for j in T.vectorized(4):
                            C[row, col // 4, j] = y[4 + j]

    return sgemm


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}
_WORKSPACE = {}


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


def _compiled(hidden=1024, inter=4096):
    key = (hidden, inter)
    exes = _CACHE.get(key)
    if exes is None:
        assert hidden % BN == 0 and inter % 64 == 0 and hidden % BK == 0 and inter % BK == 0
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (make_sgemm("swiglu", hidden, inter), make_sgemm("bias", inter, inter)))
        _CACHE[key] = exes
    return exes


def solve(x, w_gate_up, b_gate_up, w_down, b_down):
    hidden = x.shape[-1]
    inter = w_down.shape[1]
    gemm1, gemm2 = _compiled(hidden, inter)
    x2 = x.reshape(-1, hidden).contiguous()
    ntok = x2.shape[0]
    out = torch.empty_like(x2)
    if ntok > 0:
        key = (str(x.device), ntok, inter)
        act = _WORKSPACE.get(key)
        if act is None:
            act = torch.empty((ntok, inter), dtype=torch.float32, device=x.device)
            _WORKSPACE[key] = act
        gemm1(x2.view(ntok, hidden // 4, 4), w_gate_up.contiguous().view(2 * inter, hidden // 4, 4),
              b_gate_up.contiguous(), act.view(ntok, inter // 4, 4))
        gemm2(act.view(ntok, inter // 4, 4), w_down.contiguous().view(hidden, inter // 4, 4), b_down.contiguous(),
              out.view(ntok, hidden // 4, 4))
    return out.view(x.shape)
