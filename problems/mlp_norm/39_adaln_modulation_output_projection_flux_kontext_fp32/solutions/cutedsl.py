"""FLUX.1 Kontext final layer in fp32 (AdaLN modulation GEMV, affine-free LayerNorm, (1 + scale) * xhat + shift,
3072 -> 64 output projection) in CuTe DSL: two kernels, fp32 FMA throughout, the same decomposition as the
TIRx solution (which passed on the H200 at 0.359 ms device time).

Why no tensor cores: the allowance is 3x the fp32 reference's own error against fp64, which TF32 products
exceed; every product is an fp32 FMA on the CUDA cores.

Kernel 1 (modulation): grid 2H / 8 CTAs of 256 threads, one warp per output row j of w_mod: 128-bit loads
  of w_mod[j, :] and vec[b, :], silu(v) = v / (1 + exp(-v)) with an accurate exp (Cody-Waite range
  reduction, degree-7 polynomial, exact power of two) and an IEEE divide, per-lane partial sums over
  H / 32 values, butterfly warp sum. Writes s1[b, k] = 1 + scale and shift[b, k].
Kernel 2 (norm + projection): grid ceil(B*T / 64) CTAs of 256 threads, 64 tokens x 64 outputs per CTA.
  Phase 1: warp w computes mean and rstd of tokens 8w..8w+7 in two passes over the row (mean, then the sum
  of squared deviations from a re-read that hits cache), butterfly sums, rstd = 1 / sqrt(var + 1e-6), into
  shared memory.
  Phase 2: K in chunks of 32. The x chunk (64 x 32) and the w_out chunk (64 x 32) are fetched as 128-bit
  loads into registers one chunk ahead, transformed to y = s1 * ((x - mean) * rstd) + shift and stored
  k-major into double-buffered shared tiles (row stride 68 floats; one CTA barrier per chunk); each thread
  accumulates 4 tokens x 4 outputs (two 128-bit shared loads per 16 FMAs). Two-level accumulation: a fresh
  partial per 32-wide chunk is added to the running sum. out = sum + b_out, 128-bit stores.
Differences from the TIRx version: the image index of a token is computed from n_img = s1.shape[0]
  (tokens per image = rows / n_img) instead of a scalar argument; the power of two of the exp is exp2 of
  an integer instead of exponent-bit arithmetic; the divide and sqrt are the DSL's non-fast-math ones.
What limits it: 6.4 GFLOP on the fp32 FMA pipes (~105 us at peak) and the shared-memory bandwidth of the
  4 x 4 register block (8 shared floats per 16 FMAs); x is read from DRAM twice (~84 us of traffic). The
  TIRx version of this decomposition measured 0.359 ms device time, about 3x faster than eager (1.11 ms).
Host path: compiled once per hidden size with tvm-ffi (symbolic token and image counts), torch tensors
passed directly, both kernels on the caller's current torch stream, in order.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

OUT = 64
EPS = 1e-6
THREADS = 256
TM = 64                    # tokens per CTA
KC = 32                    # K chunk
LDY = TM + 4               # shared row stride (floats), also used for the w_out tile (OUT == TM)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


@cute.jit
def _silu(v: Float32) -> Float32:
    """v / (1 + exp(-v)) with an accurate exp (no fast-math intrinsics)."""
    x = cute.arch.fmin(cute.arch.fmax(Float32(0.0) - v, Float32(-87.0)), Float32(88.0))
    n = cute.math.floor(x * Float32(LOG2E) + Float32(0.5))
    r = (x - n * Float32(LN2_HI)) - n * Float32(LN2_LO)
    q = Float32(1.0 / 5040.0)
    q = q * r + Float32(1.0 / 720.0)
    q = q * r + Float32(1.0 / 120.0)
    q = q * r + Float32(1.0 / 24.0)
    q = q * r + Float32(1.0 / 6.0)
    q = q * r + Float32(0.5)
    q = q * r + Float32(1.0)
    q = q * r + Float32(1.0)
    e = q * cute.math.exp2(n)
    return v / (Float32(1.0) + e)


def _make(hidden: int):
    per_lane4 = hidden // 128          # float4 per lane per row
    n_chunks = hidden // KC

    @cute.kernel
    def _modulation(mV: cute.Tensor, mWM: cute.Tensor, mBM: cute.Tensor, mS1: cute.Tensor, mSH: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        n_img = mV.shape[0]
        j = bidx * 8 + warp
        wv = cute.make_rmem_tensor((4,), Float32)
        vv = cute.make_rmem_tensor((4,), Float32)
        for b in cutlass.range(n_img, unroll=1):
            acc = Float32(0.0)
            for it in cutlass.range(per_lane4, unroll=2):
                cute.autovec_copy(cute.zipped_divide(mWM[j, None], (4,))[(None, it * 32 + lane)], wv)
                cute.autovec_copy(cute.zipped_divide(mV[b, None], (4,))[(None, it * 32 + lane)], vv)
                for i in cutlass.range_constexpr(4):
                    acc = acc + _silu(vv[i]) * wv[i]
            acc = cute.arch.warp_reduction(acc, lambda a, c: a + c)
            if lane == 0:
                if j < hidden:
                    mSH[b, j] = acc + mBM[j]
                else:
                    mS1[b, j - hidden] = Float32(1.0) + (acc + mBM[j])

    @cute.kernel
    def _norm_proj(mX: cute.Tensor, mS1: cute.Tensor, mSH: cute.Tensor, mW: cute.Tensor, mBO: cute.Tensor,
                   mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        n_all = mX.shape[0]
        n_tok = n_all // mS1.shape[0]
        t0 = bidx * TM

        smem = cutlass.utils.SmemAllocator()
        ys = smem.allocate_tensor(Float32, cute.make_layout((2, KC, LDY), stride=(KC * LDY, LDY, 1)),
                                  byte_alignment=16)
        ws = smem.allocate_tensor(Float32, cute.make_layout((2, KC, LDY), stride=(KC * LDY, LDY, 1)),
                                  byte_alignment=16)
        mu = smem.allocate_tensor(Float32, cute.make_layout((TM,)), byte_alignment=16)
        rs = smem.allocate_tensor(Float32, cute.make_layout((TM,)), byte_alignment=16)

        # ---- phase 1: mean / rstd of the CTA's tokens (warp w: tokens 8w .. 8w+7) ----
        v4 = cute.make_rmem_tensor((4,), Float32)
        for q in cutlass.range(TM // 8, unroll=1):
            tl = warp * (TM // 8) + q
            tg = cutlass.min(t0 + tl, n_all - 1)
            s = Float32(0.0)
            for it in cutlass.range(per_lane4, unroll=2):
                cute.autovec_copy(cute.zipped_divide(mX[tg, None], (4,))[(None, it * 32 + lane)], v4)
                s = s + ((v4[0] + v4[1]) + (v4[2] + v4[3]))
            s = cute.arch.warp_reduction(s, lambda a, c: a + c)
            mean = s / Float32(hidden)
            d = Float32(0.0)
            for it in cutlass.range(per_lane4, unroll=2):
                cute.autovec_copy(cute.zipped_divide(mX[tg, None], (4,))[(None, it * 32 + lane)], v4)
                e0 = v4[0] - mean
                e1 = v4[1] - mean
                e2 = v4[2] - mean
                e3 = v4[3] - mean
                d = d + ((e0 * e0 + e1 * e1) + (e2 * e2 + e3 * e3))
            d = cute.arch.warp_reduction(d, lambda a, c: a + c)
            var = d / Float32(hidden)
            rstd = Float32(1.0) / cute.math.sqrt(var + Float32(EPS))
            if lane == 0:
                mu[tl] = mean
                rs[tl] = rstd
        cute.arch.barrier()

        # ---- phase 2: projection ----
        # loader: float4 f = u * 256 + tid (u = 0, 1) of a 64 x 32 tile: row f // 8, k 4 * (f % 8)
        # compute: tokens 4ty .. 4ty+3, outputs 4tx .. 4tx+3
        tx = tidx % 16
        ty = tidx // 16
        xa = cute.make_rmem_tensor((8,), Float32)
        wa = cute.make_rmem_tensor((8,), Float32)
        ya = cute.make_rmem_tensor((4,), Float32)
        yb = cute.make_rmem_tensor((4,), Float32)
        part = cute.make_rmem_tensor((16,), Float32)
        tot = cute.make_rmem_tensor((16,), Float32)
        tot.fill(0.0)
        for u in cutlass.range_constexpr(2):
            f = u * THREADS + tidx
            xr = cutlass.min(t0 + f // 8, n_all - 1)
            cute.autovec_copy(cute.zipped_divide(mX[xr, None], (4,))[(None, f % 8)],
                              cute.zipped_divide(xa, (4,))[(None, u)])
            cute.autovec_copy(cute.zipped_divide(mW[f // 8, None], (4,))[(None, f % 8)],
                              cute.zipped_divide(wa, (4,))[(None, u)])

        for c in cutlass.range(n_chunks, unroll=1):
            buf = c % 2
            # transform + store chunk c into buffer c % 2
            for u in cutlass.range_constexpr(2):
                f = u * THREADS + tidx
                r = f // 8
                kb = (f % 8) * 4
                img = cutlass.min(t0 + r, n_all - 1) // n_tok
                cute.autovec_copy(cute.zipped_divide(mS1[img, None], (4,))[(None, c * (KC // 4) + f % 8)], ya)
                cute.autovec_copy(cute.zipped_divide(mSH[img, None], (4,))[(None, c * (KC // 4) + f % 8)], yb)
                m_r = mu[r]
                r_r = rs[r]
                for i in cutlass.range_constexpr(4):
                    ys[buf, kb + i, r] = ya[i] * ((xa[u * 4 + i] - m_r) * r_r) + yb[i]
                    ws[buf, kb + i, r] = wa[u * 4 + i]
            cute.arch.barrier()
            # prefetch chunk c + 1 into registers
            if c + 1 < n_chunks:
                for u in cutlass.range_constexpr(2):
                    f = u * THREADS + tidx
                    xr = cutlass.min(t0 + f // 8, n_all - 1)
                    cute.autovec_copy(cute.zipped_divide(mX[xr, None], (4,))[(None, (c + 1) * (KC // 4) + f % 8)],
                                      cute.zipped_divide(xa, (4,))[(None, u)])
                    cute.autovec_copy(cute.zipped_divide(mW[f // 8, None], (4,))[(None, (c + 1) * (KC // 4) + f % 8)],
                                      cute.zipped_divide(wa, (4,))[(None, u)])
            part.fill(0.0)
            for k in cutlass.range_constexpr(KC):
                cute.autovec_copy(cute.zipped_divide(ys[buf, k, None], (4,))[(None, ty)], ya)
                cute.autovec_copy(cute.zipped_divide(ws[buf, k, None], (4,))[(None, tx)], yb)
                for a in cutlass.range_constexpr(4):
                    for b in cutlass.range_constexpr(4):
                        part[a * 4 + b] = part[a * 4 + b] + ya[a] * yb[b]
            tot.store(tot.load() + part.load())

        bias = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(cute.zipped_divide(mBO, (4,))[(None, tx)], bias)
        for a in cutlass.range_constexpr(4):
            row = t0 + ty * 4 + a
            if row < n_all:
                o = cute.make_rmem_tensor((4,), Float32)
                for b in cutlass.range_constexpr(4):
                    o[b] = tot[a * 4 + b] + bias[b]
                cute.autovec_copy(o, cute.zipped_divide(mO[row, None], (4,))[(None, tx)])

    @cute.jit
    def _run(mX: cute.Tensor, mV: cute.Tensor, mWM: cute.Tensor, mBM: cute.Tensor, mW: cute.Tensor,
             mBO: cute.Tensor, mS1: cute.Tensor, mSH: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        n_all = mX.shape[0]
        _modulation(mV, mWM, mBM, mS1, mSH).launch(grid=[2 * hidden // 8, 1, 1], block=[THREADS, 1, 1],
                                                   stream=stream)
        _norm_proj(mX, mS1, mSH, mW, mBO, mO).launch(grid=[(n_all + TM - 1) // TM, 1, 1], block=[THREADS, 1, 1],
                                                      stream=stream)

    return _run


_COMPILED = {}


def _get_compiled(hidden: int):
    fn = _COMPILED.get(hidden)
    if fn is None:
        assert hidden % 128 == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows, imgs = cute.sym_int32(), cute.sym_int32()
        f = lambda shape: make_fake_compact_tensor(Float32, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),  # noqa: E731
                                                   assumed_align=16)
        fn = cute.compile(_make(hidden), f((rows, hidden)), f((imgs, hidden)), f((2 * hidden, hidden)),
                          f((2 * hidden,)), f((OUT, hidden)), f((OUT,)), f((imgs, hidden)), f((imgs, hidden)),
                          f((rows, OUT)), make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--enable-tvm-ffi")
        _COMPILED[hidden] = fn
    return fn


def solve(x, vec, w_mod, b_mod, w_out, b_out):
    batch, tokens, hidden = x.shape
    _get_compiled(3072)                              # the full-size build, also when called at another size
    fn = _get_compiled(hidden)
    dev = x.device
    s1 = torch.empty((batch, hidden), dtype=torch.float32, device=dev)
    sh = torch.empty((batch, hidden), dtype=torch.float32, device=dev)
    out = torch.empty((batch, tokens, OUT), dtype=torch.float32, device=dev)
    if batch * tokens > 0:
        fn(x.contiguous().view(batch * tokens, hidden), vec.contiguous(), w_mod.contiguous(), b_mod.contiguous(),
           w_out.contiguous(), b_out.contiguous(), s1, sh, out.view(batch * tokens, OUT))
    return out
