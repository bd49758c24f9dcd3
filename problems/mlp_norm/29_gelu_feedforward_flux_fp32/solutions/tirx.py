# FLUX.1 feed-forward in fp32 (Linear 3072 -> 12288 + tanh GELU, Linear 12288 -> 3072) over 4096 image tokens:
# two fp32 FMA (SIMT) GEMMs in TIRx.
#
# GEMM template (both GEMMs; C = A @ B^T with A [M, K] and B [N, K], K contiguous):
# - CTA tile 128 x 128, 256 threads, each thread an 8 x 8 block of outputs (rows 4ty..+3 and 64+4ty..+3,
#   columns 4tx..+3 and 64+4tx..+3: the two halves keep the float4 shared-memory reads conflict-free).
# - K in tiles of 16: the next tile is loaded global -> registers (float4) while the current one is computed
#   from shared memory, then stored k-major (transposed) into the other of two shared buffers; one
#   __syncthreads per tile. Per k step a thread issues 4 float4 shared loads for 64 FMAs.
# - Two-level accumulation: a fresh 8 x 8 partial per 64 k values, added into the running sums (no single
#   fp32 accumulator runs over the whole 3072 / 12288-long reduction).
# - GEMM 1 epilogue: h = gelu_tanh(acc + b_in), with tanh from an accurate expm1 (polynomial near 0, accurate
#   exp elsewhere; TVM builds with --use_fast_math, whose tanh/exp approximations cost several ulp) and div.rn.
#   h [4096, 12288] fp32 goes to global memory (201 MB written and re-read, ~85 us).
# - GEMM 2 epilogue: out = acc + b_out.
# Edge tiles: rows / columns past M / N are clamped on load and masked on store; a K tail (K a multiple of 4
# but not of 16, only at other sizes) zero-fills the missing float4s. Operands are viewed as [rows, K/4, 4]
# so that TVM can prove the float4 alignment with symbolic sizes.
#
# Limits: 619 GFLOP on the fp32 FMA pipes (67 TFLOP/s peak): ~9.2 ms at peak, expected ~12-14 ms (about
# 65-75% of peak for this register-blocked SIMT GEMM). Eager PyTorch runs cuBLAS SGEMM (fp32 FMA as well,
# tuned to ~80-85% of peak) plus a GELU pass, so this is expected to be around eager speed, possibly ~10-20%
# slower. The obvious next step, an error-compensated tensor-core split (3xTF32, which this problem's
# statement allows), was not attempted in this session.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules; the intermediate h is allocated per call.

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
GELU_C = math.sqrt(2.0 / math.pi)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


