"""Qwen3-VL-32B attention output projection in FP8 (8192 tokens, 8192 -> 5120): dynamic per-(token, 128)
activation quantization, then a 128x128 block-scaled FP8 GEMM, in CuTe DSL. Two kernels:

1. Activation quantization (warp per (token, 2 groups)): per 128-channel group scale = amax / 448 (fp32),
   q = e4m3(x / scale) (IEEE division, cvt.rn.satfinite: round to nearest even; |x / scale| <= 448 so the
   clamp never changes a value) into cached fp8 / fp32 workspaces.
2. FP8 GEMM out = dequant(q) dequant(W)^T on tensor cores (warp-level mma.sync m16n8k32 e4m3 x e4m3 ->
   fp32; e4m3 products are exact): grid (T / 128, N / 128), 256 threads = 8 warps as 4 (M) x 2 (N), CTA
   tile 128 x 128, one 128-wide K block (the scale granularity) per main-loop step. A 3-stage cp.async ring
   (16-byte copies; fp8 rows padded to 144 B for conflict-free 32-bit fragment loads) holds the A / B tiles
   and the 128 activation scales of the block; the raw products of a K block accumulate in a per-block fp32
   tile, which is scaled by s_x[token, kb] * s_w[nb, kb] and added to the main fp32 accumulator
   (dequantization inside the kernel, per-block promotion). bf16 output.
What limits it: 6.9e11 FLOP on warp-level fp8 mma.sync (SOL ~0.35 ms at the fp8 wgmma peak; expect
~1-1.3 ms here - eager dequantizes to fp32 and runs an fp32 GEMM, ~14 ms). Next step: fp8 wgmma with
TMA-fed shared-memory operands (the per-block promotion stays the same).
Host path: compiled once per (K, N) (tvm-ffi; T symbolic), torch tensors passed directly, launches on the
caller's current torch stream; quantized-activation workspaces cached per (device, T, K).

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
QG = 2                         # 128-channel groups per warp in the quantization kernel


@cute.kernel
def _quant_kernel(mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
    """mX [T, K] bf16 -> mQ [T, K] e4m3, mS [T, K / 128] fp32; a warp handles 2 groups of one token."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    T = mX.shape[0]
    ng = mX.shape[1] // BLOCK
    lane = tidx % 32
    wg = bidx * (THREADS // 32) + tidx // 32           # global warp index
    t = wg // (ng // QG)
    g0 = (wg % (ng // QG)) * QG
    if t < T:
        for gi in cutlass.range_constexpr(QG):
            g = g0 + gi
            xr = cute.make_rmem_tensor((4,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(mX[t, None], (4,))[(None, g * 32 + lane)], xr)
            xv = xr.load().to(Float32)
            am = Float32(0.0)
            for e in cutlass.range_constexpr(4):
                am = cute.arch.fmax(am, cute.math.abs(xv[e]))
            for off in (16, 8, 4, 2, 1):
                am = cute.arch.fmax(am, cute.arch.shuffle_sync_bfly(am, offset=off))
            sc = cute.arch.fmax(am, Float32(1e-12)) / Float32(FP8_MAX)
            qv = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                qv[e] = xv[e] / sc
            q8 = cute.make_rmem_tensor((4,), Float8E4M3FN)
            q8.store(qv.load().to(Float8E4M3FN))
            cute.autovec_copy(q8, cute.zipped_divide(mQ[t, None], (4,))[(None, g * 32 + lane)])
            if lane == 0:
                mS[t, g] = sc


@cute.kernel
def _gemm_kernel(mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mOut: cute.Tensor,
                 tiled_mma: cute.TiledMma):
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

    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
        row = m0 + tC[r, 0][0]
        if row < T:
            gO = mOut[row, None]
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                gO[n0 + tC[0, c][1]] = acc_mn[r, c].to(BFloat16)


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
def _oproj(mA: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, mQ: cute.Tensor, mQs: cute.Tensor,
           mOut: cute.Tensor, stream: cuda.CUstream):
    T = mA.shape[0]
    ng = mA.shape[1] // BLOCK
    nwarps = T * (ng // QG)
    _quant_kernel(mA, mQ, mQs).launch(grid=[(nwarps + 7) // 8, 1, 1], block=[THREADS, 1, 1], stream=stream)
    tiled_mma = cute.make_tiled_mma(warp.MmaFP8Op(Float8E4M3FN, Float32, (16, 8, 32)), (4, 2, 1))
    _gemm_kernel(mQ, mQs, mW, mWs, mOut, tiled_mma).launch(
        grid=[(T + BM - 1) // BM, mW.shape[0] // BN, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(k, n):
    fn = _COMPILED.get((k, n))
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        t = cute.sym_int32()
        a = make_fake_compact_tensor(BFloat16, (t, k), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(Float8E4M3FN, (n, k), stride_order=(1, 0), assumed_align=16)
        ws = make_fake_compact_tensor(Float32, (n // BLOCK, k // BLOCK), stride_order=(1, 0), assumed_align=4)
        q = make_fake_compact_tensor(Float8E4M3FN, (t, k), stride_order=(1, 0), assumed_align=16)
        qs = make_fake_compact_tensor(Float32, (t, k // BLOCK), stride_order=(1, 0), assumed_align=4)
        out = make_fake_compact_tensor(BFloat16, (t, n), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_oproj, a, w, ws, q, qs, out, stream, options="--enable-tvm-ffi")
        _COMPILED[(k, n)] = fn
    return fn


def solve(attn_output, weight, weight_scale):
    t, k = attn_output.shape
    n = weight.shape[0]
    assert k % (BLOCK * QG) == 0 and n % BN == 0
    dev = attn_output.device
    out = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
    if t == 0:
        return out
    key = (str(dev), t, k)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((t, k), dtype=torch.float8_e4m3fn, device=dev),
              torch.empty((t, k // BLOCK), dtype=torch.float32, device=dev))
        _WORKSPACE[key] = ws
    _get_compiled(k, n)(attn_output.contiguous(), weight.contiguous(), weight_scale.contiguous(), ws[0], ws[1], out)
    return out
