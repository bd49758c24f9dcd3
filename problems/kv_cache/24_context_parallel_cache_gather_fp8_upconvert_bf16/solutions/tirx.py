# Paged FP8 MLA cache gather + upconvert to bf16 (656-byte entries -> 576 bf16), one TIRx kernel.
#
# Algorithm (same decomposition as the CuTe DSL solution)
# - One warp per output token, UNROLL = 4 tokens per warp, 8 warps (256 threads) per CTA:
#   grid = ceil(total / 32) CTAs (2048 for 65536 tokens).
# - Output row t -> (request r, position p): each thread walks seq_lens (a handful of int32 words,
#   served from L1/L2) and keeps the first request whose running end exceeds t. This differs from
#   the CuTe solution (warp shuffle scan + ballot): with 8 requests a short serial search is as
#   cheap and simpler to write here. Tail tokens use a clamped row for loads and skip the stores.
# - Entry e = cache[block_table[r, p // 64], p % 64] as row `slot` of the flattened
#   [blocks * 64, 656] byte view (16-byte aligned rows). Lane l loads latent bytes 8l..8l+7 and
#   256+8l..256+8l+7 (8-byte vector loads, 256 contiguous bytes per warp access), the fp32 scales
#   of their 128-groups (l / 16 and 2 + l / 16; broadcast loads) and rope word l (4 of the 128 rope
#   bytes). All loads of the warp's 4 tokens are issued before any conversion or store.
# - fp8 e4m3fn -> fp32 is decoded with integer bit operations (exact: normals by moving the 7
#   exponent/mantissa bits into the fp32 field and rebasing the exponent by 120, subnormals as
#   m * 2^-9), then times the group scale in fp32 and one round-to-nearest-even to bf16, which is
#   bit-identical to the reference. (TVM 0.27's vectorized fp8 -> fp32 cast emits invalid CUDA, and
#   the bit decode keeps the kernel runnable in the CPU emulator.) Stores: 16 bytes per lane at
#   out[t, 8l..] and out[t, 256 + 8l..] (512 contiguous bytes per warp access) and the rope word
#   copied bitwise into out[t, 512 + 2l..] through a 32-bit view of the output.
# What limits it: DRAM bandwidth (43 MB gathered + 75.5 MB written, 24.7 us floor); the CuTe
# version of this kernel measured 38.7 us device time per call. The fp8 bit decode adds ~10
# integer ops per element, which should hide under the memory traffic. The host reads
# sum(seq_lens) (one device sync, as the reference) to size the output.
# Host path: one cached Executable (symbolic slots, requests, table width, tokens) called with
# torch tensors on the caller's stream; the cache is passed as three views of its storage
# (bytes, fp32 words, int32 words) and the output as bf16 and int32 views.
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator at smoke size; not yet
# run on the H200.

import torch
import tvm
from tvm.script import tirx as T

NOPE_DIM = 512
ROPE_DIM = 64
GROUP = 128
GROUPS = NOPE_DIM // GROUP
ENTRY_BYTES = NOPE_DIM + 4 * GROUPS + 2 * ROPE_DIM    # 656
ENTRY_WORDS = ENTRY_BYTES // 4                         # 164
SCALE_WORD = NOPE_DIM // 4                             # 128
ROPE_WORD = (NOPE_DIM + 4 * GROUPS) // 4               # 132
OUT_DIM = NOPE_DIM + ROPE_DIM                          # 576
OUT_WORDS = OUT_DIM // 2                               # 288
BLOCK_SIZE = 64
THREADS = 256
NWARPS = THREADS // 32
UNROLL = 4                                             # tokens per warp
TOK_PER_CTA = NWARPS * UNROLL                          # 32
LVEC = 8                                               # latent bytes per lane per half
HALF = NOPE_DIM // 2                                   # 256


