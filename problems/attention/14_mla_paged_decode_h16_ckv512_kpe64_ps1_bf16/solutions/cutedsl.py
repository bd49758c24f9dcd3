"""MLA paged decode (DeepSeek-V3 absorbed form at TP=8: 16 heads, latent 512 + rotary 64, page size 1,
bf16) in CuTe DSL: split-KV flash decoding on tensor cores (warp-level mma.sync m16n8k16), then a merge.

The 16 heads of a request are exactly the 16 rows of an MMA tile; keys are [ckv | kpe] (576 dims) and the
values are the ckv part of the same shared-memory tile (each token's 1152 bytes are gathered once).

Kernel 1 (partial): grid (32 splits, B requests), 128 threads = 4 warps.
- Request b's tokens are cut into chunks of max(256, ceil(len/32)) tokens; CTA (s, b) takes chunk s and
  returns at once when the chunk starts past the end.
- Q = [q_nope | q_pe] (16 x 576 bf16) is staged in shared memory once (cp.async, with block 0); its A
  fragments are re-read with ldmatrix per k-step (36 k-steps would need 144 registers).
- Blocks of 64 tokens: the [ckv | kpe] rows are gathered through the page ids with cp.async (16 B copies;
  thread t copies half of token t/2's 72 chunks) into a 2-stage ring of swizzled [64 x 576] tiles (block
  i+1 in flight while block i is computed). Tokens past the chunk end read a clamped page and are masked.
- Warp w computes the logits of tokens 16w..16w+15 (36 k-steps x 2 n-tiles, 4 interleaved fp32
  accumulators), scaled to base 2 and masked, into a shared fp32 [16 x 64] tile. After a barrier every warp
  reads the whole tile back in the accumulator layout and runs the same online softmax (quad shuffles for
  the row max), so all warps hold identical P and statistics; P (bf16) is reused as the A operand of
  O_w += P V[:, 128w:128w+128] (V = ckv part through ldmatrix.trans): each warp owns a 128-column slice of
  O (64 fp32 registers/thread).
- Each warp writes its normalized O slice and (warp 0) the partial base-2 lse to a workspace.
Kernel 2 (merge): grid (B, 16 heads), 128 threads x 4 elements; LSE = M + log2 sum 2^(lse_s - M);
bf16 output; zero-length requests: 0 and -inf.
What limits it: DRAM bandwidth for the gathered rows (86.6 MB; SOL ~0.019 ms) and page-size-1 gather
latency; one CTA per SM (166 KiB of shared memory) with one block always in flight. Expected ~0.03 ms.
Host path: one tvm-ffi compiled function takes the torch tensors directly; both kernels are launched on
the caller's current torch stream, in order.

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
THREADS = 128
NWARPS = THREADS // 32
BLK = 64                       # tokens per block
WTOK = BLK // NWARPS           # 16 tokens of logits per warp
VCOL = CKV // NWARPS           # 128 output columns per warp
CH_CKV = CKV // 8              # 64 chunks of 16 B
CH_ROW = KD // 8               # 72 chunks per token
CHUNK = 256
SPLITS = 32
OUT_VEC = 4
LOG2E = 1.4426950408889634
M_INIT = -1.0e30
NACC = 4                       # logit accumulators


@cute.kernel
def _partial_kernel(mQn: cute.Tensor, mQp: cute.Tensor, mC: cute.Tensor, mP: cute.Tensor, mIP: cute.Tensor,
                    mIdx: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    s, b, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32

    smem = cutlass.utils.SmemAllocator()
    sQ = smem.allocate_tensor(BFloat16, sQ_layout, byte_alignment=1024)
    sK = smem.allocate_tensor(BFloat16, sK_layout, byte_alignment=1024)
    sS = smem.allocate_tensor(Float32, cute.make_layout((HEADS, BLK), stride=(BLK, 1)), byte_alignment=16)

    start = mIP[b]
    n_tot = mIP[b + 1] - start
    chunk = cutlass.max(Int32(CHUNK), (n_tot + (SPLITS - 1)) // SPLITS)
    c0 = s * chunk
    if c0 < n_tot:
        cn = cutlass.min(chunk, n_tot - c0)
        base = start + c0
        nblk = (cn + BLK - 1) // BLK
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)
        # Q: 16 rows x 72 chunks = 1152 chunks, 9 per thread
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
        _issue_block(g2s, mC, mP, mIdx, sK, base, cn, Int32(0), Int32(0), tidx)
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
        tScS = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((HEADS, WTOK))))
        nrow = cute.size(acc_mn.shape[0])          # rows g and g + 8
        row_m = cute.make_rmem_tensor((nrow,), Float32)
        row_l = cute.make_rmem_tensor((nrow,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSsQ = thr_a.partition_S(sQ)
        tSrQ_v = thr_a.retile(tSrQ)
        sSw = cute.local_tile(sS, (HEADS, WTOK), (0, wid))
        tSsSw = thr_mma.partition_C(sSw)
        tPsS = thr_mma.partition_C(sS)

        for blk in cutlass.range(nblk):
            if blk + 1 < nblk:
                _issue_block(g2s, mC, mP, mIdx, sK, base, cn, blk + 1, (blk + 1) % 2, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            st = blk % 2
            sKst = sK[None, None, st]

            # logits of this warp's 16 tokens
            sKw = cute.local_tile(sKst, (WTOK, KD), (wid, 0))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKw))
            tSsK = thr_b.partition_S(sKw)
            tSrK_v = thr_b.retile(tSrK)
            # 4 interleaved accumulators over the 36 k-steps (shorter fp32 accumulation chains: the base-2
            # lse is compared at fp32 precision)
            scs = []
            for a in cutlass.range_constexpr(NACC):
                t = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEADS, WTOK)), Float32)
                t.fill(0.0)
                scs.append(t)
            for k in cutlass.range_constexpr(cute.size(tSsK.shape[2])):
                cute.copy(s2r_a, tSsQ[None, None, k], tSrQ_v[None, None, k])
                cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, k])
                cute.gemm(tiled_mma, scs[k % NACC], tSrQ[None, None, k], tSrK[None, None, k], scs[k % NACC])
            sc = scs[0]
            sc.store((scs[0].load() + scs[1].load()) + (scs[2].load() + scs[3].load()))
            sc_mn = _mn_view(sc)
            t_base = blk * BLK + wid * WTOK
            for r in cutlass.range_constexpr(nrow):
                for q in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    tok = t_base + tScS[0, q][1]
                    sc_mn[r, q] = cutlass.select_(tok < cn, sc_mn[r, q] * scale_log2, Float32(-math.inf))
            cute.autovec_copy(sc, tSsSw)
            cute.arch.barrier()

            # every warp: the whole 16 x 64 logits tile, identical online softmax
            pf = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEADS, BLK)), Float32)
            cute.autovec_copy(tPsS, pf)
            pf_mn = _mn_view(pf)
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
                    p = cute.math.exp2(pf_mn[r, q] - mx, fastmath=True)
                    pf_mn[r, q] = p
                    ls = ls + p
                row_l[r] = row_l[r] * alpha + ls
                for q in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    acc_mn[r, q] = acc_mn[r, q] * alpha

            rP = cute.make_fragment_like(pf, BFloat16)
            rP.store(pf.load().to(BFloat16))
            pd = cute.logical_divide(rP.layout, (None, None, 2))
            rPa = cute.make_tensor(rP.iterator, cute.make_layout(
                ((pd.shape[0], pd.shape[2][0]), pd.shape[1], pd.shape[2][1]),
                stride=((pd.stride[0], pd.stride[2][0]), pd.stride[1], pd.stride[2][1])))
            sKc = cute.local_tile(sKst, (BLK, CKV), (0, 0))
            sVt = cute.composition(sKc, cute.make_layout((CKV, BLK), stride=(BLK, 1)))
            sVtw = cute.local_tile(sVt, (VCOL, BLK), (wid, 0))
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
def _issue_block(g2s: cute.CopyAtom, mC: cute.Tensor, mP: cute.Tensor, mIdx: cute.Tensor, sK: cute.Tensor,
                 base: Int32, cn: Int32, blk: Int32, st: Int32, tidx: Int32):
    """cp.async of the [ckv | kpe] rows of block blk (token tidx/2, chunks 36*(tidx%2)..+35) into stage st."""
    r = tidx // 2
    half = tidx % 2
    page = mIdx[base + cutlass.min(blk * BLK + r, cn - 1)]
    for e in cutlass.range_constexpr(CH_ROW // 2):
        cc = half * (CH_ROW // 2) + e
        if cc < CH_CKV:
            cute.copy(g2s, cute.zipped_divide(mC[page, 0, None], (8,))[(None, cc)],
                      cute.zipped_divide(sK[r, None, st], (8,))[(None, cc)])
        else:
            cute.copy(g2s, cute.zipped_divide(mP[page, 0, None], (8,))[(None, cc - CH_CKV)],
                      cute.zipped_divide(sK[r, None, st], (8,))[(None, cc)])


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.kernel
def _merge_kernel(mIP: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    b, hq, _ = cute.arch.block_idx()
    n_tot = mIP[b + 1] - mIP[b]
    chunk = cutlass.max(Int32(CHUNK), (n_tot + (SPLITS - 1)) // SPLITS)
    ns = (n_tot + chunk - 1) // chunk
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
def _decode(mQn: cute.Tensor, mQp: cute.Tensor, mC: cute.Tensor, mP: cute.Tensor, mIP: cute.Tensor,
            mIdx: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
            scale_log2: Float32, stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    sQ_layout = cute.tile_to_shape(atom, (HEADS, KD), (0, 1))
    sK_layout = cute.tile_to_shape(atom, (BLK, KD, 2), (0, 1, 2))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1),
                                    permutation_mnk=(16, 16, 16))
    batch = mQn.shape[0]
    _partial_kernel(mQn, mQp, mC, mP, mIP, mIdx, mPO, mPL, scale_log2, sQ_layout, sK_layout, tiled_mma).launch(
        grid=[SPLITS, batch, 1], block=[THREADS, 1, 1], stream=stream)
    _merge_kernel(mIP, mPO, mPL, mO, mLSE).launch(grid=[batch, HEADS, 1], block=[CKV // OUT_VEC, 1, 1],
                                                  stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        batch, pages, nidx, nptr = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        qn = make_fake_compact_tensor(BFloat16, (batch, HEADS, CKV), stride_order=(2, 1, 0), assumed_align=16)
        qp = make_fake_compact_tensor(BFloat16, (batch, HEADS, KPE), stride_order=(2, 1, 0), assumed_align=16)
        c = make_fake_compact_tensor(BFloat16, (pages, 1, CKV), stride_order=(2, 1, 0), assumed_align=16)
        p = make_fake_compact_tensor(BFloat16, (pages, 1, KPE), stride_order=(2, 1, 0), assumed_align=16)
        ip = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        idx = make_fake_compact_tensor(Int32, (nidx,), assumed_align=4)
        po = make_fake_compact_tensor(Float32, (batch, SPLITS, HEADS, CKV), stride_order=(3, 2, 1, 0),
                                      assumed_align=16)
        pl = make_fake_compact_tensor(Float32, (batch, SPLITS, HEADS), stride_order=(2, 1, 0), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (batch, HEADS, CKV), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (batch, HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_decode, qn, qp, c, p, ip, idx, po, pl, o, lse, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _workspace(device, batch):
    key = (str(device), batch)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((batch, SPLITS, HEADS, CKV), dtype=torch.float32, device=device),
              torch.empty((batch, SPLITS, HEADS), dtype=torch.float32, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch = q_nope.shape[0]
    out = torch.empty((batch, HEADS, CKV), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((batch, HEADS), dtype=torch.float32, device=q_nope.device)
    if batch == 0:
        return out, lse
    po, pl = _workspace(q_nope.device, batch)
    indptr = kv_indptr if kv_indptr.dtype == torch.int32 else kv_indptr.to(torch.int32)
    indices = kv_indices if kv_indices.dtype == torch.int32 else kv_indices.to(torch.int32)
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q_nope.device)
    _get_compiled()(q_nope.contiguous(), q_pe.contiguous(), ckv_cache, kpe_cache, indptr, indices, po, pl, out,
                    lse, float(sm_scale) * LOG2E)
    return out, lse
