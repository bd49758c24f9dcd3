# DeepSeek-V3 MoE layer on one EP rank (grouped sigmoid top-8 routing with correction bias, 32 local FP8
# block-scaled SwiGLU experts, T = 14107, hidden 7168, intermediate 2048) in TIRx: six kernels.
#
# 1. route (one warp per token, lane l owns experts 8l..8l+7): s = sigmoid(logit), b = s + bias; group
#    score = sum of the two largest b of the group (the 4 lanes of a group merge top-2 pairs by xor
#    shuffles); a group is kept when fewer than 4 groups beat it; 8 rounds of warp arg-max over the kept
#    b (ties to the lower id) pick the experts; w = s / sum(s) * 2.5. A chosen expert of this rank takes a
#    slot with an atomic increment of its counter.
# 2. sched (one thread): padded row offset of every local expert (rows rounded up to 128-row tiles, tiles
#    never mix experts), tile -> expert table, tile count; copies and resets the counters.
# 3. place (one thread per (token, k)): row = offset[e] + slot; row -> token list and token -> row table.
# 4. up GEMM (grouped FP8): CTA = one 128-row tile x (64 gate + the matching 64 up columns); A rows are
#    gathered straight from hidden_states through the row -> token list (no gathered copy; tail rows
#    repeat the tile's last valid row). K in 128-deep steps (one scale block) through a 3-stage cp.async
#    ring (rows of 128 B, 16-byte chunks XOR-swizzled by row: conflict-free ldmatrix). 8 warps of
#    64 rows x (16 gate + 16 up) columns on mma.sync m16n8k32 e4m3 x e4m3 -> fp32; the products of each
#    k-step go to a fresh fp32 partial that is then added to the accumulator times
#    act_scale[k-block, token] * w_scale[column block, k-block] (DeepSeek-style promotion: exact block
#    scaling up to summation order, and at most 128 products inside the tensor-core accumulation).
#    Epilogue: inner = silu(gate) * up in fp32, split into two e4m3 terms with per-(row, 64-column)
#    scales (row amax over the 4 warps through shared memory): hi = e4m3(inner / s_hi),
#    lo = e4m3((inner - hi s_hi) / s_lo); hi | lo and the two scales are stored. Grid: column block fastest
#    (as the CuTe grid), so CTAs resident together share a row tile in L2 and sweep one expert's weights.
# 5. down GEMM (grouped FP8): A = [hi | lo] (K = 2 x 2048), B = w2 tiles read twice (k mod 2048), 128 x 128
#    tile, promotion every 64 k with q_scale[row, k/64] * w2_scale[n-block, (k mod 2048)/128]; y -> bf16.
# 6. combine (one CTA per token): out = sum over the token's local rows of w_k y[row] in fp32 -> bf16
#    (zeros for tokens without a local expert).
#
# Differences from the CuTe DSL solution (which passed on the H200 at 3.77 ms device time): its separate
# gather kernel (a ~100 MB copy of the routed rows and scales) is replaced by the place kernel and
# gathered operand loads (the skill's untested next step); the GEMMs run on the warp-level FP8 mma.sync
# with a cp.async ring instead of warpgroup MMA fed by TMA (the TIRx GEMMs of this repo are all built on
# the warp-level path; the warpgroup path was not attempted here), 128 rows x 128 columns per CTA with
# 3 stages (96 KiB) instead of 128 x 64 with 6 stages for the up GEMM. The hi/lo split and the promotion
# scheme are the same.
#
# Expected speed: probably slower than the CuTe DSL kernels (warp-level MMA reaches a fraction of the
# warpgroup rate, and on Hopper the FP8 warp-level MMA may not run faster than bf16), but far faster than
# eager PyTorch (~49 ms) and torch.compile (~60 ms), which dequantize to fp32 and run fp32 GEMMs per expert.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Workspaces (sized for the worst-case routed row count) are cached per (device, shapes);
# the per-expert counters are zero between calls (reset by the sched kernel).
#
# Registers (ptxas, sm_90a): both GEMMs at the 255 limit (1 CTA of 8 warps per SM, 96 KiB shared memory);
# the down GEMM spills 64 bytes.
#
# Verification: compile-checked on CPU (sm_90a); emulated on CPU (scripts/cuda_emu, mma in double precision)
# at smoke size (2 seeds, 0.25x of the allowance) and at 5000 tokens / hidden 384 / inter 256 / 4 local
# experts (a 2-tile expert, partial tiles; 0.13x of the allowance); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 256
NUM_GROUPS = 8
TOPK_GROUPS = 4
TOP_K = 8
BLOCK = 128                     # quantization block of activations and weights
FP8_MAX = 448.0
QB = 64                         # block width of the fp8 re-quantization of the intermediate
THREADS = 256
BM = 128                        # rows per GEMM tile
BN = 128                        # B rows per CTA (up: 64 gate + 64 up; down: 128 outputs)
BK = 128                        # k bytes per pipeline stage
STAGES = 3
A_ST = BM * BK
STAGE = A_ST + BN * BK          # bytes per stage (32 KiB)
POOL = STAGES * STAGE           # 96 KiB of dynamic shared memory
NEG = -3.0e38


