"""FIX (found by the H200 run of 2026-11-29: ~25% of q wrong, all in the rope dims): the epilogue took
each accumulator value's (row, col) from the warpgroup-level MMA slice, i.e. the coordinates of thread 0
of the warpgroup, so most threads rotated with the wrong token position and the wrong cos/sin pair.
The coordinate tensor is now partitioned with the per-thread slice (thread index within the 256 MMA
threads). A CPU emulation of the old index math reproduced the failure (3.2M of 12.6M over, max 9.3).

MLA q up-projection (wgmma GEMM) + GPT-J RoPE epilogue, and the paged kv_c / k_pe cache write,
in CuTe DSL (two kernels launched back to back by one compiled host function).

Kernel 1: q = q_c @ q_b_weight^T with the rotary embedding applied in the epilogue.
- A = q_c, the first 1536 columns of qkv_lora (a strided view: row stride 2112), B = q_b_weight
  [3072, 1536]; both K-major bf16, fp32 accumulation on the tensor cores (wgmma m64n192k16).
- CTA tile 128 x 192 x 64: one CTA per (128-token block, head), grid (ceil(T/128), 16) = 512
  CTAs (3.9 waves on 132 SMs). 2 consumer warpgroups (256 threads), each owns 64 rows x 192.
- Mainloop: TMA (cp.async.bulk.tensor, 128B-swizzled smem) into a 5-stage ring (40 KB/stage) with
  full/empty mbarriers (PipelineTmaAsync); warp 0 issues the loads for stage k + 5 as stage k is
  released; wgmma with 1 group in flight.
- Epilogue: the accumulator fragment keeps every GPT-J pair (2i, 2i+1) in one thread (adjacent
  columns of the wgmma C layout: value index v and v ^ 1), so columns 128..191 of the head are
  rotated in registers: each element's (row, col) comes from an identity-tensor partition, the
  token position selects cos/sin of pair (col - 128) / 2 from the bf16 cache (L2 hits). Then
  fp32 -> bf16, stmatrix into a swizzled 128 x 32 smem tile (4 buffers, reusing the A ring) and
  TMA bulk stores to q (rows past T are clipped by the TMA unit).
Kernel 2 (cache write): one warp per token (8 per CTA): for slot s >= 0, lane l copies kv_c bytes
32l..32l+31 (2 x 128-bit) to kv_cache[s // 64, s % 64, 0:512]; lanes 0..7 rotate k_pe elements
8l..8l+7 (pairs 4l..4l+3, fp32 math, one rounding) into [512:576].
What limits it: tensor-core throughput of the 38.7 GFLOP GEMM (39 us at the 990 TFLOP/s peak);
without warp specialization or a persistent scheduler the epilogue (~10% of a tile) is not
overlapped with the next tile's mainloop. Expected ~55-65 us (SOL 39 us).
Host path: compiled once per process with tvm-ffi (symbolic token count and cache sizes); torch
tensors (including the strided q_c view) are passed directly on the caller's current stream.
Verification: first version failed on the H200 (see FIX above); fixed version compile-checked on
CPU (sm_90a), H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64

HEADS = 16
Q_LORA_RANK = 1536
KV_LORA_RANK = 512
NOPE_DIM = 128
ROPE_DIM = 64
QK_HEAD_DIM = NOPE_DIM + ROPE_DIM            # 192
ROW = Q_LORA_RANK + KV_LORA_RANK + ROPE_DIM  # 2112
BLOCK_SIZE = 64
ENTRY = KV_LORA_RANK + ROPE_DIM              # 576

BM, BN, BK = 128, QK_HEAD_DIM, 64
ATOM_LAYOUT = (2, 1, 1)                      # 2 warpgroups along M
MMA_THREADS = 256
EPI_TILE = (128, 32)
EPI_STAGES = 4
SMEM_CAPACITY = 227 * 1024
AB_STAGES = (SMEM_CAPACITY - 1024) // ((BM + BN) * BK * 2)   # 5

CACHE_THREADS = 256
CACHE_WARPS = CACHE_THREADS // 32


@cute.kernel
def _gemm_rope_kernel(tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom, mB: cute.Tensor,
                      tma_atom_c: cute.CopyAtom, mC: cute.Tensor, mPos: cute.Tensor, mCS: cute.Tensor,
                      tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout,
                      b_smem_layout: cute.ComposedLayout, epi_smem_layout: cute.ComposedLayout):
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    pid_m, pid_n, _ = cute.arch.block_idx()
    ntok = mPos.shape[0]

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
    coord = (pid_m, pid_n, None)
    gA = cute.local_tile(mA, tile, coord, proj=(1, None, 1))      # (BM, BK, k)
    gB = cute.local_tile(mB, tile, coord, proj=(None, 1, 1))      # (BN, BK, k)
    gC = cute.local_tile(mC, tile, coord, proj=(1, 1, None))      # (BM, BN)

    wg = cute.arch.make_warp_uniform(tidx // 128)
    thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(wg))
    tCgC = thr_mma.partition_C(gC)
    # (row, col) of each accumulator value must come from THIS thread's slice: the warpgroup slice
    # above is thread 0 of the warpgroup (fine for the smem A/B partitions and the fragment shape only)
    tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((BM, BN)))

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
        # keep one wgmma group in flight; the stage read by the previous group can be released
        cute.nvgpu.warpgroup.wait_group(1)
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

    # ---- epilogue: GPT-J rotary embedding on columns 128..191 of the head, in registers ----
    # wgmma C fragment per thread: values ((2,2,24)) with coordinate strides (col+1, row+8, col+8),
    # i.e. v = v0 + 2*v1 + 4*j at (row, 2*(lane%4) + v0 + 8*j): acc[v], acc[v+1] (v even) are the
    # GPT-J pair (2i, 2i+1) of one row, and column blocks j >= 16 (v >= 64) are the rope dims.
    assert cute.size(acc) == 2 * 2 * (BN // 8)
    for v in cutlass.range_constexpr(4 * (NOPE_DIM // 8), cute.size(acc), 2):
        m, n = tCcC[v]
        row = pid_m * BM + m
        p = mPos[cutlass.min(row, ntok - 1)]
        i = (n - NOPE_DIM) // 2
        c = Float32(mCS[p, i])
        s = Float32(mCS[p, ROPE_DIM // 2 + i])
        xe = acc[v]
        xo = acc[v + 1]
        acc[v] = xe * c - xo * s
        acc[v + 1] = xo * c + xe * s

    cute.arch.sync_threads()            # every warpgroup is done with the A ring (reused as sC)

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


@cute.kernel
def _cache_kernel(mX: cute.Tensor, mPos: cute.Tensor, mCS: cute.Tensor, mSlot: cute.Tensor, mKV: cute.Tensor):
    bidx, _, _ = cute.arch.block_idx()
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    t = bidx * CACHE_WARPS + warp
    ntok = mX.shape[0]
    if t < ntok:
        s = mSlot[t]
        if s >= 0:
            blk = Int32(s // BLOCK_SIZE)
            off = Int32(s % BLOCK_SIZE)
            src = cute.zipped_divide(mX[t, None], (8,))          # ((8), (264)) bf16 chunks of the row
            dst = cute.zipped_divide(mKV[blk, off, None], (8,))  # ((8), (72))
            for h in cutlass.range_constexpr(2):
                r = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(src[(None, Q_LORA_RANK // 8 + 2 * lane + h)], r)
                cute.autovec_copy(r, dst[(None, 2 * lane + h)])
            if lane < ROPE_DIM // 8:
                p = Int32(mPos[t])
                rk = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(src[(None, (Q_LORA_RANK + KV_LORA_RANK) // 8 + lane)], rk)
                rc = cute.make_rmem_tensor((4,), BFloat16)
                rs = cute.make_rmem_tensor((4,), BFloat16)
                cute.autovec_copy(cute.zipped_divide(mCS[p, None], (4,))[(None, lane)], rc)
                cute.autovec_copy(cute.zipped_divide(mCS[p, None], (4,))[(None, ROPE_DIM // 8 + lane)], rs)
                ro = cute.make_rmem_tensor((8,), BFloat16)
                for j in cutlass.range_constexpr(4):
                    xe = Float32(rk[2 * j])
                    xo = Float32(rk[2 * j + 1])
                    c = Float32(rc[j])
                    sn = Float32(rs[j])
                    ro[2 * j] = (xe * c - xo * sn).to(BFloat16)
                    ro[2 * j + 1] = (xo * c + xe * sn).to(BFloat16)
                cute.autovec_copy(ro, dst[(None, KV_LORA_RANK // 8 + lane)])


@cute.jit
def _mla(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mX: cute.Tensor, mPos: cute.Tensor, mCS: cute.Tensor,
         mSlot: cute.Tensor, mKV: cute.Tensor, stream: cuda.CUstream):
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
        cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(epi_smem_layout, (None, None, 0)), EPI_TILE)
    ntok = mA.shape[0]
    _gemm_rope_kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, mPos, mCS, tiled_mma,
                      a_smem_layout, b_smem_layout, epi_smem_layout).launch(
        grid=[(ntok + BM - 1) // BM, HEADS, 1], block=[MMA_THREADS, 1, 1], stream=stream)
    _cache_kernel(mX, mPos, mCS, mSlot, mKV).launch(
        grid=[(ntok + CACHE_WARPS - 1) // CACHE_WARPS, 1, 1], block=[CACHE_THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
        ntok, npos, nblk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        a = make_fake_tensor(BFloat16, (ntok, Q_LORA_RANK), (ROW, 1), assumed_align=16)
        b = make_fake_compact_tensor(BFloat16, (HEADS * QK_HEAD_DIM, Q_LORA_RANK), stride_order=(1, 0),
                                     assumed_align=16)
        c = make_fake_compact_tensor(BFloat16, (ntok, HEADS * QK_HEAD_DIM), stride_order=(1, 0), assumed_align=16)
        x = make_fake_compact_tensor(BFloat16, (ntok, ROW), stride_order=(1, 0), assumed_align=16)
        pos = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        cs = make_fake_compact_tensor(BFloat16, (npos, ROPE_DIM), stride_order=(1, 0), assumed_align=16)
        slot = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        kv = make_fake_compact_tensor(BFloat16, (nblk, BLOCK_SIZE, ENTRY), stride_order=(2, 1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_mla, a, b, c, x, pos, cs, slot, kv, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(qkv_lora, q_b_weight, positions, cos_sin_cache, slot_mapping, kv_cache):
    ntok = qkv_lora.shape[0]
    assert qkv_lora.shape[1] == ROW and qkv_lora.is_contiguous() and kv_cache.is_contiguous()
    q = torch.empty((ntok, HEADS, QK_HEAD_DIM), dtype=qkv_lora.dtype, device=qkv_lora.device)
    if ntok > 0:
        _get_compiled()(qkv_lora[:, :Q_LORA_RANK], q_b_weight.contiguous(), q.view(ntok, HEADS * QK_HEAD_DIM),
                        qkv_lora, positions.to(torch.int64), cos_sin_cache, slot_mapping.to(torch.int64), kv_cache)
    return q, kv_cache
