# Qwen3-Coder-480B MoE router (160 experts, top-8, renormalized) with capacity-factor slot assignment,
# token dropping and the dispatched [160, C, 6144] bf16 buffer: three TIRx kernels.
#
# Kernel 1 (router): grid ceil(T / 64) CTAs of 256 threads (8 warps), 126 KiB of dynamic shared memory.
# - logits[64 tokens, 160 experts] = x @ W^T on the tensor cores: mma.sync m16n8k16 bf16 -> fp32.
#   Warp (wm, wn) = (w % 2, w // 2) owns tokens 32wm..+31 x experts 40wn..+39 (2 x 5 mma tiles).
#   K is streamed in 64-wide stages through a 4-stage cp.async pipeline (16-byte cp.async.cg; rows
#   padded to 72 bf16 so the ldmatrix row reads are bank-conflict free); fragments via ldmatrix.x4/.x2.
# - fp32 accuracy: the tensor-core chain accumulates only 16 mma steps (K = 256), then is added to a
#   separate fp32 accumulator with ordinary IEEE adds (two-level summation): on this data the logits
#   are as accurate as a blocked fp32 SGEMM (~1e-6), well inside the margin the inputs guarantee
#   (8th/9th logit gap >= 1e-3) and below the error of a sequential fp32 accumulation.
# - The logits go to shared memory; each warp then handles 8 tokens: 8 rounds of a warp arg-max
#   (5 values per lane, xor-shuffle butterfly on (value, index)) pick the top 8; the 8 ids are ranked
#   to ascending order; weights = exp(l_k - l_max) / sum, with an accurate exp (Cody-Waite reduction +
#   degree-7 polynomial; TVM builds with --use_fast_math, whose __expf is ~2 ulp plus argument
#   rounding) and a div.rn.
# - Per-CTA slot bookkeeping: a [64 x 160] table of chosen (token, expert) pairs in shared memory;
#   thread e < 160 walks the CTA's tokens in order and gives every pair its rank among this CTA's
#   tokens for expert e; the CTA's per-expert counts go to cnt[cta, e].
# Kernel 2 (slots): one CTA per 64-token block: base[e] = sum of cnt over earlier blocks (thread e),
#   slot = base + rank, kept = slot < C; writes slots / combine weights (0 when dropped); block 0 also
#   writes n_e = min(total count of e, C), the number of filled slots of expert e.
# Kernel 3 (dispatch): grid T + 160 * ceil(C / 64) CTAs of 256 threads. Token CTA t reads x[t] once
#   (three 16-byte loads per thread) and stores it to dispatched[e, slot] for each kept pair; filler
#   CTA (e, chunk) writes zeros to the slots >= n_e of its 64-slot chunk. Every dispatched row is
#   written exactly once (slots 0..n_e-1 of an expert are exactly its kept pairs).
#
# Limits: the 1.007 GB dispatched buffer write dominates (floor ~230 us at 4.8 TB/s with the x read);
# kernel 1 is tensor-core / shared-memory bound at ~30-45 us (128 CTAs, 16 GFLOP on mma.sync, which
# reaches roughly half of the wgmma peak). Expected ~270-300 us in all. Eager PyTorch runs an fp32
# cuBLAS SGEMM (~0.3 ms without TF32), a cumsum over [T, 160] and an index_put of 1 GB with gathers:
# expected ~2x faster than eager.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on
# torch's current stream. Cached: compiled modules; small per-call workspaces (counts, ranks) are
# allocated per call with torch.empty.