def _e4m3_f32(b):
    # e4m3 byte (int32 0..255) -> fp32 (exact): normal 2^(e-7) (1 + m/8), subnormal m 2^-9
    return T.if_then_else(
        T.bitwise_and(T.shift_right(b, 3), 15) > 0,
        T.reinterpret("float32", T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(b, 7), 1), 31),
                                              T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(b, 3), 15) + 120, 23),
                                                           T.shift_left(T.bitwise_and(b, 7), 20)))),
        T.cast(T.bitwise_and(b, 7), "float32") * T.float32(2.0 ** -9)
        * T.if_then_else(T.bitwise_and(b, 128) > 0, T.float32(-1.0), T.float32(1.0)))


@T.prim_func
def route_kernel(log_h: T.handle, bias_h: T.handle, ids_h: T.handle, wts_h: T.handle, slot_h: T.handle,
                 cnt_h: T.handle, offset: T.int32, rsf: T.float32):
    n_tok = T.int32()
    n_local = T.int32()
    LOG = T.match_buffer(log_h, (n_tok, NUM_EXPERTS), "float32", align=16)
    BIAS = T.match_buffer(bias_h, (NUM_EXPERTS,), "bfloat16")
    IDS = T.match_buffer(ids_h, (n_tok, TOP_K), "int32")
    WTS = T.match_buffer(wts_h, (n_tok, TOP_K), "float32")
    SLOT = T.match_buffer(slot_h, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_h, (n_local,), "int32")

    T.device_entry()
    cta = T.cta_id([T.ceildiv(n_tok, 8)])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    lg = T.alloc_local((8,), "float32")
    sv = T.alloc_local((8,), "float32")
    vals = T.alloc_local((8,), "float32")
    m = T.alloc_local((4,), "float32")          # top-1, top-2, shuffled top-1, shuffled top-2
    rk = T.alloc_local((1,), "int32")
    bv = T.alloc_local((3,), "float32")         # best biased value, its sigmoid score, shuffled value
    os_ = T.alloc_local((1,), "float32")
    bi = T.alloc_local((2,), "int32")           # best id, shuffled id
    cs = T.alloc_local((TOP_K,), "float32")
    ci = T.alloc_local((TOP_K,), "int32")
    tot = T.alloc_local((1,), "float32")

    t: T.let[T.int32] = cta * 8 + warp
    if t < n_tok:
        for h in T.unroll(2):
            for j in T.vectorized(4):
                lg[h * 4 + j] = LOG[t, lane * 8 + h * 4 + j]
        for j in T.unroll(8):
            sv[j] = T.float32(1.0) / (T.float32(1.0) + T.exp(T.float32(0.0) - lg[j]))
            vals[j] = sv[j] + T.cast(BIAS[lane * 8 + j], "float32")
        # top-2 of this lane, then merged over the 4 lanes of the group
        m[0] = T.max(vals[0], vals[1])
        m[1] = T.min(vals[0], vals[1])
        for j in T.unroll(6):
            m[1] = T.max(m[1], T.min(m[0], vals[j + 2]))
            m[0] = T.max(m[0], vals[j + 2])
        for s in T.unroll(2):
            m[2] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, m[0], 1 << s, 32, 32)
            m[3] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, m[1], 1 << s, 32, 32)
            m[1] = T.max(T.min(m[0], m[2]), T.max(m[1], m[3]))
            m[0] = T.max(m[0], m[2])
        m[0] = m[0] + m[1]                      # score of this lane's group (lane // 4)
        rk[0] = 0
        for gg in T.unroll(NUM_GROUPS):
            m[2] = T.tvm_warp_shuffle(0xFFFFFFFF, m[0], 4 * gg, 32, 32)
            if m[2] > m[0] or (m[2] == m[0] and gg < lane // 4):
                rk[0] = rk[0] + 1
        if rk[0] >= TOPK_GROUPS:
            for j in T.unroll(8):
                vals[j] = T.float32(NEG)
        for k in T.unroll(TOP_K):
            bv[0] = vals[0]
            bv[1] = sv[0]
            bi[0] = lane * 8
            for j in T.unroll(7):
                if vals[j + 1] > bv[0]:
                    bv[0] = vals[j + 1]
                    bv[1] = sv[j + 1]
                    bi[0] = lane * 8 + j + 1
            for s in T.unroll(5):
                bv[2] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[0], 16 >> s, 32, 32)
                os_[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[1], 16 >> s, 32, 32)
                bi[1] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bi[0], 16 >> s, 32, 32)
                if bv[2] > bv[0] or (bv[2] == bv[0] and bi[1] < bi[0]):
                    bv[0] = bv[2]
                    bv[1] = os_[0]
                    bi[0] = bi[1]
            cs[k] = bv[1]
            ci[k] = bi[0]
            for j in T.unroll(8):
                if bi[0] == lane * 8 + j:
                    vals[j] = T.float32(NEG)
        tot[0] = cs[0]
        for k in T.unroll(TOP_K - 1):
            tot[0] = tot[0] + cs[k + 1]
        tot[0] = rsf / tot[0]
        for k in T.unroll(TOP_K):
            if lane == k:
                WTS[t, k] = cs[k] * tot[0]
                if ci[k] - offset >= 0 and ci[k] - offset < n_local:
                    IDS[t, k] = ci[k] - offset
                    SLOT[t, k] = T.cuda.atomic_add(T.address_of(CNT[ci[k] - offset]), 1)
                else:
                    IDS[t, k] = -1
                    SLOT[t, k] = 0


