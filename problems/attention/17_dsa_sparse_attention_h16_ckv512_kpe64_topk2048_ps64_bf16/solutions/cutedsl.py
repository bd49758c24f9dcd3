"""DeepSeek-V3.2 sparse attention decode (DSA; 16 heads, latent 512 + rope 64, top-2048 slots of a page-size-64
cache) in CuTe DSL: split-KV flash decoding on bf16 tensor cores (warp-level mma.sync m16n8k16, fp32
accumulation), two kernels. Same decomposition as the TIRx solution.

Kernel 1 (partial): grid (4 splits, B requests), 128 threads = 4 warps. Split s owns selection entries
512 s .. 512 s + 511 of its request (16 tiles of 32). The 16 query heads are the 16 rows of the MMA tiles;
all heads share the gathered latent rows.
- cp.async gathers each tile's 32 slots ([ckv | kpe] = 576 bf16 per slot, flat slot id page * 64 + offset;
  thread t copies 18 of the 72 16-byte pieces of entry t/4) into a 2-stage ring of swizzled [32 x 576]
  tiles (tile i+1 in flight while tile i is computed). Q = [q_nope | q_pe] (16 x 576) is staged once.
- QK^T is split over the 576 feature dims: warp p computes the partial 16 x 32 logits over dims
  144 p .. +144 (9 k-steps); the four partials go through shared memory (fp32) and every warp sums them in
  the same fixed order (short mma accumulation chains: the base-2 lse is compared at fp32 precision).
- Online softmax in base 2 (scale * log2 e folded in); unused entries (-1) get -inf. P (bf16) is reused as
  the A operand of O_p += P V[:, 128 p : 128 p + 128] (V = latent part of the same tile, ldmatrix.trans).
- The CTA writes its normalized partial output [16 x 512] fp32 and partial base-2 lse to a cached
  workspace; a split whose first entry is -1 (entries are a prefix) writes nothing and is skipped by the merge.
Kernel 2 (merge): grid (B, 16 heads), 128 threads x 4 dims over the non-empty splits.
Differences from the TIRx version: unused entries are gathered from a clamped valid slot (slot 0) and masked
instead of zero-filled, and the tile loop stops after the last tile whose first entry is used (TIRx walks
all 16 tiles); the merge counts the non-empty splits from the indices instead of testing lse = -inf.
~100 KiB of shared memory per CTA: 2 CTAs per SM, 256 CTAs = one wave.
What limits it: DRAM reads of the gathered slots (128 MB, SOL ~27 us) at low memory parallelism (8 warps per
SM, one tile of prefetch per CTA); the TIRx version of this decomposition took 78 us device time on the H200.
Host path: one tvm-ffi compiled function takes the torch tensors directly; both kernels are launched on the
caller's current torch stream, in order.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

HEADS = 16
CKV = 512
KPE = 64
KD = CKV + KPE                 # 576
PAGE = 64
TOPK = 2048
NSPLIT = 4
SPLIT = TOPK // NSPLIT         # 512 entries per CTA
KT = 32                        # entries per tile
NT = SPLIT // KT               # 16 tiles
THREADS = 128
NWARPS = THREADS // 32
KSTEPS = KD // 16 // NWARPS    # 9 k-steps of the logits per warp
VCOL = CKV // NWARPS           # 128 output columns per warp
CH_CKV = CKV // 8              # 64 pieces of 16 B
CH_ROW = KD // 8               # 72 pieces per entry
CH_THR = CH_ROW * KT // THREADS  # 18 pieces per thread per tile
OUT_VEC = 4
LOG2E = 1.4426950408889634
M_INIT = -1.0e30


@cute.kernel
def _partial_kernel(mQn: cute.Tensor, mQp: cute.Tensor, mC: cute.Tensor, mP: cute.Tensor, mSI: cute.Tensor,
                    mPO: cute.Tensor, mPL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    s, b, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32

    smem = cutlass.utils.SmemAllocator()
    sQ = smem.allocate_tensor(BFloat16, sQ_layout, byte_alignment=1024)
    sK = smem.allocate_tensor(BFloat16, sK_layout, byte_alignment=1024)
    sS = smem.allocate_tensor(Float32, cute.make_layout((HEADS, KT, NWARPS), stride=(KT, 1, HEADS * KT)),
                              byte_alignment=16)

    e0 = s * SPLIT
    # tiles whose first entry is used (unused entries, -1, form the tail of the row)
    ntile = Int32(0)
    for t in cutlass.range_constexpr(NT):
        ntile = ntile + cutlass.select_(mSI[b, e0 + t * KT] >= 0, Int32(1), Int32(0))
    if ntile > 0:
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)
        # Q: 16 rows x 72 pieces = 1152 pieces, 9 per thread
        for it in cutlass.range_constexpr(HEADS * CH_ROW // THREADS):
            cid = tidx + THREADS * it
            qr = cid // CH_ROW
            qc = cid % CH_ROW
            if qc < CH_CKV:
                cute.copy(g2s, cute.zipped_divide(mQn[b, qr, None], (8,))[(None, qc)],
                          cute.zipped_divide(sQ[qr, None], (8,))[(None, qc)])
            else:
                cute.copy(g2s, cute.zipped_divide(mQp[b, qr, None], (8,))[(None, qc - CH_CKV)],
                          cute.zipped_divide(sQ[qr, None], (8,))[(None, qc)])
        _issue_tile(g2s, mC, mP, mSI, sK, b, e0, Int32(0), tidx)
        cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(lane)
        s2r_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                           BFloat16), tiled_mma)
        s2r_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                           BFloat16), tiled_mma)
        s2r_bt = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                                            BFloat16), tiled_mma)
        thr_a = s2r_a.get_slice(lane)
        thr_b = s2r_b.get_slice(lane)
        thr_bt = s2r_bt.get_slice(lane)

        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEADS, VCOL)), Float32)
        acc.fill(0.0)
        acc_mn = _mn_view(acc)
        tScS = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((HEADS, KT))))
        nrow = cute.size(acc_mn.shape[0])          # rows g and g + 8
        row_m = cute.make_rmem_tensor((nrow,), Float32)
        row_l = cute.make_rmem_tensor((nrow,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSsQ = thr_a.partition_S(sQ)
        tSrQ_v = thr_a.retile(tSrQ)
        tSsSw = thr_mma.partition_C(sS[None, None, wid])
        tPsS = [thr_mma.partition_C(sS[None, None, p]) for p in range(NWARPS)]

        for kt in cutlass.range(ntile):
            if kt + 1 < ntile:
                _issue_tile(g2s, mC, mP, mSI, sK, b, e0 + (kt + 1) * KT, (kt + 1) % 2, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            st = kt % 2
            sKst = sK[None, None, st]

            # partial logits of the 16 heads x 32 entries over this warp's 144 feature dims
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKst))
            tSsK = thr_b.partition_S(sKst)
            tSrK_v = thr_b.retile(tSrK)
            sc = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEADS, KT)), Float32)
            sc.fill(0.0)
            for kk in cutlass.range_constexpr(KSTEPS):
                kq = wid * KSTEPS + kk
                cute.copy(s2r_a, tSsQ[None, None, kq], tSrQ_v[None, None, kk])
                cute.copy(s2r_b, tSsK[None, None, kq], tSrK_v[None, None, kk])
                cute.gemm(tiled_mma, sc, tSrQ[None, None, kk], tSrK[None, None, kk], sc)
            cute.autovec_copy(sc, tSsSw)
            cute.arch.barrier()

            # every warp: sum of the four partials in a fixed order, mask, identical online softmax
            pf = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEADS, KT)), Float32)
            cute.autovec_copy(tPsS[0], pf)
            for p in cutlass.range_constexpr(1, NWARPS):
                px = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEADS, KT)), Float32)
                cute.autovec_copy(tPsS[p], px)
                pf.store(pf.load() + px.load())
            pf_mn = _mn_view(pf)
            ebase = e0 + kt * KT
            for q in cutlass.range_constexpr(cute.size(pf_mn.shape[1])):
                ok = mSI[b, ebase + tScS[0, q][1]] >= 0
                for r in cutlass.range_constexpr(nrow):
                    pf_mn[r, q] = cutlass.select_(ok, pf_mn[r, q] * scale_log2, Float32(-math.inf))
            for r in cutlass.range_constexpr(nrow):
                mx = row_m[r]
                for q in cutlass.range_constexpr(cute.size(pf_mn.shape[1])):
                    mx = cute.arch.fmax(mx, pf_mn[r, q])
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
                alpha = cute.math.exp2(row_m[r] - mx, fastmath=True)
                row_m[r] = mx
                ls = Float32(0.0)
                for q in cutlass.range_constexpr(cute.size(pf_mn.shape[1])):
                    pv = cute.math.exp2(pf_mn[r, q] - mx, fastmath=True)
                    pf_mn[r, q] = pv
                    ls = ls + pv
                row_l[r] = row_l[r] * alpha + ls
                for q in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    acc_mn[r, q] = acc_mn[r, q] * alpha

            # O_w += P V[:, 128 w : 128 w + 128]
            rP = cute.make_fragment_like(pf, BFloat16)
            rP.store(pf.load().to(BFloat16))
            pd = cute.logical_divide(rP.layout, (None, None, 2))
            rPa = cute.make_tensor(rP.iterator, cute.make_layout(
                ((pd.shape[0], pd.shape[2][0]), pd.shape[1], pd.shape[2][1]),
                stride=((pd.stride[0], pd.stride[2][0]), pd.stride[1], pd.stride[2][1])))
            sKc = cute.local_tile(sKst, (KT, CKV), (0, 0))
            sVt = cute.composition(sKc, cute.make_layout((CKV, KT), stride=(KT, 1)))
            sVtw = cute.local_tile(sVt, (VCOL, KT), (wid, 0))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVtw))
            tOsVt = thr_bt.partition_S(sVtw)
            tOrVt_v = thr_bt.retile(tOrVt)
            for k in cutlass.range_constexpr(cute.size(tOsVt.shape[2])):
                cute.copy(s2r_bt, tOsVt[None, None, k], tOrVt_v[None, None, k])
                cute.gemm(tiled_mma, acc, rPa[None, None, k], tOrVt[None, None, k], acc)
            cute.arch.barrier()                    # stage st and sS are free again

        # ---- normalized partial output slice and lse
        tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((HEADS, VCOL))))
        for r in cutlass.range_constexpr(nrow):
            lt = row_l[r]
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=2)
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=1)
            inv = Float32(1.0) / lt
            row = tOcO[r, 0][0]
            for q in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                mPO[b, s, row, wid * VCOL + tOcO[0, q][1]] = acc_mn[r, q] * inv
            if wid == 0:
                if lane % 4 == 0:
                    mPL[b, s, row] = row_m[r] + cute.math.log2(lt)


@cute.jit
def _issue_tile(g2s: cute.CopyAtom, mC: cute.Tensor, mP: cute.Tensor, mSI: cute.Tensor, sK: cute.Tensor,
                b: Int32, ebase: Int32, st: Int32, tidx: Int32):
    """cp.async of the [ckv | kpe] rows of entries ebase .. ebase+31 (entry tidx/4, pieces 18*(tidx%4)..+17)
    into stage st; unused entries (-1) read slot 0 and are masked later."""
    r = tidx // 4
    qtr = tidx % 4
    slot = cutlass.max(mSI[b, ebase + r], Int32(0))
    page = slot // PAGE
    off = slot % PAGE
    for e in cutlass.range_constexpr(CH_THR):
        cc = qtr * CH_THR + e
        if cc < CH_CKV:
            cute.copy(g2s, cute.zipped_divide(mC[page, off, None], (8,))[(None, cc)],
                      cute.zipped_divide(sK[r, None, st], (8,))[(None, cc)])
        else:
            cute.copy(g2s, cute.zipped_divide(mP[page, off, None], (8,))[(None, cc - CH_CKV)],
                      cute.zipped_divide(sK[r, None, st], (8,))[(None, cc)])


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.kernel
def _merge_kernel(mSI: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    b, hq, _ = cute.arch.block_idx()
    ns = Int32(0)                                  # non-empty splits (a prefix of the splits)
    for t in cutlass.range_constexpr(NSPLIT):
        ns = ns + cutlass.select_(mSI[b, t * SPLIT] >= 0, Int32(1), Int32(0))
    res = cute.make_rmem_tensor((OUT_VEC,), BFloat16)
    gOut = cute.zipped_divide(mO[b, hq, None], (OUT_VEC,))[(None, tidx)]
    if ns == 0:
        res.fill(0.0)
        cute.autovec_copy(res, gOut)
        if tidx == 0:
            mLSE[b, hq] = Float32(-math.inf)
    else:
        mm = mPL[b, 0, hq]
        for sp in cutlass.range(1, ns, 1):
            mm = cute.arch.fmax(mm, mPL[b, sp, hq])
        tot = Float32(0.0)
        acc = cute.make_rmem_tensor((OUT_VEC,), Float32)
        acc.fill(0.0)
        for sp in cutlass.range(ns):
            w = cute.math.exp2(mPL[b, sp, hq] - mm)
            tot = tot + w
            ra = cute.make_rmem_tensor((OUT_VEC,), Float32)
            cute.autovec_copy(cute.zipped_divide(mPO[b, sp, hq, None], (OUT_VEC,))[(None, tidx)], ra)
            acc.store(acc.load() + ra.load() * w)
        res.store((acc.load() * (1.0 / tot)).to(BFloat16))
        cute.autovec_copy(res, gOut)
        if tidx == 0:
            mLSE[b, hq] = mm + cute.math.log2(tot)


@cute.jit
def _dsa(mQn: cute.Tensor, mQp: cute.Tensor, mC: cute.Tensor, mP: cute.Tensor, mSI: cute.Tensor,
         mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
         stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    sQ_layout = cute.tile_to_shape(atom, (HEADS, KD), (0, 1))
    sK_layout = cute.tile_to_shape(atom, (KT, KD, 2), (0, 1, 2))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1),
                                    permutation_mnk=(16, 16, 16))
    batch = mQn.shape[0]
    _partial_kernel(mQn, mQp, mC, mP, mSI, mPO, mPL, scale_log2, sQ_layout, sK_layout, tiled_mma).launch(
        grid=[NSPLIT, batch, 1], block=[THREADS, 1, 1], stream=stream)
    _merge_kernel(mSI, mPO, mPL, mO, mLSE).launch(grid=[batch, HEADS, 1], block=[CKV // OUT_VEC, 1, 1],
                                                  stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        batch, pages = cute.sym_int32(), cute.sym_int32()
        qn = make_fake_compact_tensor(BFloat16, (batch, HEADS, CKV), stride_order=(2, 1, 0), assumed_align=16)
        qp = make_fake_compact_tensor(BFloat16, (batch, HEADS, KPE), stride_order=(2, 1, 0), assumed_align=16)
        c = make_fake_compact_tensor(BFloat16, (pages, PAGE, CKV), stride_order=(2, 1, 0), assumed_align=16)
        p = make_fake_compact_tensor(BFloat16, (pages, PAGE, KPE), stride_order=(2, 1, 0), assumed_align=16)
        si = make_fake_compact_tensor(Int32, (batch, TOPK), stride_order=(1, 0), assumed_align=4)
        po = make_fake_compact_tensor(Float32, (batch, NSPLIT, HEADS, CKV), stride_order=(3, 2, 1, 0),
                                      assumed_align=16)
        pl = make_fake_compact_tensor(Float32, (batch, NSPLIT, HEADS), stride_order=(2, 1, 0), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (batch, HEADS, CKV), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (batch, HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_dsa, qn, qp, c, p, si, po, pl, o, lse, Float32(1.0), stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _workspace(device, batch):
    key = (str(device), batch)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((batch, NSPLIT, HEADS, CKV), dtype=torch.float32, device=device),
              torch.empty((batch, NSPLIT, HEADS), dtype=torch.float32, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale):
    batch = q_nope.shape[0]
    out = torch.empty((batch, HEADS, CKV), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((batch, HEADS), dtype=torch.float32, device=q_nope.device)
    if batch == 0:
        return out, lse
    po, pl = _workspace(q_nope.device, batch)
    si = sparse_indices if sparse_indices.dtype == torch.int32 else sparse_indices.to(torch.int32)
    _get_compiled()(q_nope.contiguous(), q_pe.contiguous(), ckv_cache.contiguous(), kpe_cache.contiguous(),
                    si.contiguous(), po, pl, out, lse, float(sm_scale) * LOG2E)
    return out, lse
