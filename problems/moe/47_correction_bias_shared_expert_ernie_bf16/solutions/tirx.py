# ERNIE-4.5-21B-A3B MoE layer (hidden 2560, 64 routed SwiGLU experts of intermediate 1536, top-6 chosen by
# probability + correction bias, plus a shared SwiGLU of intermediate 3072), in TIRx: 7 kernels.
#
# 1. router (fp32 SIMT, grid T/32 CTAs x 256 threads): logits [32 tokens x 64 experts] with fp32 FMAs from
#    shared-memory tiles (x converted from bf16, gate weight fp32; each thread 2 tokens x 4 experts), then
#    per token (one warp, 2 experts per lane): softmax (xor-shuffle max / sum), the 6 largest p + bias by 6
#    warp arg-max rounds, w = p / max(sum p, 1e-12). Per-CTA expert histogram + each pair's rank among the
#    CTA's tokens (walk of a [32 x 64] choice table, one thread per expert).
# 2. place (grid T/32): expert offsets (exclusive scan of the totals), base of this CTA per expert, and the
#    pairs scattered into an expert-sorted list (token, weight); CTA 0 also writes the per-expert prefix of
#    128-row GEMM tiles.
# 3.-6. bf16 tensor-core GEMMs, one template (mma.sync m16n8k16, fp32 accumulation; CTA tile 128 x 128,
#    K stages of 32 through a 4-stage cp.async pipeline, 80 KiB dynamic shared memory, 2 CTAs / SM;
#    8 warps of 64 x 32; ldmatrix.x4 fragments; smem rows padded to 40 bf16, conflict-free ldmatrix):
#    - gate/up GEMM: the CTA's 128 B rows are 64 gate rows and the 64 matching up rows, so each thread
#      holds gate and up of the same outputs and the epilogue writes a = silu(g) * up as bf16 (the only
#      rounding the reference does not do; its effect is ~2^-9 of the output's typical size, far inside
#      the bf16 tolerance). Routed experts: rows are gathered from x through the sorted token list, the
#      CTA finds its expert from the tile prefix (grid = upper bound on tiles, idle CTAs exit).
#    - down GEMM: shared expert stores y to an fp32 accumulator out32[T, 2560]; routed experts add w * y
#      into it with red.global.add.v2.f32 (stream order puts the shared store first).
# 7. convert: out32 -> bf16 output.
#
# Limits: 774 GFLOP of expert GEMMs on mma.sync (roughly half of the wgmma peak; no wgmma/TMA pipeline
# here) plus the 1.5 GB expert-weight stream: expected ~1.8-2.5 ms, far from the ~0.8 ms tensor-core
# SOL but >5x faster than the eager reference (fp32 SGEMMs per expert without TF32, ~15 ms).
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules per shape; workspaces are allocated per call (torch.empty).

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 64
TOP_K = 6
NORM_MIN = 1e-12
THREADS = 256
# router
RT = 32                 # tokens per router CTA
RK = 32                 # K chunk
# GEMM template
BM = 128
BN = 128
BK = 32
LDS = BK + 8            # 80-byte padded smem rows
STAGES = 4
A_ST = BM * LDS
B_ST = BN * LDS
STAGE = A_ST + B_ST
POOL = STAGES * STAGE   # bf16 elements (80 KiB)
MT = 4                  # m tiles (16) per warp
NT = 4                  # n tiles (8) per warp


