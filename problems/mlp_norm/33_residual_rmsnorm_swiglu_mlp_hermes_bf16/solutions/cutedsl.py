"""Hermes 3 (Llama 3.1 8B) MLP half-layer: residual add + RMSNorm, then the bias-free SwiGLU MLP
(4096 -> 2 x 14336 -> 4096), bf16, in CuTe DSL: three kernels launched in order by one compiled host function.

Same decomposition as the TIRx solution (add + RMSNorm kernel; gate/up GEMM whose CTA sees gate rows and the
matching up rows so the epilogue writes act = silu(g) * u as bf16 [T, 14336]; down GEMM), with the GEMM
engine changed, as the skill's next experiment suggests:
- Both GEMMs use Hopper warpgroup MMA (wgmma, bf16 in, fp32 accumulation) fed by TMA bulk tensor copies
  into 128-byte-swizzled shared tiles, a 4-stage full/empty mbarrier ring (warp 0 refills each stage as it
  is released, one wgmma group kept in flight), 2 consumer warpgroups of 64 rows each: the template of the
  problem-34 CuTe solution, which measured ~66% of the bf16 peak on the H200 (the TIRx mma.sync template
  measured ~30% here).
- Gate/up GEMM: CTA tile 128 tokens x 128 intermediate columns x 64 K with TWO B operands per stage, the
  128 gate rows (rows j of w_gate_up) and the 128 matching up rows (rows 14336 + j), loaded by two TMA
  copies, and two accumulators of identical layout (wgmma 64 x 128 x 16 each), so acc_g[v] and acc_u[v]
  are the same (row, col) in every thread; the epilogue computes silu(g) * u in fp32 in registers, rounds
  to bf16 and stores through stmatrix -> swizzled smem -> TMA bulk stores (rows past T clipped by the TMA
  unit). Shared memory per stage 16 + 2 x 16 KiB, 4 stages; grid 32 x 112 = 3584 CTAs.
- Down GEMM: CTA tile 128 x 256 x 64 (wgmma 64 x 256 x 16), one B operand, same pipeline and store
  epilogue; grid 32 x 16 = 512 CTAs.
- Add + RMSNorm: one CTA per token (256 threads at hidden 4096, 16 channels each via 128-bit loads):
  s = h + r in fp32, stored as the bf16 residual output; sum of squares by warp shuffles and one shared
  step; n = s * rsqrt(mean + 1e-5) * w rounded to bf16 (the GEMM operand; the allowed deviation).
What limits it: tensor-core throughput (1.42 TFLOP: 1.44 ms at the dense peak); no warp specialization or
persistent scheduling, so each tile's epilogue is exposed. Expected ~2.2-2.6 ms (TIRx: 4.86 ms).
Host path: compiled once per (hidden, intermediate) with tvm-ffi (symbolic token count); the n and act
workspaces are cached per (device, T); torch tensors (w_gate_up's two row halves as views) passed directly
on the caller's current stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int64

EPS = 1e-5
BM, BK = 128, 64
BN_GU = 128                       # gate/up GEMM: 128 act columns (two B operands of 128 rows)
BN_DOWN = 256                     # down GEMM
ATOM_LAYOUT = (2, 1, 1)           # 2 warpgroups along M
MMA_THREADS = 256
EPI_TILE = (128, 32)
EPI_STAGES = 4
STAGES = 4                        # (128 + 256) x 64 x 2 B = 48 KiB per stage for both GEMMs


def _make_gemm(gated: bool, bn: int):
    nb = 2 if gated else 1

    @cute.kernel
    def _gemm(tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom, mB: cute.Tensor,
              tma_atom_b2: cute.CopyAtom, mB2: cute.Tensor, tma_atom_c: cute.CopyAtom, mC: cute.Tensor,
              tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
              epi_smem_layout: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        pid_m, pid_n, _ = cute.arch.block_idx()

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(gated):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b2)

        b_cosize = cute.cosize(b_smem_layout)

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[Int64, STAGES * 2]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, b_cosize * nb], 1024]

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        a_stage = cute.slice_(a_smem_layout, (None, None, 0))
        b_stage = cute.slice_(b_smem_layout, (None, None, 0))
        tx_bytes = cute.size_in_bytes(BFloat16, a_stage) + nb * cute.size_in_bytes(BFloat16, b_stage)
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        # second B operand (up rows) right after the first in the same 1024-aligned range (each stage
        # ring is a multiple of the 1024-byte swizzle period, so the swizzle pattern is unchanged)
        sB2 = cute.make_tensor(cute.recast_ptr(storage.sB.data_ptr() + b_cosize * (nb - 1), b_smem_layout.inner,
                                               dtype=BFloat16), b_smem_layout.outer)

        tile = (BM, bn, BK)
        coord = (pid_m, pid_n, None)
        gA = cute.local_tile(mA, tile, coord, proj=(1, None, 1))      # (BM, BK, k)
        gB = cute.local_tile(mB, tile, coord, proj=(None, 1, 1))      # (bn, BK, k)
        gB2 = cute.local_tile(mB2, tile, coord, proj=(None, 1, 1))
        gC = cute.local_tile(mC, tile, coord, proj=(1, 1, None))      # (BM, bn)

        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(wg))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1),
                                                      cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(1),
                                                      cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        tB2sB2, tB2gB2 = cute.nvgpu.cpasync.tma_partition(tma_atom_b2, 0, cute.make_layout(1),
                                                          cute.group_modes(sB2, 0, 2), cute.group_modes(gB2, 0, 2))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCrB2 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB2))
        tCgC = thr_mma.partition_C(gC)
        acc = cute.make_rmem_tensor(tCgC.shape, Float32)
        acc2 = cute.make_rmem_tensor(tCgC.shape, Float32)      # up projection (gated only)
        # both accumulators start at zero and every wgmma accumulates (two chains share one flag)
        acc.fill(0.0)
        if cutlass.const_expr(gated):
            acc2.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        cute.arch.sync_threads()
        k_tiles = cute.size(gA, mode=[2])
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        num_k_blocks = cute.size(tCrA, mode=[2])
        n_pro = cutlass.min(STAGES, k_tiles)
        for kt in cutlass.range(-n_pro, k_tiles, unroll=1):
            if kt >= 0:
                mainloop.consumer_wait(read)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range(num_k_blocks, unroll_full=True):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)],
                              acc)
                    if cutlass.const_expr(gated):
                        cute.gemm(tiled_mma, acc2, tCrA[(None, None, kb, read.index)],
                                  tCrB2[(None, None, kb, read.index)], acc2)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)       # the previous group is done: its stage can go
                read.advance()
                if kt > 0:
                    mainloop.consumer_release(release)
                    release.advance()
            # producer: prologue fills (kt < 0), then refills the stage released just above
            if warp_idx == 0 and prod.count < k_tiles and kt != 0:
                mainloop.producer_acquire(prod)
                bar = mainloop.producer_get_barrier(prod)
                cute.copy(tma_atom_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                cute.copy(tma_atom_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                if cutlass.const_expr(gated):
                    cute.copy(tma_atom_b2, tB2gB2[(None, prod.count)], tB2sB2[(None, prod.index)], tma_bar_ptr=bar)
                mainloop.producer_commit(prod)
                prod.advance()
        cute.nvgpu.warpgroup.wait_group(0)

        if cutlass.const_expr(gated):
            # act = silu(g) * u, element-wise: acc and acc2 share one layout, so index v is one (row, col)
            for v in cutlass.range_constexpr(cute.size(acc)):
                g = acc[v]
                acc[v] = g / (1.0 + cute.math.exp(-g)) * acc2[v]

        # ---- epilogue: fp32 -> bf16, stmatrix into swizzled smem (the A ring), TMA bulk stores ----
        cute.arch.sync_threads()            # every warpgroup is done with the A ring
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_smem_layout.inner, dtype=BFloat16),
                              epi_smem_layout.outer)
        c_layout = utils.LayoutEnum.ROW_MAJOR
        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(c_layout, elem_ty_d=BFloat16, elem_ty_acc=Float32)
        copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), BFloat16)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(tidx)
        tRS_sD = thr_copy_r2s.partition_D(sC)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
        tRS_rD_layout = cute.make_layout(rD_shape[:3])
        tRS_rD = cute.make_rmem_tensor_like(tRS_rD_layout, Float32)
        size_rD = cute.size(tRS_rD)
        gC_epi = cute.zipped_divide(gC, EPI_TILE)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(tma_atom_c, 0, cute.make_layout(1),
                                                          cute.group_modes(sC, 0, 2), gC_epi)
        epi_num = cute.size(gC_epi, mode=[1])
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        c_pipe = pipeline.PipelineTmaStore.create(
            num_stages=EPI_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS))
        for e in cutlass.range_constexpr(epi_num):
            for v in cutlass.range_constexpr(size_rD):
                tRS_rD[v] = tRS_rAcc[e * size_rD + v]
            rD_out = cute.make_rmem_tensor_like(tRS_rD_layout, BFloat16)
            rD_out.store(tRS_rD.load().to(BFloat16))
            buf = e % EPI_STAGES
            cute.copy(tiled_copy_r2s, rD_out, tRS_sD[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            pipeline.sync(barrier_id=1)
            if warp_idx == 0:
                cute.copy(tma_atom_c, bSG_sD[(None, buf)], bSG_gD[(None, epi_layout.get_hier_coord(e))])
                c_pipe.producer_commit()
                c_pipe.producer_acquire()
            pipeline.sync(barrier_id=1)
        if warp_idx == 0:
            c_pipe.producer_tail()

    return _gemm


@cute.jit
def _launch_gemm(gated: cutlass.Constexpr, bn: cutlass.Constexpr, mA: cute.Tensor, mB: cute.Tensor,
                 mB2: cute.Tensor, mC: cute.Tensor, stream: cuda.CUstream):
    """C[M, N] = A[M, K] @ B[N, K]^T, or (gated) C = silu(A @ B^T) * (A @ B2^T); all K-major."""
    a_layout = utils.LayoutEnum.from_tensor(mA)
    b_layout = utils.LayoutEnum.from_tensor(mB)
    c_layout = utils.LayoutEnum.ROW_MAJOR
    tiled_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a_layout.sm90_mma_major_mode(),
                                                  b_layout.sm90_mma_major_mode(), Float32, ATOM_LAYOUT,
                                                  tiler_mn=(64, bn))
    tile = (BM, bn, BK)
    a_smem_layout = sm90_utils.make_smem_layout_a(a_layout, tile, BFloat16, STAGES)
    b_smem_layout = sm90_utils.make_smem_layout_b(b_layout, tile, BFloat16, STAGES)
    epi_smem_layout = sm90_utils.make_smem_layout_epi(BFloat16, c_layout, EPI_TILE, EPI_STAGES)
    g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(a_smem_layout, (None, None, 0)),
                                                               (BM, BK))
    tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB, cute.slice_(b_smem_layout, (None, None, 0)),
                                                               (bn, BK))
    tma_atom_b2, tma_b2 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB2,
                                                                 cute.slice_(b_smem_layout, (None, None, 0)), (bn, BK))
    tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC,
                                                               cute.slice_(epi_smem_layout, (None, None, 0)), EPI_TILE)
    m = mA.shape[0]
    n = mB.shape[0]
    _make_gemm(gated, bn)(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_b2, tma_b2, tma_atom_c, tma_c, tiled_mma,
                          a_smem_layout, b_smem_layout, epi_smem_layout).launch(
        grid=[(m + BM - 1) // BM, (n + bn - 1) // bn, 1], block=[MMA_THREADS, 1, 1], stream=stream)


def _make_norm(hidden: int):
    threads = min(256, hidden // 8)
    chunks = hidden // (threads * 8)
    nwarps = threads // 32
    assert chunks * threads * 8 == hidden and threads % 32 == 0

    @cute.kernel
    def _add_rmsnorm(mH: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mN: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((nwarps,)), byte_alignment=16)
        gH = cute.zipped_divide(mH[row, None], (8,))
        gR = cute.zipped_divide(mR[row, None], (8,))
        gS = cute.zipped_divide(mS[row, None], (8,))
        gN = cute.zipped_divide(mN[row, None], (8,))
        gW = cute.zipped_divide(mW, (8,))
        xs = []
        ss = Float32(0.0)
        for k in cutlass.range_constexpr(chunks):
            c = tidx + k * threads
            rh = cute.make_rmem_tensor((8,), BFloat16)
            rr = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(gH[(None, c)], rh)
            cute.autovec_copy(gR[(None, c)], rr)
            v = rh.load().to(Float32) + rr.load().to(Float32)
            xs.append(v)
            ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            rs = cute.make_rmem_tensor((8,), BFloat16)
            rs.store(v.to(BFloat16))
            cute.autovec_copy(rs, gS[(None, c)])
        ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
        if lane == 0:
            red[warp] = ss
        cute.arch.barrier()
        tot = red[0]
        for i in cutlass.range_constexpr(1, nwarps):
            tot = tot + red[i]
        inv = cute.math.rsqrt(tot * (1.0 / hidden) + EPS)
        for k in cutlass.range_constexpr(chunks):
            c = tidx + k * threads
            rw = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(gW[(None, c)], rw)
            rn = cute.make_rmem_tensor((8,), BFloat16)
            rn.store((xs[k] * inv * rw.load().to(Float32)).to(BFloat16))
            cute.autovec_copy(rn, gN[(None, c)])

    return _add_rmsnorm, threads, nwarps


def _make_run(hidden: int):
    norm, threads, nwarps = _make_norm(hidden)

    @cute.jit
    def _run(mH: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mN: cute.Tensor,
             mWg: cute.Tensor, mWu: cute.Tensor, mAct: cute.Tensor, mWd: cute.Tensor, mOut: cute.Tensor,
             stream: cuda.CUstream):
        norm(mH, mR, mW, mS, mN).launch(grid=[mH.shape[0], 1, 1], block=[threads, 1, 1], smem=nwarps * 4,
                                        stream=stream)
        _launch_gemm(True, BN_GU, mN, mWg, mWu, mAct, stream)
        _launch_gemm(False, BN_DOWN, mAct, mWd, mWd, mOut, stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int, inter: int):
    key = (hidden, inter)
    fn = _COMPILED.get(key)
    if fn is None:
        assert hidden % 256 == 0 and inter % BN_GU == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        T = cute.sym_int32()
        bf = lambda shape: make_fake_compact_tensor(BFloat16, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),  # noqa: E731
                                                    assumed_align=16)
        fn = cute.compile(_make_run(hidden), bf((T, hidden)), bf((T, hidden)), bf((hidden,)), bf((T, hidden)),
                          bf((T, hidden)), bf((inter, hidden)), bf((inter, hidden)), bf((T, inter)),
                          bf((hidden, inter)), bf((T, hidden)), make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def solve(hidden_states, residual, norm_weight, w_gate_up, w_down):
    n_tok, hidden = hidden_states.shape
    inter = w_down.shape[1]
    dev = hidden_states.device
    h = hidden_states.contiguous()
    r = residual.contiguous()
    wgu = w_gate_up.contiguous()
    s = torch.empty_like(h)
    out = torch.empty_like(h)
    if n_tok > 0:
        key = (str(dev), n_tok, hidden, inter)
        ws = _WORKSPACE.get(key)
        if ws is None:
            ws = (torch.empty((n_tok, hidden), dtype=torch.bfloat16, device=dev),
                  torch.empty((n_tok, inter), dtype=torch.bfloat16, device=dev))
            _WORKSPACE[key] = ws
        nrm, act = ws
        _get_compiled(hidden, inter)(h, r, norm_weight.contiguous(), s, nrm, wgu[:inter], wgu[inter:], act,
                                     w_down.contiguous(), out)
    return out, s
