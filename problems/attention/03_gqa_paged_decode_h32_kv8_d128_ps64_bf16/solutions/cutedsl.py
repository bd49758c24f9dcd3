"""GQA paged decode (32 q heads / 8 kv heads, head dim 128, page size 64, bf16) in CuTe DSL: split-KV
flash decoding on CUDA cores, two kernels launched back to back by one compiled host function.

Same algorithm and decomposition as the verified TIRx solution of this problem (and the verified
page-size-1 CuTe kernel of problem 01, whose code this follows); only the KV addressing differs:
token t of request b is row kv_indices[indptr[b] + t // 64] * 64 + t % 64 of the caches viewed as
[pages * 64, 8, 128], and the request length is (pages - 1) * 64 + kv_last_page_len[b] (0 without pages);
the unused slots of the last page are never read.

Kernel 1 (partial): grid (16 splits, 8 kv heads, B requests), 128 threads = 8 half-warps; chunks of
max(256, ceil(len/16)) tokens, CTAs past the end exit at once. Lane l of a half-warp owns head-dim
elements 8l..8l+7; half-warp g takes tokens t0 + 8u + g, u = 0..3, per iteration. K/V rows are
gathered with 16-byte cp.async into a 2-stage shared-memory ring (each lane reads back only its own
pieces, no CTA barrier in the loop); the rows of the next iteration are looked up one iteration ahead.
4 query heads in fp32 (pre-scaled by sm_scale*log2 e) per lane, 16 partial dot products reduced with
a reduce-scatter over the 16 lanes, online softmax in base 2, fp32 accumulator [4 x 8] per lane.
The 8 half-warp states are merged through shared memory (ring reused); normalized fp32 partials and
base-2 partial lse go to a workspace cached per (device, batch).
Differences from the TIRx kernel (both taken from the verified CuTe kernel of problem 01): K/V pass
through a cp.async ring instead of direct register loads, and the lane reduction is a reduce-scatter
(15 shuffles) with probability broadcasts instead of a full xor all-reduce of every logit.
Kernel 2 (merge): grid (8 kv heads, B), 128 threads; LSE = M + log2 sum 2^(lse_s - M), bf16 output;
zero-length requests: 0 and -inf.
What likely limits it: DRAM reads of the K/V rows (544 MB, SOL ~0.113 ms) and the per-token CUDA-core
instruction count; the TIRx version of this design measured 0.1818 ms device time on the H200.
Host path: one tvm-ffi compiled function takes the torch tensors directly; both kernels are launched on
the caller's current torch stream, in order.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""
import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

QO_HEADS = 32
KV_HEADS = 8
GROUP = QO_HEADS // KV_HEADS          # 4 query heads per kv head
HEAD_DIM = 128
VEC = 8                               # bf16 per 128-bit access
LANES = HEAD_DIM // VEC               # 16 lanes per token
THREADS = 128
HALF_WARPS = THREADS // LANES         # 8 tokens side by side
UNROLL = 4                            # tokens per half-warp per iteration
STEP = HALF_WARPS * UNROLL            # 32 tokens per CTA iteration
CHUNK = 256                           # minimum tokens per split
SPLITS = 16                           # max splits per (request, kv head)
STAGES = 2                            # cp.async ring depth (STAGES-1 iterations in flight)
MIN_CTAS = 4                          # register cap: 4 CTAs (16 warps) per SM -> <= 128 registers
OUT_VEC = 4                           # fp32 per thread in the merges
PAGE = 64                             # tokens per page
LOG2E = 1.4426950408889634
M_INIT = -1.0e30                      # finite start of the running max (no inf - inf)
SEG16 = (16 << 8) | 31                # shfl.idx clamp word: 16-lane segments (source lane within the half-warp)
assert UNROLL * GROUP == LANES        # the reduce-scatter gives each lane one (token slot, head) logit


def _add(a, b):
    return a + b


@cute.jit
def _load_row_vec(row: cute.Tensor, idx: Int32) -> cute.TensorSSA:
    """128-bit load of elements [8*idx, 8*idx+8) of a 1-D bf16 row, converted to fp32."""
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(cute.zipped_divide(row, (VEC,))[(None, idx)], r)
    return r.load().to(Float32)


@cute.jit
def _kv_len(mIP: cute.Tensor, mLast: cute.Tensor, b: Int32) -> Int32:
    """Tokens of request b: every slot of its pages but the last, then last_page_len[b] slots."""
    npg = mIP[b + 1] - mIP[b]
    return cutlass.select_(npg > 0, (npg - 1) * PAGE + mLast[b], Int32(0))


@cute.jit
def _row(mIdx: cute.Tensor, start: Int32, t: Int32) -> Int32:
    """Row (page * 64 + slot) of the flattened [pages * 64, heads, dim] cache holding token t of the request."""
    return mIdx[start + t // PAGE] * PAGE + t % PAGE


@cute.kernel
def _partial_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIP: cute.Tensor,
                    mIdx: cute.Tensor, mLast: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor,
                    scale_log2: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    s, h, b = cute.arch.block_idx()

    # K/V staging ring: [stage, token slot u, half-warp g, K|V, head dim] bf16 (16 KiB per stage).
    # Every lane copies (cp.async) and later reads back only its own 16-byte pieces.
    smem = cutlass.utils.SmemAllocator()
    sKV = smem.allocate_tensor(
        BFloat16,
        cute.make_layout((STAGES, UNROLL, HALF_WARPS, 2, HEAD_DIM),
                         stride=(UNROLL * HALF_WARPS * 2 * HEAD_DIM, HALF_WARPS * 2 * HEAD_DIM, 2 * HEAD_DIM,
                                 HEAD_DIM, 1)),
        byte_alignment=128)
    # after the main loop the ring is reused for the merge of the 8 half-warp states
    sAcc = cute.make_tensor(cute.recast_ptr(sKV.iterator, dtype=Float32),
                            cute.make_layout((HALF_WARPS, GROUP, HEAD_DIM), stride=(GROUP * HEAD_DIM, HEAD_DIM, 1)))
    sML = cute.make_tensor(cute.recast_ptr(sKV.iterator, dtype=Float32) + HALF_WARPS * GROUP * HEAD_DIM,
                           cute.make_layout((HALF_WARPS, 2 * GROUP), stride=(2 * GROUP, 1)))

    start = mIP[b]                            # first page-table entry of the request
    n_tot = _kv_len(mIP, mLast, b)
    chunk = cutlass.max(Int32(CHUNK), (n_tot + (SPLITS - 1)) // SPLITS)
    c0 = s * chunk
    if c0 < n_tot:
        cn = cutlass.min(chunk, n_tot - c0)       # tokens in this chunk, >= 1
        g = tidx // LANES
        l = tidx % LANES
        n_iter = (cn + (STEP - 1)) // STEP
        g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)

        # page ids of the prologue stages (clamped into the chunk, always in bounds)
        pro = []
        for p in cutlass.range_constexpr(STAGES - 1):
            prow = []
            for u in cutlass.range_constexpr(UNROLL):
                prow.append(_row(mIdx, start, c0 + cutlass.min(p * STEP + u * HALF_WARPS + g, cn - 1)))
            pro.append(prow)

        qs = []
        for i in cutlass.range_constexpr(GROUP):
            qs.append(_load_row_vec(mQ[b, h * GROUP + i, None], l) * scale_log2)

        for p in cutlass.range_constexpr(STAGES - 1):
            if p < n_iter:
                for u in cutlass.range_constexpr(UNROLL):
                    _issue_kv(g2s, mK, mV, sKV, pro[p][u], h, l, p, u, g)
            cute.arch.cp_async_commit_group()

        pg = cute.make_rmem_tensor((UNROLL,), Int32)
        for u in cutlass.range_constexpr(UNROLL):
            pg[u] = _row(mIdx, start, c0 + cutlass.min((STAGES - 1) * STEP + u * HALF_WARPS + g, cn - 1))

        # After the reduce-scatter below, lane l of a half-warp owns the logit of token slot
        # ul = l // 4 and head il = l % 4; it tracks the running max of head il (identical in the
        # 4 lanes of that head) and a partial running sum over its own token slots.
        ul = l // GROUP
        il = l % GROUP
        st = cute.make_rmem_tensor((2,), Float32)   # [running max of head il, partial sum]
        st[0] = Float32(M_INIT)
        st[1] = Float32(0.0)
        accs = []
        for i in cutlass.range_constexpr(GROUP):
            a = cute.make_rmem_tensor((VEC,), Float32)
            a.fill(0.0)
            accs.append(a)

        for it in cutlass.range(n_iter):
            nxt = it + (STAGES - 1)
            if nxt < n_iter:
                for u in cutlass.range_constexpr(UNROLL):
                    _issue_kv(g2s, mK, mV, sKV, pg[u], h, l, nxt % STAGES, u, g)
            cute.arch.cp_async_commit_group()
            for u in cutlass.range_constexpr(UNROLL):
                pg[u] = _row(mIdx, start, c0 + cutlass.min((nxt + 1) * STEP + u * HALF_WARPS + g, cn - 1))
            cute.arch.cp_async_wait_group(STAGES - 1)

            stage = it % STAGES
            t0 = it * STEP
            ks = []
            vs = []
            for u in cutlass.range_constexpr(UNROLL):
                ks.append(_load_row_vec(sKV[stage, u, g, 0, None], l))
                vs.append(_load_row_vec(sKV[stage, u, g, 1, None], l))

            # 16 partial dot products (token slot u, head i) -> index u*4 + i, each over 8 elements
            vals = []
            for u in cutlass.range_constexpr(UNROLL):
                for i in cutlass.range_constexpr(GROUP):
                    vals.append((ks[u] * qs[i]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            # reduce-scatter over the 16 lanes: at offset o the lane whose bit o is set keeps the
            # upper half of the list and sends the lower half (15 shuffles instead of 64)
            for off in (8, 4, 2, 1):
                upper = (l & off) != 0
                half = len(vals) // 2
                nv = []
                for k in cutlass.range_constexpr(half):
                    send = Float32(cutlass.select_(upper, vals[k], vals[k + half]))
                    keep = Float32(cutlass.select_(upper, vals[k + half], vals[k]))
                    nv.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
                vals = nv
            valid = (t0 + ul * HALF_WARPS + g) < cn
            s_l = Float32(cutlass.select_(valid, vals[0], Float32(-math.inf)))

            # online softmax, distributed: max over the 4 lanes of head il (lane bits 2, 3)
            mx = cute.arch.fmax(s_l, cute.arch.shuffle_sync_bfly(s_l, offset=4))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=8))
            m_old = st[0]
            m_new = cute.arch.fmax(m_old, mx)
            alpha = cute.math.exp2(m_old - m_new, fastmath=True)
            p = cute.math.exp2(s_l - m_new, fastmath=True)
            st[1] = st[1] * alpha + p
            st[0] = m_new

            # broadcast the 4 rescale factors and 16 probabilities inside the half-warp
            for i in cutlass.range_constexpr(GROUP):
                alpha_i = cute.arch.shuffle_sync(alpha, offset=i, mask_and_clamp=SEG16)
                acc = accs[i].load() * alpha_i
                for u in cutlass.range_constexpr(UNROLL):
                    p_ui = cute.arch.shuffle_sync(p, offset=u * GROUP + i, mask_and_clamp=SEG16)
                    acc = acc + vs[u] * p_ui
                accs[i].store(acc)

        # per-head totals of the partial sums (over the 4 lanes of each head)
        l_tot = st[1] + cute.arch.shuffle_sync_bfly(st[1], offset=4)
        l_tot = l_tot + cute.arch.shuffle_sync_bfly(l_tot, offset=8)

        # merge the 8 half-warp states through shared memory (reusing the ring)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        for i in cutlass.range_constexpr(GROUP):
            cute.autovec_copy(accs[i], cute.zipped_divide(sAcc[g, i, None], (VEC,))[(None, l)])
        if l < GROUP:
            sML[g, il] = st[0]
            sML[g, GROUP + il] = l_tot
        cute.arch.barrier()

        hi = tidx // 32
        e = tidx % 32
        mm = sML[0, hi]
        for gg in cutlass.range_constexpr(1, HALF_WARPS):
            mm = cute.arch.fmax(mm, sML[gg, hi])
        tot_l = Float32(0.0)
        o = cute.make_rmem_tensor((OUT_VEC,), Float32)
        o.fill(0.0)
        ov = o.load()
        for gg in cutlass.range_constexpr(HALF_WARPS):
            w = cute.math.exp2(sML[gg, hi] - mm, fastmath=True)
            tot_l = tot_l + sML[gg, GROUP + hi] * w
            ra = cute.make_rmem_tensor((OUT_VEC,), Float32)
            cute.autovec_copy(cute.zipped_divide(sAcc[gg, hi, None], (OUT_VEC,))[(None, e)], ra)
            ov = ov + ra.load() * w
        o.store(ov * (1.0 / tot_l))
        cute.autovec_copy(o, cute.zipped_divide(mPO[b, h, s, hi, None], (OUT_VEC,))[(None, e)])
        if e == 0:
            mPL[b, h, s, hi] = mm + cute.math.log2(tot_l)


@cute.jit
def _issue_kv(g2s: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, sKV: cute.Tensor, page: Int32, h: Int32,
              l: Int32, stage: Int32, u: cutlass.Constexpr, g: Int32):
    """cp.async (16 B each) of this lane's pieces of the K and V rows of one token (cache row `page`) into the ring."""
    cute.copy(g2s, cute.zipped_divide(mK[page, h, None], (VEC,))[(None, l)],
              cute.zipped_divide(sKV[stage, u, g, 0, None], (VEC,))[(None, l)])
    cute.copy(g2s, cute.zipped_divide(mV[page, h, None], (VEC,))[(None, l)],
              cute.zipped_divide(sKV[stage, u, g, 1, None], (VEC,))[(None, l)])


