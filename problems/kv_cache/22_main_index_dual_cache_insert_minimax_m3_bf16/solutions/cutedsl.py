"""MiniMax-M3 per-head RMS norm (1 + w) + partial NeoX RoPE of q / k / indexer q / indexer k, with
K|V insertion into the paged main cache and indexer-k insertion into the paged indexer cache, in
CuTe DSL (one fused kernel).

Algorithm
- Grid (29 heads, ceil(T / 64) token chunks): CTA (h, c) handles head column h of the fused qkv
  projection for 64 tokens (consecutive CTAs are the 29 heads of one token chunk, so a wave reads
  contiguous rows of qkv). The head kind (q 0..15, k 16..19, v 20..23, indexer q 24..27,
  indexer k 28) is uniform in a CTA: no divergence, and the norm weight (1 + w, fp32) is loaded
  once per thread.
- 256 threads = 16 half-warps; half-warp g handles tokens c*64 + 16u + g, u = 0..3 (at each u the
  CTA covers 16 consecutive tokens). Lane l (0..15) owns dims 8l..8l+7 of the 128-dim head: one
  128-bit load of qkv; all 4 tokens' loads (x, position, cos and sin 128-bit chunks of the cached
  row) are issued before any math.
- RMS norm in fp32: 8 squares per lane, butterfly shuffle over the 16 lanes (8,4,2,1),
  y = x * rsqrt(mean + eps) * (1 + w). NeoX RoPE on dims 0..63: dim i pairs with i + 32, i.e. lane l
  with lane l ^ 4 for l < 8 (8 xor-4 shuffles of fp32); lanes 0..3: y c - y' s, lanes 4..7:
  y c + y' s, with cos/sin of pair 8(l % 4) + j; lanes 8..15 pass through. Rounded once to bf16.
- Stores (128-bit per lane, 256 contiguous bytes per half-warp): q -> q_out[t, h],
  indexer q -> iq_out[t, h - 24] (padding rows included); k / v -> kv_cache[s // 64, h', s % 64,
  0:128 | 128:256] and indexer k -> index_cache[s' // 64, s' % 64] only where the slot is >= 0.
  v is copied unchanged (bf16 -> bf16).
What limits it: DRAM bandwidth (61 MB read + 61 MB written; cos/sin rows are L2 hits after first
use). Expected ~30 us vs the 25.6 us SOL floor.
Host path: compiled once per process with tvm-ffi (symbolic token count and cache sizes), called
with the torch tensors directly on the caller's current torch stream (tvm-ffi env stream).
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

Q_HEADS = 16
KV_HEADS = 4
INDEX_Q_HEADS = 4
HEAD_DIM = 128
ROTARY_DIM = 64
EPS = 1e-6
BLOCK_SIZE = 64
NHEADS = Q_HEADS + 2 * KV_HEADS + INDEX_Q_HEADS + 1     # 29
K0 = Q_HEADS                                             # first k head
V0 = K0 + KV_HEADS                                       # first v head
IQ0 = V0 + KV_HEADS                                      # first indexer-q head
IK = IQ0 + INDEX_Q_HEADS                                 # indexer-k head (28)
VEC = 8
LANES = HEAD_DIM // VEC                                  # 16 lanes per head vector
THREADS = 256
GROUPS = THREADS // LANES                                # 16 half-warps
UNROLL = 4
TOK_PER_CTA = GROUPS * UNROLL                            # 64


@cute.jit
def _load_vec(row: cute.Tensor, chunk: Int32) -> cute.Tensor:
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(cute.zipped_divide(row, (VEC,))[(None, chunk)], r)
    return r


@cute.jit
def _store_vec(val: cute.TensorSSA, row: cute.Tensor, chunk: Int32):
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    r.store(val.to(BFloat16))
    cute.autovec_copy(r, cute.zipped_divide(row, (VEC,))[(None, chunk)])


@cute.kernel
def _qkv_kernel(mX: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWiq: cute.Tensor, mWik: cute.Tensor,
                mPos: cute.Tensor, mCS: cute.Tensor, mSlot: cute.Tensor, mISlot: cute.Tensor,
                mKV: cute.Tensor, mIC: cute.Tensor, mQ: cute.Tensor, mIQ: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    h, c, _ = cute.arch.block_idx()
    ntok = mX.shape[0]
    g = tidx // LANES
    l = tidx % LANES
    is_v = (h >= V0) & (h < IQ0)

    # (1 + w) of this CTA's head kind, fp32 (v: unused)
    rw = cute.make_rmem_tensor((VEC,), BFloat16)
    rw.fill(0.0)
    if h < K0:
        cute.autovec_copy(cute.zipped_divide(mWq, (VEC,))[(None, l)], rw)
    elif h < V0:
        cute.autovec_copy(cute.zipped_divide(mWk, (VEC,))[(None, l)], rw)
    elif h < IQ0:
        pass
    elif h < IK:
        cute.autovec_copy(cute.zipped_divide(mWiq, (VEC,))[(None, l)], rw)
    else:
        cute.autovec_copy(cute.zipped_divide(mWik, (VEC,))[(None, l)], rw)
    w1 = rw.load().to(Float32) + 1.0

    # issue all loads of the 4 tokens first
    xs = []
    css = []
    sns = []
    toks = []
    for u in cutlass.range_constexpr(UNROLL):
        t = c * TOK_PER_CTA + u * GROUPS + g
        toks.append(t)
        tc = cutlass.min(t, ntok - 1)
        xs.append(_load_vec(mX[tc, None], h * LANES + l))
        p = Int32(mPos[tc])
        css.append(_load_vec(mCS[p, None], l % 4))
        sns.append(_load_vec(mCS[p, None], 4 + l % 4))

    if is_v:
        for u in cutlass.range_constexpr(UNROLL):
            t = toks[u]
            if t < ntok:
                s = mSlot[t]
                if s >= 0:
                    b = Int32(s // BLOCK_SIZE)
                    o = Int32(s % BLOCK_SIZE)
                    cute.autovec_copy(xs[u], cute.zipped_divide(mKV[b, h - V0, o, None], (VEC,))[(None, LANES + l)])
    else:
        sign = Float32(cutlass.select_(l < 4, Float32(-1.0), Float32(1.0)))
        for u in cutlass.range_constexpr(UNROLL):
            x = xs[u].load().to(Float32)
            ss = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            ss = cute.arch.warp_reduction(ss, lambda a, b: a + b, threads_in_group=LANES)
            inv = cute.math.rsqrt(ss * (1.0 / HEAD_DIM) + EPS)
            y = cute.make_rmem_tensor((VEC,), Float32)
            y.store(x * inv * w1)
            cv = css[u].load().to(Float32)
            sv = sns[u].load().to(Float32)
            o = cute.make_rmem_tensor((VEC,), Float32)
            for j in cutlass.range_constexpr(VEC):
                yj = y[j]
                pj = cute.arch.shuffle_sync_bfly(yj, offset=4)
                rot = yj * cv[j] + pj * (sv[j] * sign)
                o[j] = Float32(cutlass.select_(l < 8, rot, yj))
            t = toks[u]
            if t < ntok:
                res = o.load()
                if h < K0:
                    _store_vec(res, mQ[t, h, None], l)
                elif h < V0:
                    s = mSlot[t]
                    if s >= 0:
                        _store_vec(res, mKV[Int32(s // BLOCK_SIZE), h - K0, Int32(s % BLOCK_SIZE), None], l)
                elif h < IK:
                    _store_vec(res, mIQ[t, h - IQ0, None], l)
                else:
                    s = mISlot[t]
                    if s >= 0:
                        _store_vec(res, mIC[Int32(s // BLOCK_SIZE), Int32(s % BLOCK_SIZE), None], l)


@cute.jit
def _qkv(mX: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWiq: cute.Tensor, mWik: cute.Tensor,
         mPos: cute.Tensor, mCS: cute.Tensor, mSlot: cute.Tensor, mISlot: cute.Tensor,
         mKV: cute.Tensor, mIC: cute.Tensor, mQ: cute.Tensor, mIQ: cute.Tensor, stream: cuda.CUstream):
    ntok = mX.shape[0]
    _qkv_kernel(mX, mWq, mWk, mWiq, mWik, mPos, mCS, mSlot, mISlot, mKV, mIC, mQ, mIQ).launch(
        grid=[NHEADS, (ntok + TOK_PER_CTA - 1) // TOK_PER_CTA, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        ntok, npos, nblk, niblk = (cute.sym_int32() for _ in range(4))
        x = make_fake_compact_tensor(BFloat16, (ntok, NHEADS * HEAD_DIM), stride_order=(1, 0), assumed_align=16)
        ws = [make_fake_compact_tensor(BFloat16, (HEAD_DIM,), assumed_align=16) for _ in range(4)]
        pos = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        cs = make_fake_compact_tensor(BFloat16, (npos, ROTARY_DIM), stride_order=(1, 0), assumed_align=16)
        slot = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        islot = make_fake_compact_tensor(Int64, (ntok,), assumed_align=8)
        kv = make_fake_compact_tensor(BFloat16, (nblk, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
                                      stride_order=(3, 2, 1, 0), assumed_align=16)
        ic = make_fake_compact_tensor(BFloat16, (niblk, BLOCK_SIZE, HEAD_DIM), stride_order=(2, 1, 0),
                                      assumed_align=16)
        q = make_fake_compact_tensor(BFloat16, (ntok, Q_HEADS, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
        iq = make_fake_compact_tensor(BFloat16, (ntok, INDEX_Q_HEADS, HEAD_DIM), stride_order=(2, 1, 0),
                                      assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_qkv, x, *ws, pos, cs, slot, islot, kv, ic, q, iq, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(qkv, q_norm_weight, k_norm_weight, index_q_norm_weight, index_k_norm_weight, positions, cos_sin_cache,
          slot_mapping, index_slot_mapping, kv_cache, index_cache):
    ntok = qkv.shape[0]
    assert qkv.shape[1] == NHEADS * HEAD_DIM and qkv.dtype == torch.bfloat16 and kv_cache.is_contiguous()
    q = torch.empty((ntok, Q_HEADS, HEAD_DIM), dtype=qkv.dtype, device=qkv.device)
    iq = torch.empty((ntok, INDEX_Q_HEADS, HEAD_DIM), dtype=qkv.dtype, device=qkv.device)
    if ntok > 0:
        _get_compiled()(qkv, q_norm_weight, k_norm_weight, index_q_norm_weight, index_k_norm_weight,
                        positions.to(torch.int64), cos_sin_cache, slot_mapping.to(torch.int64),
                        index_slot_mapping.to(torch.int64), kv_cache, index_cache, q, iq)
    return q, iq, kv_cache, index_cache
