"""Backward of Jamba's token embedding + first-layer RMSNorm (hidden 4096, vocab 65536, bf16) in CuTe DSL:
the dense embedding gradient (scatter-add over repeated tokens) and the norm-weight gradient, three kernels,
the same algorithm as the TIRx solution (which passed on the H200 at 0.324 ms device time).

Math (exact rearrangement of the reference): for vocab row v with positions P(v), e = E[v] and
rstd = rsqrt(mean(e^2) + eps) are per row and c_p = mean(g_p w ehat) is linear in g_p, so
  d_embed[v] = R + rstd * (w * G - ehat * C),  G = sum_p g_p,  R = sum_p dr_p,  C = mean(G * w * ehat)
  d_norm_weight = sum_v G_v * ehat_v.
Every g / dr row is read once and every output row is written once; no atomics on the output.

Kernel 1 (link): one thread per position p: 64-bit atomic exchange of head[id] with (gen << 32 | p), the old
  value goes to next[p]: a linked list of the positions of every vocab id. gen is a per-call generation
  number (host counter), so lists of earlier calls read as empty and head never needs clearing (head / next
  are cached workspaces).
Kernel 2 (rows): grid ceil(V / 64) CTAs of 256 threads (launch bound 3 CTAs per SM), CTA c owns vocab rows
  64c .. 64c+63; thread t holds the 16-byte chunks t and 256 + t of a row (columns 8t.. and 2048 + 8t..).
  Per row (head[v] is CTA-uniform):
  - no position of this call: 16-byte stores of zeros;
  - else walk the list (the next pointer is loaded together with the g / dr rows of the current position),
    accumulating G and R in fp32 registers; one CTA reduction of S1 = sum e^2 and S2 = sum G w e (butterfly
    shuffles, shared memory double-buffered by reduction count, one barrier); rstd = rsqrt(S1/H + eps),
    C = rstd * S2 / H; out = R + rstd (w G - (e rstd) C) rounded once to bf16; the CTA's d_norm_weight partial
    += G * (e rstd) in fp32, kept in shared memory at thread-private columns (no barrier needed).
  The CTA writes its fp32 partial [H] to a workspace row.
Kernel 3 (dnw): H / 32 CTAs x 256 threads: CTA j sums the partial rows for columns 32j..32j+31 (warp w takes
  rows w, w+8, ...; lane = column: 128-byte coalesced loads), 8 warp sums combined through shared memory in a
  fixed order, rounded to bf16.
Differences from the TIRx version: none in the algorithm; the smoke width (H = 128) uses 4-element chunks and
one warp, as the TIRx geometry does.
Limits: the dense [65536, 4096] bf16 output (537 MB, ~80% zeros) plus 16384 x (g, dr) rows and the distinct e
rows (~400 MB): floor ~196 us at 4.8 TB/s; the serial list walk of the frequent ids (~50 positions each) is a
tail. The TIRx version measured 0.324 ms device time, 14x faster than eager PyTorch.
Host path: compiled once per hidden size with tvm-ffi (symbolic counts); workspaces cached per (device,
sizes); the three kernels run in order on the caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

EPS = 1e-6
ROWS_PER_CTA = 64
LINK_THREADS = 256
RED_THREADS = 256
RED_COLS = 32
RED_WARPS = RED_THREADS // 32
MIN_CTAS = 3


def _chunk(row, idx, vec):
    """The idx-th vec-element chunk of a row (a view, no copy)."""
    return cute.zipped_divide(row, (vec,))[(None, idx)]


def _geometry(hidden):
    vec = 8 if hidden >= 256 else hidden // 32          # bf16 per access
    threads = min(256, hidden // vec)
    chunks = hidden // (threads * vec)
    assert vec * threads * chunks == hidden and threads % 32 == 0
    return vec, threads, chunks


@cute.kernel
def _link_kernel(mIds: cute.Tensor, mHead: cute.Tensor, mNext: cute.Tensor, gen: Int64):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    n_pos = mIds.shape[0]
    p = bidx * LINK_THREADS + tidx
    if p < n_pos:
        tok = Int32(mIds[p])
        tag = (gen << Int64(32)) | Int64(p)
        old = cute.arch.atomic_exch((mHead.iterator + tok).llvm_ptr, tag)
        mNext[p] = old


def _make(hidden: int):
    vec, threads, chunks = _geometry(hidden)
    warps = threads // 32
    nel = chunks * vec
    inv_h = 1.0 / hidden

    @cute.kernel
    def _rows_kernel(mE: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor, mHead: cute.Tensor,
                     mNext: cute.Tensor, mOut: cute.Tensor, mPart: cute.Tensor, gen: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        vocab = mE.shape[0]

        smem = cutlass.utils.SmemAllocator()
        dnw = smem.allocate_tensor(Float32, cute.make_layout((hidden,)), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((2, 2, warps), stride=(2 * warps, warps, 1)),
                                   byte_alignment=16)

        # chunk c of this thread in a row: columns c * threads * vec + tidx * vec .. + vec
        wb = cute.make_rmem_tensor((nel,), BFloat16)
        for c in cutlass.range_constexpr(chunks):
            cute.autovec_copy(_chunk(mW, c * threads + tidx, vec), cute.zipped_divide(wb, (vec,))[(None, c)])
        zero = cute.make_rmem_tensor((vec,), Float32)
        zero.fill(0.0)
        for c in cutlass.range_constexpr(chunks):
            cute.autovec_copy(zero, _chunk(dnw, c * threads + tidx, vec))
        zb = cute.make_rmem_tensor((nel,), BFloat16)
        zb.fill(0.0)

        eb = cute.make_rmem_tensor((nel,), BFloat16)
        gb = cute.make_rmem_tensor((nel,), BFloat16)
        rb = cute.make_rmem_tensor((nel,), BFloat16)
        gs = cute.make_rmem_tensor((nel,), Float32)
        rs = cute.make_rmem_tensor((nel,), Float32)
        ob = gb                                 # the output row reuses the g buffer (free after the walk)
        part = rs                               # the d_norm_weight update reuses R (free once ob is formed)

        nred = Int32(0)
        for k in cutlass.range(ROWS_PER_CTA, unroll=1):
            v = cta * ROWS_PER_CTA + k
            if v < vocab:
                hcur = mHead[v]
                if (hcur >> Int64(32)) != gen:
                    for c in cutlass.range_constexpr(chunks):
                        cute.autovec_copy(cute.zipped_divide(zb, (vec,))[(None, c)], _chunk(mOut[v, None], c * threads + tidx, vec))
                else:
                    for c in cutlass.range_constexpr(chunks):
                        cute.autovec_copy(_chunk(mE[v, None], c * threads + tidx, vec), cute.zipped_divide(eb, (vec,))[(None, c)])
                    gs.fill(0.0)
                    rs.fill(0.0)
                    while (hcur >> Int64(32)) == gen:
                        pos = Int32(hcur & Int64(0xFFFFFFFF))
                        hnext = mNext[pos]
                        for c in cutlass.range_constexpr(chunks):
                            cute.autovec_copy(_chunk(mG[pos, None], c * threads + tidx, vec), cute.zipped_divide(gb, (vec,))[(None, c)])
                            cute.autovec_copy(_chunk(mR[pos, None], c * threads + tidx, vec), cute.zipped_divide(rb, (vec,))[(None, c)])
                        gs.store(gs.load() + gb.load().to(Float32))
                        rs.store(rs.load() + rb.load().to(Float32))
                        hcur = hnext
                    # CTA reduction of S1 = sum e^2 and S2 = sum G w e
                    ef = eb.load().to(Float32)
                    wf = wb.load().to(Float32)
                    g = gs.load()
                    s1 = (ef * ef).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    s2 = (g * wf * ef).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    s1 = cute.arch.warp_reduction(s1, lambda a, b: a + b)
                    s2 = cute.arch.warp_reduction(s2, lambda a, b: a + b)
                    par = nred % 2
                    if lane == 0:
                        red[par, 0, warp] = s1
                        red[par, 1, warp] = s2
                    cute.arch.barrier()
                    t1 = red[par, 0, 0]
                    t2 = red[par, 1, 0]
                    for w in cutlass.range_constexpr(1, warps):
                        t1 = t1 + red[par, 0, w]
                        t2 = t2 + red[par, 1, w]
                    nred = nred + 1
                    rstd = cute.math.rsqrt(t1 * inv_h + EPS)
                    cc = rstd * t2 * inv_h
                    ehat = ef * rstd
                    ob.store((rs.load() + rstd * (wf * g - ehat * cc)).to(BFloat16))
                    for c in cutlass.range_constexpr(chunks):
                        cute.autovec_copy(_chunk(dnw, c * threads + tidx, vec), cute.zipped_divide(part, (vec,))[(None, c)])
                    part.store(part.load() + g * ehat)
                    for c in cutlass.range_constexpr(chunks):
                        cute.autovec_copy(cute.zipped_divide(part, (vec,))[(None, c)], _chunk(dnw, c * threads + tidx, vec))
                        cute.autovec_copy(cute.zipped_divide(ob, (vec,))[(None, c)], _chunk(mOut[v, None], c * threads + tidx, vec))

        for c in cutlass.range_constexpr(chunks):
            cute.autovec_copy(_chunk(dnw, c * threads + tidx, vec), cute.zipped_divide(gs, (vec,))[(None, c)])
            cute.autovec_copy(cute.zipped_divide(gs, (vec,))[(None, c)], _chunk(mPart[cta, None], c * threads + tidx, vec))

    @cute.kernel
    def _dnw_kernel(mPart: cute.Tensor, mDNW: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cb, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        n_cta = mPart.shape[0]
        col = cb * RED_COLS + lane
        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((RED_WARPS, RED_COLS), stride=(RED_COLS, 1)),
                                   byte_alignment=16)
        acc = Float32(0.0)
        for r in cutlass.range(warp, n_cta, RED_WARPS, unroll=4):
            acc = acc + mPart[r, col]
        red[warp, lane] = acc
        cute.arch.barrier()
        if warp == 0:
            tot = red[0, lane]
            for i in cutlass.range_constexpr(1, RED_WARPS):
                tot = tot + red[i, lane]
            mDNW[col] = tot.to(BFloat16)

    @cute.jit
    def _run(mIds: cute.Tensor, mE: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
             mHead: cute.Tensor, mNext: cute.Tensor, mOut: cute.Tensor, mPart: cute.Tensor, mDNW: cute.Tensor,
             gen: Int64, stream: cuda.CUstream):
        n_pos = mIds.shape[0]
        n_cta = mPart.shape[0]
        _link_kernel(mIds, mHead, mNext, gen).launch(
            grid=[(n_pos + LINK_THREADS - 1) // LINK_THREADS, 1, 1], block=[LINK_THREADS, 1, 1], stream=stream)
        _rows_kernel(mE, mW, mG, mR, mHead, mNext, mOut, mPart, gen).launch(
            grid=[n_cta, 1, 1], block=[threads, 1, 1], smem=hidden * 4 + 4 * warps * 4 + 64, stream=stream,
            min_blocks_per_mp=MIN_CTAS, preferred_smem_carveout=50)
        _dnw_kernel(mPart, mDNW).launch(grid=[hidden // RED_COLS, 1, 1], block=[RED_THREADS, 1, 1],
                                        smem=RED_WARPS * RED_COLS * 4 + 64, stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}
_GEN = [0]


def _get_compiled(hidden: int):
    fn = _COMPILED.get(hidden)
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        n_pos, vocab, n_cta = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        ids = make_fake_compact_tensor(Int64, (n_pos,), assumed_align=8)
        e = make_fake_compact_tensor(BFloat16, (vocab, hidden), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(BFloat16, (hidden,), assumed_align=16)
        g = make_fake_compact_tensor(BFloat16, (n_pos, hidden), stride_order=(1, 0), assumed_align=16)
        r = make_fake_compact_tensor(BFloat16, (n_pos, hidden), stride_order=(1, 0), assumed_align=16)
        head = make_fake_compact_tensor(Int64, (vocab,), assumed_align=8)
        nxt = make_fake_compact_tensor(Int64, (n_pos,), assumed_align=8)
        out = make_fake_compact_tensor(BFloat16, (vocab, hidden), stride_order=(1, 0), assumed_align=16)
        part = make_fake_compact_tensor(Float32, (n_cta, hidden), stride_order=(1, 0), assumed_align=16)
        dnw = make_fake_compact_tensor(BFloat16, (hidden,), assumed_align=16)
        fn = cute.compile(_make(hidden), ids, e, w, g, r, head, nxt, out, part, dnw, Int64(1),
                          make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
        _COMPILED[hidden] = fn
    return fn


def _workspace(device, vocab, n_pos, n_cta, hidden):
    key = (str(device), vocab, n_pos, n_cta, hidden)
    ws = _WORKSPACE.get(key)
    if ws is None:
        head = torch.zeros(vocab, dtype=torch.int64, device=device)     # generation 0: empty lists
        nxt = torch.empty(n_pos, dtype=torch.int64, device=device)
        part = torch.empty((n_cta, hidden), dtype=torch.float32, device=device)
        ws = _WORKSPACE[key] = (head, nxt, part)
    return ws


def solve(input_ids, embed_weight, norm_weight, d_normed, d_residual):
    vocab, hidden = embed_weight.shape
    _get_compiled(4096)                  # the full-size (Jamba) build, also when called at another size
    fn = _get_compiled(hidden)
    ids = input_ids.reshape(-1)
    ids = (ids if ids.dtype == torch.int64 else ids.to(torch.int64)).contiguous()
    n_pos = ids.numel()
    n_cta = (vocab + ROWS_PER_CTA - 1) // ROWS_PER_CTA
    d_embed = torch.empty((vocab, hidden), dtype=embed_weight.dtype, device=embed_weight.device)
    d_nw = torch.empty((hidden,), dtype=norm_weight.dtype, device=norm_weight.device)
    if n_pos == 0:                                                        # no positions: all-zero gradients
        d_embed.zero_()
        d_nw.zero_()
        return d_embed, d_nw
    head, nxt, part = _workspace(embed_weight.device, vocab, n_pos, n_cta, hidden)
    _GEN[0] += 1                                                          # list generation of this call
    g = d_normed.reshape(n_pos, hidden).contiguous()
    r = d_residual.reshape(n_pos, hidden).contiguous()
    fn(ids, embed_weight.contiguous(), norm_weight.contiguous(), g, r, head, nxt, d_embed, part, d_nw, _GEN[0])
    return d_embed, d_nw
