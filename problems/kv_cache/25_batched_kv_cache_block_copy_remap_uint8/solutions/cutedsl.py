"""Batched K/V cache block copy under a block remap (uint8 pages of 64 KiB) in CuTe DSL.

Algorithm
- Grid (M, SPLIT=4, 2): CTA (m, p, kv) copies quarter p (16 KiB) of one 64 KiB block of the K
  cache (kv = 0) or the V cache (kv = 1); it reads src = block_mapping[m, 0] and
  dst = block_mapping[m, 1] (int64) itself, so the host never looks at the
  mapping. 2048 CTAs for M = 256 spread evenly over the 132 SMs.
- 256 threads per CTA; the quarter is 1024 chunks of 16 bytes; thread t copies chunks
  p*1024 + t + 256*i, i = 0..3 (a warp moves 512 contiguous bytes per instruction). All 4 128-bit
  loads (ld.global.v4) are issued before the 4 128-bit stores (st.global.v4).
- dst_k / dst_v are updated in place (unmapped blocks are never touched) and returned.
Host path: compiled once per (cache shape) key with tvm-ffi (dynamic block and mapping counts),
called with torch tensors directly on the caller's current torch stream (tvm-ffi env stream).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

THREADS = 256
VEC = 16                                  # bytes per 128-bit access
SPLIT = 4                                 # CTAs per 64 KiB block (16 KiB each)


def _make_kernel(block_bytes: int):
    chunks = block_bytes // VEC
    iters = chunks // (THREADS * SPLIT)     # 16-byte chunks per thread

    @cute.kernel
    def _copy_kernel(mSK: cute.Tensor, mSV: cute.Tensor, mDK: cute.Tensor, mDV: cute.Tensor,
                     mMap: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        m, part, kv = cute.arch.block_idx()
        src = Int32(mMap[m, 0])
        dst = Int32(mMap[m, 1])
        first = part * (iters * THREADS) + tidx   # first 16-byte chunk of this thread
        if kv == 0:
            _copy_block(mSK, mDK, src, dst, first, iters)
        else:
            _copy_block(mSV, mDV, src, dst, first, iters)

    @cute.jit
    def _copy(mSK: cute.Tensor, mSV: cute.Tensor, mDK: cute.Tensor, mDV: cute.Tensor,
              mMap: cute.Tensor, stream: cuda.CUstream):
        _copy_kernel(mSK, mSV, mDK, mDV, mMap).launch(
            grid=[mMap.shape[0], SPLIT, 2], block=[THREADS, 1, 1], stream=stream)

    return _copy


@cute.jit
def _copy_block(mS: cute.Tensor, mD: cute.Tensor, src: Int32, dst: Int32, first: Int32,
                iters: cutlass.Constexpr):
    gS = cute.zipped_divide(mS[src, None], (VEC,))    # ((16), (chunks))
    gD = cute.zipped_divide(mD[dst, None], (VEC,))
    regs = []
    for i in cutlass.range_constexpr(iters):
        r = cute.make_rmem_tensor((VEC,), Uint8)
        cute.autovec_copy(gS[(None, first + i * THREADS)], r)
        regs.append(r)
    for i in cutlass.range_constexpr(iters):
        cute.autovec_copy(regs[i], gD[(None, first + i * THREADS)])


_COMPILED = {}


def _get_compiled(block_bytes: int):
    fn = _COMPILED.get(block_bytes)
    if fn is None:
        assert block_bytes % (VEC * THREADS * SPLIT) == 0
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        nsrc, ndst, nmap = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        sk = make_fake_compact_tensor(Uint8, (nsrc, block_bytes), stride_order=(1, 0), assumed_align=16)
        sv = make_fake_compact_tensor(Uint8, (nsrc, block_bytes), stride_order=(1, 0), assumed_align=16)
        dk = make_fake_compact_tensor(Uint8, (ndst, block_bytes), stride_order=(1, 0), assumed_align=16)
        dv = make_fake_compact_tensor(Uint8, (ndst, block_bytes), stride_order=(1, 0), assumed_align=16)
        mp = make_fake_compact_tensor(Int64, (nmap, 2), stride_order=(1, 0), assumed_align=8)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_make_kernel(block_bytes), sk, sv, dk, dv, mp, stream, options="--enable-tvm-ffi")
        _COMPILED[block_bytes] = fn
    return fn


def solve(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
          block_mapping: torch.Tensor):
    block_bytes = src_k[0].numel() * src_k.element_size()
    mapping = block_mapping if block_mapping.dtype == torch.int64 else block_mapping.to(torch.int64)
    if mapping.shape[0] > 0:
        _get_compiled(block_bytes)(src_k.view(src_k.shape[0], block_bytes),
                                   src_v.view(src_v.shape[0], block_bytes),
                                   dst_k.view(dst_k.shape[0], block_bytes),
                                   dst_v.view(dst_v.shape[0], block_bytes),
                                   mapping.contiguous())
    return dst_k, dst_v
