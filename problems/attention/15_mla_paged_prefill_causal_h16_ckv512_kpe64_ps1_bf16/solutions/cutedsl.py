"""Causal MLA prefill (DeepSeek-V3 absorbed form at TP=8: 16 heads, latent 512 + rope 64, page size 1) in CuTe
DSL: one FlashAttention-2 style kernel on tensor cores (warp-level mma.sync m16n8k16, bf16 in, fp32 accumulate),
bottom-right aligned causal mask, base-2 lse.

Same decomposition as the TIRx solution of this problem:
- A CTA owns two consecutive query tokens of one request = 32 rows (token x 16 heads; all heads share the latent
  KV). 1-D grid ceil(Tq / 2) + B (upper bound on the pair count), the (request, pair) found by scanning qo_indptr
  on the device, spare CTAs exit; no host synchronisation.
- 256 threads = 8 warps: warp w is row group rg = w % 2 (token of the pair, its 16 heads) and part p = w // 2.
- Per KV tile of 32 tokens: cp.async gathers the 32 paged rows (ckv 1024 B + kpe 128 B each, rows past Lkv
  zero-filled) into one swizzled shared-memory buffer; only keys up to the last one visible from the pair are
  visited. Q of the pair stays in shared memory.
- Logits split over the 576 feature dims: part p computes partial logits of its 16 rows x 32 keys over 9 k16
  steps (latent dims 128p .. 128p+127 and rope dims 16p .. 16p+15); the 4 partials are exchanged through shared
  memory and summed in fp32 in a fixed order by all 4 warps of the row group (short accumulation chains).
- Online softmax in base 2 (scale * log2 e folded in), causal mask key <= i + Lkv - Lq per row group; P (bf16)
  reused from registers as the A operand of O += P V, part p accumulating output dims 128p .. 128p+127 (V = the
  latent rows in shared memory, ldmatrix.trans).
- Epilogue: O / l -> bf16, lse = m + log2(l).
Differences from the TIRx kernel: the depth quarters are latent slab p plus rope step p instead of contiguous
dims 144p .. 144p+143 (the same 9 k-steps per part; it lets each quarter be a whole slab of a [rows, 128, 4]
shared layout); no explicit register cap for 2 CTAs per SM (88 KiB shared memory allows 2).
What limits it: latency, not bandwidth (SOL is the 14.7 us DRAM floor): one KV buffer, so each 32-key tile is a
serial gather + wait + 3 barriers + tiny GEMMs; every token pair re-gathers its visible KV (~2x the compulsory
bytes through L2). The TIRx version took 175 us device time on the H200; expect the same order.
Host path: compiled once per process (tvm-ffi; token counts symbolic), torch tensors passed directly, launch on
the caller's current torch stream.

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
DC = 512                          # latent dims (keys and values)
DR = 64                           # rope dims
SLAB = 128                        # latent dims per part
NPART = DC // SLAB                # 4
ROWS = 32                         # 2 tokens x 16 heads
KT = 32                           # keys per tile
THREADS = 256
LOG2E = 1.4426950408889634
M_INIT = -1.0e30
NCHUNK = 2                        # column chunks of the P V product (64 columns each)


@cute.kernel
def _mla_kernel(mQN: cute.Tensor, mQP: cute.Tensor, mC: cute.Tensor, mR: cute.Tensor, mQI: cute.Tensor,
                mKI: cute.Tensor, mIdx: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
                sQc_layout: cute.ComposedLayout, sQr_layout: cute.ComposedLayout,
                sKc_layout: cute.ComposedLayout, sKr_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    x, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    t64 = tidx % 64                   # thread index inside the row-group pair (the tiled MMA's 64 threads)
    part = tidx // 64
    rg = t64 // 32
    nb = mQI.shape[0] - 1

    # ---- work item: (request, token pair), requests in order
    b = Int32(0)
    pair = Int32(0)
    cum = Int32(0)
    for bb in cutlass.range(nb):
        npair = (mQI[bb + 1] - mQI[bb] + 1) // 2
        if x >= cum:
            if x < cum + npair:
                b = bb
                pair = x - cum
        cum = cum + npair
    if x < cum:
        qbeg = mQI[b]
        lq = mQI[b + 1] - qbeg
        kbeg = mKI[b]
        lkv = mKI[b + 1] - kbeg
        i0 = pair * 2
        nval = cutlass.min(lq - i0, 2)
        kend = i0 + nval + lkv - lq               # keys 0 .. kend - 1 are visible from the pair
        qpos = i0 + rg + lkv - lq                 # last visible key of this row group's token

        smem = cutlass.utils.SmemAllocator()
        sQc = smem.allocate_tensor(BFloat16, sQc_layout, byte_alignment=1024)
        sQr = smem.allocate_tensor(BFloat16, sQr_layout, byte_alignment=1024)
        sKc = smem.allocate_tensor(BFloat16, sKc_layout, byte_alignment=1024)
        sKr = smem.allocate_tensor(BFloat16, sKr_layout, byte_alignment=1024)
        sX = smem.allocate_tensor(Float32, cute.make_layout((NPART, 16, 64), stride=(1024, 64, 1)),
                                  byte_alignment=16)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)

        # ---- Q of the pair: row r = token * 16 + head (a missing second token reads the first token's rows)
        for it in cutlass.range_constexpr(ROWS * (DC + DR) // 8 // THREADS):
            cid = tidx + THREADS * it
            r = cid // ((DC + DR) // 8)
            c = cid % ((DC + DR) // 8)
            tok = qbeg + i0 + cutlass.min(r // 16, nval - 1)
            if c < DC // 8:
                cute.copy(g2s, cute.zipped_divide(mQN[tok, r % 16, None], (8,))[(None, c)],
                          cute.zipped_divide(sQc[r, None, c // 16], (8,))[(None, c % 16)])
            else:
                cute.copy(g2s, cute.zipped_divide(mQP[tok, r % 16, None], (8,))[(None, c - DC // 8)],
                          cute.zipped_divide(sQr[r, None], (8,))[(None, c - DC // 8)])
        cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(t64)
        s2r_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                           BFloat16), tiled_mma)
        s2r_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                           BFloat16), tiled_mma)
        s2r_bt = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                                            BFloat16), tiled_mma)
        thr_a = s2r_a.get_slice(t64)
        thr_b = s2r_b.get_slice(t64)
        thr_bt = s2r_bt.get_slice(t64)

        sQp = sQc[None, None, part]
        sKp = sKc[None, None, part]
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQp))
        tSsQ = thr_a.partition_S(sQp)
        tSsQr = thr_a.partition_S(sQr)
        tSrQ_v = thr_a.retile(tSrQ)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKp))
        tSsK = thr_b.partition_S(sKp)
        tSsKr = thr_b.partition_S(sKr)
        tSrK_v = thr_b.retile(tSrK)
        sVt = cute.composition(sKp, cute.make_layout((SLAB, KT), stride=(KT, 1)))   # V^T of this part's dims
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        tOsVt = thr_bt.partition_S(sVt)
        tOrVt_v = thr_bt.retile(tOrVt)
        tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((ROWS, SLAB))))

        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, SLAB)), Float32)
        acc.fill(0.0)
        acc_mn = _mn_view(acc)
        acc_c = cute.make_tensor(acc.iterator, cute.logical_divide(acc.layout, (None, None, SLAB // 8 // NCHUNK)))
        nrow = cute.size(acc_mn.shape[0])
        row_m = cute.make_rmem_tensor((nrow,), Float32)
        row_l = cute.make_rmem_tensor((nrow,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)

        nkt = (kend + KT - 1) // KT
        for kt in cutlass.range(nkt):
            # ---- gather the KV tile (rows past Lkv zero-filled)
            for it in cutlass.range_constexpr(KT * (DC + DR) // 8 // THREADS):
                cid = tidx + THREADS * it
                r = cid // ((DC + DR) // 8)
                c = cid % ((DC + DR) // 8)
                kj = kt * KT + r
                page = mIdx[kbeg + cutlass.min(kj, lkv - 1)]
                if c < DC // 8:
                    dst = cute.zipped_divide(sKc[r, None, c // 16], (8,))[(None, c % 16)]
                    if kj < lkv:
                        cute.copy(g2s, cute.zipped_divide(mC[page, 0, None], (8,))[(None, c)], dst)
                    else:
                        dst.fill(0.0)
                else:
                    dst = cute.zipped_divide(sKr[r, None], (8,))[(None, c - DC // 8)]
                    if kj < lkv:
                        cute.copy(g2s, cute.zipped_divide(mR[page, 0, None], (8,))[(None, c - DC // 8)], dst)
                    else:
                        dst.fill(0.0)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

            # ---- partial logits of this part: latent slab (8 k-steps) + rope step `part`
            sc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, KT)), Float32)
            sc.fill(0.0)
            for k in cutlass.range(cute.size(tSsK.shape[2]), unroll=1):
                cute.copy(s2r_a, tSsQ[None, None, k], tSrQ_v[None, None, 0])
                cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, 0])
                cute.gemm(tiled_mma, sc, tSrQ[None, None, 0], tSrK[None, None, 0], sc)
            cute.copy(s2r_a, tSsQr[None, None, part], tSrQ_v[None, None, 0])
            cute.copy(s2r_b, tSsKr[None, None, part], tSrK_v[None, None, 0])
            cute.gemm(tiled_mma, sc, tSrQ[None, None, 0], tSrK[None, None, 0], sc)

            # ---- exchange the partials; every warp of the row group sums all 4 in a fixed order
            for i in cutlass.range_constexpr(cute.size(sc)):
                sX[part, i, t64] = sc[i]
            cute.arch.barrier()
            for i in cutlass.range_constexpr(cute.size(sc)):
                sc[i] = ((sX[0, i, t64] + sX[1, i, t64]) + sX[2, i, t64]) + sX[3, i, t64]

            # ---- online softmax (base 2), key kt*32 + col visible iff <= qpos
            sc_mn = _mn_view(sc)
            d_causal = kt * KT + 2 * (lane % 4) - qpos
            for r in cutlass.range_constexpr(nrow):
                mx = row_m[r]
                for c in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    cc = (c % 2) + 8 * (c // 2)
                    vv = cutlass.select_(d_causal + cc <= 0, sc_mn[r, c] * scale_log2, Float32(-math.inf))
                    sc_mn[r, c] = vv
                    mx = cute.arch.fmax(mx, vv)
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
                alpha = cute.math.exp2(row_m[r] - mx, fastmath=True)
                row_m[r] = mx
                ls = Float32(0.0)
                for c in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    p = cute.math.exp2(sc_mn[r, c] - mx, fastmath=True)
                    sc_mn[r, c] = p
                    ls = ls + p
                row_l[r] = row_l[r] * alpha + ls
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    acc_mn[r, c] = acc_mn[r, c] * alpha

            # ---- O += P V on this part's 128 output dims
            rP = cute.make_fragment_like(sc, BFloat16)
            rP.store(sc.load().to(BFloat16))
            pd = cute.logical_divide(rP.layout, (None, None, 2))
            rPa = cute.make_tensor(rP.iterator, cute.make_layout(
                ((pd.shape[0], pd.shape[2][0]), pd.shape[1], pd.shape[2][1]),
                stride=((pd.stride[0], pd.stride[2][0]), pd.stride[1], pd.stride[2][1])))
            for k in cutlass.range_constexpr(cute.size(tOsVt.shape[2])):
                for cn in cutlass.range_constexpr(NCHUNK):
                    cute.copy(s2r_bt, tOsVt[None, (None, cn), k], tOrVt_v[None, (None, cn), k])
                    cute.gemm(tiled_mma, acc_c[None, None, (None, cn)], rPa[None, None, k],
                              tOrVt[None, (None, cn), k], acc_c[None, None, (None, cn)])
            cute.arch.barrier()                      # KV buffer and exchange area free for the next tile

        # ---- epilogue
        for r in cutlass.range_constexpr(nrow):
            lt = row_l[r]
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=2)
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=1)
            row = tOcO[r, 0][0]
            if rg < nval:
                inv = Float32(1.0) / lt
                gO = mO[qbeg + i0 + rg, row % 16, None]
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    gO[part * SLAB + tOcO[0, c][1]] = (acc_mn[r, c] * inv).to(BFloat16)
                if part == 0:
                    if lane % 4 == 0:
                        mL[qbeg + i0 + rg, row % 16] = row_m[r] + cute.math.log2(lt)


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def _mla(mQN: cute.Tensor, mQP: cute.Tensor, mC: cute.Tensor, mR: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
         mIdx: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32, stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    sQc_layout = cute.tile_to_shape(atom, (ROWS, SLAB, NPART), (0, 1, 2))
    sQr_layout = cute.tile_to_shape(atom, (ROWS, DR), (0, 1))
    sKc_layout = cute.tile_to_shape(atom, (KT, SLAB, NPART), (0, 1, 2))
    sKr_layout = cute.tile_to_shape(atom, (KT, DR), (0, 1))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (2, 1, 1),
                                    permutation_mnk=(ROWS, 16, 16))
    n_items = (mQN.shape[0] + 1) // 2 + mQI.shape[0] - 1
    _mla_kernel(mQN, mQP, mC, mR, mQI, mKI, mIdx, mO, mL, scale_log2, sQc_layout, sQr_layout, sKc_layout,
                sKr_layout, tiled_mma).launch(grid=[n_items, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        tq, pages, nptr, nidx = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        qn = make_fake_compact_tensor(BFloat16, (tq, HEADS, DC), stride_order=(2, 1, 0), assumed_align=16)
        qp = make_fake_compact_tensor(BFloat16, (tq, HEADS, DR), stride_order=(2, 1, 0), assumed_align=16)
        ckv = make_fake_compact_tensor(BFloat16, (pages, 1, DC), stride_order=(2, 1, 0), assumed_align=16)
        kpe = make_fake_compact_tensor(BFloat16, (pages, 1, DR), stride_order=(2, 1, 0), assumed_align=16)
        qi = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        ki = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        idx = make_fake_compact_tensor(Int32, (nidx,), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (tq, HEADS, DC), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (tq, HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_mla, qn, qp, ckv, kpe, qi, ki, idx, o, lse, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale):
    tq = q_nope.shape[0]
    out = torch.empty_like(q_nope)
    lse = torch.empty((tq, HEADS), dtype=torch.float32, device=q_nope.device)
    if tq == 0 or qo_indptr.numel() < 2:
        return out, lse
    indices = kv_indices.to(torch.int32).contiguous()
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q_nope.device)
    _get_compiled()(q_nope.contiguous(), q_pe.contiguous(), ckv_cache.contiguous(), kpe_cache.contiguous(),
                    qo_indptr.to(torch.int32).contiguous(), kv_indptr.to(torch.int32).contiguous(), indices,
                    out, lse, float(sm_scale) * LOG2E)
    return out, lse
