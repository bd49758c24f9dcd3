# Qwen3-Next MoE layer (router softmax top-10 over 512 SwiGLU experts + sigmoid-gated shared expert, T = 4096,
# hidden 2048, intermediate 512) in TIRx: seven kernels. As in the CuTe DSL solution (which passed on the H200 at
# 1.20 ms device time), the shared expert is expert 512, visited by every token with weight sigmoid(x . g).
#
# K0 router: logits = x @ W_r^T on bf16 tensor cores (exact products, fp32 accumulation), stored as fp32.
# K1 top-10: one warp per token, 16 logits per lane (4-float loads), 10 rounds of warp arg-max (ties to the lower
#    id); w = softmax over the 10 chosen logits (= p[chosen] / sum p[chosen]); gate = sigmoid(x . g) in fp32; each
#    chosen (token, k) takes a slot in its expert with an atomic counter.
# K2 sched (1 CTA of 1024 threads, thread e = expert 0..512): 128-row tiles per expert, warp shuffle scan ->
#    padded row offsets (tiles never mix experts), tile -> expert table, tile count; counters reset for the next call.
# K3 place (one thread per (token, slot), 11 slots = 10 routed + the shared row): row -> token list and the
#    token's 11 rows.
# K4 up-projection (grouped GEMM): CTA = one 128-row tile x (64 gate + the matching 64 up weight rows of the
#    tile's expert); A rows gathered straight from x through the row -> token list (tail rows repeat the tile's
#    last valid row). One bf16 GEMM template for K0/K4/K5: mma.sync m16n8k16, fp32 accumulation, 128 x 128 CTA
#    tile, K in 32-wide stages through a 4-stage cp.async ring (zero-filled past the matrix edges), shared rows
#    padded to 40 bf16 (conflict-free ldmatrix), 80 KiB, 2 CTAs per SM, 8 warps of 64 x 32. Epilogue:
#    silu(gate) * up in fp32 -> bf16 intermediate.
# K5 down-projection (grouped GEMM, 128 x 128 output tiles): bf16 y rows (valid rows only).
# K6 combine: one CTA per token: out = sum_k w_k y[row_k] + gate * y[shared row] in fp32 -> bf16.
#
# Differences from the CuTe DSL kernels: (1) the gather kernel is replaced by the place kernel and gathered
# operand loads (the CuTe solution's own next step; saves ~0.2 GB of copy traffic); (2) the GEMMs run on
# warp-level mma.sync with a cp.async ring instead of warpgroup MMA fed by TMA (the TIRx GEMMs of this repo are
# built on the warp-level path), with 64 + 64 weight rows per up CTA (CuTe: 128 + 128) and 128-wide down tiles
# (CuTe: 256); (3) y is stored only for valid rows.
# Expected speed: the weight stream (3.22 GB, ~0.67 ms) bounds it; the warp-level MMA at 2 CTAs per SM should
# keep up with that rate on most tiles, so roughly the CuTe kernels' 1.2 ms, still far below eager (16.7 ms).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Workspaces (worst-case padded rows) are cached per (device, shapes); the per-expert counters
# are zero between calls (reset by the sched kernel).
#
# Registers (ptxas, sm_90a): GEMMs 122-123 under the 2-CTA bound, no spills; top-10 80; the rest <= 56.
#
# Verification: compile-checked on CPU (sm_90a); emulated on CPU (scripts/cuda_emu, mma in double precision) at
# smoke size (2 seeds, <= 0.25x of the allowance) and at T = 200, hidden 256, inter 128 (shared expert over two
# tiles with a tail, ~500 partial routed tiles, 2 column blocks per GEMM, several K stages; 0.24x); not yet run
# on the H200.

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 512
TOP_K = 10
NSLOT = TOP_K + 1               # 10 routed rows + the shared-expert row per token
THREADS = 256
BM = 128
BN = 128
BK = 32
LDS = BK + 8                    # 80-byte padded shared rows (bf16)
STAGES = 4
A_ST = BM * LDS
STAGE = A_ST + BN * LDS
POOL = STAGES * STAGE           # bf16 elements (80 KiB)
VEC = 8
K1_WARPS = 8
SCHED_THREADS = 1024
NEG = -3.0e38