def make_sgemm(mode):
    """C[M, N] = A[M, K] @ B[N, K]^T + bias[N]; mode 'gelu' applies gelu_tanh."""

    @T.prim_func
    def sgemm(a_handle: T.handle, b_handle: T.handle, bias_handle: T.handle, c_handle: T.handle):
        m = T.int32()
        n = T.int32()
        k4 = T.int32()             # K / 4 (operands are viewed as [rows, K / 4, 4] so float4 accesses are provably aligned)
        n4 = T.int32()             # N / 4
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
        y = T.alloc_local((8,), "float32")
        e = T.alloc_local((6,), "float32")

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        m0: T.let[T.int32] = by * BM
        n0: T.let[T.int32] = bx * BN
        k_dim: T.let[T.int32] = k4 * 4
        nk: T.let[T.int32] = T.ceildiv(k_dim, BK)
        # loader: float4 f = u * 256 + tid of a 128 x 16 tile -> row f // 4, k 4 * (f % 4)
        lrow0: T.let[T.int32] = tid // 4
        lk: T.let[T.int32] = (tid % 4) * 4

        for i in T.unroll(64):
            acc[i] = T.float32(0.0)
            tot[i] = T.float32(0.0)

        # ---- tile 0 -> registers -> buffer 0 ----
        for u in T.unroll(2):
            if BK <= k_dim:
                for i in T.vectorized(4):
                    ra[u * 4 + i] = A[T.min(m0 + lrow0 + u * 64, m - 1), lk // 4, i]
                for i in T.vectorized(4):
                    rb[u * 4 + i] = B[T.min(n0 + lrow0 + u * 64, n - 1), lk // 4, i]
            else:
                for i in T.vectorized(4):
                    ra[u * 4 + i] = A[T.min(m0 + lrow0 + u * 64, m - 1), T.min(lk // 4, k4 - 1), i]
                for i in T.vectorized(4):
                    rb[u * 4 + i] = B[T.min(n0 + lrow0 + u * 64, n - 1), T.min(lk // 4, k4 - 1), i]
                for i in T.unroll(4):
                    ra[u * 4 + i] = T.if_then_else(lk < k_dim, ra[u * 4 + i], T.float32(0.0))
                    rb[u * 4 + i] = T.if_then_else(lk < k_dim, rb[u * 4 + i], T.float32(0.0))
        for u in T.unroll(2):
            for i in T.unroll(4):
                As[0, lk + i, lrow0 + u * 64] = ra[u * 4 + i]
                Bs[0, lk + i, lrow0 + u * 64] = rb[u * 4 + i]
        T.cuda.cta_sync()

        for kt in range(nk):
            kn: T.let[T.int32] = (kt + 1) * BK
            if kt + 1 < nk:
                for u in T.unroll(2):
                    if kn + BK <= k_dim:
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[T.min(m0 + lrow0 + u * 64, m - 1), (kn + lk) // 4, i]
                        for i in T.vectorized(4):
                            rb[u * 4 + i] = B[T.min(n0 + lrow0 + u * 64, n - 1), (kn + lk) // 4, i]
                    else:
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[T.min(m0 + lrow0 + u * 64, m - 1), T.min((kn + lk) // 4, k4 - 1), i]
                        for i in T.vectorized(4):
                            rb[u * 4 + i] = B[T.min(n0 + lrow0 + u * 64, n - 1), T.min((kn + lk) // 4, k4 - 1), i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(kn + lk < k_dim, ra[u * 4 + i], T.float32(0.0))
                            rb[u * 4 + i] = T.if_then_else(kn + lk < k_dim, rb[u * 4 + i], T.float32(0.0))
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

        for i in T.unroll(64):
            tot[i] = tot[i] + acc[i]

        # ---- epilogue ----
        for hb in T.unroll(2):
            col: T.let[T.int32] = n0 + hb * 64 + tx * 4
            for j in T.unroll(4):
                y[j] = BIAS[T.min(col + j, n - 1)]
            for a in T.unroll(8):
                row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                for j in T.unroll(4):
                    y[4 + j] = tot[a * 8 + hb * 4 + j] + y[j]
                    if mode == "gelu":
                        # gelu_tanh(v) = 0.5 v (1 + tanh(c (v + 0.044715 v^3))), tanh(|u|) = -m / (2 + m),
                        # m = expm1(-2|u|) (polynomial for |2u| < ln2 / 2, accurate exp - 1 beyond)
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
                        y[4 + j] = T.float32(0.5) * y[4 + j] * (T.float32(1.0) + e[2])
                if row < m and col < n:
                    for j in T.vectorized(4):
                        C[row, col // 4, j] = y[4 + j]

    return sgemm


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
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": make_sgemm(md)}), target=target, tir_pipeline="tirx"))
                     for md in ("gelu", "bias"))
        _CACHE["exes"] = exes
    return exes


def solve(hidden_states, w_in, b_in, w_out, b_out):
    fc1, fc2 = _compiled()
    batch, tokens, hidden = hidden_states.shape
    inner = w_in.shape[0]
    assert hidden % 4 == 0 and inner % 4 == 0
    dev = hidden_states.device
    x = hidden_states.contiguous().view(batch * tokens, hidden)
    h = torch.empty((batch * tokens, inner), dtype=torch.float32, device=dev)
    out = torch.empty((batch, tokens, hidden), dtype=torch.float32, device=dev)
    fc1(x.view(-1, hidden // 4, 4), w_in.contiguous().view(inner, hidden // 4, 4), b_in.contiguous(),
        h.view(-1, inner // 4, 4))
    fc2(h.view(-1, inner // 4, 4), w_out.contiguous().view(hidden, inner // 4, 4), b_out.contiguous(),
        out.view(-1, hidden // 4, 4))
    return out
