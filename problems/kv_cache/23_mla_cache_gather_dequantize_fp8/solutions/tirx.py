# Gather the paged FP8 MLA cache entries (576 = 512 latent + 64 rope values, block size 64) of several
# requests into one contiguous bf16 buffer, dequantized with a per-tensor scale; one TIRx kernel.
#
# Algorithm
# - Grid: ceil(total / 64) CTAs of 256 threads; CTA c produces output rows 64c .. 64c+63.
# - Phase 1 (threads 0..63, one output row each): find the row's request by walking seq_lens (a loop
#   over the requests with a running start), then src_row = block_table[r, p // 64] * 64 + p % 64;
#   the 64 source rows go to shared memory; one __syncthreads.
# - Phase 2: the CTA's 64 rows x 36 chunks of 16 fp8 values = 2304 chunks, 9 per thread
#   (chunk k*256 + tid -> row, column), all 9 16-byte loads issued before any conversion: consecutive
#   threads read consecutive 16-byte pieces of one 576-byte source row. Each fp8 value is converted
#   exactly to fp32 (cvt via __nv_fp8_e4m3 -> float), multiplied by the fp32 scale (one IEEE
#   multiply, as the reference) and rounded to bf16 (RNE); two 16-byte stores per chunk.
# Bit-exact with the reference (fp8 -> fp32 is exact, one fp32 multiply, one RNE rounding).
#
# Host: the output row count is sum(seq_lens), a device value: solve copies the (tiny) seq_lens to the
# host to size the output, the one synchronization this contract needs (the eager reference does the
# same, plus repeat_interleave / gathers with several more kernels).
#
# Limits: DRAM streaming: read 37.7 MB of fp8, write 75.5 MB of bf16 (floor ~24 us at 4.8 TB/s);
# expected ~28-32 us of device time. End to end the seq_lens copy (~10-20 us of host/driver time)
# is of the same order as the kernel.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches on torch's current
# stream. Only the compiled module is cached (symbolic sizes); the output is allocated per call.

import torch
import tvm
from tvm.script import tirx as T

ENTRY = 576
BLOCK_SIZE = 64
THREADS = 256
VEC = 16                                   # fp8 values per 16-byte load
CHUNKS = ENTRY // VEC                      # 36 chunks per row
ROWS = 64                                  # output rows per CTA
PER_THREAD = ROWS * CHUNKS // THREADS      # 9 chunks per thread
HALF = VEC // 2                            # bf16 per 16-byte store


@T.prim_func
def gather_dequant(src_handle: T.handle, bt_handle: T.handle, lens_handle: T.handle, scale_handle: T.handle,
                   out_handle: T.handle):
    n_src = T.int32()
    n_req = T.int32()
    width = T.int32()
    total = T.int32()
    SRC = T.match_buffer(src_handle, (n_src, ENTRY), "float8_e4m3fn", align=16)
    BT = T.match_buffer(bt_handle, (n_req, width), "int32")
    LENS = T.match_buffer(lens_handle, (n_req,), "int32")
    SCALE = T.match_buffer(scale_handle, (1,), "float32")
    OUT = T.match_buffer(out_handle, (total, ENTRY), "bfloat16", align=16)

    T.device_entry()
    cta = T.cta_id([T.ceildiv(total, ROWS)])
    tid = T.thread_id([THREADS])

    src_rows = T.alloc_shared((ROWS,), "int32")
    acc = T.alloc_local((1,), "int32")
    found = T.alloc_local((1,), "int32")
    raw = T.alloc_local((PER_THREAD * VEC,), "float8_e4m3fn")
    ob = T.alloc_local((VEC,), "bfloat16")
    sc = T.alloc_local((1,), "float32")

    if tid < ROWS:
        row: T.let[T.int32] = cta * ROWS + tid
        acc[0] = 0
        found[0] = 0
        for r in range(n_req):
            if row >= acc[0] and row < acc[0] + LENS[r]:
                found[0] = BT[r, (row - acc[0]) // BLOCK_SIZE] * BLOCK_SIZE + (row - acc[0]) % BLOCK_SIZE
            acc[0] = acc[0] + LENS[r]
        src_rows[tid] = found[0]
    sc[0] = SCALE[0]
    T.cuda.cta_sync()

    for k in T.unroll(PER_THREAD):
        if cta * ROWS + (k * THREADS + tid) // CHUNKS < total:
            for i in T.vectorized(VEC):
                raw[k * VEC + i] = SRC[src_rows[(k * THREADS + tid) // CHUNKS], ((k * THREADS + tid) % CHUNKS) * VEC + i]
    for k in T.unroll(PER_THREAD):
        if cta * ROWS + (k * THREADS + tid) // CHUNKS < total:
            for h in T.unroll(2):
                for i in T.unroll(HALF):
                    ob[h * HALF + i] = T.cast(T.cast(raw[k * VEC + h * HALF + i], "float32") * sc[0], "bfloat16")
            for h in T.unroll(2):
                for i in T.vectorized(HALF):
                    OUT[cta * ROWS + (k * THREADS + tid) // CHUNKS, ((k * THREADS + tid) % CHUNKS) * VEC + h * HALF + i] = ob[h * HALF + i]


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
        exe = tvm.compile(tvm.IRModule({"main": gather_dequant}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(src_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
          scale: torch.Tensor) -> torch.Tensor:
    exe = _compiled()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    total = int(lens.sum().item())          # output size: the one host synchronization
    out = torch.empty((total, ENTRY), dtype=torch.bfloat16, device=src_cache.device)
    if total > 0:
        bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        src = src_cache.view(src_cache.shape[0] * BLOCK_SIZE, ENTRY)
        exe(src, bt.contiguous(), lens.contiguous(), scale.to(torch.float32).contiguous(), out)
    return out
