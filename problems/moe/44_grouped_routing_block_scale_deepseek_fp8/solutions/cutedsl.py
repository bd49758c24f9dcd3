"""DeepSeek-V3 MoE layer on one EP rank (grouped sigmoid top-8 routing with correction bias, 32 local
FP8 block-scaled SwiGLU experts, T = 14107, hidden 7168, intermediate 2048) in CuTe DSL: six
kernels launched back to back by one compiled host function.

K1 routing: one warp per token, lane l holds experts 8l..8l+7 (two 128-bit loads of fp32
   logits): s = sigmoid(logit), b = s + bias; group score = top-2 sum of b over the 32 experts of
   a group (4 lanes, quad shuffles merge top-2 lists); the 4 best groups are kept (every lane
   ranks its group against the 8 shuffled group scores); 8 rounds of warp argmax choose the
   experts (value desc, id asc); w = s[chosen] / sum * 2.5. Chosen experts of this rank take a
   slot with an atomic counter.
K2 schedule (1 CTA): per local expert 128-row tiles, exclusive scan -> padded row offsets (tiles
   never mix experts), tile -> expert table, tile count; counters reset for the next call.
K3 gather: one CTA per token copies its fp8 row (128-bit accesses) and its 56 activation block
   scales to each local (token, expert) row of the padded expert-major buffers.
K4 up-projection (grouped FP8 GEMM, DeepSeek-style block scaling): CTA (64-column n-tile, row
   tile); per 128-deep k-step TMA brings the fp8 A tile (128 x 128) and the fp8 gate and up B tiles
   (64 x 128 each) into a 6-stage mbarrier ring; wgmma e4m3 x e4m3 -> fp32 (m64n64k32, two
   accumulators sharing A) into temporaries that are promoted after each k-step:
   acc += tmp * a_scale[row, kb] * w_scale[n_block, kb] (fp32; this also bounds the reduced-
   precision wgmma fp8 accumulation to 128 products). Epilogue: inner = silu(gate) * up in fp32,
   then split into two fp8 terms with per-(row, 64-column) scales: hi = e4m3(inner / s_hi),
   lo = e4m3((inner - hi s_hi) / s_lo) (quad-shuffle row amax); hi|lo and their scales stored.
K5 down-projection (grouped FP8 GEMM): A = [hi | lo] (K = 2 x 2048), B = w2 tiles read twice
   (k mod 2048), per-64 promotion with a_scale[row, kb] * w2_scale[n_block, kb'] -> y tile (fp32)
   -> bf16, TMA-stored. The hi/lo split keeps the second GEMM on the fp8 tensor cores while its
   activation error stays ~2^-8 relative (a single e4m3 term, ~2^-5, would exceed the bf16
   tolerance; emulated on CPU: 0.27x of the allowance at full H, I).
K6 combine: one CTA per token: out = sum over its local experts of w_k y[row] (fp32) -> bf16; 0 for
   tokens without a local expert.
What limits it: tensor-core time (~1.24 TFLOP of fp8 work incl. the doubled second GEMM, ~630 us at
the 1979 TFLOP/s fp8 peak) and the per-k-step promotion (the wgmma group is waited on before
promoting, so MMA and promotion do not overlap); weights are 1.41 GB (300 us of DRAM). Expected
~1.2-1.6 ms. Next steps: double-buffered temporaries to overlap promotion, warp specialization.
Host path: compiled once per shape with tvm-ffi (symbolic token count); fp8 tensors are passed as
uint8 views and reinterpreted in the kernel; workspaces cached per (device, shapes).
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
Review 2026-11-29 (no GPU): fixed K4/K5 fragment coordinates (tCcC from the warpgroup slice gave all threads thread 0's row/col for scales and stores; now get_slice(tidx)).
"""

import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32, Int64, Uint8

NUM_EXPERTS = 256
NUM_GROUPS = 8
TOPK_GROUPS = 4
TOP_K = 8
BLOCK = 128
FP8_MAX = 448.0
QB = 64                          # block width of the fp8 re-quantization of the intermediate
BM = 128
MMA_THREADS = 256
ATOM_LAYOUT = (2, 1, 1)
EPI_TILE = (128, 32)
EPI_STAGES = 4
UP_BN, UP_BK, UP_STAGES = 64, 128, 6
DN_BN, DN_BK, DN_STAGES = 128, 64, 8
VEC = 8
K1_WARPS = 8
SCHED_THREADS = 128
ROW_THREADS = 256


