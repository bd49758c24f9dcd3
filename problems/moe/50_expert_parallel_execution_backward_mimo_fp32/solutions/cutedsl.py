"""Backward of the grouped SwiGLU experts on one EP rank (MiMo-V2-Flash: 8 local experts, hidden 4096,
intermediate 2048, N = 8192 rows grouped by expert, fp32 throughout) in CuTe DSL: one SIMT fp32 GEMM
template instantiated six times plus two small kernels, launched back to back by one compiled host
function.

Why SIMT: all arithmetic must be fp32-accurate (no TF32), so every product is an fp32 FMA.
Why it is expected to be slower than eager PyTorch: eager runs the same 1.24 TFLOP as cuBLAS fp32
GEMMs (~50 TFLOP/s on the H200); this hand-written SIMT GEMM (128 x 128 x 16 tiles, register
double buffering, no cp.async ring) is expected to reach ~35-45 TFLOP/s. The obvious next steps
(cp.async multi-stage smem pipeline, 2 CTAs/SM via 8 x 4 micro-tiles) are not taken yet.

Schedule kernel (1 CTA): row offsets of the experts (scan of tokens_per_expert) and the list of
128-row tiles of every expert (tiles never straddle experts).
GEMM template C = A @ B^T (A as (M, K), B as (N, K)); each operand is read either K-major (thread t
loads 8 consecutive k of tile row t/2, stored transposed in shared memory) or M/N-major (thread t
loads 8 consecutive m of k-row t/16, stored as is), with an optional on-the-fly transform: 'swiglu'
(a = silu(h_g) * h_u from the recomputed h), 'pgy' (p[row] * dy[row, :]). CTA tile 128 x 128 x 16,
256 threads, 8 x 8 outputs per thread (two 128-bit shared loads of A and of B feed 64 FMAs per
k), one k-tile of global loads in flight in registers, two shared buffers, one barrier per
k-tile; blocked (two-level) accumulation over 64-deep k-blocks. Grouping: 'rows' mode = one CTA
per (n-tile, expert row tile) with the expert's weights; 'wgrad' mode = one CTA per (n-tile,
m-tile, expert) reducing over the expert's rows (K = its row count, predicated).
  G1  h  = x @ W13[e]^T                         rows,  A K-major, B K-major          -> h [N, 4096]
  G2  <dy, o> partials, o = a @ W2[e]^T         rows,  A = swiglu(h), B K-major      -> P [N, 32]
  G3  da = (p dy) @ W2[e]; dh = [da u silu'(g) | da silu(g)]
                                                rows,  A = pgy K-major, B N-major    -> dh [N, 4096]
  G4  dW2[e]  = (p dy)^T @ a                    wgrad, A = pgy M-major, B = swiglu N-major
  G5  dW13[e] = dh^T @ x                        wgrad, A, B M/N-major
  G6  dx = dh @ W13[e]                          rows,  A K-major, B N-major
  grad_routing_probs = sum of the 32 partials of each row (fixed order: deterministic).
Experts without rows get zero weight gradients (their K range is empty).
What limits it: fp32 FMA throughput (1.24 TFLOP: 18.5 ms at the 67 TFLOP/s peak); expected ~28-35 ms.
Host path: compiled once per (hidden, intermediate, experts) with tvm-ffi (symbolic row count);
workspaces cached per (device, N); torch tensors passed directly on the caller's current stream.
Verification: compile-checked on CPU (sm_90a); on the H200 (2026-11-30 sweep) it stopped at the argument
check (see the fix below), so no kernel of it has run on the GPU yet.
Fix 2026-11-30 after the H200 sweep (runtime_error at the first correctness draw, before any kernel ran):
the compiled signature requires unit-stride routing_probs, but make_inputs passes a stride-8 column view
([N, 8] Dirichlet sample, column 0) at every size; solve() now passes compact copies (.contiguous()).
Review 2026-11-29 (no GPU): fixed out-of-bounds global reads in the operand loads (column not clamped for
masked-off lanes: smoke-size tiles of 128 over 32/64-wide operands read up to 384 B past the allocation).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

BM, BN, BK = 128, 128, 16
THREADS = 256
LDS = BM + 4
CHUNK_TILES = 4
SCHED_THREADS = 32


def _make_gemm(mode: str, a_major: str, a_x: str, b_major: str, b_x: str, epi: str, inter: int):
    """mode 'rows' | 'wgrad'; *_major 'k' | 'mn'; *_x 'none' | 'swiglu' | 'pgy';
    epi 'store' | 'dot' | 'dh'."""

    @cute.jit
    def _load8(src: cute.Tensor, xf: cutlass.Constexpr, mH: cute.Tensor, mP: cute.Tensor, r: Int32, c: Int32,
               ok: cutlass.Boolean, dst: cute.Tensor):
        # 8 consecutive elements (r, c..c+7) of a 2-D source (or transform) into dst; zeros if not ok
        nr = src.shape[0]
        rc = cutlass.max(cutlass.min(r, nr - 1), Int32(0))
        # column clamped too (only matters when not ok, e.g. a 128-wide tile over a 32-wide operand):
        # never read past the row / the allocation; the values are zeroed below anyway
        if cutlass.const_expr(xf == "swiglu"):
            cs = cutlass.max(cutlass.min(c, inter - 8), Int32(0))
            rg = cute.make_rmem_tensor((8,), Float32)
            ru = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.zipped_divide(mH[rc, None], (8,))[(None, cs // 8)], rg)
            cute.autovec_copy(cute.zipped_divide(mH[rc, None], (8,))[(None, (inter + cs) // 8)], ru)
            for j in cutlass.range_constexpr(8):
                g = rg[j]
                dst[j] = g / (1.0 + cute.math.exp(-g)) * ru[j]
        else:
            cc = cutlass.max(cutlass.min(c, src.shape[1] - 8), Int32(0))
            cute.autovec_copy(cute.zipped_divide(src[rc, None], (8,))[(None, cc // 8)], dst)
            if cutlass.const_expr(xf == "pgy"):
                p = mP[rc]
                for j in cutlass.range_constexpr(8):
                    dst[j] = p * dst[j]
        if cutlass.not_(ok):
            dst.fill(0.0)

    @cute.kernel
    def _gemm(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mH: cute.Tensor, mP: cute.Tensor,
              mGY: cute.Tensor, mOff: cute.Tensor, mSched: cute.Tensor, mMeta: cute.Tensor, mPart: cute.Tensor,
              M: Int32, N: Int32, K: Int32):
        # A / B: 2-D activations or 3-D expert weights [E, rows, cols]; C: 2-D (rows) or 3-D (wgrad)
        tidx, _, _ = cute.arch.thread_idx()
        pid_n, pid_y, pid_z = cute.arch.block_idx()
        tx = tidx % 16
        ty = tidx // 16
        active = True
        e = Int32(0)
        m0 = Int32(0)
        m_end = M
        k0 = Int32(0)
        k_end = K
        if cutlass.const_expr(mode == "rows"):
            active = pid_y < mMeta[0]
        if active:
            if cutlass.const_expr(mode == "rows"):
                tl = mSched[pid_y]
                e = tl // 65536
                m0 = mOff[e] + (tl % 65536) * BM
                m_end = mOff[e + 1]
            else:
                e = pid_z
                m0 = pid_y * BM
                k0 = mOff[e]
                k_end = mOff[e + 1]
            n0 = pid_n * BN

            # operand sources (2-D views)
            srcA = mA
            srcB = mB
            if cutlass.const_expr(mode == "rows"):
                srcB = mB[e, None, None]             # the tile's expert weights

            smem = cutlass.utils.SmemAllocator()
            sA = smem.allocate_tensor(Float32, cute.make_layout((2, BK, LDS), stride=(BK * LDS, LDS, 1)),
                                      byte_alignment=16)
            sB = smem.allocate_tensor(Float32, cute.make_layout((2, BK, LDS), stride=(BK * LDS, LDS, 1)),
                                      byte_alignment=16)

            # per-thread load coordinates
            if cutlass.const_expr(a_major == "k"):
                a_i = tidx // 2              # tile row (m)
                a_kk = (tidx % 2) * 8        # k offset
            else:
                a_kk = tidx // 16            # k row
                a_i = (tidx % 16) * 8        # m offset
            if cutlass.const_expr(b_major == "k"):
                b_i = tidx // 2
                b_kk = (tidx % 2) * 8
            else:
                b_kk = tidx // 16
                b_i = (tidx % 16) * 8

            ra = cute.make_rmem_tensor((8,), Float32)
            rb = cute.make_rmem_tensor((8,), Float32)
            acc = cute.make_rmem_tensor((64,), Float32)
            tmp = cute.make_rmem_tensor((64,), Float32)
            acc.fill(0.0)
            tmp.fill(0.0)

            nk = (k_end - k0 + BK - 1) // BK
            for kt in cutlass.range(-1, nk, unroll=1):
                buf = (kt + 2) % 2
                # ---- global loads of k-tile kt + 1 into registers ----
                if kt + 1 < nk:
                    kb = k0 + (kt + 1) * BK
                    if cutlass.const_expr(a_major == "k"):
                        _load8(srcA, a_x, mH, mP, m0 + a_i, kb + a_kk, m0 + a_i < m_end, ra)
                    else:
                        _load8(srcA, a_x, mH, mP, kb + a_kk, m0 + a_i, (kb + a_kk < k_end) & (m0 + a_i < m_end), ra)
                    if cutlass.const_expr(b_major == "k"):
                        _load8(srcB, b_x, mH, mP, n0 + b_i, kb + b_kk, n0 + b_i < N, rb)
                    else:
                        _load8(srcB, b_x, mH, mP, kb + b_kk, n0 + b_i, (kb + b_kk < k_end) & (n0 + b_i < N), rb)
                # ---- math on k-tile kt ----
                if kt >= 0:
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
                    if ((kt + 1) % CHUNK_TILES == 0) | (kt + 1 == nk):
                        acc.store(acc.load() + tmp.load())
                        tmp.fill(0.0)
                # ---- registers -> the other shared buffer ----
                if kt + 1 < nk:
                    nb = 1 - buf
                    if cutlass.const_expr(a_major == "k"):
                        for j in cutlass.range_constexpr(8):
                            sA[nb, a_kk + j, a_i] = ra[j]
                    else:
                        for j in cutlass.range_constexpr(8):
                            sA[nb, a_kk, a_i + j] = ra[j]
                    if cutlass.const_expr(b_major == "k"):
                        for j in cutlass.range_constexpr(8):
                            sB[nb, b_kk + j, b_i] = rb[j]
                    else:
                        for j in cutlass.range_constexpr(8):
                            sB[nb, b_kk, b_i + j] = rb[j]
                cute.arch.barrier()

            # ---- epilogue: thread rows m0 + 64 hi + 4 ty + ii, columns n0 + 64 hj + 4 tx + jj ----
            if cutlass.const_expr(epi == "dot"):
                for hi in cutlass.range_constexpr(2):
                    for ii in cutlass.range_constexpr(4):
                        i = hi * 4 + ii
                        row = m0 + 64 * hi + 4 * ty + ii
                        rc = cutlass.min(row, m_end - 1)
                        d = Float32(0.0)
                        for hj in cutlass.range_constexpr(2):
                            col = n0 + 64 * hj + 4 * tx
                            gy = cute.make_rmem_tensor((4,), Float32)
                            cute.autovec_copy(cute.zipped_divide(mGY[rc, None], (4,))[(None, cutlass.min(col, N - 4) // 4)], gy)
                            for jj in cutlass.range_constexpr(4):
                                d = d + Float32(cutlass.select_(col < N, acc[i * 8 + hj * 4 + jj] * gy[jj], Float32(0.0)))
                        for off in (1, 2, 4, 8):
                            d = d + cute.arch.shuffle_sync_bfly(d, offset=off)
                        if (tx == 0) & (row < m_end):
                            mPart[row, pid_n] = d
            else:
                for hj in cutlass.range_constexpr(2):
                    col = n0 + 64 * hj + 4 * tx
                    for hi in cutlass.range_constexpr(2):
                        for ii in cutlass.range_constexpr(4):
                            i = hi * 4 + ii
                            row = m0 + 64 * hi + 4 * ty + ii
                            if (row < m_end) & (col < N):
                                o = cute.make_rmem_tensor((4,), Float32)
                                for jj in cutlass.range_constexpr(4):
                                    o[jj] = acc[i * 8 + hj * 4 + jj]
                                if cutlass.const_expr(epi == "dh"):
                                    rg = cute.make_rmem_tensor((4,), Float32)
                                    ru = cute.make_rmem_tensor((4,), Float32)
                                    cute.autovec_copy(cute.zipped_divide(mH[row, None], (4,))[(None, col // 4)], rg)
                                    cute.autovec_copy(cute.zipped_divide(mH[row, None], (4,))[(None, (inter + col) // 4)], ru)
                                    og = cute.make_rmem_tensor((4,), Float32)
                                    for jj in cutlass.range_constexpr(4):
                                        g = rg[jj]
                                        u = ru[jj]
                                        sg = 1.0 / (1.0 + cute.math.exp(-g))
                                        og[jj] = o[jj] * u * (sg * (1.0 + g * (1.0 - sg)))
                                        o[jj] = o[jj] * (g * sg)
                                    crow = cute.zipped_divide(mC[row, None], (4,))
                                    cute.autovec_copy(og, crow[(None, col // 4)])
                                    cute.autovec_copy(o, crow[(None, (inter + col) // 4)])
                                elif cutlass.const_expr(mode == "wgrad"):
                                    cute.autovec_copy(o, cute.zipped_divide(mC[e, row, None], (4,))[(None, col // 4)])
                                else:
                                    cute.autovec_copy(o, cute.zipped_divide(mC[row, None], (4,))[(None, col // 4)])

    return _gemm


@cute.kernel
def _sched_kernel(mCnt: cute.Tensor, mOff: cute.Tensor, mSched: cute.Tensor, mMeta: cute.Tensor):
    lane = cute.arch.lane_idx()
    ne = mCnt.shape[0]
    n = Int32(0)
    if lane < ne:
        n = Int32(mCnt[lane])
    incl = n
    for off in (1, 2, 4, 8, 16):
        v = cute.arch.shuffle_sync_up(incl, offset=off)
        if lane >= off:
            incl = incl + v
    nt = (n + BM - 1) // BM
    tincl = nt
    for off in (1, 2, 4, 8, 16):
        v = cute.arch.shuffle_sync_up(tincl, offset=off)
        if lane >= off:
            tincl = tincl + v
    if lane < ne:
        mOff[lane] = incl - n
        for j in cutlass.range(nt):
            mSched[tincl - nt + j] = lane * 65536 + j
    if lane == ne - 1:
        mOff[ne] = incl
        mMeta[0] = tincl


@cute.kernel
def _probs_kernel(mPart: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    r = bidx * 256 + tidx
    if r < mOut.shape[0]:
        s = mPart[r, 0]
        for j in cutlass.range(1, mPart.shape[1]):
            s = s + mPart[r, j]
        mOut[r] = s


def _make(hidden: int, inter: int, experts: int):
    g1 = _make_gemm("rows", "k", "none", "k", "none", "store", inter)
    g2 = _make_gemm("rows", "k", "swiglu", "k", "none", "dot", inter)
    g3 = _make_gemm("rows", "k", "pgy", "mn", "none", "dh", inter)
    g4 = _make_gemm("wgrad", "mn", "pgy", "mn", "swiglu", "store", inter)
    g5 = _make_gemm("wgrad", "mn", "none", "mn", "none", "store", inter)
    g6 = _make_gemm("rows", "k", "none", "mn", "none", "store", inter)
    H, I, E = hidden, inter, experts

    @cute.jit
    def _run(mX: cute.Tensor, mCnt: cute.Tensor, mP: cute.Tensor, mW13: cute.Tensor, mW2: cute.Tensor,
             mGY: cute.Tensor, mGX: cute.Tensor, mGP: cute.Tensor, mGW13: cute.Tensor, mGW2: cute.Tensor,
             mH: cute.Tensor, mDH: cute.Tensor, mPart: cute.Tensor, mOff: cute.Tensor, mSched: cute.Tensor,
             mMeta: cute.Tensor, stream: cuda.CUstream):
        rows = mX.shape[0]
        tiles = mSched.shape[0]
        blk = [THREADS, 1, 1]
        _sched_kernel(mCnt, mOff, mSched, mMeta).launch(grid=[1, 1, 1], block=[SCHED_THREADS, 1, 1], stream=stream)
        g1(mX, mW13, mH, mH, mP, mGY, mOff, mSched, mMeta, mPart, rows, 2 * I, H).launch(
            grid=[(2 * I + BN - 1) // BN, tiles, 1], block=blk, stream=stream)
        g2(mH, mW2, mH, mH, mP, mGY, mOff, mSched, mMeta, mPart, rows, H, I).launch(
            grid=[(H + BN - 1) // BN, tiles, 1], block=blk, stream=stream)
        g3(mGY, mW2, mDH, mH, mP, mGY, mOff, mSched, mMeta, mPart, rows, I, H).launch(
            grid=[(I + BN - 1) // BN, tiles, 1], block=blk, stream=stream)
        g4(mGY, mH, mGW2, mH, mP, mGY, mOff, mSched, mMeta, mPart, H, I, rows).launch(
            grid=[(I + BN - 1) // BN, (H + BM - 1) // BM, E], block=blk, stream=stream)
        g5(mDH, mX, mGW13, mH, mP, mGY, mOff, mSched, mMeta, mPart, 2 * I, H, rows).launch(
            grid=[(H + BN - 1) // BN, (2 * I + BM - 1) // BM, E], block=blk, stream=stream)
        g6(mDH, mW13, mGX, mH, mP, mGY, mOff, mSched, mMeta, mPart, rows, H, 2 * I).launch(
            grid=[(H + BN - 1) // BN, tiles, 1], block=blk, stream=stream)
        _probs_kernel(mPart, mGP).launch(grid=[(rows + 255) // 256, 1, 1], block=[256, 1, 1], stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int, inter: int, experts: int):
    key = (hidden, inter, experts)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % BK == 0 and inter % BK == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows, tiles = cute.sym_int32(), cute.sym_int32()
        H, I, E = hidden, inter, experts
        f = lambda shape, dt=Float32, al=16: make_fake_compact_tensor(  # noqa: E731
            dt, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)), assumed_align=al)
        fn = cute.compile(_make(hidden, inter, experts), f((rows, H)), f((E,), Int64, 8), f((rows,), Float32, 4),
                          f((E, 2 * I, H)), f((E, H, I)), f((rows, H)), f((rows, H)), f((rows,), Float32, 4),
                          f((E, 2 * I, H)), f((E, H, I)), f((rows, 2 * I)), f((rows, 2 * I)),
                          f((rows, (H + BN - 1) // BN), Float32, 4), f((E + 1,), Int32, 4), f((tiles,), Int32, 4),
                          f((1,), Int32, 4), make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def solve(expert_inputs, tokens_per_expert, routing_probs, w_gate_up, w_down, grad_outputs):
    rows, hidden = expert_inputs.shape
    experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    assert experts <= 32
    dev = expert_inputs.device
    gx = torch.empty((rows, hidden), dtype=torch.float32, device=dev)
    gp = torch.empty((rows,), dtype=torch.float32, device=dev)
    gw13 = torch.empty((experts, two_inter, hidden), dtype=torch.float32, device=dev)
    gw2 = torch.empty((experts, hidden, inter), dtype=torch.float32, device=dev)
    key = (str(dev), rows, hidden, inter, experts)
    ws = _WORKSPACE.get(key)
    if ws is None:
        tiles = (rows + BM - 1) // BM + experts
        ws = (torch.empty((rows, two_inter), dtype=torch.float32, device=dev),
              torch.empty((rows, two_inter), dtype=torch.float32, device=dev),
              torch.empty((rows, (hidden + BN - 1) // BN), dtype=torch.float32, device=dev),
              torch.empty((experts + 1,), dtype=torch.int32, device=dev),
              torch.empty((tiles,), dtype=torch.int32, device=dev),
              torch.empty((1,), dtype=torch.int32, device=dev))
        _WORKSPACE[key] = ws
    h, dh, part, off, sched, meta = ws
    # the compiled function assumes compact row-major operands (unit innermost stride); make_inputs hands
    # routing_probs over as a strided column of a [N, 8] Dirichlet sample (stride 8), so it is compacted
    # here (a 32 KiB copy); .contiguous() is a no-op for the operands that already are compact
    _get_compiled(hidden, inter, experts)(expert_inputs.contiguous(), tokens_per_expert.to(torch.int64).contiguous(),
                                          routing_probs.contiguous(), w_gate_up.contiguous(), w_down.contiguous(),
                                          grad_outputs.contiguous(), gx, gp, gw13, gw2, h, dh, part, off, sched, meta)
    return gx, gp, gw13, gw2