@T.prim_func
def gather_upconvert(c8_handle: T.handle, cf_handle: T.handle, cw_handle: T.handle, bt_handle: T.handle,
                     lens_handle: T.handle, o_handle: T.handle, ow_handle: T.handle):
    slots = T.int32()
    nreq = T.int32()
    width = T.int32()
    total = T.int32()
    C8 = T.match_buffer(c8_handle, (slots, ENTRY_BYTES), "uint8", align=16)
    CF = T.match_buffer(cf_handle, (slots, ENTRY_WORDS), "float32", align=16)
    CW = T.match_buffer(cw_handle, (slots, ENTRY_WORDS), "int32", align=16)
    BT = T.match_buffer(bt_handle, (nreq, width), "int32")
    LENS = T.match_buffer(lens_handle, (nreq,), "int32")
    O = T.match_buffer(o_handle, (total, OUT_DIM), "bfloat16", align=16)
    OW = T.match_buffer(ow_handle, (total, OUT_WORDS), "int32", align=16)

    T.device_entry()
    bx = T.cta_id([(total + TOK_PER_CTA - 1) // TOK_PER_CTA])
    tid = T.thread_id([THREADS])

    req = T.alloc_local((UNROLL,), "int32")
    beg = T.alloc_local((UNROLL,), "int32")
    tok = T.alloc_local((UNROLL,), "int32")
    slot = T.alloc_local((UNROLL,), "int32")
    lat = T.alloc_local((UNROLL * 2 * LVEC,), "uint8")
    scl = T.alloc_local((UNROLL * 2,), "float32")
    rope = T.alloc_local((UNROLL,), "int32")
    res = T.alloc_local((LVEC,), "bfloat16")
    run = T.alloc_local((1,), "int32")
    xi = T.alloc_local((1,), "int32")
    mag = T.alloc_local((1,), "float32")

    warp: T.let[T.int32] = tid // 32
    lane: T.let[T.int32] = tid % 32
    t0: T.let[T.int32] = (bx * NWARPS + warp) * UNROLL

    # request and start of each of the warp's tokens (tail tokens clamped to the last row)
    for u in T.unroll(UNROLL):
        tok[u] = T.min(t0 + u, total - 1)
        req[u] = -1
        beg[u] = 0
    run[0] = 0
    for r in range(nreq):
        ln: T.let[T.int32] = LENS[r]
        for u in T.unroll(UNROLL):
            if req[u] < 0:
                if tok[u] < run[0] + ln:
                    req[u] = r
                    beg[u] = run[0]
        run[0] = run[0] + ln

    # issue every load of the warp's tokens first
    for u in T.unroll(UNROLL):
        p: T.let[T.int32] = tok[u] - beg[u]
        slot[u] = BT[req[u], p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    for u in T.unroll(UNROLL):
        for hh in T.unroll(2):
            for i in T.vectorized(LVEC):
                lat[(u * 2 + hh) * LVEC + i] = C8[slot[u], hh * HALF + lane * LVEC + i]
            scl[u * 2 + hh] = CF[slot[u], SCALE_WORD + hh * 2 + lane // 16]
        rope[u] = CW[slot[u], ROPE_WORD + lane]

    for u in T.unroll(UNROLL):
        if t0 + u < total:
            for hh in T.unroll(2):
                for i in T.unroll(LVEC):
                    xi[0] = T.cast(lat[(u * 2 + hh) * LVEC + i], "int32")
                    mag[0] = T.Select((xi[0] & 0x78) == 0,
                                      T.cast(xi[0] & 7, "float32") * T.float32(0.001953125),
                                      T.reinterpret("float32", ((xi[0] & 0x7F) << 20) + (120 << 23)))
                    mag[0] = T.Select(xi[0] >= 128, mag[0] * T.float32(-1.0), mag[0])
                    res[i] = T.cast(mag[0] * scl[u * 2 + hh], "bfloat16")
                for i in T.vectorized(LVEC):
                    O[t0 + u, hh * HALF + lane * LVEC + i] = res[i]
            OW[t0 + u, NOPE_DIM // 2 + lane] = rope[u]


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ goes through jit() on every call; caching the jitted module the way
    # jit() itself does for exported modules keeps the call path short.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else
        pass
    return exe


def _compiled():
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": gather_upconvert}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    assert cache.dtype == torch.uint8 and cache.shape[1:] == (BLOCK_SIZE, ENTRY_BYTES) and cache.is_contiguous()
    exe = _compiled()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    lens = lens.contiguous()
    total = int(lens.sum())                       # output size (the reference syncs the same way)
    out = torch.empty((total, OUT_DIM), dtype=torch.bfloat16, device=cache.device)
    if total > 0:
        flat = cache.view(-1, ENTRY_BYTES)
        bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        exe(flat, flat.view(torch.float32), flat.view(torch.int32), bt.contiguous(), lens, out,
            out.view(torch.int32))
    return out
