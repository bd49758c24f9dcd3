# MLA query up-projection (q_c @ q_b_weight^T) with the GPT-J rotary of q_pe fused into the GEMM epilogue,
# plus the paged write of kv_c and the rotated k_pe into the MLA cache: ONE TIRx kernel (one launch).
#
# Same decomposition as the CuTe DSL solution (CTA tile = 128 tokens x one whole head of 192 columns, grid
# ceil(T/128) x 16 heads = 512 CTAs at full size; rotary applied to the fp32 accumulator in registers,
# because every thread holds adjacent column pairs (2c, 2c+1) of one row, i.e. a GPT-J pair; one rounding
# to bf16), with two differences and why:
# - Tensor cores: warp-level mma.sync m16n8k16 (bf16 in, fp32 accumulation) fed by ldmatrix from padded
#   shared rows and a 4-stage cp.async ring (K steps of 32), instead of warpgroup MMA fed by TMA. This is
#   the GEMM path the TIRx solutions of this repo use (and the one the CPU emulator can check). LIKELY
#   SLOWER than the CuTe solution (67 us device): the mma.sync GEMM of problem 27 measured about 27% of
#   the bf16 peak on the H200, which here would be ~100-150 us; still ~10x faster than eager (1.76 ms)
#   and torch.compile (5.8 ms) of the reference.
# - The cache write is folded into the same launch instead of a second kernel: the 128 tokens of a token
#   block are split over its 16 head CTAs, 8 tokens per CTA, one per warp; each warp copies its token's
#   kv_c (1024 B, 32 B per lane) and lanes 0..7 rotate 8 k_pe values each (fp32 math, one rounding). It
#   runs after the pipeline prologue has issued its loads, so it overlaps the first stages' latency.
#
# GEMM: 8 warps as 2 (M, 64 rows) x 4 (N, 48 columns); per warp 4 x 6 m16n8k16 tiles (96 fp32
# accumulators per thread). Shared memory 4 stages x (128 + 192) rows x 40 bf16 (rows padded from 32 to 40
# so the 8x8 matrix loads are conflict-free) = 100 KiB; launch bounds ask for 2 CTAs per SM (ptxas: 125
# registers, no spills; 158 without the bound), so the 512 CTAs are 1.9 waves of 264. A is read straight
# out of qkv_lora (row stride 2112, columns 0..1535); rows past T are clamped on load, masked on store.
# Epilogue: each thread owns 8 rows (4 m-tiles x 2 halves) and 6 column pairs; positions of its rows are
# loaded once; column pairs with tile column >= 128 (warp-uniform per n-tile) take cos/sin of pair
# (col - 128) / 2 from the bf16 table at the row's position and are rotated in fp32; bf16x2 stores.
# Padding tokens (slot -1) still get their q row, and write nothing to the cache.
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator (scripts/cuda_emu)
# at smoke size and at a custom size with several token blocks and a tail; H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches it on torch's current
# stream. Only the compiled module is cached (symbolic token count, table rows, cache rows).

import torch
import tvm
from tvm.script import tirx as T

HEADS = 16
Q_LORA_RANK = 1536
KV_LORA_RANK = 512
NOPE_DIM = 128
ROPE_DIM = 64
HALF = ROPE_DIM // 2
QK_HEAD_DIM = NOPE_DIM + ROPE_DIM            # 192
ROW = Q_LORA_RANK + KV_LORA_RANK + ROPE_DIM  # 2112
QW = HEADS * QK_HEAD_DIM                     # 3072
BLOCK_SIZE = 64
ENTRY = KV_LORA_RANK + ROPE_DIM              # 576

THREADS = 256
WARPS = THREADS // 32
BM = 128
BN = QK_HEAD_DIM
BK = 32
LDS = BK + 8
STAGES = 4
A_ST = BM * LDS
B_ST = BN * LDS
STAGE = A_ST + B_ST
POOL = STAGES * STAGE
MT = 4                                       # m16 tiles per warp (64 rows)
NT = 6                                       # n8 tiles per warp (48 columns)
WN = NT * 8
NK = Q_LORA_RANK // BK                       # 48
A_CH = BM * BK // 8 // THREADS               # 16-byte chunks per thread per stage: 2
B_CH = BN * BK // 8 // THREADS               # 3
TOK_PER_CTA = BM // HEADS                    # 8 cache tokens per CTA = one per warp
assert TOK_PER_CTA == WARPS and Q_LORA_RANK % BK == 0


