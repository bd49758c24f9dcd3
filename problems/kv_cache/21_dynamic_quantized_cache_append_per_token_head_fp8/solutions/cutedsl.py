"""Dynamic per-(token, head) FP8 e4m3 quantization of new K/V rows appended into paged FP8 caches, one CuTe DSL kernel.

Algorithm (same decomposition as the TIRx solution)
- Grid: ceil(T / 2) CTAs of 256 threads; a (token, head) row is owned by a half-warp (16 lanes):
  half-warp h of CTA c handles token 2c + h // 8, head h % 8, for the key AND the value row (two
  16-byte bf16x8 loads per lane in flight). A warp's two half-warps share the token, so a padding
  token (slot -1) retires whole warps and the butterfly shuffles always run fully converged.
- absmax: |x| in fp32, max over the lane's 8 values, then 4 xor shuffles (8, 4, 2, 1).
- Bit-exact with the reference's IEEE sequence: scale = max(absmax / 448, 1e-8) and
  inv = 1 / scale as correctly rounded fp32 divisions (div.rn; checked in the PTX), q =
  min(max(x * inv, -448), 448) (plain fp32 multiply), converted to float8_e4m3fn with the
  round-to-nearest-even saturating hardware conversion (the clamp makes saturation a no-op).
- The lane's 8 fp8 bytes are one 8-byte store into the cache row (row = slot * 8 + head of the
  [slots * 8, 128] byte view); lane 0 of the half-warp writes the fp32 scale.
Only live tokens write; every other cache entry is untouched (in place; the inputs are returned).
What limits it: DRAM traffic (33.6 MB bf16 read, 17 MB written: 10.6 us floor); the TIRx version of
this kernel measured 15.6 us device time; end to end the host call path dominates (~75 us there).
Host path: compiled once with tvm-ffi (symbolic token and cache sizes), on the caller's stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32, Int64, Uint8

KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
FP8_MAX = 448.0
MIN_SCALE = 1e-8
THREADS = 256
VEC = 8                                    # bf16 per 16-byte load = fp8 bytes per 8-byte store
LANES = HEAD_DIM // VEC                    # 16 lanes per (token, head) row
ROWS_PER_CTA = THREADS // LANES            # 16 (token, head) rows
TOKENS_PER_CTA = ROWS_PER_CTA // KV_HEADS  # 2 tokens


@cute.kernel
def _quant_kernel(mK: cute.Tensor, mV: cute.Tensor, mSlot: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor,
                  mKS: cute.Tensor, mVS: cute.Tensor):
    bidx, _, _ = cute.arch.block_idx()
    tidx, _, _ = cute.arch.thread_idx()
    n_tok = mK.shape[0]
    row = tidx // LANES
    tok = bidx * TOKENS_PER_CTA + row // KV_HEADS
    head = row % KV_HEADS
    l16 = tidx % LANES

    if tok < n_tok:
        slot = Int32(mSlot[tok])
        if slot >= 0:
            gk = cute.zipped_divide(mK[tok, head, None], (VEC,))          # ((8), (16))
            gv = cute.zipped_divide(mV[tok, head, None], (VEC,))
            kb = cute.make_rmem_tensor((VEC,), BFloat16)
            vb = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(gk[(None, l16)], kb)
            cute.autovec_copy(gv[(None, l16)], vb)
            kf = cute.make_rmem_tensor((VEC,), Float32)
            vf = cute.make_rmem_tensor((VEC,), Float32)
            kf.store(kb.load().to(Float32))
            vf.store(vb.load().to(Float32))
            amk = Float32(0.0)
            amv = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                amk = cute.arch.fmax(amk, cute.arch.fmax(kf[i], -kf[i]))
                amv = cute.arch.fmax(amv, cute.arch.fmax(vf[i], -vf[i]))
            for off in (8, 4, 2, 1):
                amk = cute.arch.fmax(amk, cute.arch.shuffle_sync_bfly(amk, offset=off))
                amv = cute.arch.fmax(amv, cute.arch.shuffle_sync_bfly(amv, offset=off))
            sk = cute.arch.fmax(amk / Float32(FP8_MAX), Float32(MIN_SCALE))
            sv = cute.arch.fmax(amv / Float32(FP8_MAX), Float32(MIN_SCALE))
            ik = Float32(1.0) / sk
            iv = Float32(1.0) / sv
            for i in cutlass.range_constexpr(VEC):
                kf[i] = cute.arch.fmin(cute.arch.fmax(kf[i] * ik, Float32(-FP8_MAX)), Float32(FP8_MAX))
                vf[i] = cute.arch.fmin(cute.arch.fmax(vf[i] * iv, Float32(-FP8_MAX)), Float32(FP8_MAX))
            kq = cute.make_rmem_tensor((VEC,), Float8E4M3FN)
            vq = cute.make_rmem_tensor((VEC,), Float8E4M3FN)
            kq.store(kf.load().to(Float8E4M3FN))
            vq.store(vf.load().to(Float8E4M3FN))
            crow = slot * KV_HEADS + head
            gkc = cute.zipped_divide(mKC[crow, None], (VEC,))              # ((8), (16))
            gvc = cute.zipped_divide(mVC[crow, None], (VEC,))
            cute.autovec_copy(cute.recast_tensor(kq, Uint8), gkc[(None, l16)])
            cute.autovec_copy(cute.recast_tensor(vq, Uint8), gvc[(None, l16)])
            if l16 == 0:
                mKS[crow] = sk
                mVS[crow] = sv


@cute.jit
def _quant(mK: cute.Tensor, mV: cute.Tensor, mSlot: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor,
           mKS: cute.Tensor, mVS: cute.Tensor, stream: cuda.CUstream):
    n_tok = mK.shape[0]
    _quant_kernel(mK, mV, mSlot, mKC, mVC, mKS, mVS).launch(
        grid=[(n_tok + TOKENS_PER_CTA - 1) // TOKENS_PER_CTA, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        n_tok, n_rows = cute.sym_int32(), cute.sym_int32()
        k = make_fake_compact_tensor(BFloat16, (n_tok, KV_HEADS, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (n_tok, KV_HEADS, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
        sl = make_fake_compact_tensor(Int64, (n_tok,), assumed_align=8)
        kc = make_fake_compact_tensor(Uint8, (n_rows, HEAD_DIM), stride_order=(1, 0), assumed_align=16)
        vc = make_fake_compact_tensor(Uint8, (n_rows, HEAD_DIM), stride_order=(1, 0), assumed_align=16)
        ks = make_fake_compact_tensor(Float32, (n_rows,), assumed_align=4)
        vs = make_fake_compact_tensor(Float32, (n_rows,), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_quant, k, v, sl, kc, vc, ks, vs, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(key, value, slot_mapping, key_cache, value_cache, k_scale_cache, v_scale_cache):
    n_tok = key.shape[0]
    if n_tok > 0:
        fn = _get_compiled()
        n_rows = key_cache.shape[0] * BLOCK_SIZE * KV_HEADS
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        # views only: the caches are updated in place through them
        fn(key.contiguous(), value.contiguous(), slots.contiguous(),
           key_cache.view(n_rows, HEAD_DIM), value_cache.view(n_rows, HEAD_DIM),
           k_scale_cache.view(n_rows), v_scale_cache.view(n_rows))
    return key_cache, value_cache, k_scale_cache, v_scale_cache
