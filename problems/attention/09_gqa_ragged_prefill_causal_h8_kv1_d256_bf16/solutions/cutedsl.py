"""Causal GQA prefill over ragged K/V (8 query heads sharing one KV head, head dim 256, bf16) in CuTe DSL:
one FlashAttention-2 kernel on tensor cores (warp-level mma.sync m16n8k16, bf16 in, fp32 accumulate),
bottom-right aligned causal mask, base-2 lse. Same decomposition as the verified TIRx solution.

- Rows: with a single KV head all query heads read the same keys, so a request's queries are packed as
  rows r = token * 8 + head (q viewed as [Tq * 8, 256]); a CTA owns 64 consecutive rows (8 tokens x 8
  heads) of one request, 4 warps x 16 rows. Row-half hh of warp w is token r0 / 8 + 2 w + hh.
- Grid: ceil(Tq * 8 / 64) + B CTAs (an upper bound on the row tiles); every thread walks qo_indptr once
  to find its (request, row tile), requests and row tiles enumerated from the last so the late, long-KV
  tiles start first; CTAs past the real count return at once. No host synchronisation.
- Per KV tile of 32 tokens (only tiles up to the last key visible from the row tile): cp.async (16 B)
  gathers K and V rows (rows past Lkv zero-filled) into a 2-stage ring of swizzled [32 x 256] tiles (tile
  i+1 in flight while tile i is computed); the Q tile [64 x 256] stays in shared memory and its A fragments
  are re-read with ldmatrix per k-step.
- S = Q K^T (16 k-steps) accumulated as two 8-step halves added in fp32 (short tensor-core accumulation
  chains: the base-2 lse is compared at fp32 precision); online softmax in base 2 (scale * log2 e folded
  in), causal mask key <= token + Lkv - Lq; P (bf16) is reused in registers as the A operand of O += P V
  (V via ldmatrix.trans, 4 column chunks of 64; 128 fp32 accumulators per thread).
- Epilogue: O / l -> bf16 for rows < Lq * 8; lse = m + log2 l by one lane per row.
96 KiB of shared memory: 2 CTAs (8 warps) per SM.
What limits it: not bandwidth (35 MB, SOL ~0.007 ms): the longest row tiles (1024-token prefix: 33 KV
tiles) form a serial critical path; the TIRx version of this design measured 0.058 ms on the H200.
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

HEADS = 8
D = 256
ROWS = 64                      # packed rows (token x head) per CTA
KT = 32                        # keys per tile
THREADS = 128
CPR = D // 8                   # 16-byte pieces per row
LOG2E = 1.4426950408889634
M_INIT = -1.0e30
NCHUNK = 4                     # column chunks of the P V product (64 columns each)


@cute.kernel
def _prefill_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
                    mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    x, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32
    nb = mQI.shape[0] - 1

    # ---- work item: requests from the last, row tiles from the last (one walk over qo_indptr)
    b = Int32(-1)
    rt = Int32(0)
    cum = Int32(0)
    for bi in cutlass.range(nb):
        bb = nb - 1 - bi
        ntl = ((mQI[bb + 1] - mQI[bb]) * HEADS + ROWS - 1) // ROWS
        if x >= cum:
            if x < cum + ntl:
                b = bb
                rt = ntl - 1 - (x - cum)
        cum = cum + ntl
    if b >= 0:
        qbeg = mQI[b]
        lq = mQI[b + 1] - qbeg
        kbeg = mKI[b]
        lkv = mKI[b + 1] - kbeg
        off = lkv - lq
        nrows = lq * HEADS
        r0 = rt * ROWS
        rbeg = qbeg * HEADS + r0                      # first packed row of the tile in q / out
        kend = (cutlass.min(r0 + ROWS, nrows) - 1) // HEADS + off + 1    # keys 0 .. kend - 1 are visible
        nkb = (kend + KT - 1) // KT

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, sQ_layout, byte_alignment=1024)
        sK = smem.allocate_tensor(BFloat16, sK_layout, byte_alignment=1024)
        sV = smem.allocate_tensor(BFloat16, sK_layout, byte_alignment=1024)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)

        # Q tile (rows past the request read its last row; they are never stored)
        for it in cutlass.range_constexpr(ROWS * CPR // THREADS):
            cid = tidx + THREADS * it
            r = cid // CPR
            c = cid % CPR
            qrow = qbeg * HEADS + cutlass.min(r0 + r, nrows - 1)
            cute.copy(g2s, cute.zipped_divide(mQ[qrow, None], (8,))[(None, c)],
                      cute.zipped_divide(sQ[r, None], (8,))[(None, c)])
        _load_kv(g2s, mK, mV, sK, sV, kbeg, Int32(0), lkv, Int32(0), tidx)
        cute.arch.cp_async_commit_group()

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
        tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((ROWS, D))))

        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, D)), Float32)
        acc.fill(0.0)
        acc_mn = _mn_view(acc)
        acc_c = cute.make_tensor(acc.iterator, cute.logical_divide(acc.layout, (None, None, D // 8 // NCHUNK)))
        nrow = cute.size(acc_mn.shape[0])
        row_m = cute.make_rmem_tensor((nrow,), Float32)
        row_l = cute.make_rmem_tensor((nrow,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)
        nks = D // 16
        # last visible key of row-half r (rows 16 w + g + 8 r are token r0 / 8 + 2 w + r)
        tok0 = r0 // HEADS + 2 * wid + off

        for kb in cutlass.range(nkb):
            if kb + 1 < nkb:
                _load_kv(g2s, mK, mV, sK, sV, kbeg, (kb + 1) * KT, lkv, (kb + 1) % 2, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            st = kb % 2
            sKs = sK[None, None, st]
            sVt = cute.composition(sV[None, None, st], cute.make_layout((D, KT), stride=(KT, 1)))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKs))
            tSsK = thr_b.partition_S(sKs)
            tSrK_v = thr_b.retile(tSrK)
            sc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, KT)), Float32)
            sc.fill(0.0)
            sc2 = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, KT)), Float32)
            sc2.fill(0.0)
            # dynamic k loops (fragments reloaded into slot 0), two half-depth accumulation chains
            for k in cutlass.range(nks // 2, unroll=1):
                cute.copy(s2r_a, tSsQ[None, None, k], tSrQ_v[None, None, 0])
                cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, 0])
                cute.gemm(tiled_mma, sc, tSrQ[None, None, 0], tSrK[None, None, 0], sc)
            for k in cutlass.range(nks // 2, nks, 1, unroll=1):
                cute.copy(s2r_a, tSsQ[None, None, k], tSrQ_v[None, None, 0])
                cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, 0])
                cute.gemm(tiled_mma, sc2, tSrQ[None, None, 0], tSrK[None, None, 0], sc2)
            sc.store(sc.load() + sc2.load())

            sc_mn = _mn_view(sc)
            # C fragment: row = 16 w + g + 8 r, col = 2 (lane % 4) + e + 8 n with c = e + 2 n
            kbase = kb * KT + 2 * (lane % 4)
            for r in cutlass.range_constexpr(nrow):
                mx = row_m[r]
                for c in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    cc = (c % 2) + 8 * (c // 2)
                    ok = kbase + cc <= tok0 + r
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
            ri = tOcO[r, 0][0]
            if r0 + ri < nrows:
                inv = Float32(1.0) / lt
                gO = mO[rbeg + ri, None]
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    gO[tOcO[0, c][1]] = (acc_mn[r, c] * inv).to(BFloat16)
                if lane % 4 == 0:
                    mL[rbeg + ri] = row_m[r] + cute.math.log2(lt)


@cute.jit
def _load_kv(g2s: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, beg: Int32,
             r0: Int32, n: Int32, st: Int32, tidx: Int32):
    """K and V rows r0 .. r0+31 of the request (zero past n) into stage st."""
    for it in cutlass.range_constexpr(KT * CPR // THREADS):
        cid = tidx + THREADS * it
        r = cid // CPR
        c = cid % CPR
        dk = cute.zipped_divide(sK[r, None, st], (8,))[(None, c)]
        dv = cute.zipped_divide(sV[r, None, st], (8,))[(None, c)]
        if r0 + r < n:
            cute.copy(g2s, cute.zipped_divide(mK[beg + r0 + r, None], (8,))[(None, c)], dk)
            cute.copy(g2s, cute.zipped_divide(mV[beg + r0 + r, None], (8,))[(None, c)], dv)
        else:
            dk.fill(0.0)
            dv.fill(0.0)


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
    sQ_layout = cute.tile_to_shape(atom, (ROWS, D), (0, 1))
    sK_layout = cute.tile_to_shape(atom, (KT, D, 2), (0, 1, 2))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (4, 1, 1),
                                    permutation_mnk=(64, 16, 16))
    nb = mQI.shape[0] - 1
    rows = mQ.shape[0]
    _prefill_kernel(mQ, mK, mV, mQI, mKI, mO, mL, scale_log2, sQ_layout, sK_layout, tiled_mma).launch(
        grid=[(rows + ROWS - 1) // ROWS + nb, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rq, tkv, nptr = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (rq, D), stride_order=(1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (tkv, D), stride_order=(1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (tkv, D), stride_order=(1, 0), assumed_align=16)
        qi = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        ki = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (rq, D), stride_order=(1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (rq,), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_prefill, q, k, v, qi, ki, o, lse, Float32(1.0), stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v, qo_indptr, kv_indptr, sm_scale):
    tq = q.shape[0]
    assert q.shape[1:] == (HEADS, D) and k.shape[1:] == (1, D)
    out = torch.empty_like(q)
    lse = torch.empty((tq, HEADS), dtype=torch.float32, device=q.device)
    if tq == 0 or qo_indptr.numel() < 2:
        return out, lse
    if k.shape[0] == 0:
        raise ValueError("empty KV")
    _get_compiled()(q.contiguous().view(tq * HEADS, D), k.contiguous().view(-1, D), v.contiguous().view(-1, D),
                    qo_indptr.to(torch.int32).contiguous(), kv_indptr.to(torch.int32).contiguous(),
                    out.view(tq * HEADS, D), lse.view(tq * HEADS), float(sm_scale) * LOG2E)
    return out, lse
