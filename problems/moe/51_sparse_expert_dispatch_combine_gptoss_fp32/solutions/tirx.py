# gpt-oss-20b MoE layer in fp32 (hidden 2880, 32 experts, top-4 with a softmax over the chosen logits, clamped
# SwiGLU experts with interleaved gate/up columns and biases): six TIRx kernels, fp32 FMA throughout (the
# problem requires fp32 arithmetic, no TF32).
#
# 1. router (grid T/32 x 256 threads): logits = x @ Wr^T + br for 32 tokens x 32 experts per CTA from shared
#    tiles (each thread 2 tokens x 2 experts; two-level accumulation over 32-wide K chunks); then one warp per
#    token, one expert per lane: 4 warp arg-max rounds pick the top-4 logits, the ids are ranked to ascending
#    order, w = softmax over the 4 chosen logits (accurate exp: Cody-Waite + degree-7 polynomial; div.rn; TVM
#    builds with --use_fast_math). Per-CTA expert counts and each pair's rank among the CTA's tokens.
# 2. place: expert offsets, the expert-sorted pair list (token per pair), each (token, k)'s list position, and
#    the per-expert prefix of 128-row GEMM tiles.
# 3./4. grouped fp32 SIMT GEMMs over the sorted pairs (CTA tile 128 x 128, 256 threads, 8 x 8 outputs per
#    thread, K tiles of 16 in two k-major shared buffers, next tile loaded global -> registers during the FMAs;
#    two-level accumulation with a fresh partial per 64 k values). The CTA finds its expert from the tile prefix
#    (grid = an upper bound on tiles, idle CTAs exit). Operands are viewed as [rows, cols / 4, 4] for provably
#    aligned float4 accesses.
#    - gate/up: A = x rows gathered through the pair list, B = gate_up_proj[e] ([2880, 5760], k-major), epilogue
#      h = acc + bias; each thread's 4 consecutive columns are (gate, up, gate, up): act = (clamp(up, -7, 7) + 1)
#      * g * sigmoid(1.702 g), g = min(gate, 7), sigmoid with the accurate exp and div.rn -> act [pairs, 2880].
#    - down: A = act (contiguous rows of the expert), B = down_proj[e] ([2880, 2880]), y = acc + down_bias ->
#      y [pairs, 2880].
# 5. combine: out[t] = ((w0 y0 + w1 y1) + w2 y2) + w3 y3 in ascending expert order (the reference's order),
#    float4 per thread, deterministic (no atomics).
#
# Limits: 408 GFLOP on the fp32 FMA pipes (67 TFLOP/s peak): ~6.1 ms at peak, expected ~8-10 ms; 3.2 GB of fp32
# expert weights are streamed (~0.7 ms of DRAM, overlapped). Eager PyTorch loops over the 32 experts with
# cuBLAS SGEMMs of ~256 rows plus gathers / index_add: expected around eager speed (both FMA-bound; cuBLAS's
# SGEMM is better tuned, this version fuses the SwiGLU and avoids the per-expert gathers and launches).
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules; workspaces are allocated per call.

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 32
TOP_K = 4
ALPHA = 1.702
LIMIT = 7.0
THREADS = 256
RT = 32                 # router tokens per CTA
RK = 32                 # router K chunk
BM = 128
BN = 128
BK = 16
PAD = BM + 4
FLUSH = 4
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