@T.prim_func
def router_kernel(x_handle: T.handle, g_handle: T.handle, bias_handle: T.handle, ids_handle: T.handle,
                  wt_handle: T.handle, rank_handle: T.handle, cnt_handle: T.handle):
    n_tok = T.int32()
    hidden = T.int32()
    n_blk = T.int32()
    X = T.match_buffer(x_handle, (n_tok, hidden), "bfloat16")
    G = T.match_buffer(g_handle, (NUM_EXPERTS, hidden), "float32")
    BIAS = T.match_buffer(bias_handle, (NUM_EXPERTS,), "float32")
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    WT = T.match_buffer(wt_handle, (n_tok, TOP_K), "float32")
    RANK = T.match_buffer(rank_handle, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")

    T.device_entry()
    cta = T.cta_id([n_blk])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    xs = T.alloc_shared((RT, RK + 1), "float32")
    gsm = T.alloc_shared((NUM_EXPERTS, RK + 1), "float32")
    lg = T.alloc_shared((RT, NUM_EXPERTS + 1), "float32")
    sel = T.alloc_shared((RT, NUM_EXPERTS), "int32")
    acc = T.alloc_local((8,), "float32")
    v = T.alloc_local((2,), "float32")
    p = T.alloc_local((2,), "float32")
    red = T.alloc_local((2,), "float32")
    bv = T.alloc_local((1,), "float32")
    bi = T.alloc_local((1,), "int32")
    ov = T.alloc_local((1,), "float32")
    oi = T.alloc_local((1,), "int32")
    si = T.alloc_local((TOP_K,), "int32")
    sp = T.alloc_local((TOP_K,), "float32")
    cnt = T.alloc_local((1,), "int32")

    t0: T.let[T.int32] = cta * RT
    tt: T.let[T.int32] = tid // 16          # tokens 2tt, 2tt+1
    te: T.let[T.int32] = tid % 16           # experts te, te+16, te+32, te+48

    for i in T.unroll(8):
        acc[i] = T.float32(0.0)
    for kc in range(hidden // RK):
        for u in T.unroll(RT * RK // THREADS):
            xs[(u * THREADS + tid) // RK, (u * THREADS + tid) % RK] = T.cast(
                X[T.min(t0 + (u * THREADS + tid) // RK, n_tok - 1), kc * RK + (u * THREADS + tid) % RK], "float32")
        for u in T.unroll(NUM_EXPERTS * RK // THREADS):
            gsm[(u * THREADS + tid) // RK, (u * THREADS + tid) % RK] = G[(u * THREADS + tid) // RK, kc * RK + (u * THREADS + tid) % RK]
        T.cuda.cta_sync()
        for k in T.unroll(RK):
            for a in T.unroll(2):
                for b in T.unroll(4):
                    acc[a * 4 + b] = acc[a * 4 + b] + xs[2 * tt + a, k] * gsm[te + 16 * b, k]
        T.cuda.cta_sync()
    for a in T.unroll(2):
        for b in T.unroll(4):
            lg[2 * tt + a, te + 16 * b] = acc[a * 4 + b]
    for u in T.unroll(RT * NUM_EXPERTS // THREADS):
        sel[(u * THREADS + tid) // NUM_EXPERTS, (u * THREADS + tid) % NUM_EXPERTS] = 0
    T.cuda.cta_sync()

    # per token: softmax, biased top-6, weights (warp w: tokens 4w .. 4w+3)
    for q in range(RT // 8):
        tl: T.let[T.int32] = warp * (RT // 8) + q
        if t0 + tl < n_tok:
            for c in T.unroll(2):
                v[c] = lg[tl, c * 32 + lane]
            red[0] = T.max(v[0], v[1])
            for s in T.unroll(5):
                red[0] = T.max(red[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[0], 16 >> s, 32, 32))
            for c in T.unroll(2):
                p[c] = T.exp(v[c] - red[0])
            red[1] = p[0] + p[1]
            for s in T.unroll(5):
                red[1] = red[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[1], 16 >> s, 32, 32)
            for c in T.unroll(2):
                p[c] = p[c] / red[1]
                v[c] = p[c] + BIAS[c * 32 + lane]
            for k in T.unroll(TOP_K):
                bv[0] = v[0]
                bi[0] = lane
                if v[1] > bv[0]:
                    bv[0] = v[1]
                    bi[0] = 32 + lane
                for s in T.unroll(5):
                    ov[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[0], 16 >> s, 32, 32)
                    oi[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bi[0], 16 >> s, 32, 32)
                    if ov[0] > bv[0] or (ov[0] == bv[0] and oi[0] < bi[0]):
                        bv[0] = ov[0]
                        bi[0] = oi[0]
                si[k] = bi[0]
                sp[k] = T.float32(0.0)
                if bi[0] % 32 == lane:
                    if bi[0] < 32:
                        sp[k] = p[0]
                        v[0] = T.float32(-3.0e38)
                    else:
                        sp[k] = p[1]
                        v[1] = T.float32(-3.0e38)
                sp[k] = T.tvm_warp_shuffle(0xFFFFFFFF, sp[k], bi[0] % 32, 32, 32)
            red[0] = sp[0]
            for k in T.unroll(TOP_K - 1):
                red[0] = red[0] + sp[k + 1]
            red[0] = T.max(red[0], T.float32(NORM_MIN))
            if lane < TOP_K:
                for k in T.unroll(TOP_K):
                    if lane == k:
                        IDS[t0 + tl, k] = si[k]
                        WT[t0 + tl, k] = sp[k] / red[0]
                        sel[tl, si[k]] = k + 1
    T.cuda.cta_sync()
    if tid < NUM_EXPERTS:
        cnt[0] = 0
        for tl2 in range(RT):
            if sel[tl2, tid] > 0:
                RANK[t0 + tl2, sel[tl2, tid] - 1] = cnt[0]
                cnt[0] = cnt[0] + 1
        CNT[cta, tid] = cnt[0]


@T.prim_func
def place_kernel(ids_handle: T.handle, wt_handle: T.handle, rank_handle: T.handle, cnt_handle: T.handle,
                 lt_handle: T.handle, lw_handle: T.handle, offs_handle: T.handle, toffs_handle: T.handle):
    n_tok = T.int32()
    n_blk = T.int32()
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    WT = T.match_buffer(wt_handle, (n_tok, TOP_K), "float32")
    RANK = T.match_buffer(rank_handle, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")
    LT = T.match_buffer(lt_handle, (n_tok * TOP_K,), "int32")
    LW = T.match_buffer(lw_handle, (n_tok * TOP_K,), "float32")
    OFFS = T.match_buffer(offs_handle, (NUM_EXPERTS + 1,), "int32")
    TOFFS = T.match_buffer(toffs_handle, (NUM_EXPERTS + 1,), "int32")

    T.device_entry()
    cta = T.cta_id([n_blk])
    tid = T.thread_id([THREADS])
    tot = T.alloc_shared((NUM_EXPERTS,), "int32")
    base = T.alloc_shared((NUM_EXPERTS,), "int32")
    a = T.alloc_local((3,), "int32")

    if tid < NUM_EXPERTS:
        a[0] = 0
        a[1] = 0
        for c in range(n_blk):
            if c < cta:
                a[1] = a[1] + CNT[c, tid]
            a[0] = a[0] + CNT[c, tid]
        tot[tid] = a[0]
    T.cuda.cta_sync()
    if tid < NUM_EXPERTS:
        a[0] = 0
        a[2] = 0
        for e in range(tid):
            a[0] = a[0] + tot[e]
            a[2] = a[2] + T.ceildiv(tot[e], BM)
        base[tid] = a[0] + a[1]
        if cta == 0:
            OFFS[tid] = a[0]
            TOFFS[tid] = a[2]
            if tid == NUM_EXPERTS - 1:
                OFFS[NUM_EXPERTS] = a[0] + tot[tid]
                TOFFS[NUM_EXPERTS] = a[2] + T.ceildiv(tot[tid], BM)
    T.cuda.cta_sync()
    if tid < RT * TOP_K:
        t: T.let[T.int32] = cta * RT + tid // TOP_K
        k: T.let[T.int32] = tid % TOP_K
        if t < n_tok:
            pos: T.let[T.int32] = base[IDS[t, k]] + RANK[t, k]
            LT[pos] = t
            LW[pos] = WT[t, k]


def make_gemm(kind, n_exp, k_dim, n_half, gather):
    """kind 'gateup': A [rows, k_dim] (gathered x rows), B [n_exp, 2*n_half, k_dim] -> silu(g)*u [P, n_half] bf16.
    kind 'down': A [P, k_dim] (expert-sorted rows), B [n_exp, n_out, k_dim] -> fp32 out (store or weighted red.add)."""
    nk = k_dim // BK
    assert k_dim % BK == 0
    is_gu = kind == "gateup"
    gu_gather = is_gu and gather
    cols_per_cta = BN // 2 if is_gu else BN
    c_dtype = "bfloat16" if is_gu else "float32"

    @T.prim_func
    def gemm(a_handle: T.handle, b_handle: T.handle, lt_handle: T.handle, lw_handle: T.handle,
             offs_handle: T.handle, toffs_handle: T.handle, c_handle: T.handle, n_tiles: T.int32):
        n_rows = T.int32()        # rows of A (tokens for gate/up, pairs for down)
        n_b = T.int32()           # rows of B per expert
        n_p = T.int32()           # length of the sorted pair list
        n_c = T.int32()           # rows of C
        n_cc = T.int32()          # columns of C
        A = T.match_buffer(a_handle, (n_rows, k_dim), "bfloat16", align=16)
        B = T.match_buffer(b_handle, (n_exp, n_b, k_dim), "bfloat16", align=16)
        LT = T.match_buffer(lt_handle, (n_p,), "int32")
        LW = T.match_buffer(lw_handle, (n_p,), "float32")
        OFFS = T.match_buffer(offs_handle, (n_exp + 1,), "int32")
        TOFFS = T.match_buffer(toffs_handle, (n_exp + 1,), "int32")
        C = T.match_buffer(c_handle, (n_c, n_cc), c_dtype, align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        bx, by = T.cta_id([n_tiles, n_cc // cols_per_cta])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
        acc = T.alloc_local((MT * NT * 4,), "float32")
        af = T.alloc_local((MT * 4,), "uint32")
        bfr = T.alloc_local((NT * 2,), "uint32")
        ex = T.alloc_local((3,), "int32")          # expert, first row, valid rows
        arow = T.alloc_local((2,), "int32")        # source rows of this thread's two A chunks
        ov = T.alloc_local((2,), "bfloat16")
        y = T.alloc_local((2,), "float32")

        wm: T.let[T.int32] = warp % 2
        wn: T.let[T.int32] = warp // 2
        lr: T.let[T.int32] = lane % 8
        lj: T.let[T.int32] = lane // 8
        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4

        # ---- which expert / rows this CTA computes ----
        if gather:
            ex[0] = 0
            for e in range(n_exp):
                if TOFFS[e + 1] <= bx:
                    ex[0] = e + 1
            if ex[0] < n_exp:
                ex[1] = OFFS[ex[0]] + (bx - TOFFS[ex[0]]) * BM
                ex[2] = T.min(BM, OFFS[ex[0] + 1] - ex[1])
            else:
                ex[1] = 0
                ex[2] = 0
        else:
            ex[0] = 0
            ex[1] = bx * BM
            ex[2] = T.min(BM, n_c - bx * BM)

        if ex[2] > 0:
            # A rows loaded by this thread (2 chunks of 16 B per stage: rows (u*256 + tid) // 4)
            for u in T.unroll(2):
                if gu_gather:
                    arow[u] = LT[ex[1] + T.min((u * THREADS + tid) // 4, ex[2] - 1)]
                else:
                    arow[u] = ex[1] + T.min((u * THREADS + tid) // 4, ex[2] - 1)
            for i in T.unroll(MT * NT * 4):
                acc[i] = T.float32(0.0)

            for s in T.unroll(STAGES - 1):
                if s < nk:
                    for u in T.unroll(2):
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                            T.address_of(A[arow[u], s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                    for u in T.unroll(2):
                        if is_gu:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                                T.address_of(B[ex[0], ((u * THREADS + tid) // 4) // 64 * n_half + by * 64 + ((u * THREADS + tid) // 4) % 64,
                                               s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                        else:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                                T.address_of(B[ex[0], by * BN + (u * THREADS + tid) // 4, s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                T.ptx.cp.async_.commit_group()

            for kt in range(nk):
                T.ptx.cp.async_.wait_group(STAGES - 2)
                T.cuda.cta_sync()
                nxt: T.let[T.int32] = kt + STAGES - 1
                if nxt < nk:
                    for u in T.unroll(2):
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                            T.address_of(A[arow[u], nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                    for u in T.unroll(2):
                        if is_gu:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                                T.address_of(B[ex[0], ((u * THREADS + tid) // 4) // 64 * n_half + by * 64 + ((u * THREADS + tid) // 4) % 64,
                                               nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                        else:
                            T.ptx.cp.async_.cg.shared.global_(
                                T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                                T.address_of(B[ex[0], by * BN + (u * THREADS + tid) // 4, nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                T.ptx.cp.async_.commit_group()

                buf: T.let[T.int32] = (kt % STAGES) * STAGE
                for kk in T.unroll(BK // 16):
                    for i in T.unroll(MT):
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                            af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                            T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * LDS + kk * 16 + 8 * (lj // 2)]))
                    for pq in T.unroll(2):
                        if is_gu:
                            # pair 0: gate n tiles of this warp, pair 1: the matching up tiles
                            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                                T.address_of(pool[buf + A_ST + (pq * 64 + wn * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
                        else:
                            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                                bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                                T.address_of(pool[buf + A_ST + (wn * 32 + pq * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
                    for i in T.unroll(MT):
                        for n in T.unroll(NT):
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                acc[(i * NT + n) * 4 + 0], acc[(i * NT + n) * 4 + 1], acc[(i * NT + n) * 4 + 2], acc[(i * NT + n) * 4 + 3],
                                af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                                bfr[n * 2 + 0], bfr[n * 2 + 1],
                                acc[(i * NT + n) * 4 + 0], acc[(i * NT + n) * 4 + 1], acc[(i * NT + n) * 4 + 2], acc[(i * NT + n) * 4 + 3])
            T.ptx.cp.async_.wait_group(0)

            # ---- epilogue ----
            for i in T.unroll(MT):
                for h in T.unroll(2):
                    rl: T.let[T.int32] = wm * 64 + i * 16 + g + 8 * h
                    if rl < ex[2]:
                        if is_gu:
                            for j in T.unroll(2):
                                for e in T.unroll(2):
                                    y[0] = acc[(i * NT + j) * 4 + h * 2 + e]
                                    ov[e] = T.cast(y[0] / (T.float32(1.0) + T.exp(T.float32(0.0) - y[0]))
                                                   * acc[(i * NT + j + 2) * 4 + h * 2 + e], "bfloat16")
                                for e in T.vectorized(2):
                                    C[ex[1] + rl, by * 64 + wn * 16 + j * 8 + 2 * tq + e] = ov[e]
                        elif gather:
                            for n in T.unroll(NT):
                                T.ptx.red.global_.add.v2.f32(
                                    T.address_of(C[LT[ex[1] + rl], by * BN + wn * 32 + n * 8 + 2 * tq]),
                                    LW[ex[1] + rl] * acc[(i * NT + n) * 4 + h * 2 + 0],
                                    LW[ex[1] + rl] * acc[(i * NT + n) * 4 + h * 2 + 1])
                        else:
                            for n in T.unroll(NT):
                                for e in T.unroll(2):
                                    y[e] = acc[(i * NT + n) * 4 + h * 2 + e]
                                for e in T.vectorized(2):
                                    C[ex[1] + rl, by * BN + wn * 32 + n * 8 + 2 * tq + e] = y[e]

    return gemm


@T.prim_func
def convert_kernel(src_handle: T.handle, dst_handle: T.handle):
    n = T.int32()
    S = T.match_buffer(src_handle, (n, 8), "float32", align=16)
    D = T.match_buffer(dst_handle, (n, 8), "bfloat16", align=16)
    T.device_entry()
    cta = T.cta_id([T.ceildiv(n, THREADS)])
    tid = T.thread_id([THREADS])
    v = T.alloc_local((8,), "float32")
    o = T.alloc_local((8,), "bfloat16")
    r: T.let[T.int32] = cta * THREADS + tid
    if r < n:
        for h in T.unroll(2):
            for i in T.vectorized(4):
                v[h * 4 + i] = S[r, h * 4 + i]
        for i in T.unroll(8):
            o[i] = T.cast(v[i], "bfloat16")
        for i in T.vectorized(8):
            D[r, i] = o[i]


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


def _compiled(hidden=2560, inter=1536, shared_inter=3072):
    key = ("exes", hidden, inter, shared_inter)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (router_kernel, place_kernel,
                 make_gemm("gateup", 1, hidden, shared_inter, False),
                 make_gemm("down", 1, shared_inter, shared_inter, False),
                 make_gemm("gateup", NUM_EXPERTS, hidden, inter, True),
                 make_gemm("down", NUM_EXPERTS, inter, inter, True),
                 convert_kernel)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def solve(hidden_states, gate_weight, e_score_correction_bias, experts_gate_up, experts_down, shared_gate_up,
          shared_down):
    n_tok, hidden = hidden_states.shape
    inter = experts_down.shape[2]
    shared_inter = shared_down.shape[1]
    assert hidden % BN == 0 and inter % 64 == 0 and shared_inter % 64 == 0 and hidden % RK == 0
    _compiled()                                    # the full-size build, also when called at another size
    router, place, s_gu, s_dn, e_gu, e_dn, convert = _compiled(hidden, inter, shared_inter)
    dev = hidden_states.device
    x = hidden_states.contiguous()
    n_blk = (n_tok + RT - 1) // RT
    n_pairs = n_tok * TOP_K
    i32, f32 = torch.int32, torch.float32
    ids = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    wt = torch.empty((n_tok, TOP_K), dtype=f32, device=dev)
    rank = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    cnt = torch.empty((n_blk, NUM_EXPERTS), dtype=i32, device=dev)
    lt = torch.empty((n_pairs,), dtype=i32, device=dev)
    lw = torch.empty((n_pairs,), dtype=f32, device=dev)
    offs = torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev)
    toffs = torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev)
    a_sh = torch.empty((n_tok, shared_inter), dtype=torch.bfloat16, device=dev)
    a_ex = torch.empty((n_pairs, inter), dtype=torch.bfloat16, device=dev)
    out32 = torch.empty((n_tok, hidden), dtype=f32, device=dev)
    out = torch.empty((n_tok, hidden), dtype=hidden_states.dtype, device=dev)
    one = torch.empty((2,), dtype=i32, device=dev)    # expert offsets of the single shared "expert" (not read)
    router(x, gate_weight.to(f32).contiguous(), e_score_correction_bias.to(f32).contiguous(), ids, wt, rank, cnt)
    place(ids, wt, rank, cnt, lt, lw, offs, toffs)
    m_tiles = (n_tok + BM - 1) // BM
    e_tiles = n_pairs // BM + NUM_EXPERTS          # upper bound on the routed GEMM tiles
    s_gu(x, shared_gate_up.contiguous().view(1, 2 * shared_inter, hidden), lt, lw, one, one, a_sh, m_tiles)
    s_dn(a_sh, shared_down.contiguous().view(1, hidden, shared_inter), lt, lw, one, one, out32, m_tiles)
    e_gu(x, experts_gate_up.contiguous(), lt, lw, offs, toffs, a_ex, e_tiles)
    e_dn(a_ex, experts_down.contiguous(), lt, lw, offs, toffs, out32, e_tiles)
    convert(out32.view(-1, 8), out.view(-1, 8))
    return out
