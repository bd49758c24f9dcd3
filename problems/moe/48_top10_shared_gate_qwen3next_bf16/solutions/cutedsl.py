"""Qwen3-Next MoE layer (router softmax top-10 over 512 SwiGLU experts + sigmoid-gated shared expert,
T = 4096, hidden 2048, intermediate 512) in CuTe DSL: seven kernels launched back to back by one
compiled host function; the shared expert is treated as expert 512 with every token and weight
sigmoid(x . g).

K0 router: logits = x @ W_r^T (wgmma bf16 x bf16 -> fp32, exact products; tile 128 x 128, TMA
   ring), fp32 logits stored straight from the accumulators.
K1 top-10: one warp per token: 16 logits per lane, 10 rounds of warp argmax (ties -> lower id);
   w = softmax over the 10 chosen logits (= p[chosen] / sum p[chosen]); gate = sigmoid(x . g) in
   fp32; each chosen (token, k) takes a slot in its expert with an atomic counter.
K2 schedule (1 CTA): expert counts -> 128-row tiles per expert, exclusive scan -> padded row
   offsets (each expert's rows start on a tile boundary, so tiles never mix experts), a tile ->
   expert table and the tile count; the counters are reset for the next call.
K3 gather: one CTA per token copies x[t] (128-bit accesses) to its 11 rows (10 routed + shared)
   of the padded expert-major activation buffer and records the rows.
K4 expert up-projection (grouped GEMM): CTA (n-tile, row tile); per k-step TMA brings the A tile
   (128 rows x 64) and two B tiles: 128 gate rows and the matching 128 up rows of the tile's
   expert (a 3-D [512, 1024, 2048] view, or the shared expert's weights), 4-stage mbarrier ring;
   two wgmma accumulators (gate, up) share the A fragments; the epilogue computes
   silu(gate) * up in fp32 in registers (same fragment layout), rounds to bf16 and TMA-stores the
   [128 x 128] tile of the intermediate activations.
K5 expert down-projection (grouped GEMM): CTA (n-tile of 256, row tile): act tile @ down[e]^T,
   TMA ring as K4, bf16 result tile TMA-stored into the padded expert-output buffer.
K6 combine: one CTA per token: out = sum_k w_k y[row(t, k)] + gate * y[shared row] in fp32 -> bf16.
Rows past an expert's count inside its last tile are computed on whatever the buffer holds and
never read (rows are independent in both GEMMs).
What limits it: DRAM bandwidth for the 3.22 GB of expert weights (670 us at 4.8 TB/s; every
expert is hit, ~80 tokens each, ~84 FLOP/byte < the 206 FLOP/byte ridge), plus ~0.8 GB of
activation traffic (gathered x, padded tiles of act and y). Expected ~0.9-1.0 ms. Next steps:
gather x inside the up-projection producer (cp.async) instead of K3, predicated y stores.
Host path: compiled once per (hidden, intermediate) with tvm-ffi (symbolic token count);
workspaces cached per (device, T); torch tensors passed directly on the caller's stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
Review 2026-11-29 (no GPU): fixed the router-logit store coordinates (identity tensor was partitioned with the
warpgroup MMA slice, i.e. thread 0's (row, col) for every thread; now the per-thread slice, as in problem 20's fix).
"""

import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64

NUM_EXPERTS = 512
TOP_K = 10
NSLOT = TOP_K + 1                 # 10 routed rows + the shared-expert row per token
BM, BK = 128, 64
MMA_THREADS = 256
ATOM_LAYOUT = (2, 1, 1)
EPI_TILE = (128, 32)
EPI_STAGES = 4
STAGES = 4
BN_ROUTER = 128
BN_UP = 128
BN_DOWN = 256
VEC = 8
K1_WARPS = 8
SCHED_THREADS = 1024


def _add(a, b):
    return a + b


