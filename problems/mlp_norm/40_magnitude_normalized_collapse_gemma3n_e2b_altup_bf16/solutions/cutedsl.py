"""Gemma 3n AltUp collapse (3 unembedding GEMMs 2048x2048, per-token RMS rescale, 4-stream mean)
in CuTe DSL: a batched wgmma GEMM with a sum-of-squares epilogue, then a row-wise combine kernel.

Kernel 1 (GEMM, batched over the 3 alternate streams):
- P_i = h_i @ W_i^T for i = 1..3: A = hidden_states[1:] as (T, H, 3), B = unembed_weights as
  (H_out, H_in, 3), both K-major bf16; fp32 accumulation on the tensor cores (wgmma m64n256k16).
- CTA tile 128 x 256 x 64, grid (ceil(T/128), ceil(H/256), 3) = 64 x 8 x 3 = 1536 CTAs (11.6
  waves on 132 SMs); 2 consumer warpgroups (256 threads), each owns 64 rows x 256 columns
  (128 fp32 accumulators per thread).
- Mainloop: TMA into a 4-stage ring of 128B-swizzled tiles (48 KB/stage) with full/empty
  mbarriers (PipelineTmaAsync); warp 0 refills each stage as it is released; one wgmma group in
  flight.
- Epilogue: per-row partial sums of p^2 over the tile's 256 columns from the fp32 accumulators
  (thread -> 4-lane quad shuffles; one writer per row and tile, deterministic) into
  ss[i, t, n_tile]; P rounded to bf16 (the problem allows it), stmatrix into a swizzled 128 x 32
  smem tile (4 buffers reusing the A ring) and TMA bulk stores into a [3, T, H] workspace.
Kernel 2 (combine): one CTA per token, H/8 threads (256), thread i owns columns 8i..8i+7:
  target = sqrt(mean(h0^2)) (block reduction), mag_i = sqrt(max(sum of the partials / H, 1e-5)),
  out = (h0 + sum_i P_i * target / mag_i) / 4 in fp32, rounded to bf16, 128-bit accesses.
What limits it: tensor-core throughput of the 206 GFLOP (208 us at the 990 TFLOP/s peak); the
bf16 P round trip adds ~200 MB of traffic (~45 us) because the rescale needs whole rows of every
P_i before any output element is final. Expected ~330-380 us (SOL 208 us).
Host path: compiled once per hidden size with tvm-ffi (symbolic token count); workspaces cached
per (device, T, H); torch tensors passed directly on the caller's current stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
Review 2026-11-29 (no GPU): fixed epilogue-1 row coordinates (tCcC from the warpgroup slice gave all threads thread 0's rows, so most ss rows were never written; now get_slice(tidx)).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int64

STREAMS = 4
EPS = 1e-5
BM, BN, BK = 128, 256, 64
ATOM_LAYOUT = (2, 1, 1)                      # 2 warpgroups along M
MMA_THREADS = 256
EPI_TILE = (128, 32)
EPI_STAGES = 4
SMEM_CAPACITY = 227 * 1024
AB_STAGES = (SMEM_CAPACITY - 1024) // ((BM + BN) * BK * 2)   # 4
VEC = 8


def _add(a, b):
    return a + b


@cute.kernel
def _gemm_kernel(tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom, mB: cute.Tensor,
                 tma_atom_c: cute.CopyAtom, mC: cute.Tensor, mSS: cute.Tensor, tiled_mma: cute.TiledMma,
                 a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
                 epi_smem_layout: cute.ComposedLayout):
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    pid_m, pid_n, pid_l = cute.arch.block_idx()
    ntok = mSS.shape[1]

    if warp_idx == 0:
        cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
        cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

    @cute.struct
    class SharedStorage:
        bars: cute.struct.MemRange[Int64, AB_STAGES * 2]
        sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem_layout)], 1024]
        sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_smem_layout)], 1024]

    smem = cutlass.utils.SmemAllocator()
    storage = smem.allocate(SharedStorage)
    a_stage_layout = cute.slice_(a_smem_layout, (None, None, 0))
    b_stage_layout = cute.slice_(b_smem_layout, (None, None, 0))
    tx_bytes = cute.size_in_bytes(BFloat16, a_stage_layout) + cute.size_in_bytes(BFloat16, b_stage_layout)
    mainloop = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.bars.data_ptr(), num_stages=AB_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
        tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

    sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
    sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
    sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_smem_layout.inner, dtype=BFloat16), epi_smem_layout.outer)

    tile = (BM, BN, BK)
    coord = (pid_m, pid_n, None, pid_l)
    gA = cute.local_tile(mA, tile, coord, proj=(1, None, 1))      # (BM, BK, k)
    gB = cute.local_tile(mB, tile, coord, proj=(None, 1, 1))      # (BN, BK, k)
    gC = cute.local_tile(mC, tile, coord, proj=(1, 1, None))      # (BM, BN)

    wg = cute.arch.make_warp_uniform(tidx // 128)
    thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(wg))
    tCgC = thr_mma.partition_C(gC)
    tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((BM, BN)))   # per-thread coordinates

    tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1),
                                                  cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
    tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(1),
                                                  cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    acc = cute.make_rmem_tensor(tCgC.shape, Float32)

    cute.arch.sync_threads()

    k_tiles = cute.size(gA, mode=[2])
    prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, AB_STAGES)
    if warp_idx == 0:
        for _ in cutlass.range(cutlass.min(AB_STAGES, k_tiles), unroll=1):
            mainloop.producer_acquire(prod)
            cute.copy(tma_atom_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                      tma_bar_ptr=mainloop.producer_get_barrier(prod))
            cute.copy(tma_atom_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                      tma_bar_ptr=mainloop.producer_get_barrier(prod))
            mainloop.producer_commit(prod)
            prod.advance()

    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, AB_STAGES)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, AB_STAGES)
    num_k_blocks = cute.size(tCrA, mode=[2])
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    for kt in cutlass.range(k_tiles, unroll=1):
        mainloop.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range(num_k_blocks, unroll_full=True):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(1)       # the previous group is done: its stage can go
        read.advance()
        if kt > 0:
            mainloop.consumer_release(release)
            release.advance()
            # refill the stage just released (never before a release: warp 0 would wait on itself)
            if warp_idx == 0 and prod.count < k_tiles:
                mainloop.producer_acquire(prod)
                cute.copy(tma_atom_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                          tma_bar_ptr=mainloop.producer_get_barrier(prod))
                cute.copy(tma_atom_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=mainloop.producer_get_barrier(prod))
                mainloop.producer_commit(prod)
                prod.advance()
    cute.nvgpu.warpgroup.wait_group(0)

    # ---- epilogue 1: per-row partial sum of squares of this tile (fp32 accumulators) ----
    # wgmma C fragment per thread: values ((2,2,BN/8)) with coordinate strides (col+1, row+8,
    # col+8): v = v0 + 2*v1 + 4*j, v1 selects row r or r + 8; the 4 lanes of a quad share the rows.
    nval = cute.size(acc)
    s0 = Float32(0.0)
    s1 = Float32(0.0)
    for j in cutlass.range_constexpr(nval // 4):
        s0 = s0 + acc[4 * j] * acc[4 * j] + acc[4 * j + 1] * acc[4 * j + 1]
        s1 = s1 + acc[4 * j + 2] * acc[4 * j + 2] + acc[4 * j + 3] * acc[4 * j + 3]
    s0 = s0 + cute.arch.shuffle_sync_bfly(s0, offset=1)
    s0 = s0 + cute.arch.shuffle_sync_bfly(s0, offset=2)
    s1 = s1 + cute.arch.shuffle_sync_bfly(s1, offset=1)
    s1 = s1 + cute.arch.shuffle_sync_bfly(s1, offset=2)
    if lane % 4 == 0:
        m0, _ = tCcC[0]
        m1, _ = tCcC[2]
        r0 = pid_m * BM + m0
        r1 = pid_m * BM + m1
        if r0 < ntok:
            mSS[pid_l, r0, pid_n] = s0
        if r1 < ntok:
            mSS[pid_l, r1, pid_n] = s1

    cute.arch.sync_threads()            # every warpgroup is done with the A ring (reused as sC)

    # ---- epilogue 2: P (bf16) -> swizzled smem (stmatrix) -> TMA store ----
    c_layout = utils.LayoutEnum.ROW_MAJOR
    copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(c_layout, elem_ty_d=BFloat16, elem_ty_acc=Float32)
    copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), BFloat16)
    tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
    tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
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


def _make(hidden: int):
    nch = hidden // VEC
    threads = min(256, ((nch + 31) // 32) * 32)
    per = (nch + threads - 1) // threads
    nwarps = threads // 32
    ntiles_n = (hidden + BN - 1) // BN

    @cute.kernel
    def _combine_kernel(mH: cute.Tensor, mP: cute.Tensor, mSS: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((nwarps,)), byte_alignment=16)

        chunks = []
        oks = []
        for k in cutlass.range_constexpr(per):
            c = tidx + k * threads
            oks.append(c < nch)
            chunks.append(cutlass.min(c, nch - 1))
        hs = []
        ps = []
        for k in cutlass.range_constexpr(per):
            r = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(mH[0, t, None], (VEC,))[(None, chunks[k])], r)
            hs.append(r)
            for i in cutlass.range_constexpr(STREAMS - 1):
                q = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(cute.zipped_divide(mP[i, t, None], (VEC,))[(None, chunks[k])], q)
                ps.append(q)
        # per-stream inverse magnitudes from the GEMM's partial sums of squares
        scl = []
        for i in cutlass.range_constexpr(STREAMS - 1):
            ss = mSS[i, t, 0]
            for n in cutlass.range_constexpr(1, ntiles_n):
                ss = ss + mSS[i, t, n]
            scl.append(cute.math.rsqrt(cute.arch.fmax(ss * (1.0 / hidden), Float32(EPS))))
        sq = Float32(0.0)
        for k in cutlass.range_constexpr(per):
            h = hs[k].load().to(Float32)
            part = (h * h).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            sq = sq + Float32(cutlass.select_(oks[k], part, Float32(0.0)))
        sq = cute.arch.warp_reduction(sq, _add)
        if lane == 0:
            red[warp] = sq
        cute.arch.barrier()
        tot = red[0]
        for i in cutlass.range_constexpr(1, nwarps):
            tot = tot + red[i]
        target = cute.math.sqrt(tot * (1.0 / hidden))
        for k in cutlass.range_constexpr(per):
            o = hs[k].load().to(Float32)
            for i in cutlass.range_constexpr(STREAMS - 1):
                o = o + ps[k * (STREAMS - 1) + i].load().to(Float32) * (target * scl[i])
            ro = cute.make_rmem_tensor((VEC,), BFloat16)
            ro.store((o * (1.0 / STREAMS)).to(BFloat16))
            if oks[k]:
                cute.autovec_copy(ro, cute.zipped_divide(mO[t, None], (VEC,))[(None, chunks[k])])

    @cute.jit
    def _run(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mH: cute.Tensor, mP: cute.Tensor,
             mSS: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        a_layout = utils.LayoutEnum.from_tensor(mA)
        b_layout = utils.LayoutEnum.from_tensor(mB)
        c_layout = utils.LayoutEnum.from_tensor(mC)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a_layout.sm90_mma_major_mode(),
                                                      b_layout.sm90_mma_major_mode(), Float32, ATOM_LAYOUT,
                                                      tiler_mn=(64, BN))
        tile = (BM, BN, BK)
        a_smem_layout = sm90_utils.make_smem_layout_a(a_layout, tile, BFloat16, AB_STAGES)
        b_smem_layout = sm90_utils.make_smem_layout_b(b_layout, tile, BFloat16, AB_STAGES)
        epi_smem_layout = sm90_utils.make_smem_layout_epi(BFloat16, c_layout, EPI_TILE, EPI_STAGES)
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem_layout, (None, None, 0)), (BM, BK))
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem_layout, (None, None, 0)), (BN, BK))
        tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(epi_smem_layout, (None, None, 0)),
            EPI_TILE)
        ntok = mA.shape[0]
        _gemm_kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, mSS, tiled_mma,
                     a_smem_layout, b_smem_layout, epi_smem_layout).launch(
            grid=[(ntok + BM - 1) // BM, ntiles_n, STREAMS - 1], block=[MMA_THREADS, 1, 1], stream=stream)
        _combine_kernel(mH, mP, mSS, mO).launch(grid=[ntok, 1, 1], block=[threads, 1, 1],
                                                smem=nwarps * 4 + 64, stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int):
    fn = _COMPILED.get(hidden)
    if fn is None:
        assert hidden % VEC == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
        ntok = cute.sym_int32()
        ntiles_n = (hidden + BN - 1) // BN
        # GEMM views: (M, K, L) / (N, K, L) / (M, N, L) with the stream index as the batch mode L
        a = make_fake_tensor(BFloat16, (ntok, hidden, STREAMS - 1), (hidden, 1, ntok * hidden), assumed_align=16)
        b = make_fake_tensor(BFloat16, (hidden, hidden, STREAMS - 1), (hidden, 1, hidden * hidden), assumed_align=16)
        c = make_fake_tensor(BFloat16, (ntok, hidden, STREAMS - 1), (hidden, 1, ntok * hidden), assumed_align=16)
        h = make_fake_compact_tensor(BFloat16, (STREAMS, ntok, hidden), stride_order=(2, 1, 0), assumed_align=16)
        p = make_fake_compact_tensor(BFloat16, (STREAMS - 1, ntok, hidden), stride_order=(2, 1, 0), assumed_align=16)
        ss = make_fake_compact_tensor(Float32, (STREAMS - 1, ntok, ntiles_n), stride_order=(2, 1, 0),
                                      assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (ntok, hidden), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make(hidden), a, b, c, h, p, ss, o, stream, options="--enable-tvm-ffi")
        _COMPILED[hidden] = fn
    return fn


def _workspace(device, ntok, hidden):
    key = (str(device), ntok, hidden)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ntiles_n = (hidden + BN - 1) // BN
        ws = (torch.empty((STREAMS - 1, ntok, hidden), dtype=torch.bfloat16, device=device),
              torch.empty((STREAMS - 1, ntok, ntiles_n), dtype=torch.float32, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(hidden_states: torch.Tensor, unembed_weights: torch.Tensor) -> torch.Tensor:
    streams, ntok, hidden = hidden_states.shape
    assert streams == STREAMS and hidden_states.is_contiguous() and unembed_weights.is_contiguous()
    out = torch.empty((ntok, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    if ntok > 0:
        p, ss = _workspace(hidden_states.device, ntok, hidden)
        # (M, K, L) views of streams 1..3 and of the weights, (M, N, L) view of the P workspace
        a = hidden_states[1:].permute(1, 2, 0)
        b = unembed_weights.permute(1, 2, 0)
        c = p.permute(1, 2, 0)
        _get_compiled(hidden)(a, b, c, hidden_states, p, ss, out)
    return out
