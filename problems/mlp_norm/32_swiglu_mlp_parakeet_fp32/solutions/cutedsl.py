"""SwiGLU feed-forward (x @ Wgu^T + b -> silu(g) * u -> @ Wd^T + b) in fp32 at Parakeet geometry
(T = 6000, hidden 1024, intermediate 4096), in CuTe DSL: two SIMT fp32 GEMM kernels.

Why SIMT: the output is checked against an fp64 evaluation with 3x the fp32 reference's own
error; TF32 (even 3xTF32) tensor-core products exceed it (problem statement), so every product is
an fp32 FMA on the CUDA cores.

GEMM kernel (C = A @ B^T, A [M, K], B [N, K], both K-contiguous):
- CTA tile 128 x 128 x 16, 256 threads (16 x 16); thread (tx, ty) owns the 8 x 8 outputs at rows
  4ty + {0..3}, 64 + 4ty + {0..3} and columns 4tx + {0..3}, 64 + 4tx + {0..3}.
- Global -> registers: thread t loads 8 consecutive k of row t/2 of the A tile and of the B tile
  (two 128-bit loads each), one k-tile ahead of the math (register double buffering); stored
  transposed into shared memory sA[k][m], sB[k][n] (row stride 132 floats), two buffers, one CTA
  barrier per k-tile.
- Math: per k, two 128-bit shared loads of A (4 rows each) and two of B, 64 FMAs.
- Blocked (two-level) accumulation: the 64 products of a 64-deep k-chunk accumulate in a
  temporary that is added to the running sums every 4 k-tiles (a single fp32 accumulator over
  K = 4096 errs ~10x the reference's own error; blocks of 64 ~1.3x, measured in a CPU emulation);
  written as a loop over 4-tile chunks around the tile loop.
- Rows (and columns) past the matrix edge are clamped to the last row on load (not zeroed: they only
  feed outputs that are not stored) and skipped on store.
GEMM 1: h = x @ Wgu^T + b_gu, [T, 8192] fp32 (the intermediate, 197 MB, round trip to DRAM/L2).
GEMM 2: out = a @ Wd^T + b_d where the A-tile loader computes a = silu(g) * u from h on the fly
  (two 128-bit loads of g and of u per 8 elements; silu(g) = g / (1 + exp(-g)) in fp32), applied when
  the tile is stored to shared memory, after the math of the current tile.
What limits it: fp32 FMA throughput (151 GFLOP; 2.25 ms at the 67 TFLOP/s peak) with one 256-thread
CTA per SM (the two-level accumulators need 200-255 registers). H200 (2026-11-30) of the previous
version: 5.17 ms device (5.26 end to end), 0.68x torch.compile (3.57 ms) and 0.69x eager (3.62 ms,
cuBLAS SGEMM ~64% of peak). Its SASS (CPU compile, nvdisasm) showed that every k-tile waited for its
global loads before the math: GEMM 1 zero-filled out-of-range rows with selects ~12 instructions after
the loads, GEMM 2 formed silu(g) * u ~20-35 instructions after them; and the "flush every 4 tiles"
condition compiled to 64 FADD + 72 FSEL on every tile. This version clamps instead of zeroing, forms
silu(g) * u at the shared store and flushes from a chunk loop; next-tile loads are now first read
700-1300 instructions later (GEMM 1: 255 registers, 16 bytes spilled once per chunk; GEMM 2: 208,
none). Not yet measured. It is expected to stay slower than torch.compile: the same SIMT tile reached
~60% of fp32 peak in problem 29 (-> ~3.8 ms here at best), and GEMM 2 still spends ~8 exp + 8 divisions
per thread per k-tile on the gating (recomputed by each of the 8 column CTAs); TF32 and 3xTF32 exceed
the tolerance (problem statement). Next step: write a = silu(g) * u once in GEMM 1's epilogue (gate and
up columns of the same index in one CTA), halving the intermediate and removing the recomputation.
Host path: compiled once per (hidden, intermediate) with tvm-ffi (symbolic token count); the h
workspace is cached per (device, T); torch tensors passed directly on the caller's stream.
Verification: the previous version passed on the H200; this one is compile-checked on CPU (sm_90a), its
index math, silu formula and accumulation order are unchanged; H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

BM, BN, BK = 128, 128, 16
THREADS = 256
PAD = 4
LDS = BM + PAD                    # shared row stride (floats)
CHUNK_TILES = 4                   # k-tiles per accumulation block (64-deep blocks)


def _make_gemm(a_mode: str, inter: int):
    """a_mode: 'plain' (A = mA) or 'swiglu' (A[r, k] = silu(mA[r, k]) * mA[r, inter + k])."""

    @cute.jit
    def _fetch_a(mA: cute.Tensor, row: Int32, k: Int32, rg: cute.Tensor, ru: cute.Tensor):
        # raw operand for A elements (row, k..k+7): plain -> rg = A; swiglu -> rg = g, ru = u. A row past
        # the edge is clamped to the last row (not zeroed): it only feeds outputs the epilogue skips.
        rc = cutlass.max(cutlass.min(row, mA.shape[0] - 1), Int32(0))
        cute.autovec_copy(cute.zipped_divide(mA[rc, None], (8,))[(None, k // 8)], rg)
        if cutlass.const_expr(a_mode == "swiglu"):
            cute.autovec_copy(cute.zipped_divide(mA[rc, None], (8,))[(None, (inter + k) // 8)], ru)

    @cute.jit
    def _form_a(rg: cute.Tensor, ru: cute.Tensor):
        # swiglu: rg <- silu(g) * u, evaluated only when the tile is stored to shared memory (after the
        # math), so the global loads of the next tile overlap the FMAs instead of stalling on them
        if cutlass.const_expr(a_mode == "swiglu"):
            for j in cutlass.range_constexpr(8):
                g = rg[j]
                rg[j] = g / (1.0 + cute.math.exp(-g)) * ru[j]

    @cute.kernel
    def _gemm(mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        pid_n, pid_m, _ = cute.arch.block_idx()
        M = mC.shape[0]
        N = mC.shape[1]
        K = mB.shape[1]
        tx = tidx % 16
        ty = tidx // 16
        m0 = pid_m * BM
        n0 = pid_n * BN

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(Float32, cute.make_layout((2, BK, LDS), stride=(BK * LDS, LDS, 1)), byte_alignment=16)
        sB = smem.allocate_tensor(Float32, cute.make_layout((2, BK, LDS), stride=(BK * LDS, LDS, 1)), byte_alignment=16)

        lr = tidx // 2                  # tile row loaded by this thread
        lk = (tidx % 2) * 8             # first of its 8 k
        a_row = m0 + lr
        b_rc = cutlass.min(n0 + lr, N - 1)      # clamped, not zeroed: feeds only columns the epilogue skips
        ra = cute.make_rmem_tensor((8,), Float32)
        ru = cute.make_rmem_tensor((8,), Float32)
        rb = cute.make_rmem_tensor((8,), Float32)

        acc = cute.make_rmem_tensor((64,), Float32)
        tmp = cute.make_rmem_tensor((64,), Float32)
        acc.fill(0.0)
        tmp.fill(0.0)

        nk = K // BK
        _fetch_a(mA, a_row, lk, ra, ru)
        cute.autovec_copy(cute.zipped_divide(mB[b_rc, None], (8,))[(None, lk // 8)], rb)
        _form_a(ra, ru)
        for j in cutlass.range_constexpr(8):
            sA[0, lk + j, lr] = ra[j]
            sB[0, lk + j, lr] = rb[j]
        cute.arch.barrier()

        # two-level accumulation as a nested loop: tiles of one 64-deep chunk accumulate in tmp, which is
        # added to acc once per chunk (a per-tile conditional flush compiled to 128 selects/adds per tile)
        for kc in cutlass.range((nk + CHUNK_TILES - 1) // CHUNK_TILES, unroll=1):
            for kt in cutlass.range(kc * CHUNK_TILES, cutlass.min(kc * CHUNK_TILES + CHUNK_TILES, nk), unroll=1):
                buf = kt % 2
                if kt + 1 < nk:
                    kn = (kt + 1) * BK + lk
                    _fetch_a(mA, a_row, kn, ra, ru)
                    cute.autovec_copy(cute.zipped_divide(mB[b_rc, None], (8,))[(None, kn // 8)], rb)
                for k in cutlass.range_constexpr(BK):
                    av = cute.make_rmem_tensor((8,), Float32)
                    bv = cute.make_rmem_tensor((8,), Float32)
                    cute.autovec_copy(cute.zipped_divide(sA[buf, k, None], (4,))[(None, ty)],
                                      cute.zipped_divide(av, (4,))[(None, 0)])
                    cute.autovec_copy(cute.zipped_divide(sA[buf, k, None], (4,))[(None, 16 + ty)],
                                      cute.zipped_divide(av, (4,))[(None, 1)])
                    cute.autovec_copy(cute.zipped_divide(sB[buf, k, None], (4,))[(None, tx)],
                                      cute.zipped_divide(bv, (4,))[(None, 0)])
                    cute.autovec_copy(cute.zipped_divide(sB[buf, k, None], (4,))[(None, 16 + tx)],
                                      cute.zipped_divide(bv, (4,))[(None, 1)])
                    for i in cutlass.range_constexpr(8):
                        for j in cutlass.range_constexpr(8):
                            tmp[i * 8 + j] = tmp[i * 8 + j] + av[i] * bv[j]
                if kt + 1 < nk:
                    nb = 1 - buf
                    _form_a(ra, ru)
                    for j in cutlass.range_constexpr(8):
                        sA[nb, lk + j, lr] = ra[j]
                        sB[nb, lk + j, lr] = rb[j]
                cute.arch.barrier()
            acc.store(acc.load() + tmp.load())
            tmp.fill(0.0)

        # epilogue: + bias, 128-bit stores of 4 consecutive columns
        for hj in cutlass.range_constexpr(2):
            col = n0 + 64 * hj + 4 * tx
            if col < N:
                bias = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.zipped_divide(mBias, (4,))[(None, col // 4)], bias)
                for hi in cutlass.range_constexpr(2):
                    for ii in cutlass.range_constexpr(4):
                        i = hi * 4 + ii
                        row = m0 + 64 * hi + 4 * ty + ii
                        if row < M:
                            o = cute.make_rmem_tensor((4,), Float32)
                            for jj in cutlass.range_constexpr(4):
                                o[jj] = acc[i * 8 + hj * 4 + jj] + bias[jj]
                            cute.autovec_copy(o, cute.zipped_divide(mC[row, None], (4,))[(None, col // 4)])

    return _gemm


def _make(hidden: int, inter: int):
    g1 = _make_gemm("plain", inter)
    g2 = _make_gemm("swiglu", inter)

    @cute.jit
    def _run(mX: cute.Tensor, mWgu: cute.Tensor, mBgu: cute.Tensor, mWd: cute.Tensor, mBd: cute.Tensor,
             mH: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        ntok = mX.shape[0]
        g1(mX, mWgu, mBgu, mH).launch(grid=[2 * inter // BN, (ntok + BM - 1) // BM, 1], block=[THREADS, 1, 1],
                                      stream=stream)
        g2(mH, mWd, mBd, mO).launch(grid=[(hidden + BN - 1) // BN, (ntok + BM - 1) // BM, 1],
                                    block=[THREADS, 1, 1], stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int, inter: int):
    key = (hidden, inter)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % BK == 0 and inter % BK == 0 and hidden % 8 == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        ntok = cute.sym_int32()
        f = lambda shape: make_fake_compact_tensor(Float32, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),  # noqa: E731
                                                   assumed_align=16)
        fn = cute.compile(_make(hidden, inter), f((ntok, hidden)), f((2 * inter, hidden)), f((2 * inter,)),
                          f((hidden, inter)), f((hidden,)), f((ntok, 2 * inter)), f((ntok, hidden)),
                          make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def solve(x, w_gate_up, b_gate_up, w_down, b_down):
    hidden = x.shape[-1]
    inter = w_down.shape[1]
    x2 = x.reshape(-1, hidden)
    ntok = x2.shape[0]
    out = torch.empty_like(x2)
    if ntok > 0:
        key = (str(x.device), ntok, inter)
        h = _WORKSPACE.get(key)
        if h is None:
            h = torch.empty((ntok, 2 * inter), dtype=torch.float32, device=x.device)
            _WORKSPACE[key] = h
        _get_compiled(hidden, inter)(x2, w_gate_up, b_gate_up, w_down, b_down, h, out)
    return out.view(x.shape)
