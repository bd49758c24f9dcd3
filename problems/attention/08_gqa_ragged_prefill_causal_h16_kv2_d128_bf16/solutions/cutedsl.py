"""Causal GQA prefill over ragged tensors (Qwen3 32B at TP=4: 16 query heads on 2 KV heads, head dim 128)
in CuTe DSL: FlashAttention on Hopper tensor cores (wgmma), bottom-right aligned causal mask, base-2 lse.

Launch geometry
- Work items are (request, 64-query tile) pairs x 16 query heads. The host only knows an upper bound on
  the tile count (Tq / 64 + B), so the grid is (Tq / 64 + B, 16) and each CTA finds its item on the
  device from qo_indptr (walking the B requests); items are taken in reverse order so the late (long-KV)
  tiles start first; CTAs past the real count return at once.
- One warpgroup (128 threads) per CTA; warp w owns query rows 16w..16w+15 of the tile. The Q tile
  [64 x 128] (K-major, 128-byte swizzle) and 2-stage K (K-major) / V (MN-major, i.e. V's natural row-major
  layout) tiles of 64 keys are filled with cp.async (16-byte copies; rows past Lq / Lkv zero-filled) in the
  layouts wgmma reads through its shared-memory descriptors; block i+1 is in flight while block i is
  computed; only keys up to the last one visible from the tile are loaded.
- Per block: cp.async wait + fence.proxy.async + barrier; S = Q K^T with 8 wgmma m64n64k16 (fresh
  accumulator), causal mask (key j <= i + Lkv - Lq, j < Lkv), online softmax in base 2 (scale * log2 e folded
  into the fp32 logits; each thread owns 2 rows, row max / sum via quad shuffles), O rescaled by alpha,
  then O += P V with 4 wgmma m64n128k16 whose A operand is P converted to bf16 in registers (the
  accumulator's n8 tiles 2kk, 2kk+1 form k-step kk) and B is V from shared memory.
- Epilogue: O / l -> bf16 for rows < Lq; lse = m + log2 l by one lane per row.
What limits it: 1.1e11 FLOP (SOL ~0.11 ms at the wgmma peak). Softmax is not overlapped with the wgmmas
inside a warpgroup (two CTAs per SM overlap each other), and K/V tiles are re-read from L2 by the 8 query
heads of a group; expect ~0.2 ms. Next steps: FA3-style ping-pong of two consumer warpgroups with a TMA
producer warp, and packing the 8 heads of a group into the row dimension.
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
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.cute.nvgpu.warpgroup import Field, OperandSource
from cutlass.tensor_utils import LayoutEnum

QO_HEADS = 16
KV_HEADS = 2
GROUP = QO_HEADS // KV_HEADS
HD = 128
TILE = 64
THREADS = 128                  # one warpgroup
LOG2E = 1.4426950408889634
M_INIT = -1.0e30


@cute.kernel
def _prefill_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
                    mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
                    sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
                    qk_mma: cute.TiledMma, pv_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    x, h, _ = cute.arch.block_idx()
    lane = tidx % 32
    kvh = h // GROUP
    nb = mQI.shape[0] - 1

    # ---- work item: reverse order over (request, tile)
    total = Int32(0)
    for bb in cutlass.range(nb):
        total = total + (mQI[bb + 1] - mQI[bb] + TILE - 1) // TILE
    if x < total:
        t = total - 1 - x
        b = Int32(0)
        qt = Int32(0)
        cum = Int32(0)
        for bb in cutlass.range(nb):
            ntl = (mQI[bb + 1] - mQI[bb] + TILE - 1) // TILE
            if t >= cum:
                if t < cum + ntl:
                    b = bb
                    qt = t - cum
            cum = cum + ntl
        qbeg = mQI[b]
        lq = mQI[b + 1] - qbeg
        kbeg = mKI[b]
        lkv = mKI[b + 1] - kbeg
        off = lkv - lq
        q0 = qt * TILE
        n_kv = cutlass.min(lkv, q0 + TILE + off)
        nkb = (n_kv + TILE - 1) // TILE

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(BFloat16, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(BFloat16, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)

        # Q tile (thread t: row t / 2, chunks 8 (t % 2) .. +7)
        r = tidx // 2
        for e in cutlass.range_constexpr(8):
            c = (tidx % 2) * 8 + e
            dst = cute.zipped_divide(sQ[r, None, 0], (8,))[(None, c)]
            if q0 + r < lq:
                cute.copy(g2s, cute.zipped_divide(mQ[qbeg + q0 + r, h, None], (8,))[(None, c)], dst)
            else:
                dst.fill(0.0)
        _load_kv(g2s, mK, mV, sK, sV, kbeg, Int32(0), n_kv, kvh, Int32(0), tidx)
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
                _load_kv(g2s, mK, mV, sK, sV, kbeg, (kb + 1) * TILE, n_kv, kvh, (kb + 1) % 2, tidx)
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
                qi = q0 + tScS[i][0]
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
            qi = q0 + tOcO[i][0]
            if qi < lq:
                mO[qbeg + qi, h, tOcO[i][1]] = (acc_o[i] / cutlass.select_(hi, lt[1], lt[0])).to(BFloat16)
        if lane % 4 == 0:
            for j in cutlass.range_constexpr(2):
                qi = q0 + r_lo + 8 * j + 16 * (tidx // 32)
                if qi < lq:
                    mL[qbeg + qi, h] = row_m[j] + cute.math.log2(lt[j])


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
def _load_kv(g2s: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, kbeg: Int32,
             r0: Int32, n: Int32, kvh: Int32, st: Int32, tidx: Int32):
    """K and V rows r0 .. r0+63 of the request (zero past n) into stage st; thread t: row t/2, 8 chunks."""
    r = tidx // 2
    for e in cutlass.range_constexpr(8):
        c = (tidx % 2) * 8 + e
        dk = cute.zipped_divide(sK[r, None, st], (8,))[(None, c)]
        dv = cute.zipped_divide(sV[None, r, st], (8,))[(None, c)]
        if r0 + r < n:
            row = kbeg + r0 + r
            cute.copy(g2s, cute.zipped_divide(mK[row, kvh, None], (8,))[(None, c)], dk)
            cute.copy(g2s, cute.zipped_divide(mV[row, kvh, None], (8,))[(None, c)], dv)
        else:
            dk.fill(0.0)
            dv.fill(0.0)


@cute.jit
def _prefill(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQI: cute.Tensor, mKI: cute.Tensor,
             mO: cute.Tensor, mL: cute.Tensor, scale_log2: Float32, stream: cuda.CUstream):
    qk_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                               (1, 1, 1), tiler_mn=(TILE, TILE))
    pv_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
                                               Float32, (1, 1, 1), tiler_mn=(TILE, HD), a_source=OperandSource.RMEM)
    sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE, TILE, HD), BFloat16, 1)
    sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE, TILE, HD), BFloat16, 2)
    sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE, HD, TILE), BFloat16, 2)
    n_items = mQ.shape[0] // TILE + mQI.shape[0] - 1
    _prefill_kernel(mQ, mK, mV, mQI, mKI, mO, mL, scale_log2, sQ_layout, sK_layout, sV_layout, qk_mma,
                    pv_mma).launch(grid=[n_items, QO_HEADS, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        tq, tkv, nptr = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (tq, QO_HEADS, HD), stride_order=(2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (tkv, KV_HEADS, HD), stride_order=(2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (tkv, KV_HEADS, HD), stride_order=(2, 1, 0), assumed_align=16)
        qi = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        ki = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (tq, QO_HEADS, HD), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (tq, QO_HEADS), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_prefill, q, k, v, qi, ki, o, lse, Float32(1.0), stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v, qo_indptr, kv_indptr, sm_scale):
    tq = q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((tq, QO_HEADS), dtype=torch.float32, device=q.device)
    if tq == 0 or qo_indptr.numel() < 2:
        return out, lse
    _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), qo_indptr.to(torch.int32).contiguous(),
                    kv_indptr.to(torch.int32).contiguous(), out, lse, float(sm_scale) * LOG2E)
    return out, lse
