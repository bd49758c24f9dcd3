"""ERNIE-4.5-21B-A3B MoE layer (hidden 2560, 64 routed SwiGLU experts of intermediate 1536, top-6 chosen by
probability + correction bias, plus a shared SwiGLU of intermediate 3072) in CuTe DSL: seven kernels launched back
to back by one compiled host function. Same decomposition as the TIRx solution (which passed on the H200 at
3.48 ms device time).

1. router (fp32 on CUDA cores, grid T/32 CTAs x 256 threads): logits [32 tokens x 64 experts] from fp32 FMAs on
   shared-memory tiles (x converted from bf16, gate weight fp32; each thread 2 tokens x 4 experts), then per token
   (one warp, 2 experts per lane): softmax (xor-shuffle max / sum), the 6 largest p + bias by 6 warp arg-max
   rounds (ties to the lower id), w = p / max(sum p, 1e-12). Per-CTA expert histogram and each pair's rank among
   the CTA's tokens (walk of a [32 x 64] choice table, one thread per expert).
2. place (grid T/32): expert offsets (exclusive scan of the totals), base of this CTA per expert, and the pairs
   scattered into an expert-sorted list (token, weight); CTA 0 also writes the per-expert prefix of 128-row tiles.
3.-6. bf16 tensor-core GEMMs, one template (warp-level mma.sync m16n8k16, fp32 accumulation; CTA tile 128 x 128,
   K in 32-wide stages through a 4-stage cp.async ring, shared rows padded to 40 bf16 (conflict-free ldmatrix),
   80 KiB of shared memory, 2 CTAs per SM; 8 warps tiled 2 x 4 over a 32 x 32 MMA tile repeated 4 x 4):
   - gate/up: the CTA's 128 B rows are 64 gate rows and the matching 64 up rows; the repeated MMA tile puts gate
     column c and up column c + 64 in the same thread, so the epilogue writes silu(g) * up as bf16 (one rounding
     the reference does not do, ~2^-9 relative, far inside the tolerance). Routed experts: A rows gathered from x
     through the sorted token list inside the operand load; a CTA finds its expert from the tile prefix (grid =
     upper bound on tiles, idle CTAs exit).
   - down: the shared expert stores y to an fp32 accumulator out32 [T, 2560]; the routed experts add w * y into
     it with fp32 atomics (stream order puts the shared store first).
7. convert: out32 -> bf16 output.

Differences from the TIRx kernels: the warps' MMA sub-tiles are the repeated 32 x 32 tiled-MMA layout (rows
16 wm + 32 i, columns 8 wn + 32 j) instead of contiguous 64 x 32 blocks, and the B fragments are loaded with
2-matrix ldmatrix; the routed epilogue uses scalar fp32 atomics where the TIRx kernel used red.global.add.v2.f32.
What limits it: 774 GFLOP of expert GEMMs on warp-level MMA (a fraction of the warpgroup peak) plus the 1.5 GB
weight stream: expected about the TIRx kernels' 3.5 ms, far from the 0.78 ms tensor-core SOL but well ahead of
eager PyTorch (31 ms, fp32 GEMMs per expert) and torch.compile (54 ms).
Host path: compiled once per (hidden, inter, shared inter) with tvm-ffi (symbolic token count); workspaces
allocated per call with torch.empty.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

NUM_EXPERTS = 64
TOP_K = 6
NORM_MIN = 1e-12
THREADS = 256
RT = 32                 # tokens per router CTA
RK = 32                 # router K chunk
BM = 128
BN = 128
BK = 32
LDS = BK + 8            # 80-byte padded shared rows
STAGES = 4
VEC = 8
NEG = -3.0e38


@cute.kernel
def _router_kernel(mX: cute.Tensor, mG: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor,
                   mRank: cute.Tensor, mCnt: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    wid = tidx // 32
    lane = tidx % 32
    ntok = mX.shape[0]
    hidden = mX.shape[1]
    smem = cutlass.utils.SmemAllocator()
    sX = smem.allocate_tensor(Float32, cute.make_layout((RT, RK), stride=(RK + 1, 1)), byte_alignment=16)
    sG = smem.allocate_tensor(Float32, cute.make_layout((NUM_EXPERTS, RK), stride=(RK + 1, 1)), byte_alignment=16)
    sLG = smem.allocate_tensor(Float32, cute.make_layout((RT, NUM_EXPERTS), stride=(NUM_EXPERTS + 1, 1)),
                               byte_alignment=16)
    sSel = smem.allocate_tensor(Int32, cute.make_layout((RT, NUM_EXPERTS), stride=(NUM_EXPERTS, 1)),
                                byte_alignment=16)
    t0 = cta * RT
    tt = tidx // 16                     # tokens 2tt, 2tt+1
    te = tidx % 16                      # experts te, te+16, te+32, te+48
    acc = cute.make_rmem_tensor((8,), Float32)
    acc.fill(0.0)
    for kc in cutlass.range(hidden // RK, unroll=1):
        for u in cutlass.range_constexpr(RT * RK // THREADS):
            i = u * THREADS + tidx
            sX[i // RK, i % RK] = mX[cutlass.min(t0 + i // RK, ntok - 1), kc * RK + i % RK].to(Float32)
        for u in cutlass.range_constexpr(NUM_EXPERTS * RK // THREADS):
            i = u * THREADS + tidx
            sG[i // RK, i % RK] = mG[i // RK, kc * RK + i % RK]
        cute.arch.barrier()
        for k in cutlass.range_constexpr(RK):
            for a in cutlass.range_constexpr(2):
                for b in cutlass.range_constexpr(4):
                    acc[a * 4 + b] = acc[a * 4 + b] + sX[2 * tt + a, k] * sG[te + 16 * b, k]
        cute.arch.barrier()
    for a in cutlass.range_constexpr(2):
        for b in cutlass.range_constexpr(4):
            sLG[2 * tt + a, te + 16 * b] = acc[a * 4 + b]
    for u in cutlass.range_constexpr(RT * NUM_EXPERTS // THREADS):
        i = u * THREADS + tidx
        sSel[i // NUM_EXPERTS, i % NUM_EXPERTS] = Int32(0)
    cute.arch.barrier()

    # per token: softmax, biased top-6, weights (warp w: tokens 4w .. 4w+3)
    for q in cutlass.range(RT // 8, unroll=1):
        tl = wid * (RT // 8) + q
        if t0 + tl < ntok:
            v0 = sLG[tl, lane]
            v1 = sLG[tl, 32 + lane]
            mx = cute.arch.fmax(v0, v1)
            for off in (16, 8, 4, 2, 1):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
            p0 = cute.math.exp(v0 - mx)
            p1 = cute.math.exp(v1 - mx)
            ssum = p0 + p1
            for off in (16, 8, 4, 2, 1):
                ssum = ssum + cute.arch.shuffle_sync_bfly(ssum, offset=off)
            p0 = p0 / ssum
            p1 = p1 / ssum
            b0 = p0 + mBias[lane]
            b1 = p1 + mBias[32 + lane]
            si = []
            sp = []
            for k in cutlass.range_constexpr(TOP_K):
                better = b1 > b0
                bv = Float32(cutlass.select_(better, b1, b0))
                bi = Int32(cutlass.select_(better, 32 + lane, lane))
                for off in (16, 8, 4, 2, 1):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=off)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=off)
                    take = (ov > bv) | ((ov == bv) & (oi < bi))
                    bv = Float32(cutlass.select_(take, ov, bv))
                    bi = Int32(cutlass.select_(take, oi, bi))
                si.append(bi)
                own = Float32(cutlass.select_(bi < 32, p0, p1))
                sp.append(cute.arch.shuffle_sync(own, offset=bi % 32))
                b0 = Float32(cutlass.select_(bi == lane, Float32(NEG), b0))
                b1 = Float32(cutlass.select_(bi == 32 + lane, Float32(NEG), b1))
            tot = sp[0]
            for k in cutlass.range_constexpr(1, TOP_K):
                tot = tot + sp[k]
            tot = cute.arch.fmax(tot, Float32(NORM_MIN))
            for k in cutlass.range_constexpr(TOP_K):
                if lane == k:
                    mIds[t0 + tl, k] = si[k]
                    mWt[t0 + tl, k] = sp[k] / tot
                    sSel[tl, si[k]] = Int32(k + 1)
    cute.arch.barrier()
    if tidx < NUM_EXPERTS:
        cnt = Int32(0)
        for tl2 in cutlass.range(RT, unroll=1):
            v = sSel[tl2, tidx]
            if v > 0:
                mRank[t0 + tl2, v - 1] = cnt
                cnt = cnt + 1
        mCnt[cta, tidx] = cnt


@cute.kernel
def _place_kernel(mIds: cute.Tensor, mWt: cute.Tensor, mRank: cute.Tensor, mCnt: cute.Tensor, mLT: cute.Tensor,
                  mLW: cute.Tensor, mOffs: cute.Tensor, mToffs: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    ntok = mIds.shape[0]
    nblk = mCnt.shape[0]
    smem = cutlass.utils.SmemAllocator()
    sTot = smem.allocate_tensor(Int32, cute.make_layout((NUM_EXPERTS,)), byte_alignment=16)
    sBase = smem.allocate_tensor(Int32, cute.make_layout((NUM_EXPERTS,)), byte_alignment=16)
    before = Int32(0)
    if tidx < NUM_EXPERTS:
        total = Int32(0)
        for c in cutlass.range(nblk, unroll=1):
            v = mCnt[c, tidx]
            before = before + Int32(cutlass.select_(c < cta, v, Int32(0)))
            total = total + v
        sTot[tidx] = total
    cute.arch.barrier()
    if tidx < NUM_EXPERTS:
        off = Int32(0)
        toff = Int32(0)
        for e in cutlass.range(tidx, unroll=1):
            n = sTot[e]
            off = off + n
            toff = toff + (n + BM - 1) // BM
        sBase[tidx] = off + before
        if cta == 0:
            mOffs[tidx] = off
            mToffs[tidx] = toff
            if tidx == NUM_EXPERTS - 1:
                mOffs[NUM_EXPERTS] = off + sTot[tidx]
                mToffs[NUM_EXPERTS] = toff + (sTot[tidx] + BM - 1) // BM
    cute.arch.barrier()
    if tidx < RT * TOP_K:
        t = cta * RT + tidx // TOP_K
        k = tidx % TOP_K
        if t < ntok:
            pos = sBase[mIds[t, k]] + mRank[t, k]
            mLT[pos] = t
            mLW[pos] = mWt[t, k]


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def _make_gemm(kind: str, gather: bool, n_exp: int, n_half: int):
    """kind 'gateup': A [rows, K] (x, gathered for routed experts), B [n_exp, 2 n_half, K] -> silu(g) * u (bf16).
    kind 'down': A [pairs or tokens, K], B [n_exp, n_out, K] -> fp32 out32 (store, or weighted atomic add)."""
    is_gu = kind == "gateup"
    cols_per_cta = BN // 2 if is_gu else BN

    @cute.kernel
    def _gemm(mA: cute.Tensor, mB: cute.Tensor, mLT: cute.Tensor, mLW: cute.Tensor, mOffs: cute.Tensor,
              mToffs: cute.Tensor, mC: cute.Tensor, tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        n_c = mC.shape[0]
        nk = mA.shape[1] // BK

        e = Int32(0)
        row0 = bx * BM
        nvalid = cutlass.min(Int32(BM), n_c - bx * BM)
        if cutlass.const_expr(gather):
            for ee in cutlass.range(n_exp, unroll=1):
                e = e + Int32(cutlass.select_(mToffs[ee + 1] <= bx, Int32(1), Int32(0)))
            ec = cutlass.min(e, Int32(n_exp - 1))
            row0 = mOffs[ec] + (bx - mToffs[ec]) * BM
            nvalid = Int32(cutlass.select_(e < n_exp, cutlass.min(Int32(BM), mOffs[ec + 1] - row0), Int32(0)))
            e = ec
        if nvalid > 0:
            smem = cutlass.utils.SmemAllocator()
            sA = smem.allocate_tensor(BFloat16, cute.make_layout((BM, BK, STAGES), stride=(LDS, 1, BM * LDS)),
                                      byte_alignment=128)
            sB = smem.allocate_tensor(BFloat16, cute.make_layout((BN, BK, STAGES), stride=(LDS, 1, BN * LDS)),
                                      byte_alignment=128)
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                      num_bits_per_copy=128)
            cpr = BK // VEC                                       # 16-byte chunks per stage row (4)
            # source rows of this thread's two A and two B chunks (rows tidx / 4 and tidx / 4 + 64)
            arows = []
            brows = []
            for u in cutlass.range_constexpr(BM * cpr // THREADS):
                r = (u * THREADS + tidx) // cpr
                ar = row0 + cutlass.min(r, nvalid - 1)
                if cutlass.const_expr(is_gu and gather):
                    ar = mLT[ar]
                arows.append(ar)
                if cutlass.const_expr(is_gu):
                    brows.append((r // 64) * n_half + by * 64 + r % 64)
                else:
                    brows.append(by * BN + r)
            c_ld = tidx % cpr

            thr_mma = tiled_mma.get_slice(tidx)
            s2r_a = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16), tiled_mma)
            s2r_b = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=2), BFloat16), tiled_mma)
            thr_a = s2r_a.get_slice(tidx)
            thr_b = s2r_b.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), Float32)
            acc.fill(0.0)
            tCc = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))    # per-thread (row, col)
            acc_mn = _mn_view(acc)

            for s in cutlass.range_constexpr(STAGES - 1):
                if s < nk:
                    for u in cutlass.range_constexpr(BM * cpr // THREADS):
                        r = (u * THREADS + tidx) // cpr
                        cute.copy(g2s, cute.zipped_divide(mA[arows[u], None], (VEC,))[(None, s * cpr + c_ld)],
                                  cute.zipped_divide(sA[r, None, s], (VEC,))[(None, c_ld)])
                        cute.copy(g2s, cute.zipped_divide(mB[e, brows[u], None], (VEC,))[(None, s * cpr + c_ld)],
                                  cute.zipped_divide(sB[r, None, s], (VEC,))[(None, c_ld)])
                cute.arch.cp_async_commit_group()
            for kt in cutlass.range(nk, unroll=1):
                cute.arch.cp_async_wait_group(STAGES - 2)
                cute.arch.barrier()
                nxt = kt + STAGES - 1
                if nxt < nk:
                    ns = nxt % STAGES
                    for u in cutlass.range_constexpr(BM * cpr // THREADS):
                        r = (u * THREADS + tidx) // cpr
                        cute.copy(g2s, cute.zipped_divide(mA[arows[u], None], (VEC,))[(None, nxt * cpr + c_ld)],
                                  cute.zipped_divide(sA[r, None, ns], (VEC,))[(None, c_ld)])
                        cute.copy(g2s, cute.zipped_divide(mB[e, brows[u], None], (VEC,))[(None, nxt * cpr + c_ld)],
                                  cute.zipped_divide(sB[r, None, ns], (VEC,))[(None, c_ld)])
                cute.arch.cp_async_commit_group()
                st = kt % STAGES
                sAs = sA[None, None, st]
                sBs = sB[None, None, st]
                tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sAs))
                tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sBs))
                tCsA = thr_a.partition_S(sAs)
                tCsB = thr_b.partition_S(sBs)
                tCrA_v = thr_a.retile(tCrA)
                tCrB_v = thr_b.retile(tCrB)
                for k in cutlass.range_constexpr(BK // 16):
                    cute.copy(s2r_a, tCsA[None, None, k], tCrA_v[None, None, k])
                    cute.copy(s2r_b, tCsB[None, None, k], tCrB_v[None, None, k])
                    cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            cute.arch.cp_async_wait_group(0)

            nrow = cute.size(acc_mn, mode=[0])
            ncol = cute.size(acc_mn, mode=[1])
            for ri in cutlass.range_constexpr(nrow):
                rl = tCc[ri, 0][0]
                if rl < nvalid:
                    if cutlass.const_expr(is_gu):
                        # columns c < 64 are gate outputs; their up partners sit ncol / 2 columns later
                        for ci in cutlass.range_constexpr(ncol // 2):
                            g = acc_mn[ri, ci]
                            y = g / (Float32(1.0) + cute.math.exp(Float32(0.0) - g)) * acc_mn[ri, ci + ncol // 2]
                            mC[row0 + rl, by * cols_per_cta + tCc[0, ci][1]] = y.to(BFloat16)
                    elif cutlass.const_expr(gather):
                        tok = mLT[row0 + rl]
                        wgt = mLW[row0 + rl]
                        crow = mC[tok, None]
                        for ci in cutlass.range_constexpr(ncol):
                            cute.arch.atomic_add(crow.iterator + (by * BN + tCc[0, ci][1]), wgt * acc_mn[ri, ci])
                    else:
                        for ci in cutlass.range_constexpr(ncol):
                            mC[row0 + rl, by * BN + tCc[0, ci][1]] = acc_mn[ri, ci]

    return _gemm


@cute.kernel
def _convert_kernel(mS: cute.Tensor, mD: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    nch = mS.shape[1] // VEC
    i = b * THREADS + tidx
    if i < mS.shape[0] * nch:
        r = cute.make_rmem_tensor((VEC,), Float32)
        cute.autovec_copy(cute.zipped_divide(mS[i // nch, None], (VEC,))[(None, i % nch)], r)
        o = cute.make_rmem_tensor((VEC,), BFloat16)
        o.store(r.load().to(BFloat16))
        cute.autovec_copy(o, cute.zipped_divide(mD[i // nch, None], (VEC,))[(None, i % nch)])


def _make(hidden: int, inter: int, shared_inter: int):
    s_gu = _make_gemm("gateup", False, 1, shared_inter)
    s_dn = _make_gemm("down", False, 1, shared_inter)
    e_gu = _make_gemm("gateup", True, NUM_EXPERTS, inter)
    e_dn = _make_gemm("down", True, NUM_EXPERTS, inter)

    @cute.jit
    def _run(mX: cute.Tensor, mG: cute.Tensor, mBias: cute.Tensor, mEGU: cute.Tensor, mEDN: cute.Tensor,
             mSGU: cute.Tensor, mSDN: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor, mRank: cute.Tensor,
             mCnt: cute.Tensor, mLT: cute.Tensor, mLW: cute.Tensor, mOffs: cute.Tensor, mToffs: cute.Tensor,
             mASh: cute.Tensor, mAEx: cute.Tensor, mO32: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (2, 4, 1))
        ntok = mX.shape[0]
        nblk = mCnt.shape[0]
        npair = mLT.shape[0]
        m_tiles = (ntok + BM - 1) // BM
        e_tiles = npair // BM + NUM_EXPERTS                  # upper bound on the routed GEMM tiles
        _router_kernel(mX, mG, mBias, mIds, mWt, mRank, mCnt).launch(
            grid=[nblk, 1, 1], block=[THREADS, 1, 1], stream=stream)
        _place_kernel(mIds, mWt, mRank, mCnt, mLT, mLW, mOffs, mToffs).launch(
            grid=[nblk, 1, 1], block=[THREADS, 1, 1], stream=stream)
        s_gu(mX, mSGU, mLT, mLW, mOffs, mToffs, mASh, tiled_mma).launch(
            grid=[m_tiles, shared_inter // (BN // 2), 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100)
        s_dn(mASh, mSDN, mLT, mLW, mOffs, mToffs, mO32, tiled_mma).launch(
            grid=[m_tiles, hidden // BN, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100)
        e_gu(mX, mEGU, mLT, mLW, mOffs, mToffs, mAEx, tiled_mma).launch(
            grid=[e_tiles, inter // (BN // 2), 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100)
        e_dn(mAEx, mEDN, mLT, mLW, mOffs, mToffs, mO32, tiled_mma).launch(
            grid=[e_tiles, hidden // BN, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100)
        _convert_kernel(mO32, mO).launch(
            grid=[(ntok * (hidden // VEC) + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return _run


_COMPILED = {}


def _get_compiled(hidden: int, inter: int, shared_inter: int):
    key = (hidden, inter, shared_inter)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % BN == 0 and inter % 64 == 0 and shared_inter % 64 == 0 and hidden % RK == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        ntok, nblk, npair = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        rm = lambda n: tuple(range(n - 1, -1, -1))  # noqa: E731
        fake = lambda dt, shape, al=16: make_fake_compact_tensor(dt, shape, stride_order=rm(len(shape)),  # noqa: E731
                                                                 assumed_align=al)
        H, I, S = hidden, inter, shared_inter
        x = fake(BFloat16, (ntok, H))
        g = fake(Float32, (NUM_EXPERTS, H))
        bias = fake(Float32, (NUM_EXPERTS,), 4)
        egu = fake(BFloat16, (NUM_EXPERTS, 2 * I, H))
        edn = fake(BFloat16, (NUM_EXPERTS, H, I))
        sgu = fake(BFloat16, (1, 2 * S, H))
        sdn = fake(BFloat16, (1, H, S))
        ids, rank = fake(Int32, (ntok, TOP_K), 4), fake(Int32, (ntok, TOP_K), 4)
        wt = fake(Float32, (ntok, TOP_K), 4)
        cnt = fake(Int32, (nblk, NUM_EXPERTS), 4)
        lt, lw = fake(Int32, (npair,), 4), fake(Float32, (npair,), 4)
        offs, toffs = fake(Int32, (NUM_EXPERTS + 1,), 4), fake(Int32, (NUM_EXPERTS + 1,), 4)
        a_sh = fake(BFloat16, (ntok, S))
        a_ex = fake(BFloat16, (npair, I))
        o32 = fake(Float32, (ntok, H))
        o = fake(BFloat16, (ntok, H))
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make(hidden, inter, shared_inter), x, g, bias, egu, edn, sgu, sdn, ids, wt, rank, cnt, lt,
                          lw, offs, toffs, a_sh, a_ex, o32, o, stream, options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def solve(hidden_states, gate_weight, e_score_correction_bias, experts_gate_up, experts_down, shared_gate_up,
          shared_down):
    n_tok, hidden = hidden_states.shape
    inter = experts_down.shape[2]
    shared_inter = shared_down.shape[1]
    dev = hidden_states.device
    out = torch.empty((n_tok, hidden), dtype=hidden_states.dtype, device=dev)
    if n_tok == 0:
        return out
    fn = _get_compiled(hidden, inter, shared_inter)
    n_blk = (n_tok + RT - 1) // RT
    n_pairs = n_tok * TOP_K
    i32, f32, bf16 = torch.int32, torch.float32, torch.bfloat16
    ids = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    wt = torch.empty((n_tok, TOP_K), dtype=f32, device=dev)
    rank = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    cnt = torch.empty((n_blk, NUM_EXPERTS), dtype=i32, device=dev)
    lt = torch.empty((n_pairs,), dtype=i32, device=dev)
    lw = torch.empty((n_pairs,), dtype=f32, device=dev)
    offs = torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev)
    toffs = torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev)
    a_sh = torch.empty((n_tok, shared_inter), dtype=bf16, device=dev)
    a_ex = torch.empty((n_pairs, inter), dtype=bf16, device=dev)
    out32 = torch.empty((n_tok, hidden), dtype=f32, device=dev)
    fn(hidden_states.contiguous(), gate_weight.to(f32).contiguous(), e_score_correction_bias.to(f32).contiguous(),
       experts_gate_up.contiguous(), experts_down.contiguous(),
       shared_gate_up.contiguous().view(1, 2 * shared_inter, hidden),
       shared_down.contiguous().view(1, hidden, shared_inter), ids, wt, rank, cnt, lt, lw, offs, toffs, a_sh, a_ex,
       out32, out)
    return out
