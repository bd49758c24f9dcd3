"""Backward of softmax top-8 routing + dispatch (permute) + weighted combine (unpermute) of a
128-expert MoE layer (hidden 2048, T = 8192, bf16 in/out, fp32 math) in CuTe DSL.
Four kernels launched back to back by one compiled host function.

Row of pair (t, k) in the expert-major buffers: r(t, k) = off[e] + #{t' < t : e in ids[t']},
e = ids[t, k] (stable sort by expert, then token), built without sorting:
K1 (membership): one warp per 32 tokens; each lane turns its 8 ids into a 128-bit expert mask,
  and 128 ballots give the words M[e, w] (bit j: token 32w + j chose expert e).
K2 (prefix, 1 CTA, 1024 threads): warp per expert: popc of M[e, :] and a shuffle scan give
  P[e, w] = #{chosen tokens of e in words < w}; the 128 expert counts are scanned in shared
  memory into off[0..128]. Then r(t, k) = off[e] + P[e, t/32] + popc(M[e, t/32] & lanemask(t%32)).
K3 (per token): one CTA per token, H/8 threads (256), thread i owns columns 8i..8i+7.
  Threads 0..7 compute the 8 rows into shared memory while every thread loads x, dy and the 8
  router rows W[e_k]; after the barrier the 8 expert_outputs rows (128-bit loads). 16 dot
  products (chosen logits x.W[e_k], g_k = dy.EO[r_k]) in fp32: per thread -> warp reduce-scatter
  (16 shuffles for the 16 sums) -> shared partials -> every warp combines the 8 warp partials
  (identical totals in all threads). The 8 grad_expert_inputs rows and a second read of the 8
  router rows (L2 hits) are issued right after the reduction barrier: with every operand loaded
  up front the kernel needed 184-201 registers; now it is capped at 128 (2 CTAs per SM, ~12 bytes
  of spill). w = softmax over the 8 chosen logits (= p[chosen] / sum p[chosen]);
  dl_k = w_k (g_k - sum_j w_j g_j).
  Stores: grad_expert_outputs[r_k] = bf16(w_k dy); grad_hidden = bf16(sum_k GEI[r_k] +
  sum_k dl_k W[e_k]) (the dispatch backward plus dlogits @ W, dlogits having 8 non-zeros);
  thread k < 8 records (token, dl_k) of row r_k for K4.
K4 (router weight grad): CTA per (expert, 1024-column half), 128 threads: sums dl[r] * x[token(r)] in fp32 over
  the expert's rows (its contiguous row range), 4 rows in flight per iteration.
What limits it: DRAM bandwidth: K3 moves ~880 MB (3 x 268 MB expert-major rows + x, dy,
  grad_hidden), ~185 us at 4.8 TB/s; K4 re-reads x (~270 MB, mostly L2 hits); K1/K2 are tiny.
  Expected ~220-240 us.
Host path: compiled once per hidden size with tvm-ffi (symbolic token count); index/row
workspaces cached per (device, T); torch tensors passed directly on the caller's stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32

NUM_EXPERTS = 128
TOP_K = 8
VEC = 8
EWORDS = NUM_EXPERTS // 32            # 4 mask words per token
K1_THREADS = 128
K1_WARPS = K1_THREADS // 32
K2_THREADS = 1024
K2_WARPS = K2_THREADS // 32
K4_ROWS = 4                           # rows in flight per K4 iteration
K3_MIN_CTAS = 2                       # register cap for the per-token kernel (<= 128 registers)


def _add(a, b):
    return a + b


@cute.jit
def _ld(row: cute.Tensor, chunk: Int32) -> cute.Tensor:
    """128-bit load of bf16 elements [8*chunk, 8*chunk+8) of a row into registers."""
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(cute.zipped_divide(row, (VEC,))[(None, chunk)], r)
    return r


def _make(hidden: int):
    nch = hidden // VEC
    k3_threads = max(32, nch)
    assert k3_threads == nch, "hidden must be a multiple of 256"
    k3_warps = k3_threads // 32
    k4_threads = min(128, nch)
    k4_split = nch // k4_threads
    k4_warps = k4_threads // 32
    nval = 2 * TOP_K

    @cute.kernel
    def _member_kernel(mIds: cute.Tensor, mM: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        ntok = mIds.shape[0]
        w = bidx * K1_WARPS + warp
        t = w * 32 + lane
        valid = t < ntok
        tc = cutlass.min(t, ntok - 1)
        words = []
        for q in cutlass.range_constexpr(EWORDS):
            words.append(Uint32(0))
        for k in cutlass.range_constexpr(TOP_K):
            e = mIds[tc, k]
            bit = Uint32(1) << Uint32(e % 32)
            for q in cutlass.range_constexpr(EWORDS):
                words[q] = words[q] | Uint32(cutlass.select_(valid & (e // 32 == q), bit, Uint32(0)))
        nw = mM.shape[1]
        for q in cutlass.range_constexpr(EWORDS):
            mine = Uint32(0)
            for j in cutlass.range_constexpr(32):
                b = cute.arch.vote_ballot_sync(((words[q] >> Uint32(j)) & Uint32(1)) != Uint32(0))
                mine = Uint32(cutlass.select_(lane == j, Uint32(b), mine))
            if w < nw:
                mM[q * 32 + lane, w] = Int32(mine)

    @cute.kernel
    def _prefix_kernel(mM: cute.Tensor, mP: cute.Tensor, mOff: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        nw = mM.shape[1]
        smem = cutlass.utils.SmemAllocator()
        sCnt = smem.allocate_tensor(Int32, cute.make_layout((NUM_EXPERTS,)), byte_alignment=16)
        for eb in cutlass.range_constexpr(NUM_EXPERTS // K2_WARPS):
            e = eb * K2_WARPS + warp
            carry = Int32(0)
            for c in cutlass.range(0, nw, 32):
                wi = c + lane
                cnt = Int32(0)
                if wi < nw:
                    cnt = Int32(cute.arch.popc(Uint32(mM[e, wi])))
                incl = cnt
                for off in (1, 2, 4, 8, 16):
                    v = cute.arch.shuffle_sync_up(incl, offset=off)
                    if lane >= off:
                        incl = incl + v
                if wi < nw:
                    mP[e, wi] = carry + incl - cnt
                carry = carry + cute.arch.shuffle_sync(incl, offset=31)
            if lane == 0:
                sCnt[e] = carry
        cute.arch.barrier()
        if warp == 0:
            # exclusive scan of the 128 counts: lane j holds experts 4j..4j+3
            c0 = sCnt[4 * lane]
            c1 = sCnt[4 * lane + 1]
            c2 = sCnt[4 * lane + 2]
            c3 = sCnt[4 * lane + 3]
            tot = c0 + c1 + c2 + c3
            incl = tot
            for off in (1, 2, 4, 8, 16):
                v = cute.arch.shuffle_sync_up(incl, offset=off)
                if lane >= off:
                    incl = incl + v
            base = incl - tot
            mOff[4 * lane] = base
            mOff[4 * lane + 1] = base + c0
            mOff[4 * lane + 2] = base + c0 + c1
            mOff[4 * lane + 3] = base + c0 + c1 + c2
            if lane == 31:
                mOff[NUM_EXPERTS] = incl

    @cute.kernel
    def _token_kernel(mX: cute.Tensor, mW: cute.Tensor, mIds: cute.Tensor, mEO: cute.Tensor, mDY: cute.Tensor,
                      mGEI: cute.Tensor, mM: cute.Tensor, mP: cute.Tensor, mOff: cute.Tensor, mGH: cute.Tensor,
                      mGEO: cute.Tensor, mTokRow: cute.Tensor, mDlRow: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.utils.SmemAllocator()
        sRow = smem.allocate_tensor(Int32, cute.make_layout((TOP_K,)), byte_alignment=16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((k3_warps, nval), stride=(nval, 1)),
                                    byte_alignment=16)

        if tidx < TOP_K:
            e = mIds[t, tidx]
            wi = t // 32
            below = (Uint32(1) << Uint32(t % 32)) - Uint32(1)
            sRow[tidx] = mOff[e] + mP[e, wi] + Int32(cute.arch.popc(Uint32(mM[e, wi]) & below))

        rx = _ld(mX[t, None], tidx)
        rdy = _ld(mDY[t, None], tidx)
        es = []
        rws = []
        for k in cutlass.range_constexpr(TOP_K):
            e = mIds[t, k]
            es.append(e)
            rws.append(_ld(mW[e, None], tidx))
        cute.arch.barrier()
        rows = []
        reos = []
        for k in cutlass.range_constexpr(TOP_K):
            r = sRow[k]
            rows.append(r)
            reos.append(_ld(mEO[r, None], tidx))

        x = rx.load().to(Float32)
        dy = rdy.load().to(Float32)
        vals = []
        for k in cutlass.range_constexpr(TOP_K):
            vals.append((x * rws[k].load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
        for k in cutlass.range_constexpr(TOP_K):
            vals.append((dy * reos[k].load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
        # reduce-scatter over the warp (16 shuffles instead of 80): at offset o the lanes with bit o
        # set keep the upper half of the list and send the lower half; lane l ends with the warp sum
        # of value l >> 1
        for off in (16, 8, 4, 2):
            upper = (lane & off) != 0
            half = len(vals) // 2
            nv = []
            for k in cutlass.range_constexpr(half):
                send = Float32(cutlass.select_(upper, vals[k], vals[k + half]))
                keep = Float32(cutlass.select_(upper, vals[k + half], vals[k]))
                nv.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
            vals = nv
        mine = vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=1)
        if lane % 2 == 0:
            sRed[warp, lane // 2] = mine
        cute.arch.barrier()
        # the grad_expert_inputs rows are only summed at the end: issued here (after the barrier, so
        # they do not compete for registers with the dot-product operands)
        rgeis = []
        rws2 = []
        for k in cutlass.range_constexpr(TOP_K):
            rgeis.append(_ld(mGEI[rows[k], None], tidx))
            rws2.append(_ld(mW[es[k], None], tidx))     # router rows again (L2 hits): keeping the
            # fp32 copies of the first load alive across the reduction costs 64 registers
        # every warp combines the warp partials: lane l sums value l % 16 over the warps of parity
        # l / 16, one xor-16 shuffle completes it, and lane v broadcasts value v (same order in
        # every warp, so all threads see identical totals)
        vi = lane % nval
        par = lane // nval
        part = Float32(0.0)
        for j in cutlass.range_constexpr((k3_warps + 1) // 2):
            i = 2 * j + par
            part = part + Float32(cutlass.select_(i < k3_warps, sRed[cutlass.min(i, k3_warps - 1), vi],
                                                  Float32(0.0)))
        total = part + cute.arch.shuffle_sync_bfly(part, offset=nval)
        tot = []
        for v in cutlass.range_constexpr(nval):
            tot.append(cute.arch.shuffle_sync(total, offset=v))

        # softmax over the 8 chosen logits, then the routing-weight gradient
        mx = tot[0]
        for k in cutlass.range_constexpr(1, TOP_K):
            mx = cute.arch.fmax(mx, tot[k])
        ex = []
        ssum = Float32(0.0)
        for k in cutlass.range_constexpr(TOP_K):
            ek = cute.math.exp(tot[k] - mx)
            ex.append(ek)
            ssum = ssum + ek
        inv = 1.0 / ssum
        ws = []
        wg = Float32(0.0)
        for k in cutlass.range_constexpr(TOP_K):
            wk = ex[k] * inv
            ws.append(wk)
            wg = wg + wk * tot[TOP_K + k]
        dls = []
        for k in cutlass.range_constexpr(TOP_K):
            dls.append(ws[k] * (tot[TOP_K + k] - wg))

        for k in cutlass.range_constexpr(TOP_K):
            ro = cute.make_rmem_tensor((VEC,), BFloat16)
            ro.store((dy * ws[k]).to(BFloat16))
            cute.autovec_copy(ro, cute.zipped_divide(mGEO[rows[k], None], (VEC,))[(None, tidx)])
        gh = rgeis[0].load().to(Float32)
        for k in cutlass.range_constexpr(1, TOP_K):
            gh = gh + rgeis[k].load().to(Float32)
        for k in cutlass.range_constexpr(TOP_K):
            gh = gh + rws2[k].load().to(Float32) * dls[k]
        rh = cute.make_rmem_tensor((VEC,), BFloat16)
        rh.store(gh.to(BFloat16))
        cute.autovec_copy(rh, cute.zipped_divide(mGH[t, None], (VEC,))[(None, tidx)])
        for k in cutlass.range_constexpr(TOP_K):
            if tidx == k:
                mTokRow[rows[k]] = t
                mDlRow[rows[k]] = dls[k]

    @cute.kernel
    def _wgrad_kernel(mX: cute.Tensor, mOff: cute.Tensor, mTokRow: cute.Tensor, mDlRow: cute.Tensor,
                      mGW: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        e, half, _ = cute.arch.block_idx()
        chunk = half * k4_threads + tidx
        r0 = mOff[e]
        r1 = mOff[e + 1]
        acc = cute.make_rmem_tensor((VEC,), Float32)
        acc.fill(0.0)
        for rb in cutlass.range(r0, r1, K4_ROWS):
            xs = []
            ds = []
            for j in cutlass.range_constexpr(K4_ROWS):
                r = cutlass.min(rb + j, r1 - 1)
                tok = mTokRow[r]
                d = mDlRow[r]
                ds.append(Float32(cutlass.select_(rb + j < r1, d, Float32(0.0))))
                rr = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(cute.zipped_divide(mX[tok, None], (VEC,))[(None, chunk)], rr)
                xs.append(rr)
            a = acc.load()
            for j in cutlass.range_constexpr(K4_ROWS):
                a = a + xs[j].load().to(Float32) * ds[j]
            acc.store(a)
        ro = cute.make_rmem_tensor((VEC,), BFloat16)
        ro.store(acc.load().to(BFloat16))
        cute.autovec_copy(ro, cute.zipped_divide(mGW[e, None], (VEC,))[(None, chunk)])

    @cute.jit
    def _run(mX: cute.Tensor, mW: cute.Tensor, mIds: cute.Tensor, mEO: cute.Tensor, mDY: cute.Tensor,
             mGEI: cute.Tensor, mGH: cute.Tensor, mGW: cute.Tensor, mGEO: cute.Tensor, mM: cute.Tensor,
             mP: cute.Tensor, mOff: cute.Tensor, mTokRow: cute.Tensor, mDlRow: cute.Tensor, stream: cuda.CUstream):
        ntok = mX.shape[0]
        nw = mM.shape[1]
        _member_kernel(mIds, mM).launch(grid=[(nw + K1_WARPS - 1) // K1_WARPS, 1, 1], block=[K1_THREADS, 1, 1],
                                        stream=stream)
        _prefix_kernel(mM, mP, mOff).launch(grid=[1, 1, 1], block=[K2_THREADS, 1, 1],
                                            smem=NUM_EXPERTS * 4 + 64, stream=stream)
        _token_kernel(mX, mW, mIds, mEO, mDY, mGEI, mM, mP, mOff, mGH, mGEO, mTokRow, mDlRow).launch(
            grid=[ntok, 1, 1], block=[k3_threads, 1, 1], smem=k3_warps * nval * 4 + 128, stream=stream,
            min_blocks_per_mp=K3_MIN_CTAS, preferred_smem_carveout=10)
        _wgrad_kernel(mX, mOff, mTokRow, mDlRow, mGW).launch(
            grid=[NUM_EXPERTS, k4_split, 1], block=[k4_threads, 1, 1], stream=stream)

    return _run


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled(hidden: int):
    fn = _COMPILED.get(hidden)
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        ntok, npair, nw = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        bf = lambda shape: make_fake_compact_tensor(BFloat16, shape, stride_order=(1, 0), assumed_align=16)  # noqa: E731
        x, dy, gh = bf((ntok, hidden)), bf((ntok, hidden)), bf((ntok, hidden))
        eo, gei, geo = bf((npair, hidden)), bf((npair, hidden)), bf((npair, hidden))
        w, gw = bf((NUM_EXPERTS, hidden)), bf((NUM_EXPERTS, hidden))
        ids = make_fake_compact_tensor(Int32, (ntok, TOP_K), stride_order=(1, 0), assumed_align=16)
        m = make_fake_compact_tensor(Int32, (NUM_EXPERTS, nw), stride_order=(1, 0), assumed_align=4)  # bit words
        p = make_fake_compact_tensor(Int32, (NUM_EXPERTS, nw), stride_order=(1, 0), assumed_align=4)
        off = make_fake_compact_tensor(Int32, (NUM_EXPERTS + 1,), assumed_align=4)
        tok_row = make_fake_compact_tensor(Int32, (npair,), assumed_align=4)
        dl_row = make_fake_compact_tensor(Float32, (npair,), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make(hidden), x, w, ids, eo, dy, gei, gh, gw, geo, m, p, off, tok_row, dl_row, stream,
                          options="--enable-tvm-ffi")
        _COMPILED[hidden] = fn
    return fn


def _workspace(device, ntok):
    key = (str(device), ntok)
    ws = _WORKSPACE.get(key)
    if ws is None:
        nw = (ntok + 31) // 32
        ws = (torch.empty((NUM_EXPERTS, nw), dtype=torch.int32, device=device),     # membership bit words
              torch.empty((NUM_EXPERTS, nw), dtype=torch.int32, device=device),
              torch.empty((NUM_EXPERTS + 1,), dtype=torch.int32, device=device),
              torch.empty((ntok * TOP_K,), dtype=torch.int32, device=device),
              torch.empty((ntok * TOP_K,), dtype=torch.float32, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(hidden_states, router_weight, topk_ids, expert_outputs, grad_output, grad_expert_inputs):
    ntok, hidden = hidden_states.shape
    assert topk_ids.shape == (ntok, TOP_K) and router_weight.shape == (NUM_EXPERTS, hidden)
    dev = hidden_states.device
    gh = torch.empty_like(hidden_states)
    gw = torch.empty_like(router_weight)
    geo = torch.empty_like(expert_outputs)
    if ntok > 0:
        m, p, off, tok_row, dl_row = _workspace(dev, ntok)
        _get_compiled(hidden)(hidden_states, router_weight, topk_ids.to(torch.int32).contiguous(), expert_outputs,
                              grad_output, grad_expert_inputs, gh, gw, geo, m, p, off, tok_row, dl_row)
    return gh, gw, geo
