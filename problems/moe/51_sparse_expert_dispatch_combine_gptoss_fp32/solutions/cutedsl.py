"""gpt-oss-20b MoE layer in fp32 (hidden 2880, 32 experts, top-4 with a softmax over the chosen logits, clamped
SwiGLU experts with interleaved gate/up columns and biases) in CuTe DSL: five kernels launched back to back by one
compiled host function, fp32 FMA throughout (the problem requires fp32 arithmetic, no TF32).

Same algorithm as the TIRx solution (which passed on the H200 at 15.40 ms device time):
1. router (one CTA of 256 threads per 32 tokens): logits for 32 tokens x 32 experts from shared tiles (each
   thread 2 tokens x 2 experts, a fresh partial per 32-wide K chunk added to the running sum), + bias; then one
   warp per token, one expert per lane: 4 butterfly arg-max rounds (ties to the lower expert id) pick the top-4,
   the ids are ranked to ascending order, w = softmax over the 4 chosen logits with an accurate exp (Cody-Waite
   reduction, degree-7 polynomial, exact power of two) and IEEE division. Per-CTA expert counts and each
   (token, slot)'s rank among the CTA's tokens of that expert.
2. place: expert offsets, the expert-sorted pair list (token of each pair), each (token, slot)'s list position,
   and the per-expert prefix of 128-row GEMM tiles.
3./4. grouped fp32 SIMT GEMMs over the sorted pairs (CTA tile 128 x 128 x 16, 256 threads, 8 x 8 outputs per
   thread, two shared buffers with the next k tile staged in registers during the FMAs, one barrier per k tile,
   a fresh partial per 64 k values added to the running sum). Each CTA finds its expert by counting tile-prefix
   entries <= its tile index (grid = an upper bound on tiles, idle CTAs exit).
   - gate/up: A = x rows gathered through the pair list (k-major), B = gate_up_proj[e] ([2880, 5760], n-major);
     epilogue h = acc + bias, the thread's 4 consecutive columns are (gate, up, gate, up):
     act = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7) -> act [pairs, 2880].
   - down: A = act (contiguous rows of the expert), B = down_proj[e] ([2880, 2880]), y = acc + bias -> y.
5. combine: out[t] = ((w0 y0 + w1 y1) + w2 y2) + w3 y3 in ascending expert order, 4 columns per thread.
Differences from the TIRx version: each thread moves 8 consecutive floats per operand and k tile (k-major: tile
row tid / 2; n-major: k row tid / 16) instead of two 4-float pieces, and the pipeline is written with a prologue
iteration (k tile -1 only loads). Workspaces are cached per (device, tokens) instead of allocated per call.

Limits: 408 GFLOP on the fp32 FMA pipes (6.1 ms at the 67 TFLOP/s peak). The TIRx build of this design measured
15.40 ms device time (26.5 TFLOP/s useful) vs eager 18.29 ms and torch.compile 23.13 ms; a CuTe DSL build of the
same SIMT GEMM template was 25% slower than its TIRx twin on problem 29, so this version may land near eager.

Host path: compiled once per (hidden, intermediate) with tvm-ffi (symbolic token count); torch tensors passed
directly on the caller's current stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

NUM_EXPERTS = 32
TOP_K = 4
ALPHA = 1.702
LIMIT = 7.0
THREADS = 256
RT = 32                  # router tokens per CTA
RK = 32                  # router K chunk
BM, BN, BK = 128, 128, 16
LDS = BM + 4
CHUNK_TILES = 4
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


@cute.jit
def _exp_acc(x: Float32) -> Float32:
    """exp(x) for x clamped to [-87, 88]: 2^n p(r), r = x - n ln2 (|r| <= ln2 / 2), degree-7 Taylor polynomial."""
    xc = cute.arch.fmin(cute.arch.fmax(x, Float32(-87.0)), Float32(88.0))
    n = cute.math.floor(xc * Float32(LOG2E) + Float32(0.5))
    r = (xc - n * Float32(LN2_HI)) - n * Float32(LN2_LO)
    q = Float32(1.0 / 5040.0)
    q = q * r + Float32(1.0 / 720.0)
    q = q * r + Float32(1.0 / 120.0)
    q = q * r + Float32(1.0 / 24.0)
    q = q * r + Float32(1.0 / 6.0)
    q = q * r + Float32(0.5)
    q = q * r + Float32(1.0)
    q = q * r + Float32(1.0)
    return q * cute.math.exp2(n)


@cute.kernel
def _router_kernel(mX: cute.Tensor, mW: cute.Tensor, mBR: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor,
                   mRank: cute.Tensor, mCnt: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = tidx % 32
    n_tok = mX.shape[0]
    hidden = mX.shape[1]
    t0 = cta * RT

    smem = cutlass.utils.SmemAllocator()
    xs = smem.allocate_tensor(Float32, cute.make_layout((RT, RK + 1), stride=(RK + 1, 1)), byte_alignment=16)
    ws = smem.allocate_tensor(Float32, cute.make_layout((NUM_EXPERTS, RK + 1), stride=(RK + 1, 1)), byte_alignment=16)
    lg = smem.allocate_tensor(Float32, cute.make_layout((RT, NUM_EXPERTS + 1), stride=(NUM_EXPERTS + 1, 1)),
                              byte_alignment=16)
    sel = smem.allocate_tensor(Int32, cute.make_layout((RT, NUM_EXPERTS), stride=(NUM_EXPERTS, 1)), byte_alignment=16)

    tt = tidx // 16            # tokens 2 tt, 2 tt + 1
    te = tidx % 16             # experts te, te + 16
    tot = cute.make_rmem_tensor((4,), Float32)
    acc = cute.make_rmem_tensor((4,), Float32)
    tot.fill(0.0)
    for kc in cutlass.range((hidden + RK - 1) // RK, unroll=1):
        for u in cutlass.range_constexpr(RT * RK // THREADS):
            li = u * THREADS + tidx
            r = li // RK
            c = li % RK
            k = kc * RK + c
            v = mX[cutlass.min(t0 + r, n_tok - 1), cutlass.min(k, hidden - 1)]
            xs[r, c] = Float32(cutlass.select_(k < hidden, v, Float32(0.0)))
        for u in cutlass.range_constexpr(NUM_EXPERTS * RK // THREADS):
            li = u * THREADS + tidx
            r = li // RK
            c = li % RK
            k = kc * RK + c
            v = mW[r, cutlass.min(k, hidden - 1)]
            ws[r, c] = Float32(cutlass.select_(k < hidden, v, Float32(0.0)))
        cute.arch.barrier()
        acc.fill(0.0)
        for k in cutlass.range_constexpr(RK):
            for a in cutlass.range_constexpr(2):
                for b in cutlass.range_constexpr(2):
                    acc[a * 2 + b] = acc[a * 2 + b] + xs[2 * tt + a, k] * ws[te + 16 * b, k]
        tot.store(tot.load() + acc.load())
        cute.arch.barrier()
    for a in cutlass.range_constexpr(2):
        for b in cutlass.range_constexpr(2):
            lg[2 * tt + a, te + 16 * b] = tot[a * 2 + b] + mBR[te + 16 * b]
    for u in cutlass.range_constexpr(RT * NUM_EXPERTS // THREADS):
        li = u * THREADS + tidx
        sel[li // NUM_EXPERTS, li % NUM_EXPERTS] = Int32(0)
    cute.arch.barrier()

    for q in cutlass.range_constexpr(RT // 8):
        tl = warp * (RT // 8) + q
        if t0 + tl < n_tok:                       # warp-uniform
            v = Float32(lg[tl, lane])
            si = []
            sv = []
            for k in cutlass.range_constexpr(TOP_K):
                bv = v
                bi = Int32(lane)
                for s in cutlass.range_constexpr(5):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=16 >> s)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> s)
                    take = (ov > bv) | ((ov == bv) & (oi < bi))
                    bv = Float32(cutlass.select_(take, ov, bv))
                    bi = Int32(cutlass.select_(take, oi, bi))
                si.append(bi)
                sv.append(bv)
                v = Float32(cutlass.select_(bi == lane, Float32(-3.0e38), v))
            ex = [_exp_acc(sv[k] - sv[0]) for k in range(TOP_K)]     # sv[0] is the largest
            den = ((ex[0] + ex[1]) + ex[2]) + ex[3]
            for k in cutlass.range_constexpr(TOP_K):
                if lane == k:
                    cnt = Int32(0)
                    for j in cutlass.range_constexpr(TOP_K):
                        cnt = cnt + Int32(cutlass.select_(si[j] < si[k], Int32(1), Int32(0)))
                    mIds[t0 + tl, cnt] = si[k]
                    mWt[t0 + tl, cnt] = ex[k] / den
                    sel[tl, si[k]] = cnt + 1
    cute.arch.barrier()
    if tidx < NUM_EXPERTS:
        c = Int32(0)
        for tl2 in cutlass.range(RT, unroll=1):
            s = sel[tl2, tidx]
            if s > 0:
                mRank[t0 + tl2, s - 1] = c
                c = c + 1
        mCnt[cta, tidx] = c


@cute.kernel
def _place_kernel(mIds: cute.Tensor, mRank: cute.Tensor, mCnt: cute.Tensor, mLT: cute.Tensor, mPos: cute.Tensor,
                  mOffs: cute.Tensor, mToffs: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    n_tok = mIds.shape[0]
    n_blk = mCnt.shape[0]
    smem = cutlass.utils.SmemAllocator()
    tot = smem.allocate_tensor(Int32, cute.make_layout((NUM_EXPERTS,)), byte_alignment=16)
    base = smem.allocate_tensor(Int32, cute.make_layout((NUM_EXPERTS,)), byte_alignment=16)
    before = Int32(0)
    if tidx < NUM_EXPERTS:
        all_ = Int32(0)
        for c in cutlass.range(n_blk, unroll=1):
            v = mCnt[c, tidx]
            before = before + Int32(cutlass.select_(c < cta, v, Int32(0)))
            all_ = all_ + v
        tot[tidx] = all_
    cute.arch.barrier()
    if tidx < NUM_EXPERTS:
        s = Int32(0)
        st = Int32(0)
        for e in cutlass.range(tidx, unroll=1):
            s = s + tot[e]
            st = st + (tot[e] + BM - 1) // BM
        base[tidx] = s + before
        if cta == 0:
            mOffs[tidx] = s
            mToffs[tidx] = st
            if tidx == NUM_EXPERTS - 1:
                mOffs[NUM_EXPERTS] = s + tot[tidx]
                mToffs[NUM_EXPERTS] = st + (tot[tidx] + BM - 1) // BM
    cute.arch.barrier()
    if tidx < RT * TOP_K:
        t = cta * RT + tidx // TOP_K
        k = tidx % TOP_K
        if t < n_tok:
            p = base[mIds[t, k]] + mRank[t, k]
            mLT[p] = t
            mPos[t, k] = p


def _make_gemm(mode: str):
    """Grouped C[pairs of e, :] = A_rows(e) @ B[e] + bias[e]; B is [E * K, N] (n-major).
    mode 'swiglu': A rows gathered from x through LT, C = act [pairs, N / 2]; 'bias': A rows contiguous, C = y."""

    @cute.kernel
    def _gemm(mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor, mLT: cute.Tensor, mOffs: cute.Tensor,
              mToffs: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        pid_n, pid_y, _ = cute.arch.block_idx()
        K = mA.shape[1]
        N = mBias.shape[1]
        tx = tidx % 16
        ty = tidx // 16
        n0 = pid_n * BN
        e = Int32(0)
        for q in cutlass.range_constexpr(NUM_EXPERTS):
            e = e + Int32(cutlass.select_(mToffs[q + 1] <= pid_y, Int32(1), Int32(0)))
        r0 = Int32(0)
        nvalid = Int32(0)
        if e < NUM_EXPERTS:
            r0 = mOffs[e] + (pid_y - mToffs[e]) * BM
            nvalid = cutlass.min(Int32(BM), mOffs[e + 1] - r0)
        if nvalid > 0:
            smem = cutlass.utils.SmemAllocator()
            sA = smem.allocate_tensor(Float32, cute.make_layout((2, BK, LDS), stride=(BK * LDS, LDS, 1)),
                                      byte_alignment=16)
            sB = smem.allocate_tensor(Float32, cute.make_layout((2, BK, LDS), stride=(BK * LDS, LDS, 1)),
                                      byte_alignment=16)
            a_i = tidx // 2                  # A tile row (k-major loads)
            a_kk = (tidx % 2) * 8
            b_kk = tidx // 16                # B k row (n-major loads)
            b_i = (tidx % 16) * 8
            a_ok = a_i < nvalid
            arow = r0 + cutlass.min(a_i, nvalid - 1)
            if cutlass.const_expr(mode == "swiglu"):
                arow = mLT[arow]
            b_ok_n = n0 + b_i < N
            b_col = cutlass.max(cutlass.min(n0 + b_i, N - 8), Int32(0))
            ra = cute.make_rmem_tensor((8,), Float32)
            rb = cute.make_rmem_tensor((8,), Float32)
            acc = cute.make_rmem_tensor((64,), Float32)
            tmp = cute.make_rmem_tensor((64,), Float32)
            acc.fill(0.0)
            tmp.fill(0.0)

            nk = (K + BK - 1) // BK
            for kt in cutlass.range(-1, nk, unroll=1):
                buf = (kt + 2) % 2
                if kt + 1 < nk:
                    kb = (kt + 1) * BK
                    ka = kb + a_kk
                    cute.autovec_copy(cute.zipped_divide(mA[arow, None], (8,))[
                        (None, cutlass.max(cutlass.min(ka, K - 8), Int32(0)) // 8)], ra)
                    if cutlass.not_(a_ok & (ka < K)):
                        ra.fill(0.0)
                    kr = kb + b_kk
                    cute.autovec_copy(cute.zipped_divide(mB[e * K + cutlass.min(kr, K - 1), None], (8,))[
                        (None, b_col // 8)], rb)
                    if cutlass.not_(b_ok_n & (kr < K)):
                        rb.fill(0.0)
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
                if kt + 1 < nk:
                    nb = 1 - buf
                    for j in cutlass.range_constexpr(8):
                        sA[nb, a_kk + j, a_i] = ra[j]
                    for j in cutlass.range_constexpr(8):
                        sB[nb, b_kk, b_i + j] = rb[j]
                cute.arch.barrier()

            # epilogue: local rows 64 hi + 4 ty + ii, columns n0 + 64 hj + 4 tx + jj
            for hj in cutlass.range_constexpr(2):
                col = n0 + 64 * hj + 4 * tx
                bias = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.zipped_divide(mBias[e, None], (4,))[
                    (None, cutlass.max(cutlass.min(col, N - 4), Int32(0)) // 4)], bias)
                for hi in cutlass.range_constexpr(2):
                    for ii in cutlass.range_constexpr(4):
                        i = hi * 4 + ii
                        rl = 64 * hi + 4 * ty + ii
                        if (rl < nvalid) & (col < N):
                            y = cute.make_rmem_tensor((4,), Float32)
                            for jj in cutlass.range_constexpr(4):
                                y[jj] = acc[i * 8 + hj * 4 + jj] + bias[jj]
                            if cutlass.const_expr(mode == "swiglu"):
                                o = cute.make_rmem_tensor((2,), Float32)
                                for p in cutlass.range_constexpr(2):
                                    g = cute.arch.fmin(y[2 * p], Float32(LIMIT))
                                    u = cute.arch.fmin(cute.arch.fmax(y[2 * p + 1], Float32(-LIMIT)), Float32(LIMIT))
                                    sg = Float32(1.0) / (Float32(1.0) + _exp_acc(Float32(0.0) - Float32(ALPHA) * g))
                                    o[p] = (u + Float32(1.0)) * (g * sg)
                                # act columns col / 2, col / 2 + 1
                                cute.autovec_copy(o, cute.zipped_divide(mC[r0 + rl, None], (2,))[(None, col // 4)])
                            else:
                                cute.autovec_copy(y, cute.zipped_divide(mC[r0 + rl, None], (4,))[(None, col // 4)])

    return _gemm


@cute.kernel
def _combine_kernel(mY: cute.Tensor, mPos: cute.Tensor, mWt: cute.Tensor, mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    t, cb, _ = cute.arch.block_idx()
    h4 = mO.shape[1] // 4
    c = cb * THREADS + tidx
    if c < h4:
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for k in cutlass.range_constexpr(TOP_K):
            yv = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(cute.zipped_divide(mY[mPos[t, k], None], (4,))[(None, c)], yv)
            w = mWt[t, k]
            for i in cutlass.range_constexpr(4):
                acc[i] = acc[i] + yv[i] * w
        cute.autovec_copy(acc, cute.zipped_divide(mO[t, None], (4,))[(None, c)])


def _make():
    g_up = _make_gemm("swiglu")
    g_down = _make_gemm("bias")

    @cute.jit
    def _run(mX: cute.Tensor, mRW: cute.Tensor, mRB: cute.Tensor, mGU: cute.Tensor, mGUB: cute.Tensor,
             mDP: cute.Tensor, mDPB: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor, mRank: cute.Tensor,
             mCnt: cute.Tensor, mLT: cute.Tensor, mPos: cute.Tensor, mOffs: cute.Tensor, mToffs: cute.Tensor,
             mAct: cute.Tensor, mY: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        n_tok = mX.shape[0]
        hidden = mX.shape[1]
        two_inter = mGUB.shape[1]
        n_blk = mCnt.shape[0]
        tiles = mLT.shape[0] // BM + NUM_EXPERTS             # upper bound on the grouped GEMM row tiles
        blk = [THREADS, 1, 1]
        _router_kernel(mX, mRW, mRB, mIds, mWt, mRank, mCnt).launch(grid=[n_blk, 1, 1], block=blk, stream=stream)
        _place_kernel(mIds, mRank, mCnt, mLT, mPos, mOffs, mToffs).launch(grid=[n_blk, 1, 1], block=blk,
                                                                           stream=stream)
        g_up(mX, mGU, mGUB, mLT, mOffs, mToffs, mAct).launch(grid=[(two_inter + BN - 1) // BN, tiles, 1],
                                                            block=blk, stream=stream)
        g_down(mAct, mDP, mDPB, mLT, mOffs, mToffs, mY).launch(grid=[(hidden + BN - 1) // BN, tiles, 1],
                                                              block=blk, stream=stream)
        _combine_kernel(mY, mPos, mWt, mOut).launch(grid=[n_tok, (hidden // 4 + THREADS - 1) // THREADS, 1],
                                                    block=blk, stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int, inter: int):
    key = (hidden, inter)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % 8 == 0 and inter % 8 == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        T_, nb, npair = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        H, I, E = hidden, inter, NUM_EXPERTS
        f = lambda shape, dt=Float32, al=16: make_fake_compact_tensor(  # noqa: E731
            dt, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)), assumed_align=al)
        fn = cute.compile(_make(), f((T_, H)), f((E, H)), f((E,), Float32, 4), f((E * H, 2 * I)), f((E, 2 * I)),
                          f((E * I, H)), f((E, H)), f((T_, TOP_K), Int32, 4), f((T_, TOP_K), Float32, 4),
                          f((T_, TOP_K), Int32, 4), f((nb, E), Int32, 4), f((npair,), Int32, 4),
                          f((T_, TOP_K), Int32, 4), f((E + 1,), Int32, 4), f((E + 1,), Int32, 4), f((npair, I)),
                          f((npair, H)), f((T_, H)), make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def solve(hidden_states, router_weight, router_bias, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias):
    n_tok, hidden = hidden_states.shape
    inter = down_proj.shape[1]
    assert gate_up_proj.shape[0] == NUM_EXPERTS and n_tok > 0
    dev = hidden_states.device
    i32, f32 = torch.int32, torch.float32
    n_blk = (n_tok + RT - 1) // RT
    n_pairs = n_tok * TOP_K
    key = (str(dev), n_tok, hidden, inter)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((n_tok, TOP_K), dtype=i32, device=dev),       # ids
              torch.empty((n_tok, TOP_K), dtype=f32, device=dev),       # weights
              torch.empty((n_tok, TOP_K), dtype=i32, device=dev),       # rank
              torch.empty((n_blk, NUM_EXPERTS), dtype=i32, device=dev),  # per-CTA counts
              torch.empty((n_pairs,), dtype=i32, device=dev),           # pair list (token of each pair)
              torch.empty((n_tok, TOP_K), dtype=i32, device=dev),       # position of each (token, slot)
              torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev),   # expert offsets
              torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev),   # tile prefix
              torch.empty((n_pairs, inter), dtype=f32, device=dev),     # act
              torch.empty((n_pairs, hidden), dtype=f32, device=dev))    # y
        _WORKSPACE[key] = ws
    ids, wt, rank, cnt, lt, pos, offs, toffs, act, y = ws
    out = torch.empty((n_tok, hidden), dtype=f32, device=dev)
    _get_compiled(hidden, inter)(
        hidden_states.contiguous(), router_weight.contiguous(), router_bias.contiguous(),
        gate_up_proj.contiguous().view(NUM_EXPERTS * hidden, 2 * inter), gate_up_proj_bias.contiguous(),
        down_proj.contiguous().view(NUM_EXPERTS * inter, hidden), down_proj_bias.contiguous(),
        ids, wt, rank, cnt, lt, pos, offs, toffs, act, y, out)
    return out