@T.prim_func
def mla_q_rope_cache(x_handle: T.handle, w_handle: T.handle, pos_handle: T.handle, cs_handle: T.handle,
                     slot_handle: T.handle, kv_handle: T.handle, q_handle: T.handle):
    n = T.int32()
    npos = T.int32()
    nrows = T.int32()
    X = T.match_buffer(x_handle, (n, ROW), "bfloat16", align=16)
    W = T.match_buffer(w_handle, (QW, Q_LORA_RANK), "bfloat16", align=16)
    POS = T.match_buffer(pos_handle, (n,), "int64")
    CS = T.match_buffer(cs_handle, (npos, ROPE_DIM), "bfloat16", align=16)
    SLOT = T.match_buffer(slot_handle, (n,), "int64")
    KV = T.match_buffer(kv_handle, (nrows, ENTRY), "bfloat16", align=16)
    Q = T.match_buffer(q_handle, (n, QW), "bfloat16", align=4)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
    bx, by = T.cta_id([T.ceildiv(n, BM), HEADS])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
    acc = T.alloc_local((MT * NT * 4,), "float32")
    af = T.alloc_local((MT * 4,), "uint32")
    bfr = T.alloc_local((NT * 2,), "uint32")
    arow = T.alloc_local((A_CH,), "int32")
    posr = T.alloc_local((MT * 2,), "int32")
    cb = T.alloc_local((1,), "bfloat16")
    sb = T.alloc_local((1,), "bfloat16")
    ov = T.alloc_local((2,), "bfloat16")
    kvb = T.alloc_local((8,), "bfloat16")
    kr = T.alloc_local((8,), "bfloat16")
    kc = T.alloc_local((4,), "bfloat16")
    ks = T.alloc_local((4,), "bfloat16")
    ko = T.alloc_local((8,), "bfloat16")

    wm: T.let[T.int32] = warp % 2
    wn: T.let[T.int32] = warp // 2
    lr: T.let[T.int32] = lane % 8
    lj: T.let[T.int32] = lane // 8
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4

    for u in T.unroll(A_CH):
        arow[u] = T.min(bx * BM + (u * THREADS + tid) // 4, n - 1)
    for i in T.unroll(MT * NT * 4):
        acc[i] = T.float32(0.0)

    # ---- pipeline prologue: stages 0 .. STAGES-2 ----
    for s in T.unroll(STAGES - 1):
        for u in T.unroll(A_CH):
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                T.address_of(X[arow[u], s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
        for u in T.unroll(B_CH):
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                T.address_of(W[by * BN + (u * THREADS + tid) // 4, s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
        T.ptx.cp.async_.commit_group()

    # ---- cache write of this CTA's 8 tokens (one per warp), while the prologue loads fly ----
    tok: T.let[T.int32] = bx * BM + by * TOK_PER_CTA + warp
    if tok < n:
        slot: T.let[T.int32] = T.cast(SLOT[tok], "int32")
        if slot >= 0:
            for hh in T.unroll(2):
                for i in T.vectorized(8):
                    kvb[i] = X[tok, Q_LORA_RANK + (2 * lane + hh) * 8 + i]
                for i in T.vectorized(8):
                    KV[slot, (2 * lane + hh) * 8 + i] = kvb[i]
            if lane < ROPE_DIM // 8:
                p: T.let[T.int32] = T.cast(POS[tok], "int32")
                for i in T.vectorized(8):
                    kr[i] = X[tok, Q_LORA_RANK + KV_LORA_RANK + lane * 8 + i]
                for i in T.vectorized(4):
                    kc[i] = CS[p, lane * 4 + i]
                for i in T.vectorized(4):
                    ks[i] = CS[p, HALF + lane * 4 + i]
                for j in T.unroll(4):
                    ko[2 * j] = T.cast(T.cast(kr[2 * j], "float32") * T.cast(kc[j], "float32")
                                       - T.cast(kr[2 * j + 1], "float32") * T.cast(ks[j], "float32"), "bfloat16")
                    ko[2 * j + 1] = T.cast(T.cast(kr[2 * j + 1], "float32") * T.cast(kc[j], "float32")
                                           + T.cast(kr[2 * j], "float32") * T.cast(ks[j], "float32"), "bfloat16")
                for i in T.vectorized(8):
                    KV[slot, KV_LORA_RANK + lane * 8 + i] = ko[i]

    # ---- main loop ----
    for kt in range(NK):
        T.ptx.cp.async_.wait_group(STAGES - 2)
        T.cuda.cta_sync()
        nxt: T.let[T.int32] = kt + STAGES - 1
        if nxt < NK:
            for u in T.unroll(A_CH):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                    T.address_of(X[arow[u], nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
            for u in T.unroll(B_CH):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                    T.address_of(W[by * BN + (u * THREADS + tid) // 4, nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
        T.ptx.cp.async_.commit_group()

        buf: T.let[T.int32] = (kt % STAGES) * STAGE
        for kk in T.unroll(BK // 16):
            for i in T.unroll(MT):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                    T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * LDS + kk * 16 + 8 * (lj // 2)]))
            for pq in T.unroll(NT // 2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                    T.address_of(pool[buf + A_ST + (wn * WN + pq * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
            for i in T.unroll(MT):
                for nn in T.unroll(NT):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        acc[(i * NT + nn) * 4 + 0], acc[(i * NT + nn) * 4 + 1], acc[(i * NT + nn) * 4 + 2], acc[(i * NT + nn) * 4 + 3],
                        af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                        bfr[nn * 2 + 0], bfr[nn * 2 + 1],
                        acc[(i * NT + nn) * 4 + 0], acc[(i * NT + nn) * 4 + 1], acc[(i * NT + nn) * 4 + 2], acc[(i * NT + nn) * 4 + 3])
    T.ptx.cp.async_.wait_group(0)

    # ---- epilogue: GPT-J rotary on tile columns 128..191, bf16 rounding, bf16x2 stores ----
    # thread's accumulator (i, nn, h, e): row wm*64 + i*16 + g + 8h, tile column wn*48 + nn*8 + 2*tq + e
    for i in T.unroll(MT):
        for h in T.unroll(2):
            posr[i * 2 + h] = T.cast(POS[T.min(bx * BM + wm * 64 + i * 16 + g + 8 * h, n - 1)], "int32")
    for nn in T.unroll(NT):
        ct: T.let[T.int32] = wn * WN + nn * 8 + 2 * tq
        for i in T.unroll(MT):
            for h in T.unroll(2):
                r: T.let[T.int32] = bx * BM + wm * 64 + i * 16 + g + 8 * h
                if r < n:
                    if wn * WN + nn * 8 >= NOPE_DIM:
                        cb[0] = CS[posr[i * 2 + h], (ct - NOPE_DIM) // 2]
                        sb[0] = CS[posr[i * 2 + h], HALF + (ct - NOPE_DIM) // 2]
                        ov[0] = T.cast(acc[(i * NT + nn) * 4 + h * 2] * T.cast(cb[0], "float32")
                                       - acc[(i * NT + nn) * 4 + h * 2 + 1] * T.cast(sb[0], "float32"), "bfloat16")
                        ov[1] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + 1] * T.cast(cb[0], "float32")
                                       + acc[(i * NT + nn) * 4 + h * 2] * T.cast(sb[0], "float32"), "bfloat16")
                    else:
                        ov[0] = T.cast(acc[(i * NT + nn) * 4 + h * 2], "bfloat16")
                        ov[1] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + 1], "bfloat16")
                    for e in T.vectorized(2):
                        Q[r, by * BN + ct + e] = ov[e]


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
        exe = tvm.compile(tvm.IRModule({"main": mla_q_rope_cache}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(qkv_lora, q_b_weight, positions, cos_sin_cache, slot_mapping, kv_cache):
    ntok = qkv_lora.shape[0]
    assert qkv_lora.shape[1] == ROW and qkv_lora.is_contiguous() and kv_cache.is_contiguous()
    exe = _compiled()
    q = torch.empty((ntok, HEADS, QK_HEAD_DIM), dtype=qkv_lora.dtype, device=qkv_lora.device)
    if ntok > 0:
        pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        exe(qkv_lora, q_b_weight.contiguous(), pos.contiguous(), cos_sin_cache.contiguous(), slots.contiguous(),
            kv_cache.view(-1, ENTRY), q.view(ntok, QW))
    return q, kv_cache
