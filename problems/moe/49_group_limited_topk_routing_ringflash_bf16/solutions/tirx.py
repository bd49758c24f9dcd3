# Ring-flash-2.0 / Ling-flash-2.0 router: fp32 logits of 256 experts, sigmoid scores + expert bias,
# group-limited top-8 (8 groups of 32, keep the 4 best by top-2 sum), renormalized and scaled weights,
# and tokens_per_expert: two TIRx kernels.
#
# Kernel 1 (router): grid ceil(T / 128) CTAs of 256 threads (8 warps), 162 KiB of dynamic shared memory.
# - logits[128 tokens, 256 experts] = x @ W^T on the tensor cores (mma.sync m16n8k16 bf16 -> fp32).
#   Warp (wm, wn) = (w % 2, w // 2) owns tokens 64wm..+63 x experts 64wn..+63 (4 x 8 mma tiles).
#   K streams in 64-wide stages through a 3-stage cp.async pipeline (16-byte cp.async.cg, smem rows
#   padded to 72 bf16 so ldmatrix is bank-conflict free); fragments with ldmatrix.x4.
#   CTA tile 128 x 256: every CTA reads the whole 2 MB router weight from L2, so the tile is as tall
#   as the register file allows (L2 -> SM traffic 134 MB of x + 256 MB of W).
# - fp32 accuracy: every mma starts from a zero accumulator (one K=16 block, products exact) and its
#   result is added to the fp32 accumulator with an IEEE add, so the tensor core's internal
#   truncation never compounds along K; measured on CPU models of this data the logits are ~3x more
#   accurate than a sequential fp32 accumulation (what a cuBLAS SGEMM thread does), far inside the
#   1e-3 routing margins.
# - Epilogue per token (logits staged in shared memory; warp w handles 16 tokens): lane l holds the
#   experts 32c + l (c = group 0..7); s = sigmoid(l) with an accurate exp (Cody-Waite + degree-7
#   polynomial) and div.rn (TVM builds with --use_fast_math); b = s + bias; per group the top-2 of b
#   via a butterfly on (max, second max); the 4 best groups by rank counting; 8 rounds of a warp
#   arg-max over the kept experts; ids ranked to ascending order; w = s / sum(s) * 2.5 (div.rn).
#   A shared-memory histogram (atomicAdd) of the CTA's choices goes to cnt[cta, :].
# Kernel 2 (count): tokens_per_expert[e] = sum over CTAs of cnt[:, e] (one CTA, thread e).
#
# Limits: compute bound on mma.sync (34 GFLOP; mma.sync reaches roughly half of the wgmma peak) plus
# the extra fp32 adds of the accuracy scheme: expected ~60-75 us for the full size (128 CTAs, one wave
# on 132 SMs). Eager PyTorch runs an fp32 SGEMM without TF32 (~0.6 ms) plus ~20 small kernels: expected
# ~8-10x faster than eager.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on
# torch's current stream. Cached: compiled modules; the per-CTA count workspace is allocated per call.

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 256
NUM_GROUPS = 8
GROUP = NUM_EXPERTS // NUM_GROUPS      # 32 = one expert per lane
TOPK_GROUPS = 4
TOP_K = 8
THREADS = 256
BM = 128
BK = 64
LDS = BK + 8                           # padded smem row (bf16)
STAGES = 3
A_STAGE = BM * LDS
B_STAGE = NUM_EXPERTS * LDS
STAGE = A_STAGE + B_STAGE
POOL = STAGES * STAGE                  # bf16 elements (162 KiB)
LDL = NUM_EXPERTS + 4                  # padded fp32 logit row in shared memory
MT = 4                                 # m tiles per warp
NT = 8                                 # n tiles per warp
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06
NEG = -3.0e38


