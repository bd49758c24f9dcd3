"""Qwen3-VL-8B fused QKV projection in FP8 (8192 tokens, hidden 4096 -> 32 q + 8 k + 8 v heads of 128) with
per-head query/key RMSNorm, in CuTe DSL: one block-scaled FP8 GEMM kernel with a fused normalization epilogue.

- FP8 GEMM qkv = dequant(x) dequant(W)^T on tensor cores (warp-level mma.sync m16n8k32 e4m3 x e4m3 -> fp32;
  e4m3 products are exact): grid (T / 128, 48 heads), 256 threads = 8 warps as 4 (M) x 2 (N); the CTA
  tile 128 x 128 is exactly one head. One 128-wide K block (the scale granularity) per main-loop step; a
  3-stage cp.async ring (16-byte copies; fp8 rows padded to 144 B for conflict-free 32-bit fragment loads)
  holds the A / B tiles and the 128 activation scales of the block; the raw products of a K block
  accumulate in a per-block fp32 tile that is scaled by s_x[token, kb] * s_w[head, kb] and added to the
  main fp32 accumulator (dequantization inside the kernel, per-block promotion).
- Epilogue: for q and k heads, the sum of squares of each row (128 columns: per-thread partials, quad
  shuffles, and the two column warps combined through a shared fp32 slot - a sum of two terms, so exact
  and order-free) gives x * rsqrt(mean + 1e-6) * norm_weight in fp32; v is stored as is; bf16 outputs.
What limits it: 4.1e11 FLOP on warp-level fp8 mma.sync (SOL ~0.21 ms at the fp8 wgmma peak; expect
~0.6-0.8 ms here - eager dequantizes to fp32 and runs an fp32 GEMM, ~8 ms). Next step: fp8 wgmma with
TMA-fed shared-memory operands (same per-block promotion and fused epilogue).
Host path: compiled once per (K, heads) (tvm-ffi; T symbolic), torch tensors passed directly, launch on the
caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); not yet run on the H200.
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32
from cutlass.cute.nvgpu import cpasync, warp

BLOCK = 128
FP8_MAX = 448.0
BM, BN, BK = 128, 128, 128
PAD = 144                      # padded fp8 row (bytes) in shared memory
STAGES = 3
THREADS = 256
HD = 128
EPS = 1e-6


@cute.kernel
def _gemm_kernel(mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mQn: cute.Tensor,
                 mKn: cute.Tensor, mOq: cute.Tensor, mOk: cute.Tensor, mOv: cute.Tensor, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    mt, nt, _ = cute.arch.block_idx()
    T = mX.shape[0]
    nkb = mX.shape[1] // BK
    m0 = mt * BM
    n0 = nt * BN

    smem = cutlass.utils.SmemAllocator()
    sA = smem.allocate_tensor(Float8E4M3FN, cute.make_layout((BM, BK, STAGES), stride=(PAD, 1, BM * PAD)),
                              byte_alignment=128)
    sB = smem.allocate_tensor(Float8E4M3FN, cute.make_layout((BN, BK, STAGES), stride=(PAD, 1, BN * PAD)),
                              byte_alignment=128)
    sS = smem.allocate_tensor(Float32, cute.make_layout((BM, STAGES), stride=(1, BM)), byte_alignment=16)
    sSS = smem.allocate_tensor(Float32, cute.make_layout((BM,)), byte_alignment=16)
    g16 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float8E4M3FN,
                              num_bits_per_copy=128)
    g4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)

    thr_mma = tiled_mma.get_slice(tidx)
    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), Float32)
    acc.fill(0.0)
    acc_mn = _mn_view(acc)
    tC = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))

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
        cute.arch.barrier()
        st = kb % STAGES
        tAsA = thr_mma.partition_A(sA[None, None, st])
        tBsB = thr_mma.partition_B(sB[None, None, st])
        tArA = thr_mma.make_fragment_A(tAsA)
        tBrB = thr_mma.make_fragment_B(tBsB)
        blk = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), Float32)
        blk.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(tAsA.shape[2])):
            cute.autovec_copy(tAsA[None, None, k], tArA[None, None, k])
            cute.autovec_copy(tBsB[None, None, k], tBrB[None, None, k])
            cute.gemm(tiled_mma, blk, tArA[None, None, k], tBrB[None, None, k], blk)
        ws = mWs[nt, kb]
        blk_mn = _mn_view(blk)
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            sc = sS[tC[r, 0][0], st] * ws
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                acc_mn[r, c] = acc_mn[r, c] + blk_mn[r, c] * sc
        cute.arch.barrier()                       # stage st may be overwritten by the next issue

    # ---- epilogue: head nt is q (nt < QH), k (QH <= nt < QH + KVH) or v
    qh = mOq.shape[1]
    kvh = mOk.shape[1]
    if tidx < BM:
        sSS[tidx] = Float32(0.0)
    cute.arch.barrier()
    is_norm = nt < qh + kvh
    if is_norm:
        lane = tidx % 32
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            ps = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                ps = ps + acc_mn[r, c] * acc_mn[r, c]
            ps = ps + cute.arch.shuffle_sync_bfly(ps, offset=1)
            ps = ps + cute.arch.shuffle_sync_bfly(ps, offset=2)
            if lane % 4 == 0:
                cute.arch.atomic_add(sSS.iterator + tC[r, 0][0], ps)
    cute.arch.barrier()
    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
        rl = tC[r, 0][0]
        row = m0 + rl
        if row < T:
            if nt < qh:
                inv = cute.math.rsqrt(sSS[rl] / Float32(HD) + Float32(EPS))
                gO = mOq[row, nt, None]
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    col = tC[0, c][1]
                    gO[col] = ((acc_mn[r, c] * inv) * Float32(mQn[col])).to(BFloat16)
            elif nt < qh + kvh:
                inv = cute.math.rsqrt(sSS[rl] / Float32(HD) + Float32(EPS))
                gO = mOk[row, nt - qh, None]
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    col = tC[0, c][1]
                    gO[col] = ((acc_mn[r, c] * inv) * Float32(mKn[col])).to(BFloat16)
            else:
                gO = mOv[row, nt - qh - kvh, None]
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    gO[tC[0, c][1]] = acc_mn[r, c].to(BFloat16)


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


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def _qkv(mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mQn: cute.Tensor, mKn: cute.Tensor,
         mOq: cute.Tensor, mOk: cute.Tensor, mOv: cute.Tensor, stream: cuda.CUstream):
    T = mX.shape[0]
    tiled_mma = cute.make_tiled_mma(warp.MmaFP8Op(Float8E4M3FN, Float32, (16, 8, 32)), (4, 2, 1))
    _gemm_kernel(mX, mXs, mW, mWs, mQn, mKn, mOq, mOk, mOv, tiled_mma).launch(
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
