"""GQA paged decode (5 query heads on 1 KV head, head dim 128, page size 1, bf16) in CuTe DSL:
split-KV flash decoding on tensor cores (warp-level mma.sync m16n8k16), then a merge kernel.

The 5 query heads of a request are the rows of a 16-row MMA tile (rows 5..15 are zero), so each token
costs 2 MMAs (QK^T and PV) instead of ~60 SIMT instructions.

Kernel 1 (partial): grid (32 splits, B requests), 128 threads = 4 warps.
- Request b's tokens are cut into chunks of max(256, ceil(len/32)) tokens (at most 32 chunks); CTA (s, b)
  takes chunk s and returns at once when the chunk starts past the end.
- Q (5 x 128 bf16, zero-padded to 16 rows) is staged in shared memory once; each warp keeps its A
  fragments (16 x 128) in registers.
- The chunk is walked in blocks of 64 tokens. K and V rows are gathered through the page ids with
  cp.async (16 B copies; thread t copies one half-row of token t/2) into a 2-stage ring of swizzled
  [64 x 128] K and V tiles (block i+1 in flight while block i is computed). Tokens past the chunk end
  read a clamped (valid) page and are masked to -inf.
- Warp w takes tokens 16w..16w+15 of every block: S = Q K^T (8 k-steps x 2 n-tiles), online softmax in
  base 2 on the fp32 fragments (quad shuffles for the row max), P (bf16) reused as the A operand of
  O += P V (V through ldmatrix.trans, 16 n-tiles), O [16 x 128] fp32 in registers.
- The 4 warp states (max, sum, O rows 0..4) are merged through shared memory and the CTA writes its
  normalized partial output [5 x 128] fp32 and partial base-2 lse to a workspace cached per (device, B).
Kernel 2 (merge): grid (B), 160 threads: thread t merges head t/32, elements 4(t%32)..+3 over the
request's chunks (LSE = M + log2 sum 2^(lse_s - M)); bf16 output; zero-length requests: 0 and -inf.
What limits it: DRAM bandwidth for the gathered K/V rows (77.6 MB; SOL ~0.016 ms) and the latency of
page-size-1 gathers; the longest request (15050 tokens) is split 32 ways (471 tokens per CTA).
Expected ~0.025-0.035 ms.
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

QO_HEADS = 5
HEAD_DIM = 128
MROWS = 16                     # MMA rows (heads padded to 16)
THREADS = 128
NWARPS = THREADS // 32
BLK = 64                       # tokens per block (16 per warp)
WTOK = BLK // NWARPS
CHUNK = 256                    # minimum tokens per split
SPLITS = 32                    # max splits per request
OUT_VEC = 4
LOG2E = 1.4426950408889634
M_INIT = -1.0e30


@cute.kernel
def _partial_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIP: cute.Tensor, mIdx: cute.Tensor,
                    mPO: cute.Tensor, mPL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    s, b, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32

    smem = cutlass.utils.SmemAllocator()
    sQ = smem.allocate_tensor(BFloat16, sQ_layout, byte_alignment=1024)
    sK = smem.allocate_tensor(BFloat16, sKV_layout, byte_alignment=1024)
    sV = smem.allocate_tensor(BFloat16, sKV_layout, byte_alignment=1024)
    sO = smem.allocate_tensor(Float32, cute.make_layout((NWARPS, QO_HEADS, HEAD_DIM),
                                                        stride=(QO_HEADS * HEAD_DIM, HEAD_DIM, 1)),
                              byte_alignment=16)
    sML = smem.allocate_tensor(Float32, cute.make_layout((NWARPS, 2, MROWS), stride=(2 * MROWS, MROWS, 1)),
                               byte_alignment=16)

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

        # Q rows 0..4 from q[b], rows 5..15 zero (thread t: row t/8, chunks 2(t%8), 2(t%8)+1)
        qr = tidx // 8
        for e in cutlass.range_constexpr(2):
            qc = 2 * (tidx % 8) + e
            t8 = cute.make_rmem_tensor((8,), BFloat16)
            if qr < QO_HEADS:
                cute.autovec_copy(cute.zipped_divide(mQ[b, qr, None], (8,))[(None, qc)], t8)
            else:
                t8.fill(0.0)
            cute.autovec_copy(t8, cute.zipped_divide(sQ[qr, None], (8,))[(None, qc)])

        _issue_block(g2s, mK, mV, mIdx, sK, sV, base, cn, Int32(0), Int32(0), tidx)
        cute.arch.cp_async_commit_group()
        cute.arch.barrier()

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
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        cute.copy(s2r_a, thr_a.partition_S(sQ), thr_a.retile(tSrQ))

        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((MROWS, HEAD_DIM)), Float32)
        acc.fill(0.0)
        acc_mn = _mn_view(acc)
        tScS = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((MROWS, WTOK))))
        nrow = cute.size(acc_mn.shape[0])          # 2 rows per thread (g, g + 8)
        row_m = cute.make_rmem_tensor((nrow,), Float32)
        row_l = cute.make_rmem_tensor((nrow,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)

        for blk in cutlass.range(nblk):
            if blk + 1 < nblk:
                _issue_block(g2s, mK, mV, mIdx, sK, sV, base, cn, blk + 1, (blk + 1) % 2, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            st = blk % 2
            sKw = cute.local_tile(sK[None, None, st], (WTOK, HEAD_DIM), (wid, 0))
            sVw = cute.local_tile(sV[None, None, st], (WTOK, HEAD_DIM), (wid, 0))
            sVtw = cute.composition(sVw, cute.make_layout((HEAD_DIM, WTOK), stride=(WTOK, 1)))

            # S = Q K^T over this warp's 16 tokens
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKw))
            tSsK = thr_b.partition_S(sKw)
            tSrK_v = thr_b.retile(tSrK)
            sc = cute.make_rmem_tensor(thr_mma.partition_shape_C((MROWS, WTOK)), Float32)
            sc.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsK.shape[2])):
                cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, k])
                cute.gemm(tiled_mma, sc, tSrQ[None, None, k], tSrK[None, None, k], sc)

            # online softmax (base 2), tokens past the chunk end masked
            sc_mn = _mn_view(sc)
            t_base = blk * BLK + wid * WTOK
            for r in cutlass.range_constexpr(nrow):
                mx = row_m[r]
                for q in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    tok = t_base + tScS[0, q][1]
                    v = cutlass.select_(tok < cn, sc_mn[r, q] * scale_log2, Float32(-math.inf))
                    sc_mn[r, q] = v
                    mx = cute.arch.fmax(mx, v)
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
                alpha = cute.math.exp2(row_m[r] - mx, fastmath=True)
                row_m[r] = mx
                ls = Float32(0.0)
                for q in cutlass.range_constexpr(cute.size(sc_mn.shape[1])):
                    p = cute.math.exp2(sc_mn[r, q] - mx, fastmath=True)
                    sc_mn[r, q] = p
                    ls = ls + p
                row_l[r] = row_l[r] * alpha + ls
                for q in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    acc_mn[r, q] = acc_mn[r, q] * alpha

            # O += P V
            rP = cute.make_fragment_like(sc, BFloat16)
            rP.store(sc.load().to(BFloat16))
            pd = cute.logical_divide(rP.layout, (None, None, 2))
            rPa = cute.make_tensor(rP.iterator, cute.make_layout(
                ((pd.shape[0], pd.shape[2][0]), pd.shape[1], pd.shape[2][1]),
                stride=((pd.stride[0], pd.stride[2][0]), pd.stride[1], pd.stride[2][1])))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVtw))
            tOsVt = thr_bt.partition_S(sVtw)
            tOrVt_v = thr_bt.retile(tOrVt)
            for k in cutlass.range_constexpr(cute.size(tOsVt.shape[2])):
                cute.copy(s2r_bt, tOsVt[None, None, k], tOrVt_v[None, None, k])
                cute.gemm(tiled_mma, acc, rPa[None, None, k], tOrVt[None, None, k], acc)
            cute.arch.barrier()                    # stage st is free for the next issue

        # ---- merge the 4 warp states (rows 0..4 = heads)
        tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((MROWS, HEAD_DIM))))
        for r in cutlass.range_constexpr(nrow):
            lt = row_l[r]
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=2)
            lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=1)
            row = tOcO[r, 0][0]
            if row < QO_HEADS:
                if lane % 4 == 0:
                    sML[wid, 0, row] = row_m[r]
                    sML[wid, 1, row] = lt
                for q in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    sO[wid, row, tOcO[0, q][1]] = acc_mn[r, q]
        cute.arch.barrier()
        for it in cutlass.range_constexpr(QO_HEADS * HEAD_DIM // THREADS):
            e = tidx + THREADS * it
            hh = e // HEAD_DIM
            d = e % HEAD_DIM
            mm = sML[0, 0, hh]
            for w in cutlass.range_constexpr(1, NWARPS):
                mm = cute.arch.fmax(mm, sML[w, 0, hh])
            lsum = Float32(0.0)
            osum = Float32(0.0)
            for w in cutlass.range_constexpr(NWARPS):
                wt = cute.math.exp2(sML[w, 0, hh] - mm, fastmath=True)
                lsum = lsum + sML[w, 1, hh] * wt
                osum = osum + sO[w, hh, d] * wt
            mPO[b, s, hh, d] = osum / lsum
            if d == 0:
                mPL[b, s, hh] = mm + cute.math.log2(lsum)


@cute.jit
def _issue_block(g2s: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, sK: cute.Tensor,
                 sV: cute.Tensor, base: Int32, cn: Int32, blk: Int32, st: Int32, tidx: Int32):
    """cp.async of the K and V rows of block blk (token tidx/2, half tidx%2) into stage st."""
    r = tidx // 2
    half = tidx % 2
    page = mIdx[base + cutlass.min(blk * BLK + r, cn - 1)]
    for e in cutlass.range_constexpr(8):
        cc = half * 8 + e
        cute.copy(g2s, cute.zipped_divide(mK[page, 0, 0, None], (8,))[(None, cc)],
                  cute.zipped_divide(sK[r, None, st], (8,))[(None, cc)])
        cute.copy(g2s, cute.zipped_divide(mV[page, 0, 0, None], (8,))[(None, cc)],
                  cute.zipped_divide(sV[r, None, st], (8,))[(None, cc)])


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
    b, _, _ = cute.arch.block_idx()
    hq = tidx // 32
    e = tidx % 32
    n_tot = mIP[b + 1] - mIP[b]
    chunk = cutlass.max(Int32(CHUNK), (n_tot + (SPLITS - 1)) // SPLITS)
    ns = (n_tot + chunk - 1) // chunk
    res = cute.make_rmem_tensor((OUT_VEC,), BFloat16)
    gOut = cute.zipped_divide(mO[b, hq, None], (OUT_VEC,))[(None, e)]
    if ns == 0:
        res.fill(0.0)
        cute.autovec_copy(res, gOut)
        if e == 0:
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
            cute.autovec_copy(cute.zipped_divide(mPO[b, sp, hq, None], (OUT_VEC,))[(None, e)], ra)
            acc.store(acc.load() + ra.load() * w)
        res.store((acc.load() * (1.0 / tot)).to(BFloat16))
        cute.autovec_copy(res, gOut)
        if e == 0:
            mLSE[b, hq] = mm + cute.math.log2(tot)


@cute.jit
def _decode(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIP: cute.Tensor, mIdx: cute.Tensor,
            mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
            stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    sQ_layout = cute.tile_to_shape(atom, (MROWS, HEAD_DIM), (0, 1))
    sKV_layout = cute.tile_to_shape(atom, (BLK, HEAD_DIM, 2), (0, 1, 2))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1),
                                    permutation_mnk=(16, 16, 16))
    batch = mQ.shape[0]
    _partial_kernel(mQ, mK, mV, mIP, mIdx, mPO, mPL, scale_log2, sQ_layout, sKV_layout, tiled_mma).launch(
        grid=[SPLITS, batch, 1], block=[THREADS, 1, 1], stream=stream)
    _merge_kernel(mIP, mPO, mPL, mO, mLSE).launch(grid=[batch, 1, 1], block=[QO_HEADS * 32, 1, 1], stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        batch, pages, nidx, nptr = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (batch, QO_HEADS, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (pages, 1, 1, HEAD_DIM), stride_order=(3, 2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (pages, 1, 1, HEAD_DIM), stride_order=(3, 2, 1, 0), assumed_align=16)
        ip = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        idx = make_fake_compact_tensor(Int32, (nidx,), assumed_align=4)
        po = make_fake_compact_tensor(Float32, (batch, SPLITS, QO_HEADS, HEAD_DIM), stride_order=(3, 2, 1, 0),
                                      assumed_align=16)
        pl = make_fake_compact_tensor(Float32, (batch, SPLITS, QO_HEADS), stride_order=(2, 1, 0), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (batch, QO_HEADS, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (batch, QO_HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_decode, q, k, v, ip, idx, po, pl, o, lse, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _workspace(device, batch):
    key = (str(device), batch)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((batch, SPLITS, QO_HEADS, HEAD_DIM), dtype=torch.float32, device=device),
              torch.empty((batch, SPLITS, QO_HEADS), dtype=torch.float32, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale):
    batch = q.shape[0]
    out = torch.empty((batch, QO_HEADS, HEAD_DIM), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, QO_HEADS), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    po, pl = _workspace(q.device, batch)
    indptr = kv_indptr if kv_indptr.dtype == torch.int32 else kv_indptr.to(torch.int32)
    indices = kv_indices if kv_indices.dtype == torch.int32 else kv_indices.to(torch.int32)
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q.device)
    _get_compiled()(q.contiguous(), k_cache, v_cache, indptr, indices, po, pl, out, lse, float(sm_scale) * LOG2E)
    return out, lse