@T.prim_func
def router_kernel(x_handle: T.handle, w_handle: T.handle, bias_handle: T.handle, wt_handle: T.handle,
                  ids_handle: T.handle, cnt_handle: T.handle, scale: T.float32):
    n_tok = T.int32()
    hidden = T.int32()
    n_blk = T.int32()
    X = T.match_buffer(x_handle, (n_tok, hidden), "bfloat16", align=16)
    W = T.match_buffer(w_handle, (NUM_EXPERTS, hidden), "bfloat16", align=16)
    BIAS = T.match_buffer(bias_handle, (NUM_EXPERTS,), "float32")
    WT = T.match_buffer(wt_handle, (n_tok, TOP_K), "float32")
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")

    T.device_entry()
    cta = T.cta_id([n_blk])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
    LG = T.decl_buffer((BM, LDL), "float32", data=pool.data, scope="shared.dyn")
    hist = T.alloc_shared((NUM_EXPERTS,), "int32")

    acc = T.alloc_local((MT * NT * 4,), "float32")
    tmp = T.alloc_local((4,), "float32")
    af = T.alloc_local((MT * 4,), "uint32")
    bfr = T.alloc_local((NT * 2,), "uint32")
    sc = T.alloc_local((NUM_GROUPS,), "float32")     # sigmoid scores of this lane's experts
    bz = T.alloc_local((NUM_GROUPS,), "float32")     # biased scores
    gs = T.alloc_local((NUM_GROUPS,), "float32")     # group scores (warp-uniform)
    m1 = T.alloc_local((1,), "float32")
    m2 = T.alloc_local((1,), "float32")
    o1 = T.alloc_local((1,), "float32")
    o2 = T.alloc_local((1,), "float32")
    bv = T.alloc_local((1,), "float32")
    bi = T.alloc_local((1,), "int32")
    ov = T.alloc_local((1,), "float32")
    oi = T.alloc_local((1,), "int32")
    si = T.alloc_local((TOP_K,), "int32")
    ss = T.alloc_local((TOP_K,), "float32")
    xr = T.alloc_local((4,), "float32")
    cnt = T.alloc_local((1,), "int32")

    wm: T.let[T.int32] = warp % 2
    wn: T.let[T.int32] = warp // 2
    t0: T.let[T.int32] = cta * BM
    nk: T.let[T.int32] = hidden // BK
    lr: T.let[T.int32] = lane % 8
    lj: T.let[T.int32] = lane // 8
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4

    for i in T.unroll(MT * NT * 4):
        acc[i] = T.float32(0.0)
    hist[tid] = 0

    for s in T.unroll(STAGES - 1):
        if s < nk:
            for u in T.unroll(4):                     # A: 128 rows x 8 chunks = 4 per thread
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(X[T.min(t0 + (u * THREADS + tid) // 8, n_tok - 1), s * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
            for u in T.unroll(8):                     # B: 256 rows x 8 chunks = 8 per thread
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[s * STAGE + A_STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(W[(u * THREADS + tid) // 8, s * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
        T.ptx.cp.async_.commit_group()

    for kt in range(nk):
        T.ptx.cp.async_.wait_group(STAGES - 2)
        T.cuda.cta_sync()
        nxt: T.let[T.int32] = kt + STAGES - 1
        if nxt < nk:
            for u in T.unroll(4):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(X[T.min(t0 + (u * THREADS + tid) // 8, n_tok - 1), nxt * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
            for u in T.unroll(8):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(pool[(nxt % STAGES) * STAGE + A_STAGE + ((u * THREADS + tid) // 8) * LDS + ((u * THREADS + tid) % 8) * 8]),
                    T.address_of(W[(u * THREADS + tid) // 8, nxt * BK + ((u * THREADS + tid) % 8) * 8]),
                    16)
        T.ptx.cp.async_.commit_group()

        buf: T.let[T.int32] = (kt % STAGES) * STAGE
        for kk in T.unroll(BK // 16):
            for i in T.unroll(MT):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                    T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * LDS + kk * 16 + 8 * (lj // 2)]))
            for p in T.unroll(NT // 2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bfr[p * 4 + 0], bfr[p * 4 + 1], bfr[p * 4 + 2], bfr[p * 4 + 3],
                    T.address_of(pool[buf + A_STAGE + (wn * 64 + p * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
            for i in T.unroll(MT):
                for n in T.unroll(NT):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        tmp[0], tmp[1], tmp[2], tmp[3],
                        af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                        bfr[n * 2 + 0], bfr[n * 2 + 1],
                        T.float32(0.0), T.float32(0.0), T.float32(0.0), T.float32(0.0))
                    for e in T.unroll(4):
                        acc[(i * NT + n) * 4 + e] = acc[(i * NT + n) * 4 + e] + tmp[e]

    T.ptx.cp.async_.wait_group(0)
    T.cuda.cta_sync()
    for i in T.unroll(MT):
        for n in T.unroll(NT):
            for h in T.unroll(2):
                for e in T.unroll(2):
                    LG[wm * 64 + i * 16 + g + 8 * h, wn * 64 + n * 8 + 2 * tq + e] = acc[(i * NT + n) * 4 + h * 2 + e]
    T.cuda.cta_sync()

    # ---- routing per token: warp w handles local tokens 16w .. 16w+15 ----
    for q in range(BM // 8):
        tl: T.let[T.int32] = warp * (BM // 8) + q
        if t0 + tl < n_tok:
            for c in T.unroll(NUM_GROUPS):
                # s = 1 / (1 + exp(-l)), accurate exp
                xr[0] = T.min(T.max(T.float32(0.0) - LG[tl, c * GROUP + lane], T.float32(-87.0)), T.float32(88.0))
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
                xr[3] = xr[3] * T.reinterpret("float32", T.shift_left(T.cast(xr[1], "int32") + 127, 23))
                T.ptx.div.rn.f32(sc[c], T.float32(1.0), T.float32(1.0) + xr[3])
                bz[c] = sc[c] + BIAS[c * GROUP + lane]
            # group scores: top-2 sum of b within each group (a group is one value index c across the warp)
            for c in T.unroll(NUM_GROUPS):
                m1[0] = bz[c]
                m2[0] = T.float32(NEG)
                for s in T.unroll(5):
                    o1[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, m1[0], 16 >> s, 32, 32)
                    o2[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, m2[0], 16 >> s, 32, 32)
                    m2[0] = T.max(T.min(m1[0], o1[0]), T.max(m2[0], o2[0]))
                    m1[0] = T.max(m1[0], o1[0])
                gs[c] = m1[0] + m2[0]
            # keep the 4 best groups: rank by counting (ties broken by the lower group id)
            for c in T.unroll(NUM_GROUPS):
                cnt[0] = 0
                for c2 in T.unroll(NUM_GROUPS):
                    if gs[c2] > gs[c] or (gs[c2] == gs[c] and c2 < c):
                        cnt[0] = cnt[0] + 1
                if cnt[0] >= TOPK_GROUPS:
                    bz[c] = T.float32(NEG)
            # top-8 biased scores inside the kept groups
            for k in T.unroll(TOP_K):
                bv[0] = bz[0]
                bi[0] = lane
                for c in T.unroll(NUM_GROUPS - 1):
                    if bz[c + 1] > bv[0]:
                        bv[0] = bz[c + 1]
                        bi[0] = (c + 1) * GROUP + lane
                for s in T.unroll(5):
                    ov[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[0], 16 >> s, 32, 32)
                    oi[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bi[0], 16 >> s, 32, 32)
                    if ov[0] > bv[0] or (ov[0] == bv[0] and oi[0] < bi[0]):
                        bv[0] = ov[0]
                        bi[0] = oi[0]
                si[k] = bi[0]
                ss[k] = T.float32(0.0)
                if bi[0] % GROUP == lane:
                    for c in T.unroll(NUM_GROUPS):
                        if c == bi[0] // GROUP:
                            bz[c] = T.float32(NEG)
                            ss[k] = sc[c]
                # broadcast the unbiased score of the chosen expert from its owner lane
                ss[k] = T.tvm_warp_shuffle(0xFFFFFFFF, ss[k], bi[0] % GROUP, 32, 32)
            xr[0] = ss[0]
            for k in T.unroll(TOP_K - 1):
                xr[0] = xr[0] + ss[k + 1]
            for k in T.unroll(TOP_K):
                if lane == k:
                    cnt[0] = 0
                    for j in T.unroll(TOP_K):
                        if si[j] < si[k]:
                            cnt[0] = cnt[0] + 1
                    IDS[t0 + tl, cnt[0]] = si[k]
                    T.ptx.div.rn.f32(xr[1], ss[k], xr[0])
                    WT[t0 + tl, cnt[0]] = xr[1] * scale
                    T.cuda.atomic_add(T.address_of(hist[si[k]]), 1)
    T.cuda.cta_sync()
    CNT[cta, tid] = hist[tid]


@T.prim_func
def count_kernel(cnt_handle: T.handle, tpe_handle: T.handle):
    n_blk = T.int32()
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")
    TPE = T.match_buffer(tpe_handle, (NUM_EXPERTS,), "int32")
    T.device_entry()
    cta = T.cta_id([1])
    tid = T.thread_id([THREADS])
    acc = T.alloc_local((1,), "int32")
    acc[0] = 0
    for c in range(n_blk):
        acc[0] = acc[0] + CNT[c, tid]
    TPE[tid] = acc[0]


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
                     for f in (router_kernel, count_kernel))
        _CACHE["exes"] = exes
    return exes


def solve(hidden_states, router_weight, expert_bias, routed_scaling_factor):
    router, count = _compiled()
    n_tok, hidden = hidden_states.shape
    assert hidden % BK == 0
    dev = hidden_states.device
    n_blk = (n_tok + BM - 1) // BM
    weights = torch.empty((n_tok, TOP_K), dtype=torch.float32, device=dev)
    ids = torch.empty((n_tok, TOP_K), dtype=torch.int32, device=dev)
    cnt = torch.empty((n_blk, NUM_EXPERTS), dtype=torch.int32, device=dev)
    tpe = torch.empty((NUM_EXPERTS,), dtype=torch.int32, device=dev)
    router(hidden_states.contiguous(), router_weight.contiguous(), expert_bias.to(torch.float32).contiguous(),
           weights, ids, cnt, float(routed_scaling_factor))
    count(cnt, tpe)
    return weights, ids, tpe