@T.prim_func
def sched_kernel(cnt_h: T.handle, pcnt_h: T.handle, poff_h: T.handle, texp_h: T.handle, meta_h: T.handle):
    n_local = T.int32()
    n_tiles = T.int32()
    CNT = T.match_buffer(cnt_h, (n_local,), "int32")
    PCNT = T.match_buffer(pcnt_h, (n_local,), "int32")
    POFF = T.match_buffer(poff_h, (n_local,), "int32")
    TEXP = T.match_buffer(texp_h, (n_tiles,), "int32")
    META = T.match_buffer(meta_h, (1,), "int32")

    T.device_entry()
    cta = T.cta_id([1])
    tid = T.thread_id([32])
    a = T.alloc_local((2,), "int32")            # tiles so far, count of this expert
    if tid == 0:
        a[0] = 0
        for e in range(n_local):
            a[1] = CNT[e]
            CNT[e] = 0                          # reset for the next call
            PCNT[e] = a[1]
            POFF[e] = a[0] * BM
            for j in range(T.ceildiv(a[1], BM)):
                TEXP[a[0] + j] = e
            a[0] = a[0] + T.ceildiv(a[1], BM)
        META[0] = a[0]


@T.prim_func
def place_kernel(ids_h: T.handle, slot_h: T.handle, poff_h: T.handle, lt_h: T.handle, row_h: T.handle):
    n_tok = T.int32()
    n_local = T.int32()
    n_rows = T.int32()
    IDS = T.match_buffer(ids_h, (n_tok, TOP_K), "int32")
    SLOT = T.match_buffer(slot_h, (n_tok, TOP_K), "int32")
    POFF = T.match_buffer(poff_h, (n_local,), "int32")
    LT = T.match_buffer(lt_h, (n_rows,), "int32")
    ROW = T.match_buffer(row_h, (n_tok, TOP_K), "int32")

    T.device_entry()
    cta = T.cta_id([T.ceildiv(n_tok * TOP_K, THREADS)])
    tid = T.thread_id([THREADS])
    i: T.let[T.int32] = cta * THREADS + tid
    if i < n_tok * TOP_K:
        t: T.let[T.int32] = i // TOP_K
        k: T.let[T.int32] = i % TOP_K
        if IDS[t, k] >= 0:
            LT[POFF[IDS[t, k]] + SLOT[t, k]] = t
            ROW[t, k] = POFF[IDS[t, k]] + SLOT[t, k]
        else:
            ROW[t, k] = -1


