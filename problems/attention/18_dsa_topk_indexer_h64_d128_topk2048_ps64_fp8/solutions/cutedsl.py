"""DeepSeek-V3.2 sparse-attention indexer (64 index heads x 128, fp8 e4m3 queries and paged fp8 keys with
per-token fp32 scales, page size 64, top-2048) in CuTe DSL: a tensor-core scoring kernel and a per-request
radix-select / compaction kernel.

Kernel 1 (scores): grid (128 page groups, B), 128 threads = 4 warps; a CTA scores up to 4 pages (256
tokens) of one request and returns at once past seq_len.
- Q_b (64 x 128 fp8) is converted once to fp16 (cvt.rn.f16x2.e4m3x2; e4m3 values are exact in fp16) into
  a swizzled shared tile; the page's 64 x 128 fp8 key values (8 KiB, 16-byte loads) likewise; the 64
  per-token fp32 scales and the 64 head weights go to shared memory.
- MMA (mma.sync m16n8k16, fp16 in, fp32 accumulate; products of fp16 values are exact): warp w computes
  S = K[16w..16w+15] Q^T (16 tokens x 64 heads, 8 k-steps x 8 n-tiles); then per token
  score = sum_h w_h * relu(S[t, h] * scale_t): each thread sums its 16 heads, 2 quad shuffles finish
  the sum, and the score is written (fp32) to a workspace [B, 32768] (positions < seq_len only).
Kernel 2 (top-k): grid (B), 1024 threads; thread t owns the 32 consecutive positions 32t..32t+31 in
registers (orderable uint32 keys of the fp32 scores).
- n <= 2048: every position is selected. Otherwise a 4-pass 8-bit radix select finds the exact key T of
  the 2048th largest score (shared-memory histogram with atomics, then warp 0 locates the bin with a
  suffix scan over 8 bins per lane); positions with key > T are selected, plus the first (by position)
  ones equal to T until 2048 are taken.
- Compaction in position order: per-thread counts, a block-wide exclusive scan (warp shuffles + shared
  warp totals), and each selected position p is written as block_table[b, p / 64] * 64 + p % 64; the rest
  of the row is -1.
Exactness: scores differ from the reference's fp32 evaluation only by rounding order (~1e-6 relative),
while the generator guarantees a top-2048 decision margin of 1e-4 of the row's largest |score|.
What limits it: the scoring pass is memory-bound on the fp8 key pages (57 MB; SOL ~0.012 ms) plus 7 GFLOP
on mma.sync; the selection of the two 32768-token requests runs on one SM each (4 histogram passes over
32 keys per thread). Expected ~0.03-0.05 ms.
Host path: one tvm-ffi compiled function takes the torch tensors directly (the key cache as a
[pages, 8448] byte view), both kernels on the caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Float8E4M3FN, Int32, Uint8, Uint32
from cutlass.cute.nvgpu import warp

HEADS = 64
DIM = 128
PAGE = 64
TOPK = 2048
PAGE_BYTES = PAGE * (DIM + 4)          # 8448
SCALE_OFF = PAGE * DIM                 # 8192
MAX_PAGES = 512
MAX_TOK = MAX_PAGES * PAGE             # 32768
PPC = 4                                # pages per scoring CTA
THREADS_S = 128
THREADS_T = 1024
EPT = MAX_TOK // THREADS_T             # 32 positions per thread in the top-k kernel


@cute.kernel
def _score_kernel(mQ: cute.Tensor, mC: cute.Tensor, mW: cute.Tensor, mLens: cute.Tensor, mBT: cute.Tensor,
                  mS: cute.Tensor, s_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    jb, b, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32
    n = mLens[b]
    p0 = jb * PPC
    if p0 * PAGE < n:
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(Float16, s_layout, byte_alignment=1024)
        sK = smem.allocate_tensor(Float16, s_layout, byte_alignment=1024)
        sScale = smem.allocate_tensor(Float32, cute.make_layout((PAGE,)), byte_alignment=16)
        sW = smem.allocate_tensor(Float32, cute.make_layout((HEADS,)), byte_alignment=16)

        # Q_b -> fp16 (512 chunks of 16 fp8, 4 per thread)
        for it in cutlass.range_constexpr(HEADS * DIM // 16 // THREADS_S):
            cid = tidx + THREADS_S * it
            r = cid // (DIM // 16)
            c = cid % (DIM // 16)
            _cvt16(cute.zipped_divide(mQ[b, r, None], (16,))[(None, c)],
                   cute.zipped_divide(sQ[r, None], (16,))[(None, c)])
        if tidx < HEADS:
            sW[tidx] = mW[b, tidx]

        thr_mma = tiled_mma.get_slice(tidx)
        s2r_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                           Float16), tiled_mma)
        s2r_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                           Float16), tiled_mma)
        thr_a = s2r_a.get_slice(tidx)
        thr_b = s2r_b.get_slice(tidx)
        tArK = thr_mma.make_fragment_A(thr_mma.partition_A(sK))
        tAsK = thr_a.partition_S(sK)
        tArK_v = thr_a.retile(tArK)
        tBrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ))
        tBsQ = thr_b.partition_S(sQ)
        tBrQ_v = thr_b.retile(tBrQ)
        tC = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((PAGE, HEADS))))

        for pi in cutlass.range_constexpr(PPC):
            j = p0 + pi
            if j * PAGE < n:
                page = mBT[b, j]
                cute.arch.barrier()                    # previous page's tiles are no longer read
                row = mC[page, None]
                vals = cute.make_tensor(cute.recast_ptr(row.iterator, dtype=Float8E4M3FN),
                                        cute.make_layout((PAGE, DIM), stride=(DIM, 1)))
                for it in cutlass.range_constexpr(PAGE * DIM // 16 // THREADS_S):
                    cid = tidx + THREADS_S * it
                    r = cid // (DIM // 16)
                    c = cid % (DIM // 16)
                    _cvt16(cute.zipped_divide(vals[r, None], (16,))[(None, c)],
                           cute.zipped_divide(sK[r, None], (16,))[(None, c)])
                if tidx < PAGE:
                    scl = cute.make_tensor(cute.recast_ptr(row.iterator + SCALE_OFF, dtype=Float32),
                                           cute.make_layout((PAGE,)))
                    sScale[tidx] = scl[tidx]
                cute.arch.barrier()

                acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((PAGE, HEADS)), Float32)
                acc.fill(0.0)
                for k in cutlass.range_constexpr(cute.size(tAsK.shape[2])):
                    cute.copy(s2r_a, tAsK[None, None, k], tArK_v[None, None, k])
                    cute.copy(s2r_b, tBsQ[None, None, k], tBrQ_v[None, None, k])
                    cute.gemm(tiled_mma, acc, tArK[None, None, k], tBrQ[None, None, k], acc)
                acc_mn = _mn_view(acc)
                for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                    t = tC[r, 0][0]
                    sc = sScale[t]
                    tot = Float32(0.0)
                    for q in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        hh = tC[0, q][1]
                        tot = tot + cute.arch.fmax(acc_mn[r, q] * sc, Float32(0.0)) * sW[hh]
                    tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=1)
                    tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=2)
                    pos = j * PAGE + t
                    if lane % 4 == 0:
                        if pos < n:
                            mS[b, pos] = tot


@cute.jit
def _cvt16(src: cute.Tensor, dst: cute.Tensor):
    """16 fp8 e4m3 values (one 16-byte load) -> fp16 in shared memory."""
    r8 = cute.make_rmem_tensor((16,), Float8E4M3FN)
    cute.autovec_copy(src, r8)
    r16 = cute.make_rmem_tensor((16,), Float16)
    r16.store(r8.load().to(Float16))
    cute.autovec_copy(r16, dst)


def _mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an mma.sync accumulator partition ((2, 2), MMA_M, MMA_N)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.kernel
def _topk_kernel(mS: cute.Tensor, mLens: cute.Tensor, mBT: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    wid = tidx // 32
    n = mLens[b]

    smem = cutlass.utils.SmemAllocator()
    hist = smem.allocate_tensor(Int32, cute.make_layout((256,)), byte_alignment=16)
    sSel = smem.allocate_tensor(Uint32, cute.make_layout((2,)), byte_alignment=16)
    sTot = smem.allocate_tensor(Int32, cute.make_layout((2, 32), stride=(32, 1)), byte_alignment=16)

    # orderable keys of this thread's 32 positions (0 = absent)
    fv = cute.make_rmem_tensor((EPT,), Float32)
    for e in cutlass.range_constexpr(EPT):
        pos = tidx * EPT + e
        fv[e] = Float32(0.0)
        if pos < n:
            fv[e] = mS[b, pos]
    ub = cute.recast_tensor(fv, Uint32)
    keys = cute.make_rmem_tensor((EPT,), Uint32)
    for e in cutlass.range_constexpr(EPT):
        u = ub[e]
        kneg = Uint32(u ^ Uint32(0xFFFFFFFF))
        kpos = Uint32(u | Uint32(0x80000000))
        ko = Uint32(cutlass.select_((u & Uint32(0x80000000)) != Uint32(0), kneg, kpos))
        pos = tidx * EPT + e
        keys[e] = Uint32(cutlass.select_(pos < n, ko, Uint32(0)))

    kth = Uint32(0)          # key of the TOPK-th largest (0: take everything present)
    k_eq = Int32(TOPK)       # how many of the keys equal to kth are taken
    if n > TOPK:
        prefix = Uint32(0)
        mask = Uint32(0)
        k_rem = Int32(TOPK)
        for ps in cutlass.range_constexpr(4):
            shift = 24 - 8 * ps
            if tidx < 256:
                hist[tidx] = Int32(0)
            cute.arch.barrier()
            for e in cutlass.range_constexpr(EPT):
                kp = keys[e]
                if (kp & mask) == prefix:
                    if kp != Uint32(0):
                        bin_ = Int32((kp >> shift) & Uint32(255))
                        cute.arch.atomic_add(hist.iterator + bin_, Int32(1))
            cute.arch.barrier()
            if wid == 0:
                # lane l owns bins 8l..8l+7; suffix sums from the top bin down
                cnt = cute.make_rmem_tensor((8,), Int32)
                s_l = Int32(0)
                for q in cutlass.range_constexpr(8):
                    cnt[q] = hist[lane * 8 + q]
                    s_l = s_l + cnt[q]
                incl = s_l
                for off in (1, 2, 4, 8, 16):
                    o = cute.arch.shuffle_sync_down(incl, offset=off)
                    if lane + off < 32:
                        incl = incl + o
                above = incl - s_l           # count in bins of higher lanes
                for q in cutlass.range_constexpr(7, -1, -1):
                    if above < k_rem:
                        if above + cnt[q] >= k_rem:
                            sSel[0] = Uint32(lane * 8 + q)
                            sSel[1] = Uint32(k_rem - above)
                    above = above + cnt[q]
            cute.arch.barrier()
            bsel = sSel[0]
            k_rem = Int32(sSel[1])
            prefix = prefix | (bsel << shift)
            mask = mask | (Uint32(255) << shift)
            cute.arch.barrier()
        kth = prefix
        k_eq = k_rem

    # counts per thread: greater than kth, equal to kth (present keys only)
    n_gt = Int32(0)
    n_eq = Int32(0)
    for e in cutlass.range_constexpr(EPT):
        kc = keys[e]
        if kc != Uint32(0):
            if kc > kth:
                n_gt = n_gt + 1
            if kc == kth:
                n_eq = n_eq + 1
    # exclusive scan of n_eq, then of the selected counts
    ex_eq = _block_excl_scan(n_eq, sTot, 0, lane, wid)
    take_eq = cutlass.min(cutlass.max(k_eq - ex_eq, Int32(0)), n_eq)
    n_sel = n_gt + take_eq
    cute.arch.barrier()
    ex_sel = _block_excl_scan(n_sel, sTot, 1, lane, wid)

    outp = ex_sel
    eq_seen = Int32(0)
    for e in cutlass.range_constexpr(EPT):
        kw = keys[e]
        pos = tidx * EPT + e
        if kw != Uint32(0):
            sel = kw > kth
            if kw == kth:
                sel = eq_seen < take_eq
                eq_seen = eq_seen + 1
            if sel:
                mOut[b, outp] = mBT[b, pos // 64] * 64 + pos % 64
                outp = outp + 1
    total = cutlass.min(n, Int32(TOPK))
    for e in cutlass.range_constexpr(TOPK // THREADS_T):
        idx = tidx + THREADS_T * e
        if idx >= total:
            mOut[b, idx] = Int32(-1)


@cute.jit
def _block_excl_scan(v: Int32, sTot: cute.Tensor, slot: cutlass.Constexpr, lane: Int32, wid: Int32) -> Int32:
    """Exclusive prefix sum of v over the 1024 threads (thread order)."""
    incl = v
    for off in (1, 2, 4, 8, 16):
        o = cute.arch.shuffle_sync_up(incl, offset=off)
        if lane >= off:
            incl = incl + o
    if lane == 31:
        sTot[slot, wid] = incl
    cute.arch.barrier()
    wt = sTot[slot, lane]
    wincl = wt
    for off in (1, 2, 4, 8, 16):
        o = cute.arch.shuffle_sync_up(wincl, offset=off)
        if lane >= off:
            wincl = wincl + o
    # exclusive warp offset of warp `wid` = inclusive scan at lane wid minus its own total
    wex = cute.arch.shuffle_sync(wincl - wt, offset=wid)
    return wex + incl - v


@cute.jit
def _indexer(mQ: cute.Tensor, mC: cute.Tensor, mW: cute.Tensor, mLens: cute.Tensor, mBT: cute.Tensor,
             mS: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    s_layout = cute.tile_to_shape(atom, (PAGE, DIM), (0, 1))
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(Float16, Float32, (16, 8, 16)), (4, 1, 1),
                                    permutation_mnk=(64, 16, 16))
    batch = mQ.shape[0]
    _score_kernel(mQ, mC, mW, mLens, mBT, mS, s_layout, tiled_mma).launch(
        grid=[MAX_PAGES // PPC, batch, 1], block=[THREADS_S, 1, 1], stream=stream)
    _topk_kernel(mS, mLens, mBT, mOut).launch(grid=[batch, 1, 1], block=[THREADS_T, 1, 1], stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        batch, pages, width = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(Float8E4M3FN, (batch, HEADS, DIM), stride_order=(2, 1, 0), assumed_align=16)
        c = make_fake_compact_tensor(Uint8, (pages, PAGE_BYTES), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(Float32, (batch, HEADS), stride_order=(1, 0), assumed_align=4)
        lens = make_fake_compact_tensor(Int32, (batch,), assumed_align=4)
        bt = make_fake_compact_tensor(Int32, (batch, width), stride_order=(1, 0), assumed_align=4)
        s = make_fake_compact_tensor(Float32, (batch, MAX_TOK), stride_order=(1, 0), assumed_align=16)
        out = make_fake_compact_tensor(Int32, (batch, TOPK), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_indexer, q, c, w, lens, bt, s, out, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _workspace(device, batch):
    key = (str(device), batch)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = torch.empty((batch, MAX_TOK), dtype=torch.float32, device=device)
        _WORKSPACE[key] = ws
    return ws


def solve(q_index_fp8, k_index_cache, weights, seq_lens, block_table):
    batch = q_index_fp8.shape[0]
    assert block_table.shape[1] <= MAX_PAGES
    out = torch.empty((batch, TOPK), dtype=torch.int32, device=q_index_fp8.device)
    if batch == 0:
        return out
    cache = k_index_cache.reshape(k_index_cache.shape[0], PAGE_BYTES)
    _get_compiled()(q_index_fp8.contiguous(), cache, weights.to(torch.float32).contiguous(),
                    seq_lens.to(torch.int32).contiguous(), block_table.to(torch.int32).contiguous(),
                    _workspace(q_index_fp8.device, batch), out)
    return out
