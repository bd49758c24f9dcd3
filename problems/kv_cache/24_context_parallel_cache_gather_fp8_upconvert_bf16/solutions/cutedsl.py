"""Paged FP8 MLA cache gather + upconvert to bf16 (656-byte entries -> 576 bf16) in CuTe DSL.

Algorithm
- One warp per output token, UNROLL = 4 tokens per warp, 8 warps (256 threads) per CTA:
  grid = ceil(total / 32) CTAs (2048 for 65536 tokens). Output row t -> (request r, position p)
  by a warp scan: lane i holds seq_lens[c + i] of a 32-request chunk, a shuffle inclusive scan
  gives the request ends, and popc(ballot(end <= t)) is the request index (the start is
  shuffled from the lane of that request); one pass for <= 32 requests, chunked beyond.
  Tail tokens use a clamped row for loads and skip the stores.
- Entry e = cache[block_table[r, p // 64], p % 64] (the flattened [blocks*64, 656] byte view;
  entries are 16-byte aligned). Lane l loads latent bytes 8l..8l+7 and 256+8l..256+8l+7 (64-bit
  loads, 256 contiguous bytes per warp instruction), the two fp32 scales of their 128-groups
  (l/16 and 2 + l/16; broadcast loads) and rope word l (4 bytes of the 128 rope bytes). All loads
  of the warp's 4 tokens are issued before any conversion or store.
- fp8 e4m3 -> fp32 (exact), times the group scale in fp32, round to bf16: bit-identical to the
  reference. Stores: 16 bytes per lane at out[t, 8l..] and out[t, 256+8l..] (512 contiguous bytes
  per warp instruction) and the rope word copied to out[t, 512 + 2l..] as 32 bits.
What limits it: DRAM bandwidth (43 MB gathered + 75.5 MB written); the gather is row-granular
(656 contiguous bytes per token), so it streams well. Expected ~30-35 us vs the 24.7 us SOL
floor. The host reads sum(seq_lens) (one device sync, as the reference) to size the output.
Host path: compiled once per process with tvm-ffi (symbolic blocks, requests, tokens); the cache
is passed as three views of its storage (bytes, fp32 words, int32 words), on the caller's stream.
Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32, Uint8

NOPE_DIM = 512
ROPE_DIM = 64
GROUP = 128
GROUPS = NOPE_DIM // GROUP
ENTRY_BYTES = NOPE_DIM + 4 * GROUPS + 2 * ROPE_DIM    # 656
ENTRY_WORDS = ENTRY_BYTES // 4                         # 164
OUT_DIM = NOPE_DIM + ROPE_DIM                          # 576
BLOCK_SIZE = 64
THREADS = 256
NWARPS = THREADS // 32
UNROLL = 4                                             # tokens per warp
TOK_PER_CTA = NWARPS * UNROLL
LVEC = 8                                               # latent bytes per lane per half
HALF = NOPE_DIM // 2                                   # 256


@cute.kernel
def _gather_kernel(mC8: cute.Tensor, mCF: cute.Tensor, mCW: cute.Tensor, mBT: cute.Tensor, mLens: cute.Tensor,
                   mO: cute.Tensor, mOW: cute.Tensor):
    bidx, _, _ = cute.arch.block_idx()
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    total = mO.shape[0]
    nreq = mLens.shape[0]
    t0 = (bidx * NWARPS + warp) * UNROLL

    # request and start of each of the warp's tokens (tail tokens clamped to the last row)
    req = cute.make_rmem_tensor((UNROLL,), Int32)
    beg = cute.make_rmem_tensor((UNROLL,), Int32)
    tok = cute.make_rmem_tensor((UNROLL,), Int32)
    for u in cutlass.range_constexpr(UNROLL):
        tok[u] = cutlass.min(t0 + u, total - 1)
        req[u] = Int32(-1)
        beg[u] = Int32(0)
    base = Int32(0)
    for c in cutlass.range(0, nreq, 32):
        i = c + lane
        ln = Int32(0)
        if i < nreq:
            ln = mLens[i]
        incl = ln
        for off in (1, 2, 4, 8, 16):
            v = cute.arch.shuffle_sync_up(incl, offset=off)
            if lane >= off:
                incl = incl + v
        incl = incl + base
        excl = incl - ln
        nvalid = cutlass.min(nreq - c, Int32(32))
        for u in cutlass.range_constexpr(UNROLL):
            done = cute.arch.vote_ballot_sync(incl <= tok[u])
            n = cute.arch.popc(done & cute.arch.vote_ballot_sync(i < nreq))
            st = cute.arch.shuffle_sync(excl, offset=n & 31)
            if req[u] < 0 and n < nvalid:
                req[u] = c + n
                beg[u] = st
        base = cute.arch.shuffle_sync(incl, offset=31)

    # issue every load of the warp's tokens first
    lat = []
    scl = []
    rope = []
    for u in cutlass.range_constexpr(UNROLL):
        p = tok[u] - beg[u]
        blk = mBT[req[u], p // BLOCK_SIZE]
        slot = blk * BLOCK_SIZE + p % BLOCK_SIZE
        row8 = cute.zipped_divide(mC8[slot, None], (LVEC,))          # ((8), (82))
        for hh in cutlass.range_constexpr(2):
            r = cute.make_rmem_tensor((LVEC,), Uint8)
            cute.autovec_copy(row8[(None, hh * (HALF // LVEC) + lane)], r)
            lat.append(r)
            scl.append(mCF[slot, NOPE_DIM // 4 + hh * 2 + lane // 16])
        rope.append(mCW[slot, (NOPE_DIM + 4 * GROUPS) // 4 + lane])

    for u in cutlass.range_constexpr(UNROLL):
        t = t0 + u
        if t < total:
            orow = cute.zipped_divide(mO[t, None], (LVEC,))           # ((8), (72))
            for hh in cutlass.range_constexpr(2):
                f8 = cute.recast_tensor(lat[u * 2 + hh], Float8E4M3FN)
                v = f8.load().to(Float32) * scl[u * 2 + hh]
                ro = cute.make_rmem_tensor((LVEC,), BFloat16)
                ro.store(v.to(BFloat16))
                cute.autovec_copy(ro, orow[(None, hh * (HALF // LVEC) + lane)])
            mOW[t, NOPE_DIM // 2 + lane] = rope[u]


@cute.jit
def _gather(mC8: cute.Tensor, mCF: cute.Tensor, mCW: cute.Tensor, mBT: cute.Tensor, mLens: cute.Tensor,
            mO: cute.Tensor, mOW: cute.Tensor, stream: cuda.CUstream):
    total = mO.shape[0]
    _gather_kernel(mC8, mCF, mCW, mBT, mLens, mO, mOW).launch(
        grid=[(total + TOK_PER_CTA - 1) // TOK_PER_CTA, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        slots, nreq, width, total = (cute.sym_int32() for _ in range(4))
        c8 = make_fake_compact_tensor(Uint8, (slots, ENTRY_BYTES), stride_order=(1, 0), assumed_align=16)
        cf = make_fake_compact_tensor(Float32, (slots, ENTRY_WORDS), stride_order=(1, 0), assumed_align=16)
        cw = make_fake_compact_tensor(Int32, (slots, ENTRY_WORDS), stride_order=(1, 0), assumed_align=16)
        bt = make_fake_compact_tensor(Int32, (nreq, width), stride_order=(1, 0), assumed_align=4)
        lens = make_fake_compact_tensor(Int32, (nreq,), assumed_align=4)
        o = make_fake_compact_tensor(BFloat16, (total, OUT_DIM), stride_order=(1, 0), assumed_align=16)
        ow = make_fake_compact_tensor(Int32, (total, OUT_DIM // 2), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_gather, c8, cf, cw, bt, lens, o, ow, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    assert cache.dtype == torch.uint8 and cache.shape[1:] == (BLOCK_SIZE, ENTRY_BYTES) and cache.is_contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    total = int(lens.sum())                       # output size (the reference syncs the same way)
    out = torch.empty((total, OUT_DIM), dtype=torch.bfloat16, device=cache.device)
    if total > 0:
        flat = cache.view(-1, ENTRY_BYTES)
        bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        _get_compiled()(flat, flat.view(torch.float32), flat.view(torch.int32),
                        bt.contiguous(), lens.contiguous(), out, out.view(torch.int32))
    return out