def make_gemm(kind, hidden, inter):
    """'up': A = hidden_states rows gathered through LT, B = w13 -> hi|lo fp8 intermediate + scales.
    'down': A = hi|lo intermediate, B = w2 (read twice) -> y (bf16)."""
    up = kind == "up"
    k_a = hidden if up else 2 * inter              # K of the product
    k_b = hidden if up else inter                  # columns of one B row
    n_b = 2 * inter if up else hidden              # rows of B per expert
    nk = k_a // BK
    kb_b = k_b // BK                               # k-steps per pass over B
    n_by = inter // 64 if up else hidden // BN     # CTAs along the output columns
    nprom = 1 if up else 2                         # promotions per k-step (scale blocks of 128 / 64)
    ksub = 4 // nprom                              # k32 sub-steps per promotion
    c_dtype = "uint16" if up else "bfloat16"
    assert k_a % BK == 0 and k_b % BK == 0 and inter % BLOCK == 0

    @T.prim_func
    def gemm(a_h: T.handle, b_h: T.handle, as_h: T.handle, bs_h: T.handle, lt_h: T.handle, texp_h: T.handle,
             poff_h: T.handle, pcnt_h: T.handle, meta_h: T.handle, c_h: T.handle, cs_h: T.handle):
        n_a = T.int32()            # rows of A (tokens for up, padded rows for down)
        n_rows = T.int32()         # padded routed rows
        n_local = T.int32()
        n_tiles = T.int32()
        s0 = T.int32()             # activation scales: [hidden/128, tokens] (up) or [rows, 2 inter/64] (down)
        s1 = T.int32()
        n_c = T.int32()            # columns of C: inter (pairs of e4m3) for up, hidden for down
        A = T.match_buffer(a_h, (n_a, k_a), "uint8", align=16)
        B = T.match_buffer(b_h, (n_local, n_b, k_b), "uint8", align=16)
        AS = T.match_buffer(as_h, (s0, s1), "float32")
        BS = T.match_buffer(bs_h, (n_local, n_b // BLOCK, k_b // BLOCK), "float32")
        LT = T.match_buffer(lt_h, (n_rows,), "int32")
        TEXP = T.match_buffer(texp_h, (n_tiles,), "int32")
        POFF = T.match_buffer(poff_h, (n_local,), "int32")
        PCNT = T.match_buffer(pcnt_h, (n_local,), "int32")
        META = T.match_buffer(meta_h, (1,), "int32")
        C = T.match_buffer(c_h, (n_rows, n_c), c_dtype, align=16)
        CS = T.match_buffer(cs_h, (n_rows, 2 * inter // QB), "float32")

        T.device_entry()
        # column block fastest (as the CuTe grid): the CTAs resident together share one row tile (its A rows stay
        # in L2) and sweep one expert's weight panels, so x / q rows are not re-read from DRAM per column block
        by, bx = T.cta_id([n_by, n_tiles])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_buffer((POOL,), "uint8", scope="shared.dyn")
        red = T.decl_buffer((BM * 4,), "float32", data=pool.data, scope="shared.dyn")
        acc = T.alloc_local((64,), "float32")      # [m-tile 4][n-tile 4][4]
        part = T.alloc_local((64,), "float32")
        af = T.alloc_local((16,), "uint32")
        bfr = T.alloc_local((8,), "uint32")
        fa = T.alloc_local((8,), "float32")        # row scales of the thread's 8 rows
        fb = T.alloc_local((2,), "float32")        # column-block scales
        ex = T.alloc_local((3,), "int32")          # expert, first padded row, valid rows
        arow = T.alloc_local((4,), "int32")        # A source rows of this thread's 4 load chunks
        prow = T.alloc_local((8,), "int32")        # source rows (tokens / padded rows) of the 8 fragment rows
        sh = T.alloc_local((8,), "float32")        # hi scales per fragment row
        sl = T.alloc_local((8,), "float32")        # lo scales
        am = T.alloc_local((1,), "float32")
        qv = T.alloc_local((4,), "float32")
        pk = T.alloc_local((16,), "uint32")        # [hi 8 | lo 8] packed e4m3 of the fragment rows
        ov = T.alloc_local((2,), "bfloat16")

        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4
        lr: T.let[T.int32] = lane % 8
        lj: T.let[T.int32] = lane // 8
        wm: T.let[T.int32] = warp % 2
        wn: T.let[T.int32] = warp // 2

        if bx < META[0]:
            ex[0] = TEXP[bx]
            ex[1] = bx * BM
            ex[2] = T.min(BM, POFF[ex[0]] + PCNT[ex[0]] - bx * BM)
            for u in T.unroll(4):
                if up:
                    arow[u] = LT[ex[1] + T.min((u * THREADS + tid) // 8, ex[2] - 1)]
                else:
                    arow[u] = ex[1] + T.min((u * THREADS + tid) // 8, ex[2] - 1)
            for i in T.unroll(4):
                for h in T.unroll(2):
                    if up:
                        prow[i * 2 + h] = LT[ex[1] + T.min(wm * 64 + i * 16 + g + 8 * h, ex[2] - 1)]
                    else:
                        prow[i * 2 + h] = ex[1] + T.min(wm * 64 + i * 16 + g + 8 * h, ex[2] - 1)
            for v in T.unroll(64):
                acc[v] = T.float32(0.0)

            for s in T.unroll(STAGES - 1):
                if s < nk:
                    for u in T.unroll(4):
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 8) * BK
                                              + T.bitwise_xor(tid % 8, ((u * THREADS + tid) // 8) % 8) * 16]),
                            T.address_of(A[arow[u], s * BK + (tid % 8) * 16]), 16)
                    for u in T.unroll(4):
                        if up:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 8) * BK
                                                  + T.bitwise_xor(tid % 8, ((u * THREADS + tid) // 8) % 8) * 16]),
                                T.address_of(B[ex[0], (((u * THREADS + tid) // 8) // 64) * inter + by * 64
                                               + ((u * THREADS + tid) // 8) % 64, s * BK + (tid % 8) * 16]), 16)
                        else:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 8) * BK
                                                  + T.bitwise_xor(tid % 8, ((u * THREADS + tid) // 8) % 8) * 16]),
                                T.address_of(B[ex[0], by * BN + (u * THREADS + tid) // 8,
                                               (s % kb_b) * BK + (tid % 8) * 16]), 16)
                T.ptx.cp.async_.commit_group()

            for kt in range(nk):
                T.ptx.cp.async_.wait_group(STAGES - 2)
                T.cuda.cta_sync()
                nxt: T.let[T.int32] = kt + STAGES - 1
                if nxt < nk:
                    for u in T.unroll(4):
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 8) * BK
                                              + T.bitwise_xor(tid % 8, ((u * THREADS + tid) // 8) % 8) * 16]),
                            T.address_of(A[arow[u], nxt * BK + (tid % 8) * 16]), 16)
                    for u in T.unroll(4):
                        if up:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 8) * BK
                                                  + T.bitwise_xor(tid % 8, ((u * THREADS + tid) // 8) % 8) * 16]),
                                T.address_of(B[ex[0], (((u * THREADS + tid) // 8) // 64) * inter + by * 64
                                               + ((u * THREADS + tid) // 8) % 64, nxt * BK + (tid % 8) * 16]), 16)
                        else:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 8) * BK
                                                  + T.bitwise_xor(tid % 8, ((u * THREADS + tid) // 8) % 8) * 16]),
                                T.address_of(B[ex[0], by * BN + (u * THREADS + tid) // 8,
                                               (nxt % kb_b) * BK + (tid % 8) * 16]), 16)
                T.ptx.cp.async_.commit_group()

                buf: T.let[T.int32] = (kt % STAGES) * STAGE
                if up:
                    fb[0] = BS[ex[0], (by * 64) // BLOCK, kt]
                    fb[1] = BS[ex[0], (inter + by * 64) // BLOCK, kt]
                else:
                    fb[0] = BS[ex[0], by, kt % kb_b]
                for hp in T.unroll(nprom):
                    for v in T.unroll(8):
                        if up:
                            fa[v] = AS[kt, prow[v]]
                        else:
                            fa[v] = AS[prow[v], kt * 2 + hp]
                    for v in T.unroll(64):
                        part[v] = T.float32(0.0)
                    for k2 in T.unroll(ksub):
                        for i in T.unroll(4):
                            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                                T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * BK
                                                  + T.bitwise_xor(2 * (hp * ksub + k2) + lj // 2, lr) * 16]))
                        for pq in T.unroll(2):
                            if up:
                                # pq = 0: the warp's 16 gate rows of the B tile; pq = 1: the matching up rows
                                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                    bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                                    T.address_of(pool[buf + A_ST + (pq * 64 + wn * 16 + lr + 8 * (lj // 2)) * BK
                                                      + T.bitwise_xor(2 * (hp * ksub + k2) + lj % 2, lr) * 16]))
                            else:
                                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                    bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                                    T.address_of(pool[buf + A_ST + (wn * 32 + pq * 16 + lr + 8 * (lj // 2)) * BK
                                                      + T.bitwise_xor(2 * (hp * ksub + k2) + lj % 2, lr) * 16]))
                        for i in T.unroll(4):
                            for n in T.unroll(4):
                                T.ptx.mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32(
                                    part[(i * 4 + n) * 4 + 0], part[(i * 4 + n) * 4 + 1],
                                    part[(i * 4 + n) * 4 + 2], part[(i * 4 + n) * 4 + 3],
                                    af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                                    bfr[n * 2 + 0], bfr[n * 2 + 1],
                                    part[(i * 4 + n) * 4 + 0], part[(i * 4 + n) * 4 + 1],
                                    part[(i * 4 + n) * 4 + 2], part[(i * 4 + n) * 4 + 3])
                    # promotion with the block scales (row scale x column-block scale)
                    for i in T.unroll(4):
                        for n in T.unroll(4):
                            for e in T.unroll(4):
                                if up:
                                    acc[(i * 4 + n) * 4 + e] = acc[(i * 4 + n) * 4 + e] + part[(i * 4 + n) * 4 + e] * (
                                        fa[i * 2 + e // 2] * fb[n // 2])
                                else:
                                    acc[(i * 4 + n) * 4 + e] = acc[(i * 4 + n) * 4 + e] + part[(i * 4 + n) * 4 + e] * (
                                        fa[i * 2 + e // 2] * fb[0])
            T.ptx.cp.async_.wait_group(0)
            T.cuda.cta_sync()

            if up:
                # inner = silu(gate) * up into the gate slots (n-tiles 0, 1); n-tiles 2, 3 are then free
                for i in T.unroll(4):
                    for n in T.unroll(2):
                        for e in T.unroll(4):
                            acc[(i * 4 + n) * 4 + e] = acc[(i * 4 + n) * 4 + e] / (
                                T.float32(1.0) + T.exp(T.float32(0.0) - acc[(i * 4 + n) * 4 + e])) * acc[(i * 4 + n + 2) * 4 + e]
                for tm in T.unroll(2):              # 0: hi term of inner; 1: lo term of the residual
                    # row amax over the CTA's 64 columns: quad shuffles, then the 4 warps of the row
                    for i in T.unroll(4):
                        for h in T.unroll(2):
                            am[0] = T.float32(0.0)
                            for n in T.unroll(2):
                                for e in T.unroll(2):
                                    am[0] = T.max(am[0], T.abs(acc[(i * 4 + n + 2 * tm) * 4 + h * 2 + e]))
                            am[0] = T.max(am[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, am[0], 1, 32, 32))
                            am[0] = T.max(am[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, am[0], 2, 32, 32))
                            if tq == 0:
                                red[(wm * 64 + i * 16 + g + 8 * h) * 4 + wn] = am[0]
                    T.cuda.cta_sync()
                    for i in T.unroll(4):
                        for h in T.unroll(2):
                            rr: T.let[T.int32] = (wm * 64 + i * 16 + g + 8 * h) * 4
                            am[0] = T.max(T.max(red[rr], red[rr + 1]), T.max(red[rr + 2], red[rr + 3]))
                            am[0] = T.max(am[0], T.float32(1e-30)) * T.float32(1.0 / FP8_MAX)
                            if tm == 0:
                                sh[i * 2 + h] = am[0]
                            else:
                                sl[i * 2 + h] = am[0]
                            for n in T.unroll(2):
                                for e in T.unroll(2):
                                    qv[n * 2 + e] = T.min(T.max(acc[(i * 4 + n + 2 * tm) * 4 + h * 2 + e] / am[0],
                                                                T.float32(-FP8_MAX)), T.float32(FP8_MAX))
                            pk[tm * 8 + i * 2 + h] = T.cuda.fp8x4_e4m3_from_float4(qv[0], qv[1], qv[2], qv[3])
                            if tm == 0:
                                # residual of the hi term into the free n-tiles 2, 3
                                for n in T.unroll(2):
                                    for e in T.unroll(2):
                                        acc[(i * 4 + n + 2) * 4 + h * 2 + e] = acc[(i * 4 + n) * 4 + h * 2 + e] - _e4m3_f32(
                                            T.cast(T.bitwise_and(T.shift_right(pk[i * 2 + h], T.uint32(8 * (n * 2 + e))),
                                                                 T.uint32(255)), "int32")) * am[0]
                    T.cuda.cta_sync()
                for i in T.unroll(4):
                    for h in T.unroll(2):
                        rl: T.let[T.int32] = wm * 64 + i * 16 + g + 8 * h
                        if rl < ex[2]:
                            for tm in T.unroll(2):
                                C[ex[1] + rl, tm * (inter // 2) + by * 32 + wn * 8 + tq] = T.cast(
                                    T.bitwise_and(pk[tm * 8 + i * 2 + h], T.uint32(65535)), "uint16")
                                C[ex[1] + rl, tm * (inter // 2) + by * 32 + wn * 8 + 4 + tq] = T.cast(
                                    T.shift_right(pk[tm * 8 + i * 2 + h], T.uint32(16)), "uint16")
                            if wn == 0 and tq == 0:
                                CS[ex[1] + rl, by] = sh[i * 2 + h]
                                CS[ex[1] + rl, inter // QB + by] = sl[i * 2 + h]
            else:
                for i in T.unroll(4):
                    for h in T.unroll(2):
                        rl2: T.let[T.int32] = wm * 64 + i * 16 + g + 8 * h
                        if rl2 < ex[2]:
                            for n in T.unroll(4):
                                for e in T.unroll(2):
                                    ov[e] = T.cast(acc[(i * 4 + n) * 4 + h * 2 + e], "bfloat16")
                                for e in T.vectorized(2):
                                    C[ex[1] + rl2, by * BN + wn * 32 + n * 8 + 2 * tq + e] = ov[e]

    return gemm


@T.prim_func
def combine_kernel(y_h: T.handle, row_h: T.handle, wts_h: T.handle, o_h: T.handle):
    n_tok = T.int32()
    n_rows = T.int32()
    n_ch = T.int32()                            # 8-element chunks of a row
    Y = T.match_buffer(y_h, (n_rows, n_ch, 8), "bfloat16", align=16)
    ROW = T.match_buffer(row_h, (n_tok, TOP_K), "int32")
    WTS = T.match_buffer(wts_h, (n_tok, TOP_K), "float32")
    O = T.match_buffer(o_h, (n_tok, n_ch, 8), "bfloat16", align=16)

    T.device_entry()
    t = T.cta_id([n_tok])
    tid = T.thread_id([THREADS])
    rr = T.alloc_local((TOP_K,), "int32")
    ww = T.alloc_local((TOP_K,), "float32")
    yv = T.alloc_local((8,), "bfloat16")
    sm = T.alloc_local((8,), "float32")
    ob = T.alloc_local((8,), "bfloat16")
    for k in T.unroll(TOP_K):
        rr[k] = ROW[t, k]
        ww[k] = WTS[t, k]
    for c in range(T.ceildiv(n_ch, THREADS)):
        if c * THREADS + tid < n_ch:
            for j in T.unroll(8):
                sm[j] = T.float32(0.0)
            for k in T.unroll(TOP_K):
                if rr[k] >= 0:
                    for j in T.vectorized(8):
                        yv[j] = Y[rr[k], c * THREADS + tid, j]
                    for j in T.unroll(8):
                        sm[j] = sm[j] + ww[k] * T.cast(yv[j], "float32")
            for j in T.unroll(8):
                ob[j] = T.cast(sm[j], "bfloat16")
            for j in T.vectorized(8):
                O[t, c * THREADS + tid, j] = ob[j]


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


def _compiled(hidden=7168, inter=2048):
    key = ("exes", hidden, inter)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (route_kernel, sched_kernel, place_kernel, make_gemm("up", hidden, inter),
                 make_gemm("down", hidden, inter), combine_kernel)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def _max_tiles(ntok, local):
    return (ntok * min(TOP_K, local) + BM - 1) // BM + local


def _workspace(device, ntok, hidden, inter, local):
    key = ("ws", str(device), ntok, hidden, inter, local)
    ws = _CACHE.get(key)
    if ws is None:
        tiles = _max_tiles(ntok, local)
        rows = tiles * BM
        i32 = dict(dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        ws = dict(ids=torch.empty((ntok, TOP_K), **i32), slot=torch.empty((ntok, TOP_K), **i32),
                  wts=torch.empty((ntok, TOP_K), **f32), row=torch.empty((ntok, TOP_K), **i32),
                  cnt=torch.zeros((local,), **i32),            # reset by the sched kernel after use
                  pcnt=torch.empty((local,), **i32), poff=torch.empty((local,), **i32),
                  texp=torch.empty((tiles,), **i32), meta=torch.empty((1,), **i32),
                  lt=torch.empty((rows,), **i32),
                  q=torch.empty((rows, inter), dtype=torch.uint16, device=device),   # hi | lo e4m3 pairs
                  qs=torch.empty((rows, 2 * inter // QB), **f32),
                  y=torch.empty((rows, hidden), dtype=torch.bfloat16, device=device))
        _CACHE[key] = ws
    return ws


def solve(routing_logits, routing_bias, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
          gemm2_weights, gemm2_weights_scale, local_expert_offset, routed_scaling_factor):
    ntok, hidden = hidden_states.shape
    local, two_inter, _ = gemm1_weights.shape
    inter = two_inter // 2
    dev = hidden_states.device
    out = torch.empty((ntok, hidden), dtype=torch.bfloat16, device=dev)
    if ntok == 0:
        return out
    assert hidden % BLOCK == 0 and inter % BLOCK == 0
    _compiled()                                   # the full-size build, also when called at another size
    route, sched, place, up, down, combine = _compiled(hidden, inter)
    ws = _workspace(dev, ntok, hidden, inter, local)
    route(routing_logits.float().contiguous(), routing_bias.contiguous(), ws["ids"], ws["wts"], ws["slot"],
          ws["cnt"], int(local_expert_offset), float(routed_scaling_factor))
    sched(ws["cnt"], ws["pcnt"], ws["poff"], ws["texp"], ws["meta"])
    place(ws["ids"], ws["slot"], ws["poff"], ws["lt"], ws["row"])
    x8 = hidden_states.contiguous().view(torch.uint8)
    up(x8, gemm1_weights.contiguous().view(torch.uint8), hidden_states_scale.float().contiguous(),
       gemm1_weights_scale.float().contiguous(), ws["lt"], ws["texp"], ws["poff"], ws["pcnt"], ws["meta"], ws["q"],
       ws["qs"])
    down(ws["q"].view(torch.uint8), gemm2_weights.contiguous().view(torch.uint8), ws["qs"],
         gemm2_weights_scale.float().contiguous(), ws["lt"], ws["texp"], ws["poff"], ws["pcnt"], ws["meta"], ws["y"],
         ws["qs"])
    combine(ws["y"].view(-1, hidden // 8, 8), ws["row"], ws["wts"], out.view(ntok, hidden // 8, 8))
    return out