def _max_tiles(ntok: int) -> int:
    # sum_e ceil(n_e / BM) <= routed pairs / BM + experts, plus the shared expert's tiles
    return (ntok * TOP_K) // BM + NUM_EXPERTS + (ntok + BM - 1) // BM + 1


# ------------------------------------------------------------------------------------------------
# grouped / plain wgmma GEMM with a TMA mainloop; `kind` selects operands and epilogue
# ------------------------------------------------------------------------------------------------
def _make_gemm(kind: str, bn: int):
    dual = kind == "up"               # gate and up B tiles
    grouped = kind != "router"
    n_b = 2 if dual else 1

    @cute.kernel
    def _gemm(tma_a: cute.CopyAtom, mA: cute.Tensor,
              tma_b0: cute.CopyAtom, mB0: cute.Tensor, tma_b1: cute.CopyAtom, mB1: cute.Tensor,
              tma_b2: cute.CopyAtom, mB2: cute.Tensor, tma_b3: cute.CopyAtom, mB3: cute.Tensor,
              tma_c: cute.CopyAtom, mC: cute.Tensor, mOut: cute.Tensor, mSched: cute.Tensor, mMeta: cute.Tensor,
              tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
              epi_smem_layout: cute.ComposedLayout):
        # B operands: b0/b1 = routed experts (3-D, L = expert), b2/b3 = shared expert (2-D);
        # b1/b3 (up rows) only for the up-projection. Router: b0 only.
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        pid_n, tile, _ = cute.arch.block_idx()
        active = True
        e = Int32(0)
        if cutlass.const_expr(grouped):
            active = tile < mMeta[0]
        if active:
            if cutlass.const_expr(grouped):
                e = mSched[tile]
            is_shared = e >= NUM_EXPERTS
            el = cutlass.min(e, NUM_EXPERTS - 1)

            @cute.struct
            class SharedStorage:
                bars: cute.struct.MemRange[Int64, STAGES * 2]
                sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_smem_layout) * n_b], 1024]

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            a_stage = cute.slice_(a_smem_layout, (None, None, 0))
            b_stage = cute.slice_(b_smem_layout, (None, None, 0))
            tx_bytes = cute.size_in_bytes(BFloat16, a_stage) + n_b * cute.size_in_bytes(BFloat16, b_stage)
            mainloop = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

            sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
            sB0 = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
            sB1 = sB0
            if cutlass.const_expr(dual):
                sB1 = cute.make_tensor(sB0.iterator + cute.cosize(b_smem_layout), sB0.layout)
            sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_smem_layout.inner, dtype=BFloat16),
                                  epi_smem_layout.outer)

            tiler = (BM, bn, BK)
            gA = cute.local_tile(mA, tiler, (tile, pid_n, None), proj=(1, None, 1))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                          cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            if cutlass.const_expr(grouped):
                gB0 = cute.local_tile(mB0, tiler, (tile, pid_n, None, el), proj=(None, 1, 1))
                gB2 = cute.local_tile(mB2, tiler, (tile, pid_n, None), proj=(None, 1, 1))
            else:
                gB0 = cute.local_tile(mB0, tiler, (tile, pid_n, None), proj=(None, 1, 1))
                gB2 = gB0
            tB0s, tB0g = cute.nvgpu.cpasync.tma_partition(tma_b0, 0, cute.make_layout(1),
                                                          cute.group_modes(sB0, 0, 2), cute.group_modes(gB0, 0, 2))
            tB2s, tB2g = cute.nvgpu.cpasync.tma_partition(tma_b2, 0, cute.make_layout(1),
                                                          cute.group_modes(sB0, 0, 2), cute.group_modes(gB2, 0, 2))
            tB1s, tB1g, tB3s, tB3g = tB0s, tB0g, tB2s, tB2g
            if cutlass.const_expr(dual):
                gB1 = cute.local_tile(mB1, tiler, (tile, pid_n, None, el), proj=(None, 1, 1))
                gB3 = cute.local_tile(mB3, tiler, (tile, pid_n, None), proj=(None, 1, 1))
                tB1s, tB1g = cute.nvgpu.cpasync.tma_partition(tma_b1, 0, cute.make_layout(1),
                                                              cute.group_modes(sB1, 0, 2), cute.group_modes(gB1, 0, 2))
                tB3s, tB3g = cute.nvgpu.cpasync.tma_partition(tma_b3, 0, cute.make_layout(1),
                                                              cute.group_modes(sB1, 0, 2), cute.group_modes(gB3, 0, 2))

            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(wg))
            # per-thread slice: the warpgroup slice would give every thread thread 0's (row, col)
            tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((BM, bn)))
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB0))
            tCrB1 = tCrB0
            if cutlass.const_expr(dual):
                tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB1))
            acc0 = cute.make_rmem_tensor(tCcC.shape, Float32)
            acc1 = acc0
            if cutlass.const_expr(dual):
                acc1 = cute.make_rmem_tensor(tCcC.shape, Float32)

            cute.arch.sync_threads()
            k_tiles = cute.size(gA, mode=[2])
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            num_k_blocks = cute.size(tCrA, mode=[2])
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            n_pro = cutlass.min(STAGES, k_tiles)
            for kt in cutlass.range(-n_pro, k_tiles, unroll=1):
                if kt >= 0:
                    mainloop.consumer_wait(read)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range(num_k_blocks, unroll_full=True):
                        cute.gemm(tiled_mma, acc0, tCrA[(None, None, kb, read.index)],
                                  tCrB0[(None, None, kb, read.index)], acc0)
                        if cutlass.const_expr(dual):
                            cute.gemm(tiled_mma, acc1, tCrA[(None, None, kb, read.index)],
                                      tCrB1[(None, None, kb, read.index)], acc1)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)   # the previous group is done: its stage can go
                    read.advance()
                    if kt > 0:
                        mainloop.consumer_release(release)
                        release.advance()
                # producer: prologue fills (kt < 0), then refills the stage just released
                if warp_idx == 0 and prod.count < k_tiles and kt != 0:
                    mainloop.producer_acquire(prod)
                    bar = mainloop.producer_get_barrier(prod)
                    cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                    if is_shared:
                        cute.copy(tma_b2, tB2g[(None, prod.count)], tB2s[(None, prod.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(dual):
                            cute.copy(tma_b3, tB3g[(None, prod.count)], tB3s[(None, prod.index)], tma_bar_ptr=bar)
                    else:
                        cute.copy(tma_b0, tB0g[(None, prod.count)], tB0s[(None, prod.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(dual):
                            cute.copy(tma_b1, tB1g[(None, prod.count)], tB1s[(None, prod.index)], tma_bar_ptr=bar)
                    mainloop.producer_commit(prod)
                    prod.advance()
            cute.nvgpu.warpgroup.wait_group(0)

            if cutlass.const_expr(kind == "router"):
                # fp32 logits straight from the accumulators (8-byte pairs; rows past T skipped)
                ntok = mOut.shape[0]
                for v in cutlass.range_constexpr(0, cute.size(acc0), 2):
                    m, n = tCcC[v]
                    row = tile * BM + m
                    col = pid_n * bn + n
                    if row < ntok:
                        pr = cute.make_rmem_tensor((2,), Float32)
                        pr[0] = acc0[v]
                        pr[1] = acc0[v + 1]
                        cute.autovec_copy(pr, cute.zipped_divide(mOut[row, None], (2,))[(None, col // 2)])
            else:
                if cutlass.const_expr(dual):
                    # SwiGLU in registers: gate and up accumulators share the fragment layout
                    for v in cutlass.range_constexpr(cute.size(acc0)):
                        g = acc0[v]
                        acc0[v] = g / (1.0 + cute.math.exp(-g)) * acc1[v]
                cute.arch.sync_threads()            # the A ring is reused as the epilogue buffer
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
def _setup_gemm(kind: cutlass.Constexpr, bn: cutlass.Constexpr, mA: cute.Tensor, mB0: cute.Tensor,
                mB1: cute.Tensor, mB2: cute.Tensor, mB3: cute.Tensor, mC: cute.Tensor, mOut: cute.Tensor,
                mSched: cute.Tensor, mMeta: cute.Tensor, grid_tiles: Int32, stream: cuda.CUstream):
    a_layout = utils.LayoutEnum.ROW_MAJOR          # all operands are K-major (row-major [rows, K])
    tiled_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a_layout.sm90_mma_major_mode(),
                                                  a_layout.sm90_mma_major_mode(), Float32, ATOM_LAYOUT,
                                                  tiler_mn=(64, bn))
    tiler = (BM, bn, BK)
    a_smem_layout = sm90_utils.make_smem_layout_a(a_layout, tiler, BFloat16, STAGES)
    b_smem_layout = sm90_utils.make_smem_layout_b(a_layout, tiler, BFloat16, STAGES)
    epi_smem_layout = sm90_utils.make_smem_layout_epi(BFloat16, a_layout, EPI_TILE, EPI_STAGES)
    g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    a_st = cute.slice_(a_smem_layout, (None, None, 0))
    b_st = cute.slice_(b_smem_layout, (None, None, 0))
    tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mA, a_st, (BM, BK))
    tma_b0, tb0 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB0, b_st, (bn, BK))
    tma_b1, tb1 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB1, b_st, (bn, BK))
    tma_b2, tb2 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB2, b_st, (bn, BK))
    tma_b3, tb3 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB3, b_st, (bn, BK))
    tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC,
                                                       cute.slice_(epi_smem_layout, (None, None, 0)), EPI_TILE)
    n_cols = mC.shape[1]
    if cutlass.const_expr(kind == "router"):
        n_cols = mOut.shape[1]
    _make_gemm(kind, bn)(tma_a, ta, tma_b0, tb0, tma_b1, tb1, tma_b2, tb2, tma_b3, tb3, tma_c, tc, mOut,
                         mSched, mMeta, tiled_mma, a_smem_layout, b_smem_layout, epi_smem_layout).launch(
        grid=[(n_cols + bn - 1) // bn, grid_tiles, 1], block=[MMA_THREADS, 1, 1], stream=stream)


def _make(hidden: int, inter: int):
    nch = hidden // VEC
    row_threads = min(256, ((nch + 31) // 32) * 32)
    per = (nch + row_threads - 1) // row_threads
    lane_chunks = (nch + 31) // 32

    @cute.kernel
    def _topk_kernel(mLog: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                     mSlot: cute.Tensor, mGate: cute.Tensor, mCnt: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        ntok = mX.shape[0]
        t = bidx * K1_WARPS + warp
        if t < ntok:
            vals = []
            idxs = []
            lrow = cute.zipped_divide(mLog[t, None], (4,))          # ((4), (128))
            for i in cutlass.range_constexpr(NUM_EXPERTS // 128):
                r = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(lrow[(None, lane + 32 * i)], r)
                for j in cutlass.range_constexpr(4):
                    vals.append(r[j])
                    idxs.append(128 * i + 4 * lane + j)
            # shared-expert gate: sigmoid(x . g) in fp32
            dot = Float32(0.0)
            xrow = cute.zipped_divide(mX[t, None], (VEC,))
            grow = cute.zipped_divide(mG[0, None], (VEC,))
            for i in cutlass.range_constexpr(lane_chunks):
                c = lane + 32 * i
                cc = cutlass.min(c, nch - 1)
                rx = cute.make_rmem_tensor((VEC,), BFloat16)
                rg = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(xrow[(None, cc)], rx)
                cute.autovec_copy(grow[(None, cc)], rg)
                part = (rx.load().to(Float32) * rg.load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                dot = dot + Float32(cutlass.select_(c < nch, part, Float32(0.0)))
            dot = cute.arch.warp_reduction(dot, _add)
            # 10 rounds of warp argmax (value desc, index asc)
            cv = []
            ci = []
            for k in cutlass.range_constexpr(TOP_K):
                bv = vals[0]
                bi = Int32(idxs[0])
                for q in cutlass.range_constexpr(1, len(vals)):
                    better = vals[q] > bv
                    bv = Float32(cutlass.select_(better, vals[q], bv))
                    bi = Int32(cutlass.select_(better, Int32(idxs[q]), bi))
                for off in (16, 8, 4, 2, 1):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=off)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=off)
                    take = (ov > bv) | ((ov == bv) & (oi < bi))
                    bv = Float32(cutlass.select_(take, ov, bv))
                    bi = Int32(cutlass.select_(take, oi, bi))
                cv.append(bv)
                ci.append(bi)
                for q in cutlass.range_constexpr(len(vals)):
                    vals[q] = Float32(cutlass.select_(bi == idxs[q], Float32(-math.inf), vals[q]))
            ex = []
            ssum = Float32(0.0)
            for k in cutlass.range_constexpr(TOP_K):
                ek = cute.math.exp(cv[k] - cv[0])
                ex.append(ek)
                ssum = ssum + ek
            inv = 1.0 / ssum
            for k in cutlass.range_constexpr(TOP_K):
                if lane == k:
                    mIds[t, k] = ci[k]
                    mWts[t, k] = ex[k] * inv
                    mSlot[t, k] = cute.arch.atomic_add((mCnt.iterator + ci[k]).llvm_ptr, Int32(1))
            if lane == 0:
                mGate[t] = 1.0 / (1.0 + cute.math.exp(-dot))

    @cute.kernel
    def _sched_kernel(mCnt: cute.Tensor, mPoff: cute.Tensor, mSched: cute.Tensor, mMeta: cute.Tensor,
                      ntok: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.utils.SmemAllocator()
        sW = smem.allocate_tensor(Int32, cute.make_layout((SCHED_THREADS // 32,)), byte_alignment=16)
        e = tidx
        n = Int32(0)
        if e < NUM_EXPERTS:
            n = mCnt[e]
            mCnt[e] = Int32(0)              # reset for the next call (read above, in this thread)
        if e == NUM_EXPERTS:
            n = ntok
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
        if e <= NUM_EXPERTS:
            mPoff[e] = first * BM
            for j in cutlass.range(nt):
                mSched[first + j] = e
        if tidx == 0:
            mMeta[0] = total

    @cute.kernel
    def _gather_kernel(mX: cute.Tensor, mIds: cute.Tensor, mSlot: cute.Tensor, mPoff: cute.Tensor,
                       mXs: cute.Tensor, mRow: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        rows = []
        for k in cutlass.range_constexpr(TOP_K):
            rows.append(mPoff[mIds[t, k]] + mSlot[t, k])
        rows.append(mPoff[NUM_EXPERTS] + t)
        for k in cutlass.range_constexpr(NSLOT):
            if tidx == k:
                mRow[t, k] = rows[k]
        xrow = cute.zipped_divide(mX[t, None], (VEC,))
        for q in cutlass.range_constexpr(per):
            c = tidx + q * row_threads
            if c < nch:
                r = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(xrow[(None, c)], r)
                for k in cutlass.range_constexpr(NSLOT):
                    cute.autovec_copy(r, cute.zipped_divide(mXs[rows[k], None], (VEC,))[(None, c)])

    @cute.kernel
    def _combine_kernel(mY: cute.Tensor, mRow: cute.Tensor, mWts: cute.Tensor, mGate: cute.Tensor,
                        mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        ws = []
        rows = []
        for k in cutlass.range_constexpr(NSLOT):
            rows.append(mRow[t, k])
            if cutlass.const_expr(k < TOP_K):
                ws.append(mWts[t, k])
            else:
                ws.append(mGate[t])
        for q in cutlass.range_constexpr(per):
            c = tidx + q * row_threads
            if c < nch:
                ys = []
                for k in cutlass.range_constexpr(NSLOT):
                    r = cute.make_rmem_tensor((VEC,), BFloat16)
                    cute.autovec_copy(cute.zipped_divide(mY[rows[k], None], (VEC,))[(None, c)], r)
                    ys.append(r)
                acc = ys[0].load().to(Float32) * ws[0]
                for k in cutlass.range_constexpr(1, TOP_K):
                    acc = acc + ys[k].load().to(Float32) * ws[k]
                acc = acc + ys[TOP_K].load().to(Float32) * ws[TOP_K]
                ro = cute.make_rmem_tensor((VEC,), BFloat16)
                ro.store(acc.to(BFloat16))
                cute.autovec_copy(ro, cute.zipped_divide(mO[t, None], (VEC,))[(None, c)])

    @cute.jit
    def _run(mX: cute.Tensor, mWr: cute.Tensor, mGU: cute.Tensor, mUP: cute.Tensor, mDN: cute.Tensor,
             mSGU: cute.Tensor, mSUP: cute.Tensor, mSDN: cute.Tensor, mG: cute.Tensor,
             mLog: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mSlot: cute.Tensor, mGate: cute.Tensor,
             mCnt: cute.Tensor, mPoff: cute.Tensor, mSched: cute.Tensor, mMeta: cute.Tensor, mXs: cute.Tensor,
             mRow: cute.Tensor, mAct: cute.Tensor, mY: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        ntok = mX.shape[0]
        tiles_max = mSched.shape[0]
        # K0 router logits (the act buffer only stands in for the unused TMA-store operand)
        _setup_gemm("router", BN_ROUTER, mX, mWr, mWr, mWr, mWr, mAct, mLog, mSched, mMeta,
                    (ntok + BM - 1) // BM, stream)
        _topk_kernel(mLog, mX, mG, mIds, mWts, mSlot, mGate, mCnt).launch(
            grid=[(ntok + K1_WARPS - 1) // K1_WARPS, 1, 1], block=[K1_WARPS * 32, 1, 1], stream=stream)
        _sched_kernel(mCnt, mPoff, mSched, mMeta, ntok).launch(
            grid=[1, 1, 1], block=[SCHED_THREADS, 1, 1], smem=SCHED_THREADS // 32 * 4 + 64, stream=stream)
        _gather_kernel(mX, mIds, mSlot, mPoff, mXs, mRow).launch(
            grid=[ntok, 1, 1], block=[row_threads, 1, 1], stream=stream)
        _setup_gemm("up", BN_UP, mXs, mGU, mUP, mSGU, mSUP, mAct, mLog, mSched, mMeta, tiles_max, stream)
        _setup_gemm("down", BN_DOWN, mAct, mDN, mDN, mSDN, mSDN, mY, mLog, mSched, mMeta, tiles_max, stream)
        _combine_kernel(mY, mRow, mWts, mGate, mO).launch(
            grid=[ntok, 1, 1], block=[row_threads, 1, 1], stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int, inter: int):
    key = (hidden, inter)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % VEC == 0 and inter % VEC == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
        ntok, tiles, rpad = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        H, I, E = hidden, inter, NUM_EXPERTS
        bf = lambda shape: make_fake_compact_tensor(BFloat16, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),  # noqa: E731
                                                    assumed_align=16)
        x = bf((ntok, H))
        wr = bf((E, H))
        # routed weights as (N, K, L = expert) views; gate rows and up rows are separate views
        gu = make_fake_tensor(BFloat16, (I, H, E), (H, 1, 2 * I * H), assumed_align=16)
        up = make_fake_tensor(BFloat16, (I, H, E), (H, 1, 2 * I * H), assumed_align=16)
        dn = make_fake_tensor(BFloat16, (H, I, E), (I, 1, H * I), assumed_align=16)
        sgu = make_fake_tensor(BFloat16, (I, H), (H, 1), assumed_align=16)
        sup = make_fake_tensor(BFloat16, (I, H), (H, 1), assumed_align=16)
        sdn = bf((H, I))
        g = bf((1, H))
        logits = make_fake_compact_tensor(Float32, (ntok, E), stride_order=(1, 0), assumed_align=16)
        i32 = lambda shape: make_fake_compact_tensor(Int32, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),  # noqa: E731
                                                     assumed_align=4)
        ids, slot, rows = i32((ntok, TOP_K)), i32((ntok, TOP_K)), i32((ntok, NSLOT))
        wts = make_fake_compact_tensor(Float32, (ntok, TOP_K), stride_order=(1, 0), assumed_align=4)
        gate = make_fake_compact_tensor(Float32, (ntok,), assumed_align=4)
        cnt, poff, sched, meta = i32((E,)), i32((E + 1,)), i32((tiles,)), i32((1,))
        xs, act, y = bf((rpad, H)), bf((rpad, I)), bf((rpad, H))
        o = bf((ntok, H))
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make(hidden, inter), x, wr, gu, up, dn, sgu, sup, sdn, g, logits, ids, wts, slot, gate,
                          cnt, poff, sched, meta, xs, rows, act, y, o, stream, options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def _workspace(device, ntok, hidden, inter):
    key = (str(device), ntok, hidden, inter)
    ws = _WORKSPACE.get(key)
    if ws is None:
        tiles = _max_tiles(ntok)
        rpad = tiles * BM
        i32 = dict(dtype=torch.int32, device=device)
        ws = dict(logits=torch.empty((ntok, NUM_EXPERTS), dtype=torch.float32, device=device),
                  ids=torch.empty((ntok, TOP_K), **i32), slot=torch.empty((ntok, TOP_K), **i32),
                  wts=torch.empty((ntok, TOP_K), dtype=torch.float32, device=device),
                  gate=torch.empty((ntok,), dtype=torch.float32, device=device),
                  cnt=torch.zeros((NUM_EXPERTS,), **i32),          # reset by the schedule kernel after use
                  poff=torch.empty((NUM_EXPERTS + 1,), **i32), sched=torch.empty((tiles,), **i32),
                  meta=torch.empty((1,), **i32), rows=torch.empty((ntok, NSLOT), **i32),
                  xs=torch.empty((rpad, hidden), dtype=torch.bfloat16, device=device),
                  act=torch.empty((rpad, inter), dtype=torch.bfloat16, device=device),
                  y=torch.empty((rpad, hidden), dtype=torch.bfloat16, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(hidden_states, router_weight, experts_gate_up, experts_down, shared_gate_up, shared_down,
          shared_expert_gate):
    ntok, hidden = hidden_states.shape
    inter = experts_down.shape[-1]
    assert experts_gate_up.shape == (NUM_EXPERTS, 2 * inter, hidden) and router_weight.shape == (NUM_EXPERTS, hidden)
    out = torch.empty_like(hidden_states)
    if ntok == 0:
        return out
    ws = _workspace(hidden_states.device, ntok, hidden, inter)
    gu = experts_gate_up.permute(1, 2, 0)                       # (2I, H, E) view
    dn = experts_down.permute(1, 2, 0)                          # (H, I, E) view
    _get_compiled(hidden, inter)(
        hidden_states, router_weight, gu[:inter], gu[inter:], dn, shared_gate_up[:inter], shared_gate_up[inter:],
        shared_down, shared_expert_gate, ws["logits"], ws["ids"], ws["wts"], ws["slot"], ws["gate"], ws["cnt"],
        ws["poff"], ws["sched"], ws["meta"], ws["xs"], ws["rows"], ws["act"], ws["y"], out)
    return out
