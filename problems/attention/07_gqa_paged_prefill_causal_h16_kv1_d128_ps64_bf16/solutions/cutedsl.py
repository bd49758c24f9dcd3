"""Causal GQA prefill over a paged KV cache with page size 64 (Qwen3 235B A22B at TP 4: 16 query heads on one
KV head, head dim 128; chunked prefills over cached prefixes) in CuTe DSL: FlashAttention on Hopper tensor
cores (wgmma), bottom-right aligned causal mask, base-2 lse. One kernel per call.

Decomposition (as in the TIRx solution, which passed on the H200 at 0.442 ms device time)
- With one KV head, a request's queries are packed as rows r = token * 16 + head; a CTA owns 64 consecutive
  rows (4 tokens x 16 heads) of one request, each row with its own causal limit (key j visible iff
  j <= r / 16 + Lkv - Lq), so every gathered K/V tile serves all 16 heads. The 1-D grid is an upper bound
  on the row tiles (Tq * 16 / 64 + B); each CTA finds its (request, tile) from qo_indptr on the device, in
  reverse order so the tiles with the most visible keys start first; CTAs past the real count return.
- Lkv = (pages - 1) * 64 + last_page_len. A 64-key tile is exactly one page (kv_indices[kv_indptr[b] + t]);
  its K and V rows are copied with cp.async (16-byte pieces) into a 2-stage ring, rows past Lkv zero-filled
  (the unused tail of the last page never enters the products); tile i+1 is in flight while tile i is
  computed; only keys up to the last one visible from the CTA's last row are loaded. Q [64 x 128] stays
  in shared memory (K-major, 128-byte swizzle; K K-major, V MN-major = its natural row-major layout).
- One warpgroup (128 threads); per tile S = Q K^T with 8 wgmma m64n64k16 (fp32), causal mask per row,
  online softmax in base 2 (scale * log2 e folded in; each thread owns 2 rows, row max / sum via quad
  shuffles), O rescaled, O += P V with 4 wgmma m64n128k16 whose A operand is P converted to bf16 in
  registers. Epilogue: O / l -> bf16, lse = m + log2 l. 80 KiB shared memory, 2 CTAs per SM.
Where it differs from the TIRx solution: warpgroup wgmma (one warpgroup per 64 rows) instead of warp-level
m16n8k16 mma.sync, and S is one fp32 chain over the head dimension instead of two half-depth chains (the
verified CuTe prefill kernel of problem 04 passed with one chain). The wgmma / cp.async skeleton is that
of problem 04 (passed on the H200), with the head packing of the problem 05 port and the page-size-64 gather
of the problem 06 port.
What limits it: tensor-core work (~111 GFLOP, SOL ~0.112 ms); softmax is not overlapped with the wgmmas
inside a warpgroup (two CTAs per SM overlap each other); the longest tile (7010-token prefix) runs 118 key
tiles. Next steps: producer warp with bulk copies of whole pages, two consumer warpgroups in ping-pong,
split-KV for the long-prefix tiles.
Host path: compiled once per process (tvm-ffi; token counts, pages and batch symbolic), torch tensors
passed directly, launch on the caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.cute.nvgpu.warpgroup import Field, OperandSource
from cutlass.tensor_utils import LayoutEnum

QO_HEADS = 16
KV_HEADS = 1
HD = 128
PAGE = 64                      # page size; one 64-key tile is exactly one page (TILE == PAGE)
TILE = 64
THREADS = 128                  # one warpgroup
LOG2E = 1.4426950408889634
M_INIT = -1.0e30


@cute.kernel
def _prefill_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
                    mIdx: cute.Tensor, mLast: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
                    qk_mma: cute.TiledMma, pv_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    x, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    kvh = Int32(0)
    nb = mQI.shape[0] - 1

    # ---- work item: reverse order over (request, 64-row tile); rows r = token * QO_HEADS + head
    total = Int32(0)
    for bb in cutlass.range(nb):
        total = total + ((mQI[bb + 1] - mQI[bb]) * QO_HEADS + TILE - 1) // TILE
    if x < total:
        t = total - 1 - x
        b = Int32(0)
        qt = Int32(0)
        cum = Int32(0)
        for bb in cutlass.range(nb):
            ntl = ((mQI[bb + 1] - mQI[bb]) * QO_HEADS + TILE - 1) // TILE
            if t >= cum:
                if t < cum + ntl:
                    b = bb
                    qt = t - cum
            cum = cum + ntl
        qbeg = mQI[b]
        lq = mQI[b + 1] - qbeg
        kbeg = mKI[b]                                  # first page of the request in kv_indices
        lkv = (mKI[b + 1] - kbeg - 1) * PAGE + mLast[b]  # full earlier pages + valid slots of the last
        off = lkv - lq
        r0 = qt * TILE                                  # first packed row of the tile
        nrows = lq * QO_HEADS
        # keys visible from the tile's last row: 0 .. (last row's token) + off
        n_kv = cutlass.min(lkv, (cutlass.min(r0 + TILE, nrows) - 1) // QO_HEADS + off + 1)
        nkb = (n_kv + TILE - 1) // TILE

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(BFloat16, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(BFloat16, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)

        # Q tile (thread t: row t / 2, chunks 8 (t % 2) .. +7); packed row -> (token, head)
        r = tidx // 2
        qrow = r0 + r
        for e in cutlass.range_constexpr(8):
            c = (tidx % 2) * 8 + e
            dst = cute.zipped_divide(sQ[r, None, 0], (8,))[(None, c)]
            if qrow < nrows:
                cute.copy(g2s, cute.zipped_divide(mQ[qbeg + qrow // QO_HEADS, qrow % QO_HEADS, None], (8,))[(None, c)],
                          dst)
            else:
                dst.fill(0.0)
        _load_kv(g2s, mK, mV, mIdx, sK, sV, kbeg, Int32(0), n_kv, kvh, Int32(0), tidx)
        cute.arch.cp_async_commit_group()

        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE, HD)), Float32)
        acc_o.fill(0.0)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE, TILE)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE, HD)))
        # each thread owns 2 rows of the 64: (16 w + g) and (16 w + g + 8)
        r_lo = tScS[0][0] % 16
        row_m = cute.make_rmem_tensor((2,), Float32)
        row_l = cute.make_rmem_tensor((2,), Float32)
        row_m.fill(M_INIT)
        row_l.fill(0.0)
        pv_mma.set(Field.ACCUMULATE, True)

        for kb in cutlass.range(nkb):
            if kb + 1 < nkb:
                _load_kv(g2s, mK, mV, mIdx, sK, sV, kbeg, (kb + 1) * TILE, n_kv, kvh, (kb + 1) % 2, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier()
            st = kb % 2

            # S = Q K^T (wgmma m64n64k16, 8 k-steps)
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, TILE)), Float32)
            cute.nvgpu.warpgroup.fence()
            qk_mma.set(Field.ACCUMULATE, False)
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, 0], tSrK[None, None, k, st], acc_s)
                qk_mma.set(Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)

            # mask, online softmax (base 2); row stats of the 2 rows via quad shuffles
            mx = cute.make_rmem_tensor((2,), Float32)
            mx[0] = row_m[0]
            mx[1] = row_m[1]
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                hi = (tScS[i][0] % 16) != r_lo
                qi = (r0 + tScS[i][0]) // QO_HEADS          # token of the packed row
                kj = kb * TILE + tScS[i][1]
                v = cutlass.select_((kj <= qi + off) & (kj < lkv), acc_s[i] * scale_log2, Float32(-math.inf))
                acc_s[i] = v
                mx[0] = cutlass.select_(hi, mx[0], cute.arch.fmax(mx[0], v))
                mx[1] = cutlass.select_(hi, cute.arch.fmax(mx[1], v), mx[1])
            alpha = cute.make_rmem_tensor((2,), Float32)
            for j in cutlass.range_constexpr(2):
                m2 = mx[j]
                m2 = cute.arch.fmax(m2, cute.arch.shuffle_sync_bfly(m2, offset=1))
                m2 = cute.arch.fmax(m2, cute.arch.shuffle_sync_bfly(m2, offset=2))
                alpha[j] = cute.math.exp2(row_m[j] - m2, fastmath=True)
                row_m[j] = m2
            ls = cute.make_rmem_tensor((2,), Float32)
            ls.fill(0.0)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                hi = (tScS[i][0] % 16) != r_lo
                p = cute.math.exp2(acc_s[i] - cutlass.select_(hi, row_m[1], row_m[0]), fastmath=True)
                acc_s[i] = p
                ls[0] = ls[0] + cutlass.select_(hi, Float32(0.0), p)
                ls[1] = ls[1] + cutlass.select_(hi, p, Float32(0.0))
            for j in cutlass.range_constexpr(2):
                row_l[j] = row_l[j] * alpha[j] + ls[j]
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                hi = (tOcO[i][0] % 16) != r_lo
                acc_o[i] = acc_o[i] * cutlass.select_(hi, alpha[1], alpha[0])

            # O += P V (wgmma with P from registers, V MN-major from shared memory)
            tOrP = _acc_to_a_operand(acc_s, pv_mma, BFloat16)
            cute.nvgpu.warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(pv_mma, acc_o, tOrP[None, None, k], tOrV[None, None, k, st], acc_o)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            cute.arch.barrier()                      # stage st is free for the next issue

        lt = cute.make_rmem_tensor((2,), Float32)
        for j in cutlass.range_constexpr(2):
            l2 = row_l[j]
            l2 = l2 + cute.arch.shuffle_sync_bfly(l2, offset=1)
            l2 = l2 + cute.arch.shuffle_sync_bfly(l2, offset=2)
            lt[j] = l2
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            hi = (tOcO[i][0] % 16) != r_lo
            orow = r0 + tOcO[i][0]
            if orow < nrows:
                mO[qbeg + orow // QO_HEADS, orow % QO_HEADS, tOcO[i][1]] = (
                    acc_o[i] / cutlass.select_(hi, lt[1], lt[0])).to(BFloat16)
        if lane % 4 == 0:
            for j in cutlass.range_constexpr(2):
                orow = r0 + r_lo + 8 * j + 16 * (tidx // 32)
                if orow < nrows:
                    mL[qbeg + orow // QO_HEADS, orow % QO_HEADS] = row_m[j] + cute.math.log2(lt[j])


def _acc_to_a_operand(acc: cute.Tensor, pv_mma: cute.TiledMma, dtype) -> cute.Tensor:
    """bf16 copy of a wgmma accumulator fragment, viewed as the register A operand of the next wgmma
    (the k16 step kk is formed by the accumulator's n8 tiles 2 kk and 2 kk + 1)."""
    a_val = pv_mma.tv_layout_A.shape[1]
    c = acc.layout
    op_layout = cute.make_layout(
        (a_val, c.shape[1], (c.shape[2], cute.size(c, mode=[0]) // cute.size(a_val))),
        stride=(c.stride[0], c.stride[1], (c.stride[2], cute.size(a_val, mode=[2]) * c.stride[0][2])))
    op = cute.make_rmem_tensor_like(op_layout, dtype)
    cute.make_tensor(op.iterator, acc.layout).store(acc.load().to(dtype))
    return op


@cute.jit
def _load_kv(g2s: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, sK: cute.Tensor,
             sV: cute.Tensor, kbeg: Int32, r0: Int32, n: Int32, kvh: Int32, st: Int32, tidx: Int32):
    """K and V rows r0 .. r0+63 (= page r0 / 64) of the request (zero past n, which also hides the unused
    slots of the last page) into stage st; thread t: row t/2 (slot of the page), 8 chunks."""
    r = tidx // 2
    page = mIdx[kbeg + r0 // PAGE]
    for e in cutlass.range_constexpr(8):
        c = (tidx % 2) * 8 + e
        dk = cute.zipped_divide(sK[r, None, st], (8,))[(None, c)]
        dv = cute.zipped_divide(sV[None, r, st], (8,))[(None, c)]
        if r0 + r < n:
            cute.copy(g2s, cute.zipped_divide(mK[page, r, kvh, None], (8,))[(None, c)], dk)
            cute.copy(g2s, cute.zipped_divide(mV[page, r, kvh, None], (8,))[(None, c)], dv)
        else:
            dk.fill(0.0)
            dv.fill(0.0)


@cute.jit
def _prefill(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
             mIdx: cute.Tensor, mLast: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
             stream: cuda.CUstream):
    qk_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                               (1, 1, 1), tiler_mn=(TILE, TILE))
    pv_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
                                               Float32, (1, 1, 1), tiler_mn=(TILE, HD), a_source=OperandSource.RMEM)
    sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE, TILE, HD), BFloat16, 1)
    sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE, TILE, HD), BFloat16, 2)
    sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE, HD, TILE), BFloat16, 2)
    n_items = mQ.shape[0] * QO_HEADS // TILE + mQI.shape[0] - 1     # >= sum of ceil(Lq * 16 / 64)
    _prefill_kernel(mQ, mK, mV, mQI, mKI, mIdx, mLast, mO, mL, scale_log2, sQ_layout, sK_layout, sV_layout, qk_mma,
                    pv_mma).launch(grid=[n_items, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        tq, pages, nptr, nidx, nb = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32(),
                                     cute.sym_int32())
        q = make_fake_compact_tensor(BFloat16, (tq, QO_HEADS, HD), stride_order=(2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (pages, PAGE, KV_HEADS, HD), stride_order=(3, 2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (pages, PAGE, KV_HEADS, HD), stride_order=(3, 2, 1, 0), assumed_align=16)
        qi = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        ki = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        idx = make_fake_compact_tensor(Int32, (nidx,), assumed_align=4)
        last = make_fake_compact_tensor(Int32, (nb,), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (tq, QO_HEADS, HD), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (tq, QO_HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_prefill, q, k, v, qi, ki, idx, last, o, lse, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    tq = q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((tq, QO_HEADS), dtype=torch.float32, device=q.device)
    if tq == 0 or qo_indptr.numel() < 2:
        return out, lse
    indices = kv_indices.to(torch.int32).contiguous()
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q.device)
    _get_compiled()(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), qo_indptr.to(torch.int32).contiguous(),
                    kv_indptr.to(torch.int32).contiguous(), indices,
                    kv_last_page_len.to(torch.int32).contiguous(), out, lse, float(sm_scale) * LOG2E)
    return out, lse
