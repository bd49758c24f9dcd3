"""Paged FP8 MLA cache gather (576 = 512 latent + 64 rope values, block size 64) of several requests
into one contiguous bf16 buffer, dequantized with a per-tensor scale; one CuTe DSL kernel.

Algorithm (same decomposition as the TIRx solution)
- Grid: ceil(total / 64) CTAs of 256 threads; CTA c produces output rows 64c .. 64c+63.
- Phase 1 (threads 0..63, one output row each): find the row's request by walking seq_lens with a
  running start, then src_row = block_table[r, p // 64] * 64 + p % 64 in the flattened
  [blocks*64, 576] byte view; the 64 source rows go to shared memory; one CTA barrier.
- Phase 2: the CTA's 64 rows x 36 pieces of 16 fp8 bytes = 2304 pieces, 9 per thread (piece
  k*256 + tid -> row, column), all 9 16-byte loads issued before any conversion: consecutive threads
  read consecutive 16-byte pieces of one 576-byte source row. fp8 e4m3 -> fp32 (exact), times the fp32
  scale (one multiply, as the reference), rounded to bf16 (RNE); 32 bytes stored per piece.
Bit-exact with the reference by construction. The cache is passed as a uint8 view and the register
copies are reinterpreted as fp8 (the idiom of the verified problem-24 CuTe solution).
What limits it: DRAM streaming (37.7 MB read, 75.5 MB written, floor ~24 us) for the kernel; end to
end, the host read of sum(seq_lens) that sizes the output (one sync, as the reference) dominates.
Host path: compiled once per process with tvm-ffi (symbolic sizes), torch tensors passed directly on
the caller's stream; the output is allocated per call.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32, Uint8

ENTRY = 576
BLOCK_SIZE = 64
THREADS = 256
VEC = 16                                   # fp8 values per 16-byte load
CHUNKS = ENTRY // VEC                      # 36 pieces per row
ROWS = 64                                  # output rows per CTA
PER_THREAD = ROWS * CHUNKS // THREADS      # 9 pieces per thread


@cute.kernel
def _gather_dequant_kernel(mSrc: cute.Tensor, mBT: cute.Tensor, mLens: cute.Tensor, mScale: cute.Tensor,
                           mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    total = mO.shape[0]
    nreq = mLens.shape[0]

    smem = cutlass.utils.SmemAllocator()
    sRows = smem.allocate_tensor(Int32, cute.make_layout((ROWS,)), byte_alignment=16)

    # phase 1: source row of each of the CTA's 64 output rows
    if tidx < ROWS:
        row = cta * ROWS + tidx
        acc = Int32(0)
        found = Int32(0)
        for r in cutlass.range(nreq):
            ln = mLens[r]
            if row >= acc and row < acc + ln:
                p = row - acc
                found = mBT[r, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            acc = acc + ln
        sRows[tidx] = found
    sc = mScale[0]
    cute.arch.barrier()

    # phase 2: all loads first, then convert and store
    raws = []
    for k in cutlass.range_constexpr(PER_THREAD):
        c = k * THREADS + tidx
        rl = c // CHUNKS
        r8 = cute.make_rmem_tensor((VEC,), Uint8)
        if cta * ROWS + rl < total:
            cute.autovec_copy(cute.zipped_divide(mSrc[sRows[rl], None], (VEC,))[(None, c % CHUNKS)], r8)
        raws.append(r8)
    for k in cutlass.range_constexpr(PER_THREAD):
        c = k * THREADS + tidx
        orow = cta * ROWS + c // CHUNKS
        if orow < total:
            f8 = cute.recast_tensor(raws[k], Float8E4M3FN)
            v = f8.load().to(Float32) * sc
            ro = cute.make_rmem_tensor((VEC,), BFloat16)
            ro.store(v.to(BFloat16))
            cute.autovec_copy(ro, cute.zipped_divide(mO[orow, None], (VEC,))[(None, c % CHUNKS)])


@cute.jit
def _gather_dequant(mSrc: cute.Tensor, mBT: cute.Tensor, mLens: cute.Tensor, mScale: cute.Tensor,
                    mO: cute.Tensor, stream: cuda.CUstream):
    total = mO.shape[0]
    _gather_dequant_kernel(mSrc, mBT, mLens, mScale, mO).launch(
        grid=[(total + ROWS - 1) // ROWS, 1, 1], block=[THREADS, 1, 1], smem=ROWS * 4 + 16, stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        n_src, nreq, width, total = (cute.sym_int32() for _ in range(4))
        src = make_fake_compact_tensor(Uint8, (n_src, ENTRY), stride_order=(1, 0), assumed_align=16)
        bt = make_fake_compact_tensor(Int32, (nreq, width), stride_order=(1, 0), assumed_align=4)
        lens = make_fake_compact_tensor(Int32, (nreq,), assumed_align=4)
        scale = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
        out = make_fake_compact_tensor(BFloat16, (total, ENTRY), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_gather_dequant, src, bt, lens, scale, out, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(src_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
          scale: torch.Tensor) -> torch.Tensor:
    assert src_cache.shape[1:] == (BLOCK_SIZE, ENTRY) and src_cache.is_contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    total = int(lens.sum().item())          # output size: the one host synchronization
    out = torch.empty((total, ENTRY), dtype=torch.bfloat16, device=src_cache.device)
    if total > 0:
        src = src_cache.view(torch.uint8).view(src_cache.shape[0] * BLOCK_SIZE, ENTRY)
        bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        _get_compiled()(src, bt.contiguous(), lens.contiguous(), scale.to(torch.float32).contiguous(), out)
    return out
