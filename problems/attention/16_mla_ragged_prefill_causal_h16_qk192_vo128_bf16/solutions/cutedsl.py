"""Causal MLA prefill in expanded form (DeepSeek-V3 at TP=8: 16 heads, qk 192, vo 128) over ragged
tensors, in CuTe DSL: FlashAttention-2 style on tensor cores (warp-level mma.sync m16n8k16, bf16 in, fp32
accumulate), bottom-right aligned causal mask, base-2 lse.

Launch geometry
- Grid (16 heads, B requests); 128 threads = 4 warps, warp w owns query rows 16w..16w+15 of a 64-row
  query tile. The CTA loops over its request's query tiles (ceil(Lq / 64), one for every request here).
- Q tile [64 x 192] is staged with cp.async (rows past Lq zero-filled); its A fragments are re-read
  with ldmatrix per k-step (keeping all 12 k-steps in registers spilled). KV blocks of 64 rows, only up to
  the last key visible from the tile (min(Lkv, q0 + 64 + Lkv - Lq)), stream through a 2-stage cp.async
  ring of swizzled K [64 x 192] and V [64 x 128] tiles (block i+1 in flight while block i is computed; rows
  past Lkv zero-filled).
- Per block: S = Q K^T (12 k-steps x 8 n-tiles per warp), causal mask j <= i + Lkv - Lq, online softmax
  in base 2 (scale * log2 e folded into the fp32 logits; quad shuffles for the row max), P (bf16) reused
  as the A operand of O += P V (V via ldmatrix.trans), O [16 x 128] fp32 per warp in registers.
- Epilogue: O / l -> bf16 for rows < Lq; lse = m + log2(l) (base 2), written by one lane per row.
What limits it: DRAM (q, k, v, out: 224 MB; SOL ~0.047 ms); 8.3 GFLOP on mma.sync is well below that.
1008 CTAs of ~100 KiB shared memory (2 per SM). Expected ~0.06-0.07 ms.
Host path: compiled once per process (tvm-ffi; token counts and batch symbolic), torch tensors passed
directly, launch on the caller's current torch stream.

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
QK = 192
VO = 128
TILE = 64
THREADS = 128
LOG2E = 1.4426950408889634
M_INIT = -1.0e30
NCHUNK = 2                       # column chunks of the P V product (64 columns each)


@cute.kernel
def _prefill_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
                    mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
                    tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    h, b, _ = cute.arch.block_idx()
    lane = tidx % 32
    qbeg = mQI[b]
    lq = mQI[b + 1] - qbeg
    kbeg = mKI[b]
    lkv = mKI[b + 1] - kbeg
    off = lkv - lq

    smem = cutlass.utils.SmemAllocator()
    sQ = smem.allocate_tensor(BFloat16, sQ_layout, byte_alignment=1024)
    sK = smem.allocate_tensor(BFloat16, sK_layout, byte_alignment=1024)
    sV = smem.allocate_tensor(BFloat16, sV_layout, byte_alignment=1024)
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                              num_bits_per_copy=128)

    thr_mma = tiled_mma.get_slice(tidx)
    s2r_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                       BFloat16), tiled_mma)
    s2r_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                       BFloat16), tiled_mma)
    s2r_bt = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                                        BFloat16), tiled_mma)
    thr_a = s2r_a.get_slice(tidx)
    thr_b = s2r_b.get_slice(tidx)
    thr_bt = s2r_bt.get_slice(tidx)
    tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
    tSsQ = thr_a.partition_S(sQ)
    tSrQ_v = thr_a.retile(tSrQ)
    tScS = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE, TILE))))
    tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE, VO))))

    n_qt = (lq + TILE - 1) // TILE
    for qt in cutlass.range(n_qt):
        q0 = qt * TILE
        n_kv = cutlass.min(lkv, q0 + TILE + off)
        nkb = (n_kv + TILE - 1) // TILE
        cute.arch.barrier()                          # smem of the previous tile is no longer read
        _load_rows(g2s, mQ, sQ, qbeg, q0, lq, h, QK, tidx, 0)
        _load_kv(g2s, mK, mV, sK, sV, kbeg, Int32(0), n_kv, h, Int32(0), tidx)
        cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE, VO)), Float32)
        acc.fill(0.0)
        acc_mn = _mn_view(acc)
        acc_c = cute.make_tensor(acc.iterator, cute.logical_divide(acc.layout, (None, None, VO // 8 // NCHUNK)))
        nrow = cute.size(acc_mn.shape[0])
        row_m = cute.make_rmem_tensor((nrow,), Float32)
        row_l = cute.make_rmem_tensor((nrow,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)

        for kb in cutlass.range(nkb):
            if kb + 1 < nkb:
                _load_kv(g2s, mK, mV, sK, sV, kbeg, (kb + 1) * TILE, n_kv, h, (kb + 1) % 2, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            st = kb % 2
            sKs = sK[None, None, st]
            sVt = cute.composition(sV[None, None, st], cute.make_layout((VO, TILE), stride=(TILE, 1)))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKs))
            tSsK = thr_b.partition_S(sKs)
            tSrK_v = thr_b.retile(tSrK)
            sc = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE, TILE)), Float32)
            sc.fill(0.0)
            # dynamic k loop (fragments reloaded into slot 0): unrolling it hoists ~100 swizzled smem
            # addresses out of the block loop and spills
            for k in cutlass.range(cute.size(tSsK.shape[2]), unroll=1):
                cute.copy(s2r_a, tSsQ[None, None, k], tSrQ_v[None, None, 0])
                cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, 0])
                cute.gemm(tiled_mma, sc, tSrQ[None, None, 0], tSrK[None, None, 0], sc)

            sc_mn = _mn_view(sc)
            # mask from lane-derived bases (C fragment: row = 16 w + g + 8 r, col = 2 t + e + 8 n with
            # c = e + 2 n): key kj = kb*64 + col visible iff kj <= qi + off and kj < lkv
            d_causal = kb * TILE + 2 * (lane % 4) - (q0 + (tidx // 32) * 16 + lane // 4) - off
            d_len = kb * TILE + 2 * (lane % 4) - lkv
            for r in cutlass.range_constexpr(nrow):
                mx = row_m[r]
                for c in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    cc = (c % 2) + 8 * (c // 2)
                    ok = (d_causal + (cc - 8 * r) <= 0) & (d_len + cc < 0)
                    vv = cutlass.select_(ok, sc_mn[r, c] * scale_log2, Float32(-math.inf))
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

            rP = cute.make_fragment_like(sc, BFloat16)
            rP.store(sc.load().to(BFloat16))
            pd = cute.logical_divide(rP.layout, (None, None, 2))
            rPa = cute.make_tensor(rP.iterator, cute.make_layout(
                ((pd.shape[0], pd.shape[2][0]), pd.shape[1], pd.shape[2][1]),
                stride=((pd.stride[0], pd.stride[2][0]), pd.stride[1], pd.stride[2][1])))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            tOsVt = thr_bt.partition_S(sVt)
            tOrVt_v = thr_bt.retile(tOrVt)
            for k in cutlass.range_constexpr(cute.size(tOsVt.shape[2])):
                for cn in cutlass.range_constexpr(NCHUNK):
                    cute.copy(s2r_bt, tOsVt[None, (None, cn), k], tOrVt_v[None, (None, cn), k])
                    cute.gemm(tiled_mma, acc_c[None, None, (None, cn)], rPa[None, None, k],
                              tOrVt[None, (None, cn), k], acc_c[None, None, (None, cn)])
            cute.arch.barrier()                      # stage st is free for the next issue

        # epilogue
        for r in cutlass.range_constexpr(nrow):
            lt = row_l[r]
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=2)
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=1)
            qi = q0 + tOcO[r, 0][0]
            if qi < lq:
                inv = Float32(1.0) / lt
                gO = mO[qbeg + qi, h, None]
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    gO[tOcO[0, c][1]] = (acc_mn[r, c] * inv).to(BFloat16)
                if lane % 4 == 0:
                    mL[qbeg + qi, h] = row_m[r] + cute.math.log2(lt)


@cute.jit
def _load_rows(g2s: cute.CopyAtom, mX: cute.Tensor, sX: cute.Tensor, beg: Int32, r0: Int32, n: Int32, h: Int32,
               width: cutlass.Constexpr, tidx: Int32, st: cutlass.Constexpr):
    """64 rows (beg + r0 + r, head h) of a [tokens, heads, width] tensor into sX (zero past n)."""
    cpr = width // 8
    for it in cutlass.range_constexpr(TILE * cpr // THREADS):
        cid = tidx + THREADS * it
        r = cid // cpr
        c = cid % cpr
        dst = cute.zipped_divide(sX[r, None], (8,))[(None, c)]
        if r0 + r < n:
            cute.copy(g2s, cute.zipped_divide(mX[beg + r0 + r, h, None], (8,))[(None, c)], dst)
        else:
            dst.fill(0.0)


@cute.jit
def _load_kv(g2s: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, beg: Int32,
             r0: Int32, n: Int32, h: Int32, st: Int32, tidx: Int32):
    """K and V rows r0 .. r0+63 of the request (zero past n) into stage st."""
    for it in cutlass.range_constexpr(TILE * (QK // 8) // THREADS):
        cid = tidx + THREADS * it
        r = cid // (QK // 8)
        c = cid % (QK // 8)
        dst = cute.zipped_divide(sK[r, None, st], (8,))[(None, c)]
        if r0 + r < n:
            cute.copy(g2s, cute.zipped_divide(mK[beg + r0 + r, h, None], (8,))[(None, c)], dst)
        else:
            dst.fill(0.0)
    for it in cutlass.range_constexpr(TILE * (VO // 8) // THREADS):
        cid = tidx + THREADS * it
        r = cid // (VO // 8)
        c = cid % (VO // 8)
        dst = cute.zipped_divide(sV[r, None, st], (8,))[(None, c)]
        if r0 + r < n:
            cute.copy(g2s, cute.zipped_divide(mV[beg + r0 + r, h, None], (8,))[(None, c)], dst)
        else:
            dst.fill(0.0)


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def _prefill(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
             mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32, stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    sQ_layout = cute.tile_to_shape(atom, (TILE, QK), (0, 1))
    sK_layout = cute.tile_to_shape(atom, (TILE, QK, 2), (0, 1, 2))
    sV_layout = cute.tile_to_shape(atom, (TILE, VO, 2), (0, 1, 2))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (4, 1, 1),
                                    permutation_mnk=(64, 16, 16))
    batch = mQI.shape[0] - 1
    _prefill_kernel(mQ, mK, mV, mQI, mKI, mO, mL, scale_log2, sQ_layout, sK_layout, sV_layout, tiled_mma).launch(
        grid=[HEADS, batch, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        tq, tkv, nptr = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (tq, HEADS, QK), stride_order=(2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (tkv, HEADS, QK), stride_order=(2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (tkv, HEADS, VO), stride_order=(2, 1, 0), assumed_align=16)
        qi = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        ki = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (tq, HEADS, VO), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (tq, HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_prefill, q, k, v, qi, ki, o, lse, Float32(1.0), stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v, qo_indptr, kv_indptr, sm_scale):
    tq = q.shape[0]
    out = torch.empty((tq, HEADS, VO), dtype=q.dtype, device=q.device)
    lse = torch.empty((tq, HEADS), dtype=torch.float32, device=q.device)
    if tq == 0 or qo_indptr.numel() < 2:
        return out, lse
    _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), qo_indptr.to(torch.int32).contiguous(),
                    kv_indptr.to(torch.int32).contiguous(), out, lse, float(sm_scale) * LOG2E)
    return out, lse
