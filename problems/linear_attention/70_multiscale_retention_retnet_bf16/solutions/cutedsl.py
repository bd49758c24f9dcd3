"""RetNet multi-scale retention, parallel form (8 heads, key dim 256, value dim 512, 8 x 1024 tokens) in
CuTe DSL: a causal flash-attention-like tensor-core kernel without softmax (warp-level mma.sync m16n8k16,
bf16 in, fp32 accumulate).

    o_i = sum_{j <= i} gamma_h^(i - j) (q_i . k_j / 16) v_j,   gamma_h = 1 - 2^(-5 - h)
Launch geometry
- Grid (16 row tiles of 64 queries, B*H); heavy (late) row tiles are launched first. 256 threads = 8
  warps as 4 (rows, 16 each) x 2 (columns); one CTA per SM (136 KiB of shared memory).
- Q_I [64 x 256] is staged once with cp.async (16 B, zero-filled past T). For key tiles J = 0..I:
    S = Q_I K_J^T: each warp computes its 16 rows x 32 of the 64 key columns (no duplicated work);
    P = S / 16 * exp2((i - j) log2 gamma) (zero above the diagonal on J = I), rounded to bf16 and
    exchanged through a 64 x 64 shared tile; O[16 rows x 256 value columns per warp] += P V_J (V through
    ldmatrix.trans), 128 fp32 accumulators per thread.
  Loads are split-phase: V_J is fetched (cp.async) while S is computed, K_{J+1} while P V_J is computed.
- Epilogue: O (bf16) stored for rows < T.
Numerics: fp32 accumulation; P carries one bf16 rounding (2^-9 relative), well inside the bf16-output
allowance.
What limits it: tensor-core issue with warp-level mma.sync (~5.2e10 FLOP; SOL 0.052 ms at the wgmma
peak), the L2 traffic of re-reading K/V per row tile (~0.8 GB) and register pressure (128 fp32
accumulators per thread: 255 registers, ~70 B spilled per thread); expected ~0.15-0.2 ms. Next steps:
wgmma with shared-memory operands (FA3-style), 128-row tiles.
Host path: compiled once per process (tvm-ffi; B and T symbolic), torch tensors passed directly, launch on
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

HEADS = 8
DK = 256
DV = 512
TILE = 64
THREADS = 256
QK_SCALE = DK ** -0.5
NCHUNK = DV // 2 // 32          # 32-column chunks per warp in P V


@cute.kernel
def _ret_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                sQK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
                g2s: cute.TiledCopy, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    bx, bh, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32
    T = mQ.shape[1]
    n_tiles = (T + TILE - 1) // TILE
    tI = n_tiles - 1 - bx                      # heaviest row tiles first
    h = bh % HEADS
    lg = cute.math.log2(Float32(1.0) - cute.math.exp2(Float32(-5.0) - Float32(h)))   # log2 gamma_h

    smem = cutlass.utils.SmemAllocator()
    sQ = smem.allocate_tensor(BFloat16, sQK_layout, byte_alignment=1024)
    sK = smem.allocate_tensor(BFloat16, sQK_layout, byte_alignment=1024)
    sV = smem.allocate_tensor(BFloat16, sV_layout, byte_alignment=1024)
    sP = smem.allocate_tensor(BFloat16, sP_layout, byte_alignment=1024)
    sVt = cute.composition(sV, cute.make_layout((DV, TILE), stride=(TILE, 1)))

    mQt = mQ[bh, None, None]
    mKt = mK[bh, None, None]
    mVt = mV[bh, None, None]
    idQK = cute.make_identity_tensor(mQt.shape)
    idV = cute.make_identity_tensor(mVt.shape)
    thr_g = g2s.get_slice(tidx)

    _load_rows(g2s, thr_g.partition_S(cute.local_tile(mQt, (TILE, DK), (tI, 0))), thr_g.partition_D(sQ),
               thr_g.partition_S(cute.local_tile(idQK, (TILE, DK), (tI, 0))), T)
    _load_rows(g2s, thr_g.partition_S(cute.local_tile(mKt, (TILE, DK), (0, 0))), thr_g.partition_D(sK),
               thr_g.partition_S(cute.local_tile(idQK, (TILE, DK), (0, 0))), T)
    cute.arch.cp_async_commit_group()

    thr_mma = tiled_mma.get_slice(tidx)
    tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
    tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
    tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
    tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
    s2r_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                       BFloat16), tiled_mma)
    s2r_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                       BFloat16), tiled_mma)
    s2r_bt = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                                        BFloat16), tiled_mma)
    r2s_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16), tiled_mma)
    thr_a = s2r_a.get_slice(tidx)
    thr_b = s2r_b.get_slice(tidx)
    thr_bt = s2r_bt.get_slice(tidx)
    thr_c = r2s_c.get_slice(tidx)
    tSsQ = thr_a.partition_S(sQ)
    tSrQ_v = thr_a.retile(tSrQ)
    tSsK = thr_b.partition_S(sK)
    tSrK_v = thr_b.retile(tSrK)
    tOsP = thr_a.partition_S(sP)
    tOrP_v = thr_a.retile(tOrP)
    tOsVt = thr_bt.partition_S(sVt)
    tOrVt_v = thr_bt.retile(tOrVt)
    tPsP = thr_c.partition_D(sP)

    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE, DV)), Float32)
    acc.fill(0.0)
    acc_c = cute.make_tensor(acc.iterator, cute.logical_divide(acc.layout, (None, None, 4)))

    for J in cutlass.range(tI + 1):
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()                    # K_J visible; previous P V reads of sP / sV finished
        _load_rows(g2s, thr_g.partition_S(cute.local_tile(mVt, (TILE, DV), (J, 0))), thr_g.partition_D(sV),
                   thr_g.partition_S(cute.local_tile(idV, (TILE, DV), (J, 0))), T)
        cute.arch.cp_async_commit_group()

        s = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE, TILE)), Float32)
        s.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(tSsQ.shape[2])):
            cute.copy(s2r_a, tSsQ[None, None, k], tSrQ_v[None, None, k])
            cute.copy(s2r_b, tSsK[None, None, k], tSrK_v[None, None, k])
            cute.gemm(tiled_mma, s, tSrQ[None, None, k], tSrK[None, None, k], s)
        s_mn = _mn_view(s)
        # i - j from a lane-derived base (warps 4 (rows) x 2 (column strips of 8): row = 16 (w % 4) + g + 8 r,
        # col = 16 (q / 2) + 8 (w / 4) + 2 t + q % 2): the per-element coordinates are compile-time offsets
        d0 = (tI - J) * TILE + 16 * (wid % 4) + lane // 4 - 8 * (wid // 4) - 2 * (lane % 4)
        for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
            for q in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
                dist = d0 + 8 * r - (16 * (q // 2) + q % 2)
                w = cute.math.exp2(Float32(dist) * lg, fastmath=True) * Float32(QK_SCALE)
                s_mn[r, q] = cutlass.select_(dist >= 0, s_mn[r, q] * w, Float32(0.0))
        rP = cute.make_fragment_like(s, BFloat16)
        rP.store(s.load().to(BFloat16))
        cute.copy(r2s_c, thr_c.retile(rP), tPsP)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()                    # P tile and V_J visible; all S reads of sK done
        if J < tI:
            _load_rows(g2s, thr_g.partition_S(cute.local_tile(mKt, (TILE, DK), (J + 1, 0))),
                       thr_g.partition_D(sK),
                       thr_g.partition_S(cute.local_tile(idQK, (TILE, DK), (J + 1, 0))), T)
        cute.arch.cp_async_commit_group()
        # P V_J in column chunks of 32 (4 n-tiles): only 8 B-fragment registers live at a time
        for k in cutlass.range_constexpr(cute.size(tOsP.shape[2])):
            cute.copy(s2r_a, tOsP[None, None, k], tOrP_v[None, None, k])
            for cn in cutlass.range_constexpr(NCHUNK):
                cute.copy(s2r_bt, tOsVt[None, (None, cn), k], tOrVt_v[None, (None, cn), k])
                cute.gemm(tiled_mma, acc_c[None, None, (None, cn)], tOrP[None, None, k],
                          tOrVt[None, (None, cn), k], acc_c[None, None, (None, cn)])

    # epilogue: convert to bf16 first (frees the fp32 accumulators), then store rows < T
    rO = cute.make_fragment_like(acc, BFloat16)
    rO.store(acc.load().to(BFloat16))
    rO_mn = _mn_view(rO)
    tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE, DV))))
    for r in cutlass.range_constexpr(cute.size(rO_mn.shape[0])):
        row = tI * TILE + tOcO[r, 0][0]
        if row < T:
            gOr = mO[bh, row, None]
            for q in cutlass.range_constexpr(cute.size(rO_mn.shape[1])):
                gOr[tOcO[0, q][1]] = rO_mn[r, q]


@cute.jit
def _load_rows(tiled_copy: cute.TiledCopy, tS: cute.Tensor, tD: cute.Tensor, tC: cute.Tensor, L: Int32):
    """Predicated cp.async of a tile: rows with coordinate >= L are zero-filled."""
    for m in cutlass.range_constexpr(cute.size(tD.shape[1])):
        if tC[0, m, 0][0] < L:
            cute.copy(tiled_copy, tS[None, m, None], tD[None, m, None])
        else:
            tD[None, m, None].fill(0)


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def _ret(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    sQK_layout = cute.tile_to_shape(atom, (TILE, DK), (0, 1))
    sV_layout = cute.tile_to_shape(atom, (TILE, DV), (0, 1))
    sP_layout = cute.tile_to_shape(atom, (TILE, TILE), (0, 1))
    cp_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)
    g2s = cute.make_tiled_copy_tv(cp_atom, cute.make_layout((32, 8), stride=(8, 1)), cute.make_layout((1, 8)))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (4, 2, 1),
                                    permutation_mnk=(64, 16, 16))
    T = mQ.shape[1]
    _ret_kernel(mQ, mK, mV, mO, sQK_layout, sV_layout, sP_layout, g2s, tiled_mma).launch(
        grid=[(T + TILE - 1) // TILE, mQ.shape[0], 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        n, t = cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (n, t, DK), stride_order=(2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (n, t, DK), stride_order=(2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (n, t, DV), stride_order=(2, 1, 0), assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (n, t, DV), stride_order=(2, 1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_ret, q, k, v, o, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v):
    b, h, t, dk = q.shape
    assert (h, dk, v.shape[-1]) == (HEADS, DK, DV)
    out = torch.empty((b, h, t, DV), dtype=q.dtype, device=q.device)
    if b == 0 or t == 0:
        return out
    _get_compiled()(q.contiguous().view(b * h, t, DK), k.contiguous().view(b * h, t, DK),
                    v.contiguous().view(b * h, t, DV), out.view(b * h, t, DV))
    return out