def _max_tiles(ntok: int, local: int) -> int:
    return (ntok * TOP_K) // BM + local + 1


def _make_gemm(kind: str, bn: int, bk: int, stages: int, inter: int):
    up = kind == "up"
    n_b = 2 if up else 1
    k_half = inter // bk              # down: k-tiles per term (B is re-read for the lo term)

    @cute.kernel
    def _gemm(tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b0: cute.CopyAtom, mB0: cute.Tensor,
              tma_b1: cute.CopyAtom, mB1: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor,
              mAS: cute.Tensor, mBS: cute.Tensor, mQ: cute.Tensor, mQS: cute.Tensor, mSched: cute.Tensor,
              mMeta: cute.Tensor, tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout,
              b_smem_layout: cute.ComposedLayout, epi_smem_layout: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        pid_n, tile, _ = cute.arch.block_idx()
        if tile < mMeta[0]:
            e = mSched[tile]

            @cute.struct
            class SharedStorage:
                bars: cute.struct.MemRange[Int64, stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(a_smem_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(b_smem_layout) * n_b], 1024]

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            a_stage = cute.slice_(a_smem_layout, (None, None, 0))
            b_stage = cute.slice_(b_smem_layout, (None, None, 0))
            tx_bytes = cute.size_in_bytes(Float8E4M3FN, a_stage) + n_b * cute.size_in_bytes(Float8E4M3FN, b_stage)
            mainloop = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
            sB0 = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
            sB1 = sB0
            if cutlass.const_expr(up):
                sB1 = cute.make_tensor(sB0.iterator + cute.cosize(b_smem_layout), sB0.layout)

            tiler = (BM, bn, bk)
            gA = cute.local_tile(mA, tiler, (tile, pid_n, None), proj=(1, None, 1))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                          cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            gB0 = cute.local_tile(mB0, tiler, (tile, pid_n, None, e), proj=(None, 1, 1))
            tB0s, tB0g = cute.nvgpu.cpasync.tma_partition(tma_b0, 0, cute.make_layout(1),
                                                          cute.group_modes(sB0, 0, 2), cute.group_modes(gB0, 0, 2))
            tB1s, tB1g = tB0s, tB0g
            if cutlass.const_expr(up):
                gB1 = cute.local_tile(mB1, tiler, (tile, pid_n, None, e), proj=(None, 1, 1))
                tB1s, tB1g = cute.nvgpu.cpasync.tma_partition(tma_b1, 0, cute.make_layout(1),
                                                              cute.group_modes(sB1, 0, 2), cute.group_modes(gB1, 0, 2))

            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(wg))
            tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((BM, bn)))   # per-thread coords
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB0))
            tCrB1 = tCrB0
            if cutlass.const_expr(up):
                tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB1))
            acc0 = cute.make_rmem_tensor(tCcC.shape, Float32)
            tmp0 = cute.make_rmem_tensor(tCcC.shape, Float32)
            acc0.fill(0.0)
            acc1 = acc0
            tmp1 = tmp0
            if cutlass.const_expr(up):
                acc1 = cute.make_rmem_tensor(tCcC.shape, Float32)
                tmp1 = cute.make_rmem_tensor(tCcC.shape, Float32)
                acc1.fill(0.0)
            nval = cute.size(acc0)

            # rows of this thread: wgmma C fragment values v = v0 + 2*v1 + 4*j at (row m0 + 8*v1,
            # col n0 + v0 + 8*j)
            m0, n0 = tCcC[0]
            row0 = tile * BM + m0
            row1 = row0 + 8
            if cutlass.const_expr(up):
                nb0 = (pid_n * bn) // BLOCK                      # gate row block
                nb1 = (inter + pid_n * bn) // BLOCK              # up row block
            else:
                nb0 = (pid_n * bn) // BLOCK
                nb1 = nb0

            cute.arch.sync_threads()
            k_tiles = cute.size(gA, mode=[2])
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            num_k_blocks = cute.size(tCrA, mode=[2])
            n_pro = cutlass.min(stages, k_tiles)
            for kt in cutlass.range(-n_pro, k_tiles, unroll=1):
                if kt >= 0:
                    # scales of this k-step (issued before waiting on the stage)
                    sa0 = mAS[row0, kt]
                    sa1 = mAS[row1, kt]
                    if cutlass.const_expr(up):
                        sb0 = mBS[e, nb0, kt]
                        sb1 = mBS[e, nb1, kt]
                    else:
                        sb0 = mBS[e, nb0, (kt % k_half) * bk // BLOCK]
                        sb1 = sb0
                    mainloop.consumer_wait(read)
                    cute.nvgpu.warpgroup.fence()
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                    for kb in cutlass.range(num_k_blocks, unroll_full=True):
                        cute.gemm(tiled_mma, tmp0, tCrA[(None, None, kb, read.index)],
                                  tCrB0[(None, None, kb, read.index)], tmp0)
                        if cutlass.const_expr(up):
                            cute.gemm(tiled_mma, tmp1, tCrA[(None, None, kb, read.index)],
                                      tCrB1[(None, None, kb, read.index)], tmp1)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    mainloop.consumer_release(read)
                    read.advance()
                    # promotion into the fp32 accumulators with the block scales
                    f00 = sa0 * sb0
                    f01 = sa1 * sb0
                    for v in cutlass.range_constexpr(nval):
                        f = f01 if (v // 2) % 2 == 1 else f00
                        acc0[v] = acc0[v] + tmp0[v] * f
                    if cutlass.const_expr(up):
                        f10 = sa0 * sb1
                        f11 = sa1 * sb1
                        for v in cutlass.range_constexpr(nval):
                            f = f11 if (v // 2) % 2 == 1 else f10
                            acc1[v] = acc1[v] + tmp1[v] * f
                if warp_idx == 0 and prod.count < k_tiles:
                    mainloop.producer_acquire(prod)
                    bar = mainloop.producer_get_barrier(prod)
                    cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                    if cutlass.const_expr(up):
                        cute.copy(tma_b0, tB0g[(None, prod.count)], tB0s[(None, prod.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b1, tB1g[(None, prod.count)], tB1s[(None, prod.index)], tma_bar_ptr=bar)
                    else:
                        cute.copy(tma_b0, tB0g[(None, prod.count % k_half)], tB0s[(None, prod.index)],
                                  tma_bar_ptr=bar)
                    mainloop.producer_commit(prod)
                    prod.advance()

            if cutlass.const_expr(up):
                # inner = silu(gate) * up, split into hi + lo e4m3 terms with per-(row, 64-col) scales
                for v in cutlass.range_constexpr(nval):
                    g = acc0[v]
                    acc0[v] = g / (1.0 + cute.math.exp(-g)) * acc1[v]
                am = [Float32(0.0), Float32(0.0)]
                for v in cutlass.range_constexpr(nval):
                    h = (v // 2) % 2
                    am[h] = cute.arch.fmax(am[h], cute.math.absf(acc0[v]))
                s_hi = []
                for h in cutlass.range_constexpr(2):
                    a = cute.arch.fmax(am[h], cute.arch.shuffle_sync_bfly(am[h], offset=1))
                    a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=2))
                    s_hi.append(cute.arch.fmax(a, Float32(1e-30)) * (1.0 / FP8_MAX))
                hi8 = cute.make_rmem_tensor(tCcC.shape, Float8E4M3FN)
                lo8 = cute.make_rmem_tensor(tCcC.shape, Float8E4M3FN)
                qv = cute.make_rmem_tensor(tCcC.shape, Float32)
                for v in cutlass.range_constexpr(nval):
                    qv[v] = acc0[v] / s_hi[(v // 2) % 2]
                hi8.store(qv.load().to(Float8E4M3FN))
                back = hi8.load().to(Float32)
                qv.store(back)
                amr = [Float32(0.0), Float32(0.0)]
                for v in cutlass.range_constexpr(nval):
                    h = (v // 2) % 2
                    r = acc0[v] - qv[v] * s_hi[h]
                    acc1[v] = r
                    amr[h] = cute.arch.fmax(amr[h], cute.math.absf(r))
                s_lo = []
                for h in cutlass.range_constexpr(2):
                    a = cute.arch.fmax(amr[h], cute.arch.shuffle_sync_bfly(amr[h], offset=1))
                    a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=2))
                    s_lo.append(cute.arch.fmax(a, Float32(1e-30)) * (1.0 / FP8_MAX))
                for v in cutlass.range_constexpr(nval):
                    qv[v] = acc1[v] / s_lo[(v // 2) % 2]
                lo8.store(qv.load().to(Float8E4M3FN))
                q8 = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=Float8E4M3FN), mQ.layout)
                rows = (row0, row1)
                for v in cutlass.range_constexpr(0, nval, 2):
                    h = (v // 2) % 2
                    col = pid_n * bn + n0 + 8 * (v // 4)
                    ph = cute.make_rmem_tensor((2,), Float8E4M3FN)
                    pl = cute.make_rmem_tensor((2,), Float8E4M3FN)
                    ph[0] = hi8[v]
                    ph[1] = hi8[v + 1]
                    pl[0] = lo8[v]
                    pl[1] = lo8[v + 1]
                    qrow = cute.zipped_divide(q8[rows[h], None], (2,))
                    cute.autovec_copy(ph, qrow[(None, col // 2)])
                    cute.autovec_copy(pl, qrow[(None, (inter + col) // 2)])
                if lane % 4 == 0:
                    for h in cutlass.range_constexpr(2):
                        mQS[rows[h], pid_n] = s_hi[h]
                        mQS[rows[h], inter // QB + pid_n] = s_lo[h]
            else:
                cute.arch.sync_threads()            # the A ring is reused as the epilogue buffer
                sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_smem_layout.inner, dtype=BFloat16),
                                      epi_smem_layout.outer)
                c_layout = utils.LayoutEnum.ROW_MAJOR
                copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(c_layout, elem_ty_d=BFloat16, elem_ty_acc=Float32)
                copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4),
                                                  BFloat16)
                tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s,
                                                        cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
                thr_copy_r2s = tiled_copy_r2s.get_slice(tidx)
                tRS_sD = thr_copy_r2s.partition_D(sC)
                tRS_rAcc = tiled_copy_r2s.retile(acc0)
                rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
                tRS_rD_layout = cute.make_layout(rD_shape[:3])
                tRS_rD = cute.make_rmem_tensor_like(tRS_rD_layout, Float32)
                size_rD = cute.size(tRS_rD)
                gC = cute.local_tile(mC, tiler, (tile, pid_n, None), proj=(1, 1, None))
                gC_epi = cute.zipped_divide(gC, EPI_TILE)
                bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                                  cute.group_modes(sC, 0, 2), gC_epi)
                epi_num = cute.size(gC_epi, mode=[1])
                epi_shape = gC_epi.shape[1]
                epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                c_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=EPI_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS))
                for ei in cutlass.range_constexpr(epi_num):
                    for v in cutlass.range_constexpr(size_rD):
                        tRS_rD[v] = tRS_rAcc[ei * size_rD + v]
                    rD_out = cute.make_rmem_tensor_like(tRS_rD_layout, BFloat16)
                    rD_out.store(tRS_rD.load().to(BFloat16))
                    buf = ei % EPI_STAGES
                    cute.copy(tiled_copy_r2s, rD_out, tRS_sD[(None, None, None, buf)])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    pipeline.sync(barrier_id=1)
                    if warp_idx == 0:
                        cute.copy(tma_c, bSG_sD[(None, buf)], bSG_gD[(None, epi_layout.get_hier_coord(ei))])
                        c_pipe.producer_commit()
                        c_pipe.producer_acquire()
                    pipeline.sync(barrier_id=1)
                if warp_idx == 0:
                    c_pipe.producer_tail()

    return _gemm


@cute.jit
def _fp8(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=Float8E4M3FN), t.layout)


@cute.jit
def _setup_gemm(kind: cutlass.Constexpr, bn: cutlass.Constexpr, bk: cutlass.Constexpr, stages: cutlass.Constexpr,
                inter: cutlass.Constexpr, mA: cute.Tensor, mB0: cute.Tensor, mB1: cute.Tensor, mC: cute.Tensor,
                mAS: cute.Tensor, mBS: cute.Tensor, mQ: cute.Tensor, mQS: cute.Tensor, mSched: cute.Tensor,
                mMeta: cute.Tensor, n_cols: Int32, stream: cuda.CUstream):
    kmaj = utils.LayoutEnum.ROW_MAJOR
    tiled_mma = sm90_utils.make_trivial_tiled_mma(Float8E4M3FN, Float8E4M3FN, kmaj.sm90_mma_major_mode(),
                                                  kmaj.sm90_mma_major_mode(), Float32, ATOM_LAYOUT,
                                                  tiler_mn=(64, bn))
    tiler = (BM, bn, bk)
    a_smem_layout = sm90_utils.make_smem_layout_a(kmaj, tiler, Float8E4M3FN, stages)
    b_smem_layout = sm90_utils.make_smem_layout_b(kmaj, tiler, Float8E4M3FN, stages)
    epi_smem_layout = sm90_utils.make_smem_layout_epi(BFloat16, kmaj, EPI_TILE, EPI_STAGES)
    g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, _fp8(mA), cute.slice_(a_smem_layout, (None, None, 0)),
                                                       (BM, bk))
    b_st = cute.slice_(b_smem_layout, (None, None, 0))
    tma_b0, tb0 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, _fp8(mB0), b_st, (bn, bk))
    tma_b1, tb1 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, _fp8(mB1), b_st, (bn, bk))
    tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC,
                                                       cute.slice_(epi_smem_layout, (None, None, 0)), EPI_TILE)
    tiles_max = mSched.shape[0]
    _make_gemm(kind, bn, bk, stages, inter)(tma_a, ta, tma_b0, tb0, tma_b1, tb1, tma_c, tc, mAS, mBS, mQ, mQS,
                                            mSched, mMeta, tiled_mma, a_smem_layout, b_smem_layout,
                                            epi_smem_layout).launch(
        grid=[(n_cols + bn - 1) // bn, tiles_max, 1], block=[MMA_THREADS, 1, 1], stream=stream)


def _make(hidden: int, inter: int, local: int):
    nch16 = hidden // 16            # 16-byte chunks of an fp8 row
    nch8 = hidden // VEC            # 8-element chunks of a bf16 row
    nkb = hidden // BLOCK           # activation scale blocks
    per16 = (nch16 + ROW_THREADS - 1) // ROW_THREADS
    per8 = (nch8 + ROW_THREADS - 1) // ROW_THREADS
    assert local <= SCHED_THREADS

    @cute.kernel
    def _route_kernel(mLog: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                      mSlot: cute.Tensor, mCnt: cute.Tensor, offset: Int32, rsf: Float32):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        ntok = mLog.shape[0]
        t = bidx * K1_WARPS + warp
        if t < ntok:
            rl = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.zipped_divide(mLog[t, None], (8,))[(None, lane)], rl)
            rb = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(mBias, (8,))[(None, lane)], rb)
            bf = rb.load().to(Float32)
            ss = []
            bs = []
            for j in cutlass.range_constexpr(8):
                s = 1.0 / (1.0 + cute.math.exp(-rl[j]))
                ss.append(s)
                bs.append(s + bf[j])
            # top-2 of this lane, merged over the 4 lanes of the group
            m1 = cute.arch.fmax(bs[0], bs[1])
            m2 = cute.arch.fmin(bs[0], bs[1])
            for j in cutlass.range_constexpr(2, 8):
                m2 = cute.arch.fmax(m2, cute.arch.fmin(m1, bs[j]))
                m1 = cute.arch.fmax(m1, bs[j])
            for off in (1, 2):
                o1 = cute.arch.shuffle_sync_bfly(m1, offset=off)
                o2 = cute.arch.shuffle_sync_bfly(m2, offset=off)
                m2 = cute.arch.fmax(cute.arch.fmin(m1, o1), cute.arch.fmax(m2, o2))
                m1 = cute.arch.fmax(m1, o1)
            gs = m1 + m2
            g = lane // 4
            rank = Int32(0)
            for gg in cutlass.range_constexpr(NUM_GROUPS):
                og = cute.arch.shuffle_sync(gs, offset=4 * gg)
                beats = (og > gs) | ((og == gs) & (gg < g))
                rank = rank + Int32(cutlass.select_(beats, Int32(1), Int32(0)))
            keep = rank < TOPK_GROUPS
            vals = []
            for j in cutlass.range_constexpr(8):
                vals.append(Float32(cutlass.select_(keep, bs[j], Float32(-math.inf))))
            cs = []
            ci = []
            for k in cutlass.range_constexpr(TOP_K):
                bv = vals[0]
                bi = 8 * lane
                bsv = ss[0]
                for j in cutlass.range_constexpr(1, 8):
                    better = vals[j] > bv
                    bv = Float32(cutlass.select_(better, vals[j], bv))
                    bi = Int32(cutlass.select_(better, 8 * lane + j, bi))
                    bsv = Float32(cutlass.select_(better, ss[j], bsv))
                for off in (16, 8, 4, 2, 1):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=off)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=off)
                    os_ = cute.arch.shuffle_sync_bfly(bsv, offset=off)
                    take = (ov > bv) | ((ov == bv) & (oi < bi))
                    bv = Float32(cutlass.select_(take, ov, bv))
                    bi = Int32(cutlass.select_(take, oi, bi))
                    bsv = Float32(cutlass.select_(take, os_, bsv))
                cs.append(bsv)
                ci.append(bi)
                for j in cutlass.range_constexpr(8):
                    vals[j] = Float32(cutlass.select_(bi == 8 * lane + j, Float32(-math.inf), vals[j]))
            tot = cs[0]
            for k in cutlass.range_constexpr(1, TOP_K):
                tot = tot + cs[k]
            scale = rsf / tot
            for k in cutlass.range_constexpr(TOP_K):
                if lane == k:
                    le = ci[k] - offset
                    mWts[t, k] = cs[k] * scale
                    if (le >= 0) & (le < local):
                        mIds[t, k] = le
                        mSlot[t, k] = cute.arch.atomic_add((mCnt.iterator + le).llvm_ptr, Int32(1))
                    else:
                        mIds[t, k] = Int32(-1)
                        mSlot[t, k] = Int32(0)

    @cute.kernel
    def _sched_kernel(mCnt: cute.Tensor, mPoff: cute.Tensor, mSched: cute.Tensor, mMeta: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.utils.SmemAllocator()
        sW = smem.allocate_tensor(Int32, cute.make_layout((SCHED_THREADS // 32,)), byte_alignment=16)
        n = Int32(0)
        if tidx < local:
            n = mCnt[tidx]
            mCnt[tidx] = Int32(0)           # reset for the next call
        nt = (n + BM - 1) // BM
        incl = nt
        for off in (1, 2, 4, 8, 16):
            v = cute.arch.shuffle_sync_up(incl, offset=off)
            if lane >= off:
                incl = incl + v
        if lane == 31:
            sW[warp] = incl
        cute.arch.barrier()
        base = Int32(0)
        total = Int32(0)
        for i in cutlass.range_constexpr(SCHED_THREADS // 32):
            wv = sW[i]
            base = base + Int32(cutlass.select_(i < warp, wv, Int32(0)))
            total = total + wv
        first = base + incl - nt
        if tidx < local:
            mPoff[tidx] = first * BM
            for j in cutlass.range(nt):
                mSched[first + j] = tidx
        if tidx == 0:
            mMeta[0] = total

    @cute.kernel
    def _gather_kernel(mX: cute.Tensor, mXS: cute.Tensor, mIds: cute.Tensor, mSlot: cute.Tensor,
                       mPoff: cute.Tensor, mXg: cute.Tensor, mAS: cute.Tensor, mRow: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        rows = []
        for k in cutlass.range_constexpr(TOP_K):
            le = mIds[t, k]
            rows.append(Int32(cutlass.select_(le >= 0, mPoff[cutlass.max(le, Int32(0))] + mSlot[t, k], Int32(-1))))
        for k in cutlass.range_constexpr(TOP_K):
            if tidx == k:
                mRow[t, k] = rows[k]
        xrow = cute.zipped_divide(mX[t, None], (16,))
        for q in cutlass.range_constexpr(per16):
            c = tidx + q * ROW_THREADS
            if c < nch16:
                r = cute.make_rmem_tensor((16,), Uint8)
                cute.autovec_copy(xrow[(None, c)], r)
                for k in cutlass.range_constexpr(TOP_K):
                    if rows[k] >= 0:
                        cute.autovec_copy(r, cute.zipped_divide(mXg[rows[k], None], (16,))[(None, c)])
        if tidx < nkb:
            s = mXS[tidx, t]
            for k in cutlass.range_constexpr(TOP_K):
                if rows[k] >= 0:
                    mAS[rows[k], tidx] = s

    @cute.kernel
    def _combine_kernel(mY: cute.Tensor, mRow: cute.Tensor, mWts: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        rows = []
        ws = []
        oks = []
        nloc = Int32(0)
        for k in cutlass.range_constexpr(TOP_K):
            r = mRow[t, k]
            rows.append(cutlass.max(r, Int32(0)))
            oks.append(r >= 0)
            ws.append(mWts[t, k])
            nloc = nloc + Int32(cutlass.select_(r >= 0, Int32(1), Int32(0)))
        for q in cutlass.range_constexpr(per8):
            c = tidx + q * ROW_THREADS
            if c < nch8:
                acc = cute.make_rmem_tensor((VEC,), Float32)
                acc.fill(0.0)
                if nloc > 0:
                    a = acc.load()
                    for k in cutlass.range_constexpr(TOP_K):
                        if oks[k]:
                            ry = cute.make_rmem_tensor((VEC,), BFloat16)
                            cute.autovec_copy(cute.zipped_divide(mY[rows[k], None], (VEC,))[(None, c)], ry)
                            a = a + ry.load().to(Float32) * ws[k]
                    acc.store(a)
                ro = cute.make_rmem_tensor((VEC,), BFloat16)
                ro.store(acc.load().to(BFloat16))
                cute.autovec_copy(ro, cute.zipped_divide(mO[t, None], (VEC,))[(None, c)])

    @cute.jit
    def _run(mLog: cute.Tensor, mBias: cute.Tensor, mX: cute.Tensor, mXS: cute.Tensor, mW1g: cute.Tensor,
             mW1u: cute.Tensor, mW1S: cute.Tensor, mW2: cute.Tensor, mW2S: cute.Tensor, mIds: cute.Tensor,
             mWts: cute.Tensor, mSlot: cute.Tensor, mCnt: cute.Tensor, mPoff: cute.Tensor, mSched: cute.Tensor,
             mMeta: cute.Tensor, mXg: cute.Tensor, mAS: cute.Tensor, mRow: cute.Tensor, mQ: cute.Tensor,
             mQS: cute.Tensor, mY: cute.Tensor, mO: cute.Tensor, offset: Int32, rsf: Float32,
             stream: cuda.CUstream):
        ntok = mLog.shape[0]
        _route_kernel(mLog, mBias, mIds, mWts, mSlot, mCnt, offset, rsf).launch(
            grid=[(ntok + K1_WARPS - 1) // K1_WARPS, 1, 1], block=[K1_WARPS * 32, 1, 1], stream=stream)
        _sched_kernel(mCnt, mPoff, mSched, mMeta).launch(
            grid=[1, 1, 1], block=[SCHED_THREADS, 1, 1], smem=SCHED_THREADS // 32 * 4 + 64, stream=stream)
        _gather_kernel(mX, mXS, mIds, mSlot, mPoff, mXg, mAS, mRow).launch(
            grid=[ntok, 1, 1], block=[ROW_THREADS, 1, 1], stream=stream)
        _setup_gemm("up", UP_BN, UP_BK, UP_STAGES, inter, mXg, mW1g, mW1u, mY, mAS, mW1S, mQ, mQS, mSched, mMeta,
                    inter, stream)
        _setup_gemm("down", DN_BN, DN_BK, DN_STAGES, inter, mQ, mW2, mW2, mY, mQS, mW2S, mQ, mQS, mSched, mMeta,
                    hidden, stream)
        _combine_kernel(mY, mRow, mWts, mO).launch(grid=[ntok, 1, 1], block=[ROW_THREADS, 1, 1], stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int, inter: int, local: int):
    key = (hidden, inter, local)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % BLOCK == 0 and inter % BLOCK == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
        ntok, tiles, rpad = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        H, I, L = hidden, inter, local
        rm = lambda n: tuple(range(n - 1, -1, -1))  # noqa: E731
        fake = lambda dt, shape, al=16: make_fake_compact_tensor(dt, shape, stride_order=rm(len(shape)),  # noqa: E731
                                                                 assumed_align=al)
        logits = fake(Float32, (ntok, NUM_EXPERTS))
        bias = fake(BFloat16, (NUM_EXPERTS,))
        x = fake(Uint8, (ntok, H))
        xs = fake(Float32, (H // BLOCK, ntok), 4)
        # expert weights as (N, K, L = local expert) views; gate and up rows are separate views
        w1g = make_fake_tensor(Uint8, (I, H, L), (H, 1, 2 * I * H), assumed_align=16)
        w1u = make_fake_tensor(Uint8, (I, H, L), (H, 1, 2 * I * H), assumed_align=16)
        w1s = fake(Float32, (L, 2 * I // BLOCK, H // BLOCK), 4)
        w2 = make_fake_tensor(Uint8, (H, I, L), (I, 1, H * I), assumed_align=16)
        w2s = fake(Float32, (L, H // BLOCK, I // BLOCK), 4)
        ids, slot, row = fake(Int32, (ntok, TOP_K), 4), fake(Int32, (ntok, TOP_K), 4), fake(Int32, (ntok, TOP_K), 4)
        wts = fake(Float32, (ntok, TOP_K), 4)
        cnt, poff, sched, meta = fake(Int32, (L,), 4), fake(Int32, (L,), 4), fake(Int32, (tiles,), 4), fake(Int32, (1,), 4)
        xg = fake(Uint8, (rpad, H))
        a_s = fake(Float32, (rpad, H // BLOCK), 4)
        q = fake(Uint8, (rpad, 2 * I))
        q_s = fake(Float32, (rpad, 2 * I // QB), 4)
        y = fake(BFloat16, (rpad, H))
        o = fake(BFloat16, (ntok, H))
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make(hidden, inter, local), logits, bias, x, xs, w1g, w1u, w1s, w2, w2s, ids, wts, slot,
                          cnt, poff, sched, meta, xg, a_s, row, q, q_s, y, o, Int32(0), Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def _workspace(device, ntok, hidden, inter, local):
    key = (str(device), ntok, hidden, inter, local)
    ws = _WORKSPACE.get(key)
    if ws is None:
        tiles = _max_tiles(ntok, local)
        rpad = tiles * BM
        i32 = dict(dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        ws = dict(ids=torch.empty((ntok, TOP_K), **i32), slot=torch.empty((ntok, TOP_K), **i32),
                  wts=torch.empty((ntok, TOP_K), **f32),
                  cnt=torch.zeros((local,), **i32),            # reset by the schedule kernel after use
                  poff=torch.empty((local,), **i32), sched=torch.empty((tiles,), **i32),
                  meta=torch.empty((1,), **i32), row=torch.empty((ntok, TOP_K), **i32),
                  xg=torch.empty((rpad, hidden), dtype=torch.uint8, device=device),
                  a_s=torch.empty((rpad, hidden // BLOCK), **f32),
                  q=torch.empty((rpad, 2 * inter), dtype=torch.uint8, device=device),
                  q_s=torch.empty((rpad, 2 * inter // QB), **f32),
                  y=torch.empty((rpad, hidden), dtype=torch.bfloat16, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(routing_logits, routing_bias, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
          gemm2_weights, gemm2_weights_scale, local_expert_offset, routed_scaling_factor):
    ntok, hidden = hidden_states.shape
    local, two_inter, _ = gemm1_weights.shape
    inter = two_inter // 2
    out = torch.empty((ntok, hidden), dtype=torch.bfloat16, device=hidden_states.device)
    if ntok == 0:
        return out
    ws = _workspace(hidden_states.device, ntok, hidden, inter, local)
    w1 = gemm1_weights.view(torch.uint8).permute(1, 2, 0)      # (2I, H, L) view
    w2 = gemm2_weights.view(torch.uint8).permute(1, 2, 0)      # (H, I, L) view
    _get_compiled(hidden, inter, local)(
        routing_logits.float(), routing_bias, hidden_states.view(torch.uint8), hidden_states_scale.float(),
        w1[:inter], w1[inter:], gemm1_weights_scale.float(), w2, gemm2_weights_scale.float(), ws["ids"], ws["wts"],
        ws["slot"], ws["cnt"], ws["poff"], ws["sched"], ws["meta"], ws["xg"], ws["a_s"], ws["row"], ws["q"],
        ws["q_s"], ws["y"], out, int(local_expert_offset), float(routed_scaling_factor))
    return out