@cute.kernel
def _merge_kernel(mIP: cute.Tensor, mLast: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor,
                  mLSE: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    h, b, _ = cute.arch.block_idx()
    hi = tidx // 32
    e = tidx % 32
    hq = h * GROUP + hi

    n_tot = _kv_len(mIP, mLast, b)
    chunk = cutlass.max(Int32(CHUNK), (n_tot + (SPLITS - 1)) // SPLITS)
    ns = (n_tot + chunk - 1) // chunk

    res = cute.make_rmem_tensor((OUT_VEC,), BFloat16)
    gOut = cute.zipped_divide(mO[b, hq, None], (OUT_VEC,))[(None, e)]
    if ns == 0:
        res.fill(0.0)
        cute.autovec_copy(res, gOut)
        if e == 0:
            mLSE[b, hq] = Float32(-math.inf)
    else:
        mm = mPL[b, h, 0, hi]
        for sp in cutlass.range(1, ns, 1):
            mm = cute.arch.fmax(mm, mPL[b, h, sp, hi])
        tot = Float32(0.0)
        acc = cute.make_rmem_tensor((OUT_VEC,), Float32)
        acc.fill(0.0)
        for sp in cutlass.range(ns):
            w = cute.math.exp2(mPL[b, h, sp, hi] - mm)
            tot = tot + w
            ra = cute.make_rmem_tensor((OUT_VEC,), Float32)
            cute.autovec_copy(cute.zipped_divide(mPO[b, h, sp, hi, None], (OUT_VEC,))[(None, e)], ra)
            acc.store(acc.load() + ra.load() * w)
        res.store((acc.load() * (1.0 / tot)).to(BFloat16))
        cute.autovec_copy(res, gOut)
        if e == 0:
            mLSE[b, hq] = mm + cute.math.log2(tot)


@cute.jit
def _decode(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIP: cute.Tensor, mIdx: cute.Tensor,
            mLast: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
            scale_log2: Float32, stream: cuda.CUstream):
    batch = mQ.shape[0]
    smem_bytes = STAGES * UNROLL * HALF_WARPS * 2 * HEAD_DIM * 2 + 256
    _partial_kernel(mQ, mK, mV, mIP, mIdx, mLast, mPO, mPL, scale_log2).launch(
        grid=[SPLITS, KV_HEADS, batch], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
        min_blocks_per_mp=MIN_CTAS, preferred_smem_carveout=100 if MIN_CTAS > 1 else None)
    _merge_kernel(mIP, mLast, mPO, mPL, mO, mLSE).launch(
        grid=[KV_HEADS, batch, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}
_WORKSPACE = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        batch, rows, nidx, nptr = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        row_major = lambda n: tuple(range(n - 1, -1, -1))  # noqa: E731
        q = make_fake_compact_tensor(BFloat16, (batch, QO_HEADS, HEAD_DIM), stride_order=row_major(3),
                                     assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (rows, KV_HEADS, HEAD_DIM), stride_order=row_major(3),
                                     assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (rows, KV_HEADS, HEAD_DIM), stride_order=row_major(3),
                                     assumed_align=16)
        ip = make_fake_compact_tensor(Int32, (nptr,), assumed_align=4)
        idx = make_fake_compact_tensor(Int32, (nidx,), assumed_align=4)
        last = make_fake_compact_tensor(Int32, (batch,), assumed_align=4)
        po = make_fake_compact_tensor(Float32, (batch, KV_HEADS, SPLITS, GROUP, HEAD_DIM),
                                      stride_order=row_major(5), assumed_align=16)
        pl = make_fake_compact_tensor(Float32, (batch, KV_HEADS, SPLITS, GROUP), stride_order=row_major(4),
                                      assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (batch, QO_HEADS, HEAD_DIM), stride_order=row_major(3),
                                     assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (batch, QO_HEADS), stride_order=row_major(2), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_decode, q, k, v, ip, idx, last, po, pl, o, lse, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def _workspace(device, batch):
    key = (str(device), batch)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((batch, KV_HEADS, SPLITS, GROUP, HEAD_DIM), dtype=torch.float32, device=device),
              torch.empty((batch, KV_HEADS, SPLITS, GROUP), dtype=torch.float32, device=device))
        _WORKSPACE[key] = ws
    return ws


def solve(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
          kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float):
    batch = q.shape[0]
    out = torch.empty((batch, QO_HEADS, HEAD_DIM), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, QO_HEADS), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    assert k_cache.shape[1:] == (PAGE, KV_HEADS, HEAD_DIM) and v_cache.shape == k_cache.shape
    po, pl = _workspace(q.device, batch)
    indptr = (kv_indptr if kv_indptr.dtype == torch.int32 else kv_indptr.to(torch.int32)).contiguous()
    indices = (kv_indices if kv_indices.dtype == torch.int32 else kv_indices.to(torch.int32)).contiguous()
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q.device)
    last = (kv_last_page_len if kv_last_page_len.dtype == torch.int32
            else kv_last_page_len.to(torch.int32)).contiguous()
    # the caches as [pages * 64, kv heads, head dim] rows (views, no copy); token row = page * 64 + slot
    k_rows = k_cache.contiguous().view(-1, KV_HEADS, HEAD_DIM)
    v_rows = v_cache.contiguous().view(-1, KV_HEADS, HEAD_DIM)
    _get_compiled()(q.contiguous(), k_rows, v_rows, indptr, indices, last, po, pl, out, lse,
                    float(sm_scale) * LOG2E)
    return out, lse
