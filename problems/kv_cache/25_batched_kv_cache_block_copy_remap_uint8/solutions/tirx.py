# Batched K/V cache block copy under one block remap (uint8 pages of 64 KiB), one TIRx kernel.
#
# Algorithm
# - Grid: (M, 2) CTAs of 256 threads: blockIdx.x = mapping row m, blockIdx.y = 0 for K, 1 for V.
# - Every thread of the CTA reads src = block_mapping[m, 0] and dst = block_mapping[m, 1] (int64,
#   same address for the whole CTA, one broadcast load each) and converts them to int32.
# - The CTA copies the 65536-byte block src -> dst with 16-byte vector accesses (uint8x16, uint4 in
#   the generated CUDA): thread t handles bytes it*4096 + 16t .. +15 for it = 0..15, so each warp
#   instruction moves a contiguous 512-byte segment. The 16 accesses are done in two rounds of 8:
#   8 vector loads in flight per thread (32 KiB per CTA), then the 8 stores, which keeps the
#   register count low enough for all 2*M = 512 CTAs of the full size to be resident at once.
# - The K/V choice is uniform per CTA (blockIdx.y), so the branch does not diverge.
# Pure data movement (exact); dst_k / dst_v are written in place and returned. Mapped destination
# blocks are distinct (problem statement), so CTAs never write the same bytes. Byte offsets use
# int32 (fine while blocks * 65536 < 2^31, i.e. fewer than 32768 blocks per cache).
# Expected faster than eager PyTorch (two gather + index_put pairs with temporaries).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi's call path asks torch
# (DLPack exchange API, current_work_stream) for the current CUDA stream of the first CUDA tensor
# argument and installs it as the TVM environment stream for the duration of the call
# (TVMFFIEnvSetStream); TVM's CUDA module launches with cuLaunchKernelEx on
# TVMFFIEnvGetStream(kDLCUDA, dev). So the copy is enqueued on torch's current stream and anything
# enqueued on that stream after solve() returns sees the updated caches (no sync needed).
#
# Only the compiled module is cached (symbolic block and mapping counts).
# Host path: one cached Executable called directly (see _prepare).

import torch
import tvm
from tvm.script import tirx as T

BLOCK_SIZE = 32
HEADS = 8
HEAD_DIM = 256
BLOCK_BYTES = BLOCK_SIZE * HEADS * HEAD_DIM      # 65536
THREADS = 256
VEC = 16                                         # bytes per vector access
STEP = THREADS * VEC                             # 4096 bytes per CTA-wide access
ITERS = BLOCK_BYTES // STEP                      # 16
ROUND = 8                                        # vector loads in flight per thread
ROUNDS = ITERS // ROUND                          # 2
ROW_BYTES = HEADS * HEAD_DIM                     # 2048 bytes per token slot
THREADS_PER_ROW = ROW_BYTES // VEC               # 128
THREADS_PER_HEAD = HEAD_DIM // VEC               # 16


@T.prim_func
def kv_block_copy(sk_handle: T.handle, sv_handle: T.handle, dk_handle: T.handle, dv_handle: T.handle,
                  map_handle: T.handle):
    n_src = T.int32()
    n_dst = T.int32()
    n_map = T.int32()
    SK = T.match_buffer(sk_handle, (n_src, BLOCK_SIZE, HEADS, HEAD_DIM), "uint8", align=16)
    SV = T.match_buffer(sv_handle, (n_src, BLOCK_SIZE, HEADS, HEAD_DIM), "uint8", align=16)
    DK = T.match_buffer(dk_handle, (n_dst, BLOCK_SIZE, HEADS, HEAD_DIM), "uint8", align=16)
    DV = T.match_buffer(dv_handle, (n_dst, BLOCK_SIZE, HEADS, HEAD_DIM), "uint8", align=16)
    MAP = T.match_buffer(map_handle, (n_map, 2), "int64")

    T.device_entry()
    m, kv = T.cta_id([n_map, 2])
    tid = T.thread_id([THREADS])

    buf = T.alloc_local((ROUND * VEC,), "uint8")
    src: T.let[T.int32] = T.cast(MAP[m, 0], "int32")
    dst: T.let[T.int32] = T.cast(MAP[m, 1], "int32")
    # position of this thread's 16 bytes inside a 4096-byte step: token slot (2 per step),
    # head, byte within the head
    slot: T.let[T.int32] = tid // THREADS_PER_ROW
    head: T.let[T.int32] = (tid % THREADS_PER_ROW) // THREADS_PER_HEAD
    byte: T.let[T.int32] = (tid % THREADS_PER_HEAD) * VEC

    if kv == 0:
        for r in T.unroll(ROUNDS):
            for u in T.unroll(ROUND):
                for i in T.vectorized(VEC):
                    buf[u * VEC + i] = SK[src, (r * ROUND + u) * 2 + slot, head, byte + i]
            for u in T.unroll(ROUND):
                for i in T.vectorized(VEC):
                    DK[dst, (r * ROUND + u) * 2 + slot, head, byte + i] = buf[u * VEC + i]
    else:
        for r in T.unroll(ROUNDS):
            for u in T.unroll(ROUND):
                for i in T.vectorized(VEC):
                    buf[u * VEC + i] = SV[src, (r * ROUND + u) * 2 + slot, head, byte + i]
            for u in T.unroll(ROUND):
                for i in T.vectorized(VEC):
                    DV[dst, (r * ROUND + u) * 2 + slot, head, byte + i] = buf[u * VEC + i]


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; for a module that is already runnable (llvm host + cuda
    # device code) jit() re-walks the import tree on every call (tens of us of Python). Caching the
    # result the way jit() itself does for exported modules makes the call path ~0.2 us.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled():
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": kv_block_copy}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
          block_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exe = _compiled()
    mapping = block_mapping if block_mapping.dtype == torch.int64 else block_mapping.to(torch.int64)
    mapping = mapping.contiguous()
    if mapping.shape[0] > 0:
        exe(src_k, src_v, dst_k, dst_v, mapping)   # dst_k / dst_v updated in place
    return dst_k, dst_v
