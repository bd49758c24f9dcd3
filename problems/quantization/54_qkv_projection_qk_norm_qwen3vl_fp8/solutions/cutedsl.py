"""Qwen3-VL-8B fused QKV projection in FP8 (8192 tokens, hidden 4096 -> 32 q + 8 k + 8 v heads of 128) with
per-head query/key RMSNorm, in CuTe DSL: one block-scaled FP8 GEMM kernel with a fused normalization epilogue.

- FP8 GEMM qkv = dequant(x) dequant(W)^T on Hopper tensor cores (wgmma.mma_async m64n128k32 e4m3 x e4m3 ->
  fp32; e4m3 products are exact): grid (T / 128, 48 heads), 256 threads = 2 warpgroups, each owning 64 rows
  x 128 columns; the CTA tile 128 x 128 is exactly one head. One 128-wide K block (the scale granularity)
  per main-loop step: a 3-stage cp.async ring (16-byte copies) fills the 128-byte-swizzled K-major shared
  layouts wgmma reads through its descriptors, plus the 128 activation scales of the block; after cp.async
  wait + fence.proxy.async + barrier, 4 wgmma (k32) write the raw products of the block into a per-block
  fp32 tile, wait_group 0, and the tile is scaled by s_x[token, kb] * s_w[head, kb] and added to the main
  fp32 accumulator (dequantization inside the kernel, per-block promotion).
- Epilogue: a warpgroup holds whole 128-column rows, so for q and k heads the row sum of squares needs only
  the 4 lanes of a quad (2 xor shuffles); x * rsqrt(mean + 1e-6) * norm_weight in fp32; v stored as is;
  bf16 outputs.
What limits it: 4.1e11 FLOP (SOL ~0.21 ms at the fp8 wgmma peak); the per-block wait and promotion FMAs keep
it well below peak: expect ~0.4-0.5 ms (eager dequantizes to fp32 and runs an fp32 GEMM, ~8 ms). Next
steps: TMA + mbarrier pipeline with a producer warp and ping-ponging consumer warpgroups.
Host path: compiled once per (K, heads) (tvm-ffi; T symbolic), torch tensors passed directly, launch on the
caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu.warpgroup import Field, OperandMajorMode
from cutlass.tensor_utils import LayoutEnum

BLOCK = 128
FP8_MAX = 448.0
BM, BN, BK = 128, 128, 128
STAGES = 3
THREADS = 256
HD = 128
EPS = 1e-6


@cute.kernel
def _gemm_kernel(mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mQn: cute.Tensor,
                 mKn: cute.Tensor, mOq: cute.Tensor, mOk: cute.Tensor, mOv: cute.Tensor,
                 sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    mt, nt, _ = cute.arch.block_idx()
    T = mX.shape[0]
    nkb = mX.shape[1] // BK
    m0 = mt * BM
    n0 = nt * BN

    smem = cutlass.utils.SmemAllocator()
    sA = smem.allocate_tensor(Float8E4M3FN, sA_layout.outer, byte_alignment=1024, swizzle=sA_layout.inner)
    sB = smem.allocate_tensor(Float8E4M3FN, sB_layout.outer, byte_alignment=1024, swizzle=sB_layout.inner)
    sS = smem.allocate_tensor(Float32, cute.make_layout((BM, STAGES), stride=(1, BM)), byte_alignment=16)
    g16 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float8E4M3FN,
                              num_bits_per_copy=128)
    g4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)

    thr_mma = tiled_mma.get_slice(tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), Float32)
    blk = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), Float32)
    acc.fill(0.0)
    blk.fill(0.0)
    tC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))

    for p in cutlass.range_constexpr(STAGES - 1):
        if p < nkb:
            _issue(g16, g4, mX, mXs, mW, sA, sB, sS, m0, n0, p, p, T, tidx)
        cute.arch.cp_async_commit_group()

    for kb in cutlass.range(nkb):
        nxt = kb + STAGES - 1
        if nxt < nkb:
            _issue(g16, g4, mX, mXs, mW, sA, sB, sS, m0, n0, nxt, nxt % STAGES, T, tidx)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(STAGES - 1)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()
        st = kb % STAGES
        # raw fp8 products of this 128-wide K block into blk (the first wgmma overwrites it)
        cute.nvgpu.warpgroup.fence()
        tiled_mma.set(Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.gemm(tiled_mma, blk, tCrA[None, None, k, st], tCrB[None, None, k, st], blk)
            tiled_mma.set(Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        # per-block promotion: acc += blk * s_x[token, kb] * s_w[nb, kb]
        ws = mWs[nt, kb]
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + blk[i] * (sS[tC[i][0], st] * ws)
        cute.arch.barrier()                       # stage st may be overwritten by the next issue

    # ---- epilogue: head nt is q (nt < QH), k (QH <= nt < QH + KVH) or v. A warpgroup holds whole
    # 128-column rows: thread (warp w, lane 4 g + t) owns rows 16 w + g and 16 w + g + 8 of its warpgroup's
    # 64, columns 8 j + 2 t + {0, 1}; the row sums of squares need only the 4 lanes of a quad.
    qh = mOq.shape[1]
    kvh = mOk.shape[1]
    r_lo = tC[0][0] % 16                      # 0..7: this thread's first row within its 16-row slab
    ss = cute.make_rmem_tensor((2,), Float32)
    ss.fill(0.0)
    for i in cutlass.range_constexpr(cute.size(acc)):
        hi = (tC[i][0] % 16) != r_lo
        v2 = acc[i] * acc[i]
        ss[0] = ss[0] + cutlass.select_(hi, Float32(0.0), v2)
        ss[1] = ss[1] + cutlass.select_(hi, v2, Float32(0.0))
    for j in cutlass.range_constexpr(2):
        ss[j] = ss[j] + cute.arch.shuffle_sync_bfly(ss[j], offset=1)
        ss[j] = ss[j] + cute.arch.shuffle_sync_bfly(ss[j], offset=2)
    inv = cute.make_rmem_tensor((2,), Float32)
    for j in cutlass.range_constexpr(2):
        inv[j] = cute.math.rsqrt(ss[j] / Float32(HD) + Float32(EPS))
    for i in cutlass.range_constexpr(cute.size(acc)):
        row = m0 + tC[i][0]
        col = tC[i][1]
        if row < T:
            iv = cutlass.select_((tC[i][0] % 16) != r_lo, inv[1], inv[0])
            if nt < qh:
                mOq[row, nt, col] = ((acc[i] * iv) * Float32(mQn[col])).to(BFloat16)
            elif nt < qh + kvh:
                mOk[row, nt - qh, col] = ((acc[i] * iv) * Float32(mKn[col])).to(BFloat16)
            else:
                mOv[row, nt - qh - kvh, col] = acc[i].to(BFloat16)


@cute.jit
def _issue(g16: cute.CopyAtom, g4: cute.CopyAtom, mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor,
           sA: cute.Tensor, sB: cute.Tensor, sS: cute.Tensor, m0: Int32, n0: Int32, kb: Int32, st: Int32, T: Int32,
           tidx: Int32):
    """cp.async of K block kb: A [128 x 128] fp8 (rows past T zero-filled), B [128 x 128] fp8, 128 scales."""
    for it in cutlass.range_constexpr(BM * (BK // 16) // THREADS):
        cid = tidx + THREADS * it
        r = cid // (BK // 16)
        c = cid % (BK // 16)
        dst = cute.zipped_divide(sA[r, None, st], (16,))[(None, c)]
        if m0 + r < T:
            cute.copy(g16, cute.zipped_divide(mX[m0 + r, None], (16,))[(None, kb * (BK // 16) + c)], dst)
        else:
            dst.fill(0.0)
    for it in cutlass.range_constexpr(BN * (BK // 16) // THREADS):
        cid = tidx + THREADS * it
        r = cid // (BK // 16)
        c = cid % (BK // 16)
        cute.copy(g16, cute.zipped_divide(mW[n0 + r, None], (16,))[(None, kb * (BK // 16) + c)],
                  cute.zipped_divide(sB[r, None, st], (16,))[(None, c)])
    if tidx < BM:
        dsts = cute.zipped_divide(sS[None, st], (1,))[(None, tidx)]
        if m0 + tidx < T:
            cute.copy(g4, cute.zipped_divide(mXs[m0 + tidx, None], (1,))[(None, kb)], dsts)
        else:
            dsts.fill(0.0)


@cute.jit
def _qkv(mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mQn: cute.Tensor, mKn: cute.Tensor,
         mOq: cute.Tensor, mOk: cute.Tensor, mOv: cute.Tensor, stream: cuda.CUstream):
    T = mX.shape[0]
    tiled_mma = sm90_utils.make_trivial_tiled_mma(Float8E4M3FN, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K,
                                                  Float32, (2, 1, 1), tiler_mn=(64, BN))
    sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BM, BN, BK), Float8E4M3FN, STAGES)
    sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BM, BN, BK), Float8E4M3FN, STAGES)
    _gemm_kernel(mX, mXs, mW, mWs, mQn, mKn, mOq, mOk, mOv, sA_layout, sB_layout, tiled_mma).launch(
        grid=[(T + BM - 1) // BM, mW.shape[0] // BN, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled(k, qh, kvh):
    fn = _COMPILED.get((k, qh, kvh))
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        t = cute.sym_int32()
        n = (qh + 2 * kvh) * HD
        x = make_fake_compact_tensor(Float8E4M3FN, (t, k), stride_order=(1, 0), assumed_align=16)
        xs = make_fake_compact_tensor(Float32, (t, k // BLOCK), stride_order=(1, 0), assumed_align=4)
        w = make_fake_compact_tensor(Float8E4M3FN, (n, k), stride_order=(1, 0), assumed_align=16)
        ws = make_fake_compact_tensor(Float32, (n // BLOCK, k // BLOCK), stride_order=(1, 0), assumed_align=4)
        qn = make_fake_compact_tensor(BFloat16, (HD,), assumed_align=16)
        kn = make_fake_compact_tensor(BFloat16, (HD,), assumed_align=16)
        oq = make_fake_compact_tensor(BFloat16, (t, qh, HD), stride_order=(2, 1, 0), assumed_align=16)
        ok = make_fake_compact_tensor(BFloat16, (t, kvh, HD), stride_order=(2, 1, 0), assumed_align=16)
        ov = make_fake_compact_tensor(BFloat16, (t, kvh, HD), stride_order=(2, 1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_qkv, x, xs, w, ws, qn, kn, oq, ok, ov, stream, options="--enable-tvm-ffi")
        _COMPILED[(k, qh, kvh)] = fn
    return fn


def solve(x_fp8, x_scale, qkv_weight, qkv_weight_scale, q_norm_weight, k_norm_weight):
    t, k = x_fp8.shape
    n = qkv_weight.shape[0]
    kvh = n // HD // 6
    qh = 4 * kvh
    assert (qh + 2 * kvh) * HD == n and k % BLOCK == 0
    dev = x_fp8.device
    oq = torch.empty((t, qh, HD), dtype=torch.bfloat16, device=dev)
    ok = torch.empty((t, kvh, HD), dtype=torch.bfloat16, device=dev)
    ov = torch.empty((t, kvh, HD), dtype=torch.bfloat16, device=dev)
    if t == 0:
        return oq, ok, ov
    _get_compiled(k, qh, kvh)(x_fp8.contiguous(), x_scale.contiguous(), qkv_weight.contiguous(),
                              qkv_weight_scale.contiguous(), q_norm_weight.contiguous(), k_norm_weight.contiguous(),
                              oq, ok, ov)
    return oq, ok, ov
