"""Ling MTP input: shifted-token embedding gather + two RMSNorms + concat (hidden 2048, bf16) in CuTe DSL.

Algorithm (one kernel)
- Grid: one CTA per token row t (16384 CTAs), THREADS = H / 8 = 256 threads (8 warps; at least
  one full warp for small H, extra lanes predicated off). Thread i owns columns 8i..8i+7 of both
  halves: one 128-bit load of the hidden row, one of each norm weight, one of the gathered
  embedding row.
- The hidden row and both weights are loaded first; then the shifted token is resolved (every
  thread, uniform broadcast loads): id = input_ids[t + 1], replaced by next_tokens[b] when
  t = cu_seqlens[b + 1] - 1 (the last such b wins), and the embedding row of id is gathered.
- Two sums of squares in fp32 (e and h): per thread -> warp butterfly -> per-warp partials in
  shared memory -> one CTA barrier -> every thread adds the partials in the same order.
  e' = e * rsqrt(mean(e^2) + eps) * enorm_w, h' = h * rsqrt(mean(h^2) + eps) * hnorm_w in fp32,
  rounded to bf16, stored with 128-bit stores to out[t, 0:H] and out[t, H:2H].
What limits it: DRAM bandwidth (67 MB of embedding rows gathered at random, 67 MB hidden read,
134 MB written: 269 MB, 56 us at 4.8 TB/s). Expected ~65 us; the embedding gather is
row-granular (4 KB contiguous per token), so it streams like the dense reads.
Host path: compiled once per (hidden size) with tvm-ffi (symbolic token, vocab and sequence
counts), torch tensors passed directly on the caller's current torch stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

EPS = 1e-6
VEC = 8


def _make(hidden: int):
    nch = hidden // VEC                       # 128-bit chunks per half row
    threads = min(256, max(32, nch))
    per = (nch + threads - 1) // threads      # chunks per thread
    nwarps = threads // 32
    exact = per * threads == nch

    @cute.kernel
    def _kernel(mIds: cute.Tensor, mCu: cute.Tensor, mNext: cute.Tensor, mH: cute.Tensor, mE: cute.Tensor,
                mWe: cute.Tensor, mWh: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        ntok = mH.shape[0]
        nseq = mNext.shape[0]

        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((nwarps, 2), stride=(2, 1)), byte_alignment=16)

        gH = cute.zipped_divide(mH[t, None], (VEC,))
        gWe = cute.zipped_divide(mWe, (VEC,))
        gWh = cute.zipped_divide(mWh, (VEC,))
        chunks = []
        oks = []
        for k in cutlass.range_constexpr(per):
            c = tidx + k * threads
            oks.append(c < nch)
            chunks.append(cutlass.min(c, nch - 1))    # in bounds for every lane; stores are predicated

        hs = []
        wes = []
        whs = []
        for k in cutlass.range_constexpr(per):
            rh = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(gH[(None, chunks[k])], rh)
            hs.append(rh)
            re = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(gWe[(None, chunks[k])], re)
            wes.append(re)
            rw = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(gWh[(None, chunks[k])], rw)
            whs.append(rw)

        # shifted token of row t
        tok = Int64(0)
        if t + 1 < ntok:
            tok = mIds[t + 1]
        for b in cutlass.range(nseq):
            if mCu[b + 1] - 1 == t:
                tok = mNext[b]
        gE = cute.zipped_divide(mE[tok, None], (VEC,))
        es = []
        for k in cutlass.range_constexpr(per):
            rx = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(gE[(None, chunks[k])], rx)
            es.append(rx)

        sse = Float32(0.0)
        ssh = Float32(0.0)
        for k in cutlass.range_constexpr(per):
            e = es[k].load().to(Float32)
            h = hs[k].load().to(Float32)
            pe = (e * e).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            ph = (h * h).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(exact):
                sse = sse + pe
                ssh = ssh + ph
            else:
                sse = sse + Float32(cutlass.select_(oks[k], pe, Float32(0.0)))
                ssh = ssh + Float32(cutlass.select_(oks[k], ph, Float32(0.0)))
        sse = cute.arch.warp_reduction(sse, lambda a, b: a + b)
        ssh = cute.arch.warp_reduction(ssh, lambda a, b: a + b)
        if lane == 0:
            red[warp, 0] = sse
            red[warp, 1] = ssh
        cute.arch.barrier()
        te = red[0, 0]
        th = red[0, 1]
        for i in cutlass.range_constexpr(1, nwarps):
            te = te + red[i, 0]
            th = th + red[i, 1]
        inv_e = cute.math.rsqrt(te * (1.0 / hidden) + EPS)
        inv_h = cute.math.rsqrt(th * (1.0 / hidden) + EPS)

        gO = cute.zipped_divide(mO[t, None], (VEC,))          # ((8), (2 * nch))
        for k in cutlass.range_constexpr(per):
            ro = cute.make_rmem_tensor((VEC,), BFloat16)
            ro.store((es[k].load().to(Float32) * inv_e * wes[k].load().to(Float32)).to(BFloat16))
            rq = cute.make_rmem_tensor((VEC,), BFloat16)
            rq.store((hs[k].load().to(Float32) * inv_h * whs[k].load().to(Float32)).to(BFloat16))
            if oks[k]:
                cute.autovec_copy(ro, gO[(None, chunks[k])])
                cute.autovec_copy(rq, gO[(None, nch + chunks[k])])

    @cute.jit
    def _run(mIds: cute.Tensor, mCu: cute.Tensor, mNext: cute.Tensor, mH: cute.Tensor, mE: cute.Tensor,
             mWe: cute.Tensor, mWh: cute.Tensor, mO: cute.Tensor, stream: cuda.CUstream):
        _kernel(mIds, mCu, mNext, mH, mE, mWe, mWh, mO).launch(
            grid=[mH.shape[0], 1, 1], block=[threads, 1, 1], smem=nwarps * 8 + 64, stream=stream)

    return _run


_COMPILED = {}


def _get_compiled(hidden: int):
    fn = _COMPILED.get(hidden)
    if fn is None:
        assert hidden % VEC == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        ntok, ncu, nseq, vocab = (cute.sym_int32() for _ in range(4))
        ids = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        cu = make_fake_compact_tensor(Int32, (ncu,), assumed_align=4)
        nxt = make_fake_compact_tensor(Int64, (nseq,), assumed_align=8)
        h = make_fake_compact_tensor(BFloat16, (ntok, hidden), stride_order=(1, 0), assumed_align=16)
        e = make_fake_compact_tensor(BFloat16, (vocab, hidden), stride_order=(1, 0), assumed_align=16)
        we = make_fake_compact_tensor(BFloat16, (hidden,), assumed_align=16)
        wh = make_fake_compact_tensor(BFloat16, (hidden,), assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (ntok, 2 * hidden), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make(hidden), ids, cu, nxt, h, e, we, wh, o, stream, options="--enable-tvm-ffi")
        _COMPILED[hidden] = fn
    return fn


def solve(input_ids, cu_seqlens, next_tokens, hidden_states, embed_weight, enorm_weight, hnorm_weight):
    tokens, hidden = hidden_states.shape
    out = torch.empty((tokens, 2 * hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    if tokens > 0:
        _get_compiled(hidden)(input_ids.to(torch.int64), cu_seqlens.to(torch.int32), next_tokens.to(torch.int64),
                              hidden_states, embed_weight, enorm_weight, hnorm_weight, out)
    return out