import math

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 160
TOP_K = 8
CAPACITY_FACTOR = 1.25
THREADS = 256
BM = 64                        # tokens per router CTA
BK = 64                        # K per pipeline stage
LDS = BK + 8                   # padded smem row (bf16): 144 B, conflict-free ldmatrix
STAGES = 4
A_STAGE = BM * LDS             # bf16 elements per stage
B_STAGE = NUM_EXPERTS * LDS
STAGE = A_STAGE + B_STAGE
POOL = STAGES * STAGE          # bf16 elements of dynamic shared memory (126 KiB)
FLUSH = 4                      # stages per tensor-core accumulation chain (4 x 64 = K 256)
NT = 5                         # n tiles (8 experts) per warp
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125     # 12 trailing zero bits: n * LN2_HI is exact
LN2_LO = 1.4286068203094172e-06
ROW_VEC = 8                    # bf16 per 16-byte access in the dispatch
ZROWS = 64                     # slots per filler CTA


def capacity(tokens: int) -> int:
    return math.ceil(CAPACITY_FACTOR * tokens * TOP_K / NUM_EXPERTS)


@T.prim_func
def router_topk(x_handle: T.handle, w_handle: T.handle, ids_handle: T.handle, wt_handle: T.handle,
                rank_handle: T.handle, cnt_handle: T.handle):
    n_tok = T.int32()
    hidden = T.int32()
    n_blk = T.int32()
    X = T.match_buffer(x_handle, (n_tok, hidden), "bfloat16", align=16)
    W = T.match_buffer(w_handle, (NUM_EXPERTS, hidden), "bfloat16", align=16)
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    WT = T.match_buffer(wt_handle, (n_tok, TOP_K), "float32")
    RANK = T.match_buffer(rank_handle, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")

    T.device_entry()
    cta = T.cta_id([n_blk])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
    LG = T.decl_buffer((BM, NUM_EXPERTS), "float32", data=pool.data, scope="shared.dyn")
    SEL = T.decl_buffer((BM, NUM_EXPERTS), "int32", data=pool.data, elem_offset=BM * NUM_EXPERTS,
                        scope="shared.dyn")

    acc = T.alloc_local((2 * NT * 4,), "float32")
    outer = T.alloc_local((2 * NT * 4,), "float32")
    af = T.alloc_local((2 * 4,), "uint32")
    bfr = T.alloc_local((NT * 2,), "uint32")
    cand = T.alloc_local((5,), "float32")
    bv = T.alloc_local((1,), "float32")
    bi = T.alloc_local((1,), "int32")
    ov = T.alloc_local((1,), "float32")
    oi = T.alloc_local((1,), "int32")
    sv = T.alloc_local((TOP_K,), "float32")
    si = T.alloc_local((TOP_K,), "int32")
    ex = T.alloc_local((TOP_K,), "float32")
    xr = T.alloc_local((4,), "float32")
    cnt = T.alloc_local((1,), "int32")

    wm: T.let[T.int32] = warp % 2
    wn: T.let[T.int32] = warp // 2
    t0: T.let[T.int32] = cta * BM
    nk: T.let[T.int32] = hidden // BK
    lr: T.let[T.int32] = lane % 8          # ldmatrix: row within the 8x8 matrix this lane addresses
    lj: T.let[T.int32] = lane // 8         # ldmatrix: which of the 4 matrices
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4

    for i in T.unroll(2 * NT * 4):
        acc[i] = T.float32(0.0)
        outer[i] = T.float32(0.0)

    # ---- prologue: stages 0 .. STAGES-2 ----
    for s in T.unroll(STAGES - 1):
        if s < nk:
            for u in T.unroll(2):                     # A: 64 rows x 8 chunks = 512 = 2 per thread
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(X[T.min(t0 + (u * THREADS + tid) // 8, n_tok - 1), s * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
            for u in T.unroll(5):                     # B: 160 rows x 8 chunks = 1280 = 5 per thread
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[s * STAGE + A_STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(W[(u * THREADS + tid) // 8, s * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
        T.ptx.cp.async_.commit_group()

    # ---- main loop ----
    for kt in range(nk):
        T.ptx.cp.async_.wait_group(STAGES - 2)
        T.cuda.cta_sync()
        nxt: T.let[T.int32] = kt + STAGES - 1
        if nxt < nk:
            for u in T.unroll(2):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(X[T.min(t0 + (u * THREADS + tid) // 8, n_tok - 1), nxt * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
            for u in T.unroll(5):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[(nxt % STAGES) * STAGE + A_STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(W[(u * THREADS + tid) // 8, nxt * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
        T.ptx.cp.async_.commit_group()

        buf: T.let[T.int32] = (kt % STAGES) * STAGE
        for kk in T.unroll(BK // 16):
            for i in T.unroll(2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                    T.address_of(pool[buf + (wm * 32 + i * 16 + lr + 8 * (lj % 2)) * LDS + kk * 16 + 8 * (lj // 2)]))
            for p in T.unroll(2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bfr[p * 4 + 0], bfr[p * 4 + 1], bfr[p * 4 + 2], bfr[p * 4 + 3],
                    T.address_of(pool[buf + A_STAGE + (wn * 40 + p * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
            T.ptx.ldmatrix.sync.aligned.m8n8.x2.shared.b16(
                bfr[8], bfr[9],
                T.address_of(pool[buf + A_STAGE + (wn * 40 + 32 + lr) * LDS + kk * 16 + 8 * (lj % 2)]))
            for i in T.unroll(2):
                for n in T.unroll(NT):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        acc[(i * NT + n) * 4 + 0], acc[(i * NT + n) * 4 + 1], acc[(i * NT + n) * 4 + 2], acc[(i * NT + n) * 4 + 3],
                        af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                        bfr[n * 2 + 0], bfr[n * 2 + 1],
                        acc[(i * NT + n) * 4 + 0], acc[(i * NT + n) * 4 + 1], acc[(i * NT + n) * 4 + 2], acc[(i * NT + n) * 4 + 3])
        if kt % FLUSH == FLUSH - 1:
            for i in T.unroll(2 * NT * 4):
                outer[i] = outer[i] + acc[i]
                acc[i] = T.float32(0.0)

    for i in T.unroll(2 * NT * 4):
        outer[i] = outer[i] + acc[i]
    T.ptx.cp.async_.wait_group(0)
    T.cuda.cta_sync()

    # ---- logits to shared memory (aliasing the drained pipeline buffers) ----
    for i in T.unroll(2):
        for n in T.unroll(NT):
            for h in T.unroll(2):
                for e in T.unroll(2):
                    LG[wm * 32 + i * 16 + g + 8 * h, wn * 40 + n * 8 + 2 * tq + e] = outer[(i * NT + n) * 4 + h * 2 + e]
    for u in T.unroll(BM * NUM_EXPERTS // THREADS):
        SEL[(u * THREADS + tid) // NUM_EXPERTS, (u * THREADS + tid) % NUM_EXPERTS] = 0
    T.cuda.cta_sync()

    # ---- top-8 per token: warp w handles local tokens 8w .. 8w+7 ----
    for q in range(8):
        tl: T.let[T.int32] = warp * 8 + q
        if t0 + tl < n_tok:
            for c in T.unroll(5):
                cand[c] = LG[tl, c * 32 + lane]
            for k in T.unroll(TOP_K):
                bv[0] = cand[0]
                bi[0] = lane
                for c in T.unroll(4):
                    if cand[c + 1] > bv[0]:
                        bv[0] = cand[c + 1]
                        bi[0] = (c + 1) * 32 + lane
                for s in T.unroll(5):
                    ov[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[0], 16 >> s, 32, 32)
                    oi[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bi[0], 16 >> s, 32, 32)
                    if ov[0] > bv[0] or (ov[0] == bv[0] and oi[0] < bi[0]):
                        bv[0] = ov[0]
                        bi[0] = oi[0]
                sv[k] = bv[0]
                si[k] = bi[0]
                if bi[0] % 32 == lane:
                    for c in T.unroll(5):
                        if c == bi[0] // 32:
                            cand[c] = T.float32(-3.0e38)
            # weights: exp(l_k - l_max) with an accurate exp, normalized with div.rn
            for k in T.unroll(TOP_K):
                xr[0] = T.max(sv[k] - sv[0], T.float32(-87.0))
                xr[1] = T.floor(xr[0] * T.float32(LOG2E) + T.float32(0.5))
                xr[2] = (xr[0] - xr[1] * T.float32(LN2_HI)) - xr[1] * T.float32(LN2_LO)
                xr[3] = T.float32(1.0 / 5040.0)
                xr[3] = xr[3] * xr[2] + T.float32(1.0 / 720.0)
                xr[3] = xr[3] * xr[2] + T.float32(1.0 / 120.0)
                xr[3] = xr[3] * xr[2] + T.float32(1.0 / 24.0)
                xr[3] = xr[3] * xr[2] + T.float32(1.0 / 6.0)
                xr[3] = xr[3] * xr[2] + T.float32(0.5)
                xr[3] = xr[3] * xr[2] + T.float32(1.0)
                xr[3] = xr[3] * xr[2] + T.float32(1.0)
                ex[k] = xr[3] * T.reinterpret("float32", T.shift_left(T.cast(xr[1], "int32") + 127, 23))
            xr[0] = ex[0]
            for k in T.unroll(TOP_K - 1):
                xr[0] = xr[0] + ex[k + 1]
            # lane k < 8 writes pair k at its rank among the 8 ids (ascending expert id)
            for k in T.unroll(TOP_K):
                if lane == k:
                    cnt[0] = 0
                    for j in T.unroll(TOP_K):
                        if si[j] < si[k]:
                            cnt[0] = cnt[0] + 1
                    IDS[t0 + tl, cnt[0]] = si[k]
                    T.ptx.div.rn.f32(xr[1], ex[k], xr[0])
                    WT[t0 + tl, cnt[0]] = xr[1]
                    SEL[tl, si[k]] = cnt[0] + 1
    T.cuda.cta_sync()

    # ---- rank of every chosen pair among this CTA's tokens, per expert ----
    if tid < NUM_EXPERTS:
        cnt[0] = 0
        for tl2 in range(BM):
            if SEL[tl2, tid] > 0:
                RANK[t0 + tl2, SEL[tl2, tid] - 1] = cnt[0]
                cnt[0] = cnt[0] + 1
        CNT[cta, tid] = cnt[0]


@T.prim_func
def assign_slots(ids_handle: T.handle, rank_handle: T.handle, cnt_handle: T.handle, wt_handle: T.handle,
                 slot_handle: T.handle, fill_handle: T.handle, cap: T.int32):
    n_tok = T.int32()
    n_blk = T.int32()
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    RANK = T.match_buffer(rank_handle, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")
    WT = T.match_buffer(wt_handle, (n_tok, TOP_K), "float32")
    SLOT = T.match_buffer(slot_handle, (n_tok, TOP_K), "int32")
    FILL = T.match_buffer(fill_handle, (NUM_EXPERTS,), "int32")

    T.device_entry()
    cta = T.cta_id([n_blk])
    tid = T.thread_id([THREADS])
    base = T.alloc_shared((NUM_EXPERTS,), "int32")
    acc = T.alloc_local((1,), "int32")

    if tid < NUM_EXPERTS:
        acc[0] = 0
        for c in range(cta):
            acc[0] = acc[0] + CNT[c, tid]
        base[tid] = acc[0]
        if cta == 0:
            for c in range(n_blk):
                acc[0] = acc[0] + CNT[c, tid]
            FILL[tid] = T.min(acc[0], cap)
    T.cuda.cta_sync()
    for u in T.unroll(BM * TOP_K // THREADS):
        t: T.let[T.int32] = cta * BM + (u * THREADS + tid) // TOP_K
        k: T.let[T.int32] = (u * THREADS + tid) % TOP_K
        if t < n_tok:
            s: T.let[T.int32] = base[IDS[t, k]] + RANK[t, k]
            if s < cap:
                SLOT[t, k] = s
            else:
                SLOT[t, k] = -1
                WT[t, k] = T.float32(0.0)


@T.prim_func
def dispatch_rows(x_handle: T.handle, ids_handle: T.handle, slot_handle: T.handle, fill_handle: T.handle,
                  d_handle: T.handle):
    n_tok = T.int32()
    nv = T.int32()                                            # 16-byte chunks per row (768)
    cap = T.int32()
    X = T.match_buffer(x_handle, (n_tok, nv, ROW_VEC), "bfloat16", align=16)
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    SLOT = T.match_buffer(slot_handle, (n_tok, TOP_K), "int32")
    FILL = T.match_buffer(fill_handle, (NUM_EXPERTS,), "int32")
    D = T.match_buffer(d_handle, (NUM_EXPERTS, cap, nv, ROW_VEC), "bfloat16", align=16)

    T.device_entry()
    b = T.cta_id([n_tok + NUM_EXPERTS * T.ceildiv(cap, ZROWS)])
    tid = T.thread_id([THREADS])
    row = T.alloc_local((4 * ROW_VEC,), "bfloat16")
    zero = T.alloc_local((ROW_VEC,), "bfloat16")

    if b < n_tok:
        for c in T.unroll(4):
            if c * THREADS + tid < nv:
                for i in T.vectorized(ROW_VEC):
                    row[c * ROW_VEC + i] = X[b, c * THREADS + tid, i]
        for k in range(TOP_K):
            s: T.let[T.int32] = SLOT[b, k]
            if s >= 0:
                for c in T.unroll(4):
                    if c * THREADS + tid < nv:
                        for i in T.vectorized(ROW_VEC):
                            D[IDS[b, k], s, c * THREADS + tid, i] = row[c * ROW_VEC + i]
    else:
        e: T.let[T.int32] = (b - n_tok) // T.ceildiv(cap, ZROWS)
        s0: T.let[T.int32] = ((b - n_tok) % T.ceildiv(cap, ZROWS)) * ZROWS
        for i in T.unroll(ROW_VEC):
            zero[i] = T.bfloat16(0.0)
        for r in range(ZROWS):
            if s0 + r < cap and s0 + r >= FILL[e]:
                for c in range(T.ceildiv(nv, THREADS)):
                    if c * THREADS + tid < nv:
                        for i in T.vectorized(ROW_VEC):
                            D[e, s0 + r, c * THREADS + tid, i] = zero[i]


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
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (router_topk, assign_slots, dispatch_rows))
        _CACHE["exes"] = exes
    return exes


def solve(hidden_states: torch.Tensor, router_weight: torch.Tensor):
    router, slots_k, dispatch = _compiled()
    n_tok, hidden = hidden_states.shape
    assert hidden % BK == 0 and hidden <= 4 * THREADS * ROW_VEC
    cap = capacity(n_tok)
    dev = hidden_states.device
    x = hidden_states.contiguous()
    n_blk = (n_tok + BM - 1) // BM
    ids = torch.empty((n_tok, TOP_K), dtype=torch.int32, device=dev)
    comb = torch.empty((n_tok, TOP_K), dtype=torch.float32, device=dev)
    slots = torch.empty((n_tok, TOP_K), dtype=torch.int32, device=dev)
    rank = torch.empty((n_tok, TOP_K), dtype=torch.int32, device=dev)
    cnt = torch.empty((n_blk, NUM_EXPERTS), dtype=torch.int32, device=dev)
    fill = torch.empty((NUM_EXPERTS,), dtype=torch.int32, device=dev)
    disp = torch.empty((NUM_EXPERTS, cap, hidden), dtype=hidden_states.dtype, device=dev)
    router(x, router_weight.contiguous(), ids, comb, rank, cnt)
    slots_k(ids, rank, cnt, comb, slots, fill, cap)
    dispatch(x.view(n_tok, hidden // ROW_VEC, ROW_VEC), ids, slots, fill,
             disp.view(NUM_EXPERTS, cap, hidden // ROW_VEC, ROW_VEC))
    return disp, comb, ids, slots
