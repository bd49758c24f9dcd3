"""Hybrid KV-cache block-table update (3 groups) + slot mapping, int32/int64, in CuTe DSL.

Algorithm (two kernels launched back to back, in stream order, by one compiled host function)
Kernel 1 (apply the staged writes): grid = rows of the persistent batch (256 CTAs), 128 threads.
- CTA r finds the write records of its row, in staging order: the records are scanned in chunks
  of 128 (thread t tests record base + t), each warp ballots its matches, popc gives the warp's
  count and the lane's rank, a 4-entry shared prefix over the warps gives every match its place
  in an ordered shared list (stable compaction; capacity MAX_RECORDS).
- Per group g (expansion e = 1, 2, 1) the threads load n_k = staged_counts[g, w_k] * e and
  overwrite[w_k] of the listed records into shared memory; thread 0 then walks the list in order
  (s = 0 on overwrite, else the running count; start_k = s; s += n_k) -- the sequential semantics
  of the staged writes, a handful of records per row -- and stores num_blocks[g, r] = s.
- Writes: warp j takes records k = j, j+4, ..; lane l writes kernel-block entries
  l, l+32, .. < n_k at column start_k + l: id = staged_ids[g, w_k, l // e] * e + l % e. Where
  records of the row overlap, an entry is written only by the last record covering it (each
  lane checks the later records of the list), so no write-write ordering between threads is
  needed and the result equals applying the records strictly in order.
Kernel 2 (slot mapping): grid = ceil(T / 256), one thread per token slot t: binary search of t
in query_start_loc[1:] (searchsorted right, L1-resident) gives the request, idx_mapping its row;
for each group, slot = table_g[row, p // k_g] * k_g + p % k_g as int64 (coalesced 8-byte stores
of the three [T] rows of slot_mapping); padding tokens (t >= query_start_loc[-1]) get -1.
What limits it: latency, not bandwidth (~0.4 MB of traffic, a few microseconds of DRAM time): two
dependent launches, the per-row serial scan of the record list and the binary-search chain;
expected 5-10 us of device time, close to the launch-latency floor rather than the DRAM floor.
Host path: compiled once per process with tvm-ffi (symbolic rows, widths, records, tokens); the
torch tensors are passed directly (overwrite as a uint8 view) on the caller's torch stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

BLOCK_SIZES = (16, 32, 8)
KERNEL_BLOCK_SIZES = (16, 16, 8)
EXPAND = tuple(b // k for b, k in zip(BLOCK_SIZES, KERNEL_BLOCK_SIZES))
PAD_SLOT_ID = -1
THREADS1 = 128
NWARPS1 = THREADS1 // 32
MAX_RECORDS = 2048           # capacity of the per-row record list (shared memory, 3 x 8 KiB)
THREADS2 = 256


@cute.jit
def _apply_group(g: cutlass.Constexpr, mT: cute.Tensor, mNB: cute.Tensor, mOW: cute.Tensor, mIds: cute.Tensor,
                 mCnt: cute.Tensor, sList: cute.Tensor, sN: cute.Tensor, sS: cute.Tensor, nmatch: Int32,
                 row: Int32, tidx: Int32, warp: Int32, lane: Int32):
    e = EXPAND[g]
    # per-record kernel-block count and overwrite flag, in list order
    for k in cutlass.range(tidx, nmatch, THREADS1):
        w = sList[k]
        sN[k] = mCnt[g, w] * e
        sS[k] = Int32(mOW[w])
    cute.arch.barrier()
    if tidx == 0:
        s = mNB[g, row]
        for k in cutlass.range(nmatch):
            n = sN[k]
            if sS[k] != 0:
                s = Int32(0)
            sS[k] = s
            s = s + n
        mNB[g, row] = s
    cute.arch.barrier()
    for k in cutlass.range(warp, nmatch, NWARPS1):
        w = sList[k]
        n = sN[k]
        st = sS[k]
        for j in cutlass.range(lane, n, 32):
            col = st + j
            win = True
            for k2 in cutlass.range(k + 1, nmatch):
                s2 = sS[k2]
                if col >= s2 and col < s2 + sN[k2]:
                    win = False
            if win:
                mT[row, col] = mIds[g, w, j // e] * e + j % e
    cute.arch.barrier()          # sN / sS are reused by the next group


@cute.kernel
def _update_kernel(mT0: cute.Tensor, mT1: cute.Tensor, mT2: cute.Tensor, mNB: cute.Tensor, mReq: cute.Tensor,
                   mOW: cute.Tensor, mIds: cute.Tensor, mCnt: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    nrec = mReq.shape[0]

    smem = cutlass.utils.SmemAllocator()
    sList = smem.allocate_tensor(Int32, cute.make_layout((MAX_RECORDS,)), byte_alignment=16)
    sN = smem.allocate_tensor(Int32, cute.make_layout((MAX_RECORDS,)), byte_alignment=16)
    sS = smem.allocate_tensor(Int32, cute.make_layout((MAX_RECORDS,)), byte_alignment=16)
    sWarp = smem.allocate_tensor(Int32, cute.make_layout((NWARPS1,)), byte_alignment=16)

    # stable compaction of this row's records (staging order)
    nmatch = Int32(0)
    for base in cutlass.range(0, nrec, THREADS1):
        w = base + tidx
        hit = False
        if w < nrec:
            hit = mReq[w] == row
        ballot = cute.arch.vote_ballot_sync(hit)
        if lane == 0:
            sWarp[warp] = cute.arch.popc(ballot)
        cute.arch.barrier()
        before = nmatch
        total = nmatch
        for i in cutlass.range_constexpr(NWARPS1):
            c = sWarp[i]
            if i < warp:
                before = before + c
            total = total + c
        if hit:
            rank = cute.arch.popc(ballot & cute.arch.lanemask_lt())
            sList[before + rank] = w
        nmatch = total
        cute.arch.barrier()      # sWarp is rewritten by the next chunk; sList complete after the last

    _apply_group(0, mT0, mNB, mOW, mIds, mCnt, sList, sN, sS, nmatch, row, tidx, warp, lane)
    _apply_group(1, mT1, mNB, mOW, mIds, mCnt, sList, sN, sS, nmatch, row, tidx, warp, lane)
    _apply_group(2, mT2, mNB, mOW, mIds, mCnt, sList, sN, sS, nmatch, row, tidx, warp, lane)


@cute.kernel
def _slot_kernel(mT0: cute.Tensor, mT1: cute.Tensor, mT2: cute.Tensor, mMap: cute.Tensor, mQSL: cute.Tensor,
                 mPos: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    t = bidx * THREADS2 + tidx
    ntok = mPos.shape[0]
    nreq = mMap.shape[0]
    if t < ntok:
        live = t < mQSL[nreq]
        if live:
            # entry = #{i in 1..nreq : qsl[i] <= t}, clamped to nreq - 1
            lo = Int32(0)
            hi = nreq
            while lo < hi:
                mid = (lo + hi) // 2
                if mQSL[mid + 1] <= t:
                    lo = mid + 1
                else:
                    hi = mid
            entry = cutlass.min(lo, nreq - 1)
            r = mMap[entry]
            p = mPos[t]
            tables = (mT0, mT1, mT2)
            for g in cutlass.range_constexpr(3):
                kb = KERNEL_BLOCK_SIZES[g]
                blk = tables[g][r, Int32(p // kb)]
                mOut[g, t] = Int64(blk) * kb + p % kb
        else:
            for g in cutlass.range_constexpr(3):
                mOut[g, t] = Int64(PAD_SLOT_ID)


@cute.jit
def _step(mT0: cute.Tensor, mT1: cute.Tensor, mT2: cute.Tensor, mNB: cute.Tensor, mReq: cute.Tensor,
          mOW: cute.Tensor, mIds: cute.Tensor, mCnt: cute.Tensor, mMap: cute.Tensor, mQSL: cute.Tensor,
          mPos: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
    rows = mT0.shape[0]
    smem_bytes = 3 * MAX_RECORDS * 4 + 64
    _update_kernel(mT0, mT1, mT2, mNB, mReq, mOW, mIds, mCnt).launch(
        grid=[rows, 1, 1], block=[THREADS1, 1, 1], smem=smem_bytes, stream=stream)
    ntok = mPos.shape[0]
    _slot_kernel(mT0, mT1, mT2, mMap, mQSL, mPos, mOut).launch(
        grid=[(ntok + THREADS2 - 1) // THREADS2, 1, 1], block=[THREADS2, 1, 1], stream=stream)


_COMPILED = {}
_OUT = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows, w0, w1, w2 = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        nrec, stage, nreq, nqsl, ntok = (cute.sym_int32() for _ in range(5))
        t0 = make_fake_compact_tensor(Int32, (rows, w0), stride_order=(1, 0), assumed_align=4)
        t1 = make_fake_compact_tensor(Int32, (rows, w1), stride_order=(1, 0), assumed_align=4)
        t2 = make_fake_compact_tensor(Int32, (rows, w2), stride_order=(1, 0), assumed_align=4)
        nb = make_fake_compact_tensor(Int32, (3, rows), stride_order=(1, 0), assumed_align=4)
        req = make_fake_compact_tensor(Int32, (nrec,), assumed_align=4)
        ow = make_fake_compact_tensor(Uint8, (nrec,), assumed_align=1)
        ids = make_fake_compact_tensor(Int32, (3, nrec, stage), stride_order=(2, 1, 0), assumed_align=4)
        cnt = make_fake_compact_tensor(Int32, (3, nrec), stride_order=(1, 0), assumed_align=4)
        mp = make_fake_compact_tensor(Int32, (nreq,), assumed_align=4)
        qsl = make_fake_compact_tensor(Int32, (nqsl,), assumed_align=4)
        pos = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        out = make_fake_compact_tensor(Int64, (3, ntok), stride_order=(1, 0), assumed_align=8)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_step, t0, t1, t2, nb, req, ow, ids, cnt, mp, qsl, pos, out, stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 else x.to(torch.int32)


def solve(block_table_0, block_table_1, block_table_2, num_blocks, write_requests, overwrite, staged_ids,
          staged_counts, idx_mapping, query_start_loc, positions):
    assert write_requests.numel() <= MAX_RECORDS
    assert block_table_0.dtype == torch.int32 and num_blocks.dtype == torch.int32
    ntok = positions.numel()
    slot_mapping = torch.empty((3, ntok), dtype=torch.int64, device=positions.device)
    ow = overwrite.view(torch.uint8) if overwrite.dtype == torch.bool else overwrite.to(torch.uint8)
    _get_compiled()(block_table_0, block_table_1, block_table_2, num_blocks, _i32(write_requests).contiguous(),
                    ow.contiguous(), _i32(staged_ids).contiguous(), _i32(staged_counts).contiguous(),
                    _i32(idx_mapping).contiguous(), _i32(query_start_loc).contiguous(),
                    positions.to(torch.int64).contiguous(), slot_mapping)
    return block_table_0, block_table_1, block_table_2, num_blocks, slot_mapping