def make_gemm(kind, hidden, inter):
    """'router': A = x, B = router weight (1, 512, H) -> fp32 logits. 'up': A = x gathered through LT, B = expert
    gate_up (512, 2I, H) or the shared one (2I, H) -> silu(g) * u bf16. 'down': A = intermediate rows, B = expert
    down (512, H, I) or the shared one (H, I) -> y bf16."""
    router = kind == "router"
    up = kind == "up"
    k_dim = inter if kind == "down" else hidden
    nk = (k_dim + BK - 1) // BK
    cpc = BN // 2 if up else BN                 # output columns per CTA
    n_lim = inter if up else (NUM_EXPERTS if router else hidden)    # valid output columns
    c_dtype = "float32" if router else "bfloat16"
    assert k_dim % VEC == 0

    @T.prim_func
    def gemm(a_h: T.handle, b_h: T.handle, sb_h: T.handle, lt_h: T.handle, texp_h: T.handle, poff_h: T.handle,
             pcnt_h: T.handle, meta_h: T.handle, c_h: T.handle, n_tiles: T.int32):
        n_a = T.int32()
        n_eb = T.int32()
        n_b = T.int32()
        n_lt = T.int32()
        n_te = T.int32()
        n_c = T.int32()
        n_cc = T.int32()
        A = T.match_buffer(a_h, (n_a, k_dim), "bfloat16", align=16)
        B = T.match_buffer(b_h, (n_eb, n_b, k_dim), "bfloat16", align=16)
        SB = T.match_buffer(sb_h, (n_b, k_dim), "bfloat16", align=16)
        LT = T.match_buffer(lt_h, (n_lt,), "int32")
        TEXP = T.match_buffer(texp_h, (n_te,), "int32")
        POFF = T.match_buffer(poff_h, (NUM_EXPERTS + 1,), "int32")
        PCNT = T.match_buffer(pcnt_h, (NUM_EXPERTS + 1,), "int32")
        META = T.match_buffer(meta_h, (1,), "int32")
        C = T.match_buffer(c_h, (n_c, n_cc), c_dtype, align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        # column block fastest (as the CuTe grid): CTAs resident together share one row tile's A rows in L2
        by, bx = T.cta_id([T.ceildiv(n_lim, cpc), n_tiles])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
        acc = T.alloc_local((64,), "float32")
        af = T.alloc_local((16,), "uint32")
        bfr = T.alloc_local((8,), "uint32")
        ex = T.alloc_local((3,), "int32")          # expert, first row, valid rows
        arow = T.alloc_local((2,), "int32")        # A source rows of this thread's two load chunks
        brow = T.alloc_local((2,), "int32")        # B rows (clamped) of the two chunks
        bok = T.alloc_local((2,), "int32")         # B row inside the weight matrix
        ov = T.alloc_local((2,), "bfloat16")
        y = T.alloc_local((2,), "float32")

        wm: T.let[T.int32] = warp % 2
        wn: T.let[T.int32] = warp // 2
        lr: T.let[T.int32] = lane % 8
        lj: T.let[T.int32] = lane // 8
        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4

        ex[0] = 0
        ex[1] = bx * BM
        ex[2] = 0
        if router:
            ex[2] = T.min(BM, n_c - bx * BM)
        else:
            if bx < META[0]:
                ex[0] = TEXP[bx]
                ex[2] = T.min(BM, POFF[ex[0]] + PCNT[ex[0]] - bx * BM)

        if ex[2] > 0:
            for u in T.unroll(2):
                if up:
                    arow[u] = LT[ex[1] + T.min((u * THREADS + tid) // 4, ex[2] - 1)]
                else:
                    arow[u] = ex[1] + T.min((u * THREADS + tid) // 4, ex[2] - 1)
                if up:
                    bok[u] = T.if_then_else(by * 64 + ((u * THREADS + tid) // 4) % 64 < inter, 1, 0)
                    brow[u] = ((u * THREADS + tid) // 4) // 64 * inter + T.min(
                        by * 64 + ((u * THREADS + tid) // 4) % 64, inter - 1)
                else:
                    bok[u] = T.if_then_else(by * BN + (u * THREADS + tid) // 4 < n_lim, 1, 0)
                    brow[u] = T.min(by * BN + (u * THREADS + tid) // 4, n_lim - 1)
            for i in T.unroll(64):
                acc[i] = T.float32(0.0)

            for s in T.unroll(STAGES - 1):
                if s < nk:
                    for u in T.unroll(2):
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 4) * LDS + (tid % 4) * 8]),
                            T.address_of(A[arow[u], T.min(s * BK + (tid % 4) * 8, k_dim - VEC)]), 16,
                            T.if_then_else(s * BK + (tid % 4) * 8 < k_dim, T.uint32(16), T.uint32(0)))
                    for u in T.unroll(2):
                        if ex[0] < NUM_EXPERTS:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + (tid % 4) * 8]),
                                T.address_of(B[ex[0], brow[u], T.min(s * BK + (tid % 4) * 8, k_dim - VEC)]), 16,
                                T.if_then_else(s * BK + (tid % 4) * 8 < k_dim and bok[u] > 0, T.uint32(16), T.uint32(0)))
                        else:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + (tid % 4) * 8]),
                                T.address_of(SB[brow[u], T.min(s * BK + (tid % 4) * 8, k_dim - VEC)]), 16,
                                T.if_then_else(s * BK + (tid % 4) * 8 < k_dim and bok[u] > 0, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.commit_group()

            for kt in range(nk):
                T.ptx.cp.async_.wait_group(STAGES - 2)
                T.cuda.cta_sync()
                nxt: T.let[T.int32] = kt + STAGES - 1
                if nxt < nk:
                    for u in T.unroll(2):
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 4) * LDS + (tid % 4) * 8]),
                            T.address_of(A[arow[u], T.min(nxt * BK + (tid % 4) * 8, k_dim - VEC)]), 16,
                            T.if_then_else(nxt * BK + (tid % 4) * 8 < k_dim, T.uint32(16), T.uint32(0)))
                    for u in T.unroll(2):
                        if ex[0] < NUM_EXPERTS:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + (tid % 4) * 8]),
                                T.address_of(B[ex[0], brow[u], T.min(nxt * BK + (tid % 4) * 8, k_dim - VEC)]), 16,
                                T.if_then_else(nxt * BK + (tid % 4) * 8 < k_dim and bok[u] > 0, T.uint32(16), T.uint32(0)))
                        else:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + (tid % 4) * 8]),
                                T.address_of(SB[brow[u], T.min(nxt * BK + (tid % 4) * 8, k_dim - VEC)]), 16,
                                T.if_then_else(nxt * BK + (tid % 4) * 8 < k_dim and bok[u] > 0, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.commit_group()

                buf: T.let[T.int32] = (kt % STAGES) * STAGE
                for kk in T.unroll(BK // 16):
                    for i in T.unroll(4):
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                            af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                            T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * LDS + kk * 16 + 8 * (lj // 2)]))
                    for pq in T.unroll(2):
                        if up:
                            # pq = 0: the warp's 16 gate rows of the B tile; pq = 1: the matching up rows
                            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                                T.address_of(pool[buf + A_ST + (pq * 64 + wn * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
                        else:
                            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                                T.address_of(pool[buf + A_ST + (wn * 32 + pq * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
                    for i in T.unroll(4):
                        for n in T.unroll(4):
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                acc[(i * 4 + n) * 4 + 0], acc[(i * 4 + n) * 4 + 1], acc[(i * 4 + n) * 4 + 2], acc[(i * 4 + n) * 4 + 3],
                                af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                                bfr[n * 2 + 0], bfr[n * 2 + 1],
                                acc[(i * 4 + n) * 4 + 0], acc[(i * 4 + n) * 4 + 1], acc[(i * 4 + n) * 4 + 2], acc[(i * 4 + n) * 4 + 3])
            T.ptx.cp.async_.wait_group(0)

            # ---- epilogue (column pairs 2 tq, 2 tq + 1 of each 8-wide n-tile; n_lim is even) ----
            for i in T.unroll(4):
                for h in T.unroll(2):
                    rl: T.let[T.int32] = wm * 64 + i * 16 + g + 8 * h
                    if rl < ex[2]:
                        if up:
                            for j in T.unroll(2):
                                if by * 64 + wn * 16 + j * 8 + 2 * tq < inter:
                                    for e in T.unroll(2):
                                        y[0] = acc[(i * 4 + j) * 4 + h * 2 + e]
                                        ov[e] = T.cast(y[0] / (T.float32(1.0) + T.exp(T.float32(0.0) - y[0]))
                                                       * acc[(i * 4 + j + 2) * 4 + h * 2 + e], "bfloat16")
                                    for e in T.vectorized(2):
                                        C[ex[1] + rl, by * 64 + wn * 16 + j * 8 + 2 * tq + e] = ov[e]
                        else:
                            for n in T.unroll(4):
                                if by * BN + wn * 32 + n * 8 + 2 * tq < n_lim:
                                    if router:
                                        for e in T.unroll(2):
                                            y[e] = acc[(i * 4 + n) * 4 + h * 2 + e]
                                        for e in T.vectorized(2):
                                            C[ex[1] + rl, by * BN + wn * 32 + n * 8 + 2 * tq + e] = y[e]
                                    else:
                                        for e in T.unroll(2):
                                            ov[e] = T.cast(acc[(i * 4 + n) * 4 + h * 2 + e], "bfloat16")
                                        for e in T.vectorized(2):
                                            C[ex[1] + rl, by * BN + wn * 32 + n * 8 + 2 * tq + e] = ov[e]

    return gemm


def make_topk_kernel(hidden):
    nch = hidden // VEC
    lane_chunks = (nch + 31) // 32

    @T.prim_func
    def topk_kernel(log_h: T.handle, x_h: T.handle, g_h: T.handle, ids_h: T.handle, wts_h: T.handle,
                    slot_h: T.handle, gate_h: T.handle, cnt_h: T.handle):
        n_tok = T.int32()
        LOG = T.match_buffer(log_h, (n_tok, NUM_EXPERTS), "float32", align=16)
        X = T.match_buffer(x_h, (n_tok, nch, VEC), "bfloat16", align=16)
        G = T.match_buffer(g_h, (nch, VEC), "bfloat16", align=16)
        IDS = T.match_buffer(ids_h, (n_tok, TOP_K), "int32")
        WTS = T.match_buffer(wts_h, (n_tok, TOP_K), "float32")
        SLOT = T.match_buffer(slot_h, (n_tok, TOP_K), "int32")
        GATE = T.match_buffer(gate_h, (n_tok,), "float32")
        CNT = T.match_buffer(cnt_h, (NUM_EXPERTS,), "int32")

        T.device_entry()
        cta = T.cta_id([T.ceildiv(n_tok, K1_WARPS)])
        tid = T.thread_id([K1_WARPS * 32])
        warp = T.warp_id([K1_WARPS])
        lane = T.lane_id([32])
        vals = T.alloc_local((16,), "float32")
        xb = T.alloc_local((VEC,), "bfloat16")
        gb = T.alloc_local((VEC,), "bfloat16")
        dot = T.alloc_local((1,), "float32")
        bv = T.alloc_local((2,), "float32")
        bi = T.alloc_local((2,), "int32")
        cv = T.alloc_local((TOP_K,), "float32")
        ci = T.alloc_local((TOP_K,), "int32")
        ev = T.alloc_local((TOP_K,), "float32")
        sm = T.alloc_local((1,), "float32")

        t: T.let[T.int32] = cta * K1_WARPS + warp
        if t < n_tok:
            # lane l: experts 128 i + 4 l + j
            for i in T.unroll(4):
                for j in T.vectorized(4):
                    vals[i * 4 + j] = LOG[t, 128 * i + 4 * lane + j]
            # shared-expert gate: sigmoid(x . g) in fp32
            dot[0] = T.float32(0.0)
            for c in T.unroll(lane_chunks):
                if lane + 32 * c < nch:
                    for j in T.vectorized(VEC):
                        xb[j] = X[t, lane + 32 * c, j]
                    for j in T.vectorized(VEC):
                        gb[j] = G[lane + 32 * c, j]
                    for j in T.unroll(VEC):
                        dot[0] = dot[0] + T.cast(xb[j], "float32") * T.cast(gb[j], "float32")
            for s in T.unroll(5):
                dot[0] = dot[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, dot[0], 16 >> s, 32, 32)
            # 10 rounds of warp arg-max (value desc, id asc)
            for k in T.unroll(TOP_K):
                bv[0] = vals[0]
                bi[0] = 4 * lane
                for q in T.unroll(15):
                    if vals[q + 1] > bv[0]:
                        bv[0] = vals[q + 1]
                        bi[0] = 128 * ((q + 1) // 4) + 4 * lane + (q + 1) % 4
                for s in T.unroll(5):
                    bv[1] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[0], 16 >> s, 32, 32)
                    bi[1] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bi[0], 16 >> s, 32, 32)
                    if bv[1] > bv[0] or (bv[1] == bv[0] and bi[1] < bi[0]):
                        bv[0] = bv[1]
                        bi[0] = bi[1]
                cv[k] = bv[0]
                ci[k] = bi[0]
                for q in T.unroll(16):
                    if bi[0] == 128 * (q // 4) + 4 * lane + q % 4:
                        vals[q] = T.float32(NEG)
            sm[0] = T.float32(0.0)
            for k in T.unroll(TOP_K):
                ev[k] = T.exp(cv[k] - cv[0])            # cv[0] is the largest logit
                sm[0] = sm[0] + ev[k]
            sm[0] = T.float32(1.0) / sm[0]
            for k in T.unroll(TOP_K):
                if lane == k:
                    IDS[t, k] = ci[k]
                    WTS[t, k] = ev[k] * sm[0]
                    SLOT[t, k] = T.cuda.atomic_add(T.address_of(CNT[ci[k]]), 1)
            if lane == 0:
                GATE[t] = T.float32(1.0) / (T.float32(1.0) + T.exp(T.float32(0.0) - dot[0]))

    return topk_kernel


@T.prim_func
def sched_kernel(cnt_h: T.handle, pcnt_h: T.handle, poff_h: T.handle, texp_h: T.handle, meta_h: T.handle,
                 n_tok: T.int32):
    n_tiles = T.int32()
    CNT = T.match_buffer(cnt_h, (NUM_EXPERTS,), "int32")
    PCNT = T.match_buffer(pcnt_h, (NUM_EXPERTS + 1,), "int32")
    POFF = T.match_buffer(poff_h, (NUM_EXPERTS + 1,), "int32")
    TEXP = T.match_buffer(texp_h, (n_tiles,), "int32")
    META = T.match_buffer(meta_h, (1,), "int32")

    T.device_entry()
    cta = T.cta_id([1])
    tid = T.thread_id([SCHED_THREADS])
    warp = T.warp_id([SCHED_THREADS // 32])
    lane = T.lane_id([32])
    sw = T.alloc_shared((SCHED_THREADS // 32,), "int32")
    a = T.alloc_local((6,), "int32")            # count, tiles, inclusive scan, shuffled, base, total

    a[0] = 0
    if tid < NUM_EXPERTS:
        a[0] = CNT[tid]
        CNT[tid] = 0                            # reset for the next call
    if tid == NUM_EXPERTS:
        a[0] = n_tok
    a[1] = T.ceildiv(a[0], BM)
    a[2] = a[1]
    for s in T.unroll(5):
        a[3] = T.tvm_warp_shuffle_up(0xFFFFFFFF, a[2], 1 << s, 32, 32)
        if lane >= (1 << s):
            a[2] = a[2] + a[3]
    if lane == 31:
        sw[warp] = a[2]
    T.cuda.cta_sync()
    a[4] = 0
    a[5] = 0
    for i in T.unroll(SCHED_THREADS // 32):
        if i < warp:
            a[4] = a[4] + sw[i]
        a[5] = a[5] + sw[i]
    if tid <= NUM_EXPERTS:
        a[4] = a[4] + a[2] - a[1]               # first tile of this expert
        POFF[tid] = a[4] * BM
        PCNT[tid] = a[0]
        for j in range(a[1]):
            TEXP[a[4] + j] = tid
    if tid == 0:
        META[0] = a[5]


@T.prim_func
def place_kernel(ids_h: T.handle, slot_h: T.handle, poff_h: T.handle, lt_h: T.handle, row_h: T.handle):
    n_tok = T.int32()
    n_rows = T.int32()
    IDS = T.match_buffer(ids_h, (n_tok, TOP_K), "int32")
    SLOT = T.match_buffer(slot_h, (n_tok, TOP_K), "int32")
    POFF = T.match_buffer(poff_h, (NUM_EXPERTS + 1,), "int32")
    LT = T.match_buffer(lt_h, (n_rows,), "int32")
    ROW = T.match_buffer(row_h, (n_tok, NSLOT), "int32")

    T.device_entry()
    cta = T.cta_id([T.ceildiv(n_tok * NSLOT, THREADS)])
    tid = T.thread_id([THREADS])
    r = T.alloc_local((1,), "int32")
    i: T.let[T.int32] = cta * THREADS + tid
    if i < n_tok * NSLOT:
        t: T.let[T.int32] = i // NSLOT
        k: T.let[T.int32] = i % NSLOT
        if k < TOP_K:
            r[0] = POFF[IDS[t, k]] + SLOT[t, k]
        else:
            r[0] = POFF[NUM_EXPERTS] + t
        LT[r[0]] = t
        ROW[t, k] = r[0]


def make_combine_kernel(hidden):
    nch = hidden // VEC
    row_threads = min(256, ((nch + 31) // 32) * 32)

    @T.prim_func
    def combine_kernel(y_h: T.handle, row_h: T.handle, wts_h: T.handle, gate_h: T.handle, o_h: T.handle):
        n_tok = T.int32()
        n_rows = T.int32()
        Y = T.match_buffer(y_h, (n_rows, nch, VEC), "bfloat16", align=16)
        ROW = T.match_buffer(row_h, (n_tok, NSLOT), "int32")
        WTS = T.match_buffer(wts_h, (n_tok, TOP_K), "float32")
        GATE = T.match_buffer(gate_h, (n_tok,), "float32")
        O = T.match_buffer(o_h, (n_tok, nch, VEC), "bfloat16", align=16)

        T.device_entry()
        t = T.cta_id([n_tok])
        tid = T.thread_id([row_threads])
        rr = T.alloc_local((NSLOT,), "int32")
        ww = T.alloc_local((NSLOT,), "float32")
        yv = T.alloc_local((VEC,), "bfloat16")
        sm = T.alloc_local((VEC,), "float32")
        ob = T.alloc_local((VEC,), "bfloat16")
        for k in T.unroll(NSLOT):
            rr[k] = ROW[t, k]
        for k in T.unroll(TOP_K):
            ww[k] = WTS[t, k]
        ww[TOP_K] = GATE[t]
        for c in range(T.ceildiv(nch, row_threads)):
            if c * row_threads + tid < nch:
                for j in T.unroll(VEC):
                    sm[j] = T.float32(0.0)
                for k in T.unroll(NSLOT):
                    for j in T.vectorized(VEC):
                        yv[j] = Y[rr[k], c * row_threads + tid, j]
                    for j in T.unroll(VEC):
                        sm[j] = sm[j] + T.cast(yv[j], "float32") * ww[k]
                for j in T.unroll(VEC):
                    ob[j] = T.cast(sm[j], "bfloat16")
                for j in T.vectorized(VEC):
                    O[t, c * row_threads + tid, j] = ob[j]

    return combine_kernel


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; caching jit() once makes the host call path ~0.2 us.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled(hidden=2048, inter=512):
    key = ("exes", hidden, inter)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (make_gemm("router", hidden, inter), make_topk_kernel(hidden), sched_kernel, place_kernel,
                 make_gemm("up", hidden, inter), make_gemm("down", hidden, inter), make_combine_kernel(hidden))
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def _max_tiles(ntok):
    # sum_e ceil(n_e / BM) <= routed pairs / BM + experts, plus the shared expert's tiles
    return (ntok * TOP_K) // BM + NUM_EXPERTS + (ntok + BM - 1) // BM + 1


def _workspace(device, ntok, hidden, inter):
    key = ("ws", str(device), ntok, hidden, inter)
    ws = _CACHE.get(key)
    if ws is None:
        tiles = _max_tiles(ntok)
        rows = tiles * BM
        i32 = dict(dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        ws = dict(logits=torch.empty((ntok, NUM_EXPERTS), **f32),
                  ids=torch.empty((ntok, TOP_K), **i32), slot=torch.empty((ntok, TOP_K), **i32),
                  wts=torch.empty((ntok, TOP_K), **f32), gate=torch.empty((ntok,), **f32),
                  cnt=torch.zeros((NUM_EXPERTS,), **i32),          # reset by the sched kernel after use
                  pcnt=torch.empty((NUM_EXPERTS + 1,), **i32), poff=torch.empty((NUM_EXPERTS + 1,), **i32),
                  texp=torch.empty((tiles,), **i32), meta=torch.empty((1,), **i32),
                  lt=torch.empty((rows,), **i32), row=torch.empty((ntok, NSLOT), **i32),
                  act=torch.empty((rows, inter), dtype=torch.bfloat16, device=device),
                  y=torch.empty((rows, hidden), dtype=torch.bfloat16, device=device))
        _CACHE[key] = ws
    return ws


def solve(hidden_states, router_weight, experts_gate_up, experts_down, shared_gate_up, shared_down,
          shared_expert_gate):
    ntok, hidden = hidden_states.shape
    inter = experts_down.shape[-1]
    assert experts_gate_up.shape == (NUM_EXPERTS, 2 * inter, hidden) and router_weight.shape == (NUM_EXPERTS, hidden)
    assert hidden % VEC == 0 and inter % 2 == 0
    dev = hidden_states.device
    out = torch.empty_like(hidden_states)
    if ntok == 0:
        return out
    _compiled()                                   # the full-size build, also when called at another size
    k_router, k_topk, k_sched, k_place, k_up, k_down, k_combine = _compiled(hidden, inter)
    ws = _workspace(dev, ntok, hidden, inter)
    tiles = ws["texp"].shape[0]
    x = hidden_states.contiguous()
    nch = hidden // VEC
    egu, edn = experts_gate_up.contiguous(), experts_down.contiguous()
    sgu, sdn = shared_gate_up.contiguous(), shared_down.contiguous()
    k_router(x, router_weight.contiguous().view(1, NUM_EXPERTS, hidden), router_weight.contiguous(), ws["lt"],
             ws["texp"], ws["poff"], ws["pcnt"], ws["meta"], ws["logits"], (ntok + BM - 1) // BM)
    k_topk(ws["logits"], x.view(ntok, nch, VEC), shared_expert_gate.contiguous().view(nch, VEC), ws["ids"],
           ws["wts"], ws["slot"], ws["gate"], ws["cnt"])
    k_sched(ws["cnt"], ws["pcnt"], ws["poff"], ws["texp"], ws["meta"], ntok)
    k_place(ws["ids"], ws["slot"], ws["poff"], ws["lt"], ws["row"])
    k_up(x, egu, sgu, ws["lt"], ws["texp"], ws["poff"], ws["pcnt"], ws["meta"], ws["act"], tiles)
    k_down(ws["act"], edn, sdn, ws["lt"], ws["texp"], ws["poff"], ws["pcnt"], ws["meta"], ws["y"], tiles)
    k_combine(ws["y"].view(-1, nch, VEC), ws["row"], ws["wts"], ws["gate"], out.view(ntok, nch, VEC))
    return out