@T.prim_func
def router_kernel(x_handle: T.handle, w_handle: T.handle, b_handle: T.handle, ids_handle: T.handle,
                  wt_handle: T.handle, rank_handle: T.handle, cnt_handle: T.handle):
    n_tok = T.int32()
    hidden = T.int32()
    n_blk = T.int32()
    X = T.match_buffer(x_handle, (n_tok, hidden), "float32")
    W = T.match_buffer(w_handle, (NUM_EXPERTS, hidden), "float32")
    BR = T.match_buffer(b_handle, (NUM_EXPERTS,), "float32")
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
    ws = T.alloc_shared((NUM_EXPERTS, RK + 1), "float32")
    lg = T.alloc_shared((RT, NUM_EXPERTS + 1), "float32")
    sel = T.alloc_shared((RT, NUM_EXPERTS), "int32")
    acc = T.alloc_local((4,), "float32")
    tot = T.alloc_local((4,), "float32")
    v = T.alloc_local((1,), "float32")
    bv = T.alloc_local((1,), "float32")
    bi = T.alloc_local((1,), "int32")
    ov = T.alloc_local((1,), "float32")
    oi = T.alloc_local((1,), "int32")
    si = T.alloc_local((TOP_K,), "int32")
    sv = T.alloc_local((TOP_K,), "float32")
    ex = T.alloc_local((TOP_K,), "float32")
    xr = T.alloc_local((4,), "float32")
    cnt = T.alloc_local((1,), "int32")

    t0: T.let[T.int32] = cta * RT
    tt: T.let[T.int32] = tid // 16          # tokens 2tt, 2tt+1
    te: T.let[T.int32] = tid % 16           # experts te, te+16

    for i in T.unroll(4):
        tot[i] = T.float32(0.0)
    for kc in range(T.ceildiv(hidden, RK)):
        for u in T.unroll(RT * RK // THREADS):
            xs[(u * THREADS + tid) // RK, (u * THREADS + tid) % RK] = T.if_then_else(
                kc * RK + (u * THREADS + tid) % RK < hidden,
                X[T.min(t0 + (u * THREADS + tid) // RK, n_tok - 1), T.min(kc * RK + (u * THREADS + tid) % RK, hidden - 1)],
                T.float32(0.0))
        for u in T.unroll(NUM_EXPERTS * RK // THREADS):
            ws[(u * THREADS + tid) // RK, (u * THREADS + tid) % RK] = T.if_then_else(
                kc * RK + (u * THREADS + tid) % RK < hidden,
                W[(u * THREADS + tid) // RK, T.min(kc * RK + (u * THREADS + tid) % RK, hidden - 1)],
                T.float32(0.0))
        T.cuda.cta_sync()
        for i in T.unroll(4):
            acc[i] = T.float32(0.0)
        for k in T.unroll(RK):
            for a in T.unroll(2):
                for b in T.unroll(2):
                    acc[a * 2 + b] = acc[a * 2 + b] + xs[2 * tt + a, k] * ws[te + 16 * b, k]
        for i in T.unroll(4):
            tot[i] = tot[i] + acc[i]
        T.cuda.cta_sync()
    for a in T.unroll(2):
        for b in T.unroll(2):
            lg[2 * tt + a, te + 16 * b] = tot[a * 2 + b] + BR[te + 16 * b]
    for u in T.unroll(RT * NUM_EXPERTS // THREADS):
        sel[(u * THREADS + tid) // NUM_EXPERTS, (u * THREADS + tid) % NUM_EXPERTS] = 0
    T.cuda.cta_sync()

    for q in range(RT // 8):
        tl: T.let[T.int32] = warp * (RT // 8) + q
        if t0 + tl < n_tok:
            v[0] = lg[tl, lane]
            for k in T.unroll(TOP_K):
                bv[0] = v[0]
                bi[0] = lane
                for s in T.unroll(5):
                    ov[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bv[0], 16 >> s, 32, 32)
                    oi[0] = T.tvm_warp_shuffle_xor(0xFFFFFFFF, bi[0], 16 >> s, 32, 32)
                    if ov[0] > bv[0] or (ov[0] == bv[0] and oi[0] < bi[0]):
                        bv[0] = ov[0]
                        bi[0] = oi[0]
                si[k] = bi[0]
                sv[k] = bv[0]
                if bi[0] == lane:
                    v[0] = T.float32(-3.0e38)
            # softmax over the 4 chosen logits (sv[0] is the largest)
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
            xr[0] = ((ex[0] + ex[1]) + ex[2]) + ex[3]
            for k in T.unroll(TOP_K):
                if lane == k:
                    cnt[0] = 0
                    for j in T.unroll(TOP_K):
                        if si[j] < si[k]:
                            cnt[0] = cnt[0] + 1
                    IDS[t0 + tl, cnt[0]] = si[k]
                    T.ptx.div.rn.f32(xr[1], ex[k], xr[0])
                    WT[t0 + tl, cnt[0]] = xr[1]
                    sel[tl, si[k]] = cnt[0] + 1
    T.cuda.cta_sync()
    if tid < NUM_EXPERTS:
        cnt[0] = 0
        for tl2 in range(RT):
            if sel[tl2, tid] > 0:
                RANK[t0 + tl2, sel[tl2, tid] - 1] = cnt[0]
                cnt[0] = cnt[0] + 1
        CNT[cta, tid] = cnt[0]


@T.prim_func
def place_kernel(ids_handle: T.handle, rank_handle: T.handle, cnt_handle: T.handle, lt_handle: T.handle,
                 pos_handle: T.handle, offs_handle: T.handle, toffs_handle: T.handle):
    n_tok = T.int32()
    n_blk = T.int32()
    IDS = T.match_buffer(ids_handle, (n_tok, TOP_K), "int32")
    RANK = T.match_buffer(rank_handle, (n_tok, TOP_K), "int32")
    CNT = T.match_buffer(cnt_handle, (n_blk, NUM_EXPERTS), "int32")
    LT = T.match_buffer(lt_handle, (n_tok * TOP_K,), "int32")
    POS = T.match_buffer(pos_handle, (n_tok, TOP_K), "int32")
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
            p: T.let[T.int32] = base[IDS[t, k]] + RANK[t, k]
            LT[p] = t
            POS[t, k] = p


def make_grouped_sgemm(mode):
    """Grouped C[pairs of e, N] = A_rows(e) @ B[e] (+ bias[e]); B [E, K, N] viewed as [E*K, N/4, 4].
    mode 'swiglu': A rows gathered from x through LT, C = act [pairs, N/2]. mode 'bias': A rows contiguous, C = y."""

    @T.prim_func
    def gsgemm(a_handle: T.handle, b_handle: T.handle, bias_handle: T.handle, lt_handle: T.handle,
               offs_handle: T.handle, toffs_handle: T.handle, c_handle: T.handle, kd: T.int32, n_tiles: T.int32):
        ar = T.int32()
        ac4 = T.int32()
        bkr = T.int32()            # E * K
        n4 = T.int32()             # N / 4
        n_p = T.int32()
        cr = T.int32()
        cc4 = T.int32()
        A = T.match_buffer(a_handle, (ar, ac4, 4), "float32", align=16)
        B = T.match_buffer(b_handle, (bkr, n4, 4), "float32", align=16)
        BIAS = T.match_buffer(bias_handle, (NUM_EXPERTS, n4 * 4), "float32")
        LT = T.match_buffer(lt_handle, (n_p,), "int32")
        OFFS = T.match_buffer(offs_handle, (NUM_EXPERTS + 1,), "int32")
        TOFFS = T.match_buffer(toffs_handle, (NUM_EXPERTS + 1,), "int32")
        C = T.match_buffer(c_handle, (cr, cc4, 4), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx, by = T.cta_id([T.ceildiv(n4 * 4, BN), n_tiles])
        tid = T.thread_id([THREADS])

        As = T.alloc_shared((2, BK, PAD), "float32")
        Bs = T.alloc_shared((2, BK, PAD), "float32")
        acc = T.alloc_local((64,), "float32")
        tot = T.alloc_local((64,), "float32")
        ra = T.alloc_local((8,), "float32")
        rb = T.alloc_local((8,), "float32")
        av = T.alloc_local((8,), "float32")
        bv = T.alloc_local((8,), "float32")
        y = T.alloc_local((8,), "float32")
        av2 = T.alloc_local((2,), "float32")
        e = T.alloc_local((6,), "float32")
        ex = T.alloc_local((3,), "int32")          # expert, first pair row, valid rows
        arow = T.alloc_local((2,), "int32")

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        n0: T.let[T.int32] = bx * BN
        n: T.let[T.int32] = n4 * 4
        nk: T.let[T.int32] = T.ceildiv(kd, BK)
        rr: T.let[T.int32] = tid // 4
        rk: T.let[T.int32] = (tid % 4) * 4
        ck: T.let[T.int32] = tid // 32
        cc: T.let[T.int32] = (tid % 32) * 4

        ex[0] = 0
        for q in range(NUM_EXPERTS):
            if TOFFS[q + 1] <= by:
                ex[0] = q + 1
        if ex[0] < NUM_EXPERTS:
            ex[1] = OFFS[ex[0]] + (by - TOFFS[ex[0]]) * BM
            ex[2] = T.min(BM, OFFS[ex[0] + 1] - ex[1])
        else:
            ex[1] = 0
            ex[2] = 0

        if ex[2] > 0:
            for u in T.unroll(2):
                if mode == "swiglu":
                    arow[u] = LT[ex[1] + T.min(rr + u * 64, ex[2] - 1)]
                else:
                    arow[u] = ex[1] + T.min(rr + u * 64, ex[2] - 1)
            for i in T.unroll(64):
                acc[i] = T.float32(0.0)
                tot[i] = T.float32(0.0)

            for kt in range(nk + 1):
                if kt < nk:
                    for u in T.unroll(2):
                        for i in T.vectorized(4):
                            ra[u * 4 + i] = A[arow[u], T.min((kt * BK + rk) // 4, ac4 - 1), i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(kt * BK + rk < kd, ra[u * 4 + i], T.float32(0.0))
                        for i in T.vectorized(4):
                            rb[u * 4 + i] = B[ex[0] * kd + T.min(kt * BK + ck + u * 8, kd - 1), T.min((n0 + cc) // 4, n4 - 1), i]
                        for i in T.unroll(4):
                            rb[u * 4 + i] = T.if_then_else(kt * BK + ck + u * 8 < kd, rb[u * 4 + i], T.float32(0.0))
                if kt > 0:
                    cur: T.let[T.int32] = (kt - 1) % 2
                    for k in T.unroll(BK):
                        for hh in T.unroll(2):
                            for i in T.vectorized(4):
                                av[hh * 4 + i] = As[cur, k, hh * 64 + ty * 4 + i]
                            for i in T.vectorized(4):
                                bv[hh * 4 + i] = Bs[cur, k, hh * 64 + tx * 4 + i]
                        for a in T.unroll(8):
                            for b in T.unroll(8):
                                acc[a * 8 + b] = acc[a * 8 + b] + av[a] * bv[b]
                    if (kt - 1) % FLUSH == FLUSH - 1:
                        for i in T.unroll(64):
                            tot[i] = tot[i] + acc[i]
                            acc[i] = T.float32(0.0)
                if kt < nk:
                    for u in T.unroll(2):
                        for i in T.unroll(4):
                            As[kt % 2, rk + i, rr + u * 64] = ra[u * 4 + i]
                        for i in T.vectorized(4):
                            Bs[kt % 2, ck + u * 8, cc + i] = rb[u * 4 + i]
                T.cuda.cta_sync()

            for i in T.unroll(64):
                tot[i] = tot[i] + acc[i]

            for hb in T.unroll(2):
                col: T.let[T.int32] = n0 + hb * 64 + tx * 4
                for j in T.unroll(4):
                    y[4 + j] = BIAS[ex[0], T.min(col + j, n - 1)]
                for a in T.unroll(8):
                    rl: T.let[T.int32] = (a // 4) * 64 + ty * 4 + a % 4
                    if rl < ex[2] and col < n:
                        for j in T.unroll(4):
                            y[j] = tot[a * 8 + hb * 4 + j] + y[4 + j]
                        if mode == "swiglu":
                            # columns (col, col+1) and (col+2, col+3) are (gate, up) pairs -> act columns col/2, col/2+1
                            for p in T.unroll(2):
                                e[0] = T.min(y[2 * p], T.float32(LIMIT))                               # gate
                                e[1] = T.min(T.max(y[2 * p + 1], T.float32(-LIMIT)), T.float32(LIMIT))  # up
                                # sigmoid(alpha * gate) = 1 / (1 + exp(-alpha * gate)), accurate exp
                                e[2] = T.min(T.max(T.float32(0.0) - T.float32(ALPHA) * e[0], T.float32(-87.0)), T.float32(88.0))
                                e[3] = T.floor(e[2] * T.float32(LOG2E) + T.float32(0.5))
                                e[4] = (e[2] - e[3] * T.float32(LN2_HI)) - e[3] * T.float32(LN2_LO)
                                e[5] = T.float32(1.0 / 5040.0)
                                e[5] = e[5] * e[4] + T.float32(1.0 / 720.0)
                                e[5] = e[5] * e[4] + T.float32(1.0 / 120.0)
                                e[5] = e[5] * e[4] + T.float32(1.0 / 24.0)
                                e[5] = e[5] * e[4] + T.float32(1.0 / 6.0)
                                e[5] = e[5] * e[4] + T.float32(0.5)
                                e[5] = e[5] * e[4] + T.float32(1.0)
                                e[5] = e[5] * e[4] + T.float32(1.0)
                                e[5] = e[5] * T.reinterpret("float32", T.shift_left(T.cast(e[3], "int32") + 127, 23))
                                T.ptx.div.rn.f32(e[2], T.float32(1.0), T.float32(1.0) + e[5])
                                av2[p] = (e[1] + T.float32(1.0)) * (e[0] * e[2])
                            for p in T.vectorized(2):
                                C[ex[1] + rl, col // 8, (col // 2) % 4 + p] = av2[p]
                        else:
                            for j in T.vectorized(4):
                                C[ex[1] + rl, col // 4, j] = y[j]

    return gsgemm


@T.prim_func
def combine_kernel(y_handle: T.handle, pos_handle: T.handle, wt_handle: T.handle, o_handle: T.handle):
    n_pair = T.int32()
    h4 = T.int32()
    n_tok = T.int32()
    Y = T.match_buffer(y_handle, (n_pair, h4, 4), "float32", align=16)
    POS = T.match_buffer(pos_handle, (n_tok, TOP_K), "int32")
    WT = T.match_buffer(wt_handle, (n_tok, TOP_K), "float32")
    O = T.match_buffer(o_handle, (n_tok, h4, 4), "float32", align=16)
    T.device_entry()
    t, cb = T.cta_id([n_tok, T.ceildiv(h4, THREADS)])
    tid = T.thread_id([THREADS])
    acc = T.alloc_local((4,), "float32")
    yv = T.alloc_local((4,), "float32")
    c: T.let[T.int32] = cb * THREADS + tid
    if c < h4:
        for i in T.unroll(4):
            acc[i] = T.float32(0.0)
        for k in T.unroll(TOP_K):
            for i in T.vectorized(4):
                yv[i] = Y[POS[t, k], c, i]
            for i in T.unroll(4):
                acc[i] = acc[i] + yv[i] * WT[t, k]
        for i in T.vectorized(4):
            O[t, c, i] = acc[i]


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
        funcs = (router_kernel, place_kernel, make_grouped_sgemm("swiglu"), make_grouped_sgemm("bias"),
                 combine_kernel)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE["exes"] = exes
    return exes


def solve(hidden_states, router_weight, router_bias, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias):
    router, place, g_up, g_down, combine = _compiled()
    n_tok, hidden = hidden_states.shape
    inter = down_proj.shape[1]
    assert hidden % 4 == 0 and inter % 4 == 0 and n_tok > 0
    dev = hidden_states.device
    i32, f32 = torch.int32, torch.float32
    x = hidden_states.contiguous()
    n_blk = (n_tok + RT - 1) // RT
    n_pairs = n_tok * TOP_K
    ids = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    wt = torch.empty((n_tok, TOP_K), dtype=f32, device=dev)
    rank = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    cnt = torch.empty((n_blk, NUM_EXPERTS), dtype=i32, device=dev)
    lt = torch.empty((n_pairs,), dtype=i32, device=dev)
    pos = torch.empty((n_tok, TOP_K), dtype=i32, device=dev)
    offs = torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev)
    toffs = torch.empty((NUM_EXPERTS + 1,), dtype=i32, device=dev)
    act = torch.empty((n_pairs, inter), dtype=f32, device=dev)
    y = torch.empty((n_pairs, hidden), dtype=f32, device=dev)
    out = torch.empty((n_tok, hidden), dtype=f32, device=dev)
    router(x, router_weight.contiguous(), router_bias.contiguous(), ids, wt, rank, cnt)
    place(ids, rank, cnt, lt, pos, offs, toffs)
    tiles = n_pairs // BM + NUM_EXPERTS                  # upper bound on the grouped GEMM tiles
    g_up(x.view(n_tok, hidden // 4, 4), gate_up_proj.contiguous().view(NUM_EXPERTS * hidden, 2 * inter // 4, 4),
         gate_up_proj_bias.contiguous(), lt, offs, toffs, act.view(n_pairs, inter // 4, 4), hidden, tiles)
    g_down(act.view(n_pairs, inter // 4, 4), down_proj.contiguous().view(NUM_EXPERTS * inter, hidden // 4, 4),
           down_proj_bias.contiguous(), lt, offs, toffs, y.view(n_pairs, hidden // 4, 4), inter, tiles)
    combine(y.view(n_pairs, hidden // 4, 4), pos, wt, out.view(n_tok, hidden // 4, 4))
    return out
