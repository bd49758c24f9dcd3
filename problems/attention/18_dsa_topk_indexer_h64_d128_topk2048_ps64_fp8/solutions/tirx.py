# DeepSeek-V3.2 lightning indexer (64 index heads x 128, fp8 e4m3 queries and paged fp8 keys with per-token
# fp32 scales, page size 64, top-2048) in TIRx: a tensor-core scoring kernel and a per-request radix-select /
# compaction kernel. Same decomposition as the CuTe DSL solution.
#
# Kernel 1 (score_kernel): grid (128 page groups, B), 128 threads = 4 warps; a CTA scores up to 4 pages
# (256 tokens) of one request and does nothing past seq_len.
# - Q_b (64 x 128 fp8) is decoded once to bf16 into a swizzled shared tile [64 x 128] (16-byte pieces
#   XOR-swizzled by row % 8); each page's 64 x 128 fp8 key values (8 KiB, 16-byte loads) likewise; the 64
#   per-token fp32 scales and the 64 head weights go to shared memory.
#   DIFFERENCE from the CuTe solution: fp8 -> bf16 (not fp16) by integer bit manipulation in registers
#   (normal e4m3: exponent + 120, mantissa << 4; subnormals m * 2^-9 via an exact float product); every
#   e4m3 value is exact in bf16, so the products are exact as with fp16.
# - mma.sync m16n8k16 (bf16 in, fp32 accumulate): warp w computes S = K[16w .. 16w+15] Q^T (16 tokens x 64
#   heads, 8 k-steps x 8 head tiles); then per token score = sum_h w_h * relu(S[t, h] * scale_t): each
#   thread sums its 16 heads, 2 quad shuffles finish the sum, and the score goes (fp32) to a workspace
#   [B, 32768] (positions < seq_len only).
# Kernel 2 (topk_kernel): grid (B), 1024 threads; thread t owns positions 32t .. 32t+31 in registers as
#   orderable uint32 keys of the fp32 scores (0 = absent).
# - n <= 2048: every position is selected. Otherwise a 4-pass 8-bit radix select finds the exact key of the
#   2048th largest score (shared histogram with atomic adds; warp 0 finds the bin by a prefix scan over
#   lanes that own the bins in descending order, 8 per lane); keys above it are selected, plus the first
#   (by position) keys equal to it until 2048 are taken.
# - Compaction in position order: per-thread counts, block-wide exclusive scans (warp shuffle-up scans +
#   shared warp totals), each selected position p is written as block_table[b, p / 64] * 64 + p % 64; the
#   rest of the row is -1.
# Exactness: scores differ from the reference's fp32 evaluation only by rounding order (~1e-6 relative),
# while the generator guarantees a top-2048 decision margin of 1e-4 of the row's largest |score|.
# What limits it: the scoring pass streams the used key pages (57 MB; SOL ~12 us) but loads each page
# synchronously (no prefetch); the selection of the two 32768-token requests runs on one SM each (4
# histogram passes with contended shared atomics). The CuTe version of this design measured 80.7 us of
# device time on the H200.
# Host path: two compiled executables called back to back on torch's current stream; the cache and the
# queries are passed as int32 views of their bytes (no copies).
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator at smoke size; not yet run on
# the H200.

import torch
import tvm
from tvm.script import tirx as T

HEADS = 64
DIM = 128
PAGE = 64
TOPK = 2048
PAGE_BYTES = PAGE * (DIM + 4)          # 8448
PAGE_WORDS = PAGE_BYTES // 4           # 2112 int32 words per page
SCALE_WORD = PAGE * DIM // 4           # 2048: first scale word
MAX_PAGES = 512
MAX_TOK = MAX_PAGES * PAGE             # 32768
PPC = 4                                # pages per scoring CTA
THREADS_S = 128
THREADS_T = 1024
NWARP_T = THREADS_T // 32
EPT = MAX_TOK // THREADS_T             # 32 positions per thread in the top-k kernel
SUB_SCALE = 2.0 ** -9                  # e4m3 subnormal step


@T.macro
def fp8x4_to_bf16(word, dst, base):
    # 4 fp8 e4m3 bytes of an int32 word -> dst[base .. base+3] (bf16, exact)
    for i in T.unroll(4):
        x: T.let[T.int32] = T.bitwise_and(T.shift_right(word, 8 * i), 255)
        nb: T.let[T.int32] = T.bitwise_and(x, 127)
        sub: T.let[T.int32] = T.cast(T.reinterpret(
            "uint16", T.cast(T.cast(nb, "float32") * T.float32(SUB_SCALE), "bfloat16")), "int32")
        mag: T.let[T.int32] = T.if_then_else(nb >= 8, T.shift_left(nb, 4) + 120 * 128, sub)
        bits: T.let[T.int32] = T.bitwise_or(mag, T.shift_left(T.bitwise_and(x, 128), 8))
        dst[base + i] = T.reinterpret("bfloat16", T.cast(bits, "uint16"))


@T.prim_func
def score_kernel(q_h: T.handle, c_h: T.handle, w_h: T.handle, len_h: T.handle, bt_h: T.handle, s_h: T.handle):
    batch = T.int32()
    pages = T.int32()
    width = T.int32()
    Q = T.match_buffer(q_h, (batch, HEADS, DIM // 4), "int32", align=16)
    C = T.match_buffer(c_h, (pages, PAGE_WORDS), "int32", align=16)
    W = T.match_buffer(w_h, (batch, HEADS), "float32")
    L = T.match_buffer(len_h, (batch,), "int32")
    BT = T.match_buffer(bt_h, (batch, width), "int32")
    S = T.match_buffer(s_h, (batch, MAX_TOK), "float32", align=16)

    T.device_entry()
    jb, b = T.cta_id([MAX_PAGES // PPC, batch])
    tid = T.thread_id([THREADS_S])
    warp = T.warp_id([4])
    lane = T.lane_id([32])

    Qs = T.alloc_shared((HEADS, DIM), "bfloat16", align=128)
    Ks = T.alloc_shared((PAGE, DIM), "bfloat16", align=128)
    Ssc = T.alloc_shared((PAGE,), "float32")
    Ws = T.alloc_shared((HEADS,), "float32")

    wv = T.alloc_local((4,), "int32")
    hv = T.alloc_local((16,), "bfloat16")
    acc = T.alloc_local((32,), "float32")          # [8 head tiles][4]
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    tot = T.alloc_local((2,), "float32")

    n: T.let[T.int32] = L[b]
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    p0: T.let[T.int32] = jb * PPC

    if p0 * PAGE < n:
        # ---- Q_b -> bf16 (512 chunks of 16 fp8, 4 per thread), head weights
        for it in T.unroll(HEADS * DIM // 16 // THREADS_S):
            qr: T.let[T.int32] = (tid + THREADS_S * it) // (DIM // 16)
            qc: T.let[T.int32] = (tid + THREADS_S * it) % (DIM // 16)
            for i in T.vectorized(4):
                wv[i] = Q[b, qr, qc * 4 + i]
            for i in T.unroll(4):
                fp8x4_to_bf16(wv[i], hv, i * 4)
            for hp in T.unroll(2):
                for i in T.vectorized(8):
                    Qs[qr, T.bitwise_xor(qc * 2 + hp, qr % 8) * 8 + i] = hv[hp * 8 + i]
        if tid < HEADS:
            Ws[tid] = W[b, tid]

        for pi in range(PPC):
            j: T.let[T.int32] = p0 + pi
            if j * PAGE < n:
                page: T.let[T.int32] = BT[b, j]
                T.cuda.cta_sync()                      # the previous page's tiles are no longer read
                for it in T.unroll(PAGE * DIM // 16 // THREADS_S):
                    kr: T.let[T.int32] = (tid + THREADS_S * it) // (DIM // 16)
                    kc: T.let[T.int32] = (tid + THREADS_S * it) % (DIM // 16)
                    for i in T.vectorized(4):
                        wv[i] = C[page, kr * (DIM // 4) + kc * 4 + i]
                    for i in T.unroll(4):
                        fp8x4_to_bf16(wv[i], hv, i * 4)
                    for hp in T.unroll(2):
                        for i in T.vectorized(8):
                            Ks[kr, T.bitwise_xor(kc * 2 + hp, kr % 8) * 8 + i] = hv[hp * 8 + i]
                if tid < PAGE:
                    Ssc[tid] = T.reinterpret("float32", C[page, SCALE_WORD + tid])
                T.cuda.cta_sync()

                # ---- S = K[16 warp .. +16] Q^T: 16 tokens x 64 heads
                for e in T.unroll(32):
                    acc[e] = T.float32(0.0)
                arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
                for ks in T.unroll(DIM // 16):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        af[0], af[1], af[2], af[3],
                        T.address_of(Ks[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
                    for jj in T.unroll(4):
                        brow: T.let[T.int32] = jj * 16 + lane % 8 + (lane // 16) * 8
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                            bf[0], bf[1], bf[2], bf[3],
                            T.address_of(Qs[brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                        for j2 in T.unroll(2):
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                acc[(jj * 2 + j2) * 4], acc[(jj * 2 + j2) * 4 + 1],
                                acc[(jj * 2 + j2) * 4 + 2], acc[(jj * 2 + j2) * 4 + 3],
                                af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                                acc[(jj * 2 + j2) * 4], acc[(jj * 2 + j2) * 4 + 1],
                                acc[(jj * 2 + j2) * 4 + 2], acc[(jj * 2 + j2) * 4 + 3])

                # ---- score = sum_h w_h relu(S * scale): rows g and g + 8 of this warp's 16 tokens
                for hh in T.unroll(2):
                    sc: T.let[T.float32] = Ssc[warp * 16 + hh * 8 + g]
                    tot[hh] = T.float32(0.0)
                    for nt in T.unroll(8):
                        for e in T.unroll(2):
                            tot[hh] = tot[hh] + T.max(acc[nt * 4 + hh * 2 + e] * sc, T.float32(0.0)) \
                                * Ws[nt * 8 + tq * 2 + e]
                    tot[hh] = tot[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, tot[hh], 1, 32, 32)
                    tot[hh] = tot[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, tot[hh], 2, 32, 32)
                if tq == 0:
                    for hh in T.unroll(2):
                        pos: T.let[T.int32] = j * PAGE + warp * 16 + hh * 8 + g
                        if pos < n:
                            S[b, pos] = tot[hh]


@T.macro
def block_excl_scan(v, res, wtot, slot, tid, warp, lane):
    # res[0] = exclusive prefix sum of v over the 1024 threads in thread order (uses wtot[slot, :])
    res[1] = v
    for sh in T.unroll(5):
        up: T.let[T.int32] = T.tvm_warp_shuffle_up(0xFFFFFFFF, res[1], 1 << sh, 32, 32)
        if lane >= (1 << sh):
            res[1] = res[1] + up
    if lane == 31:
        wtot[slot, warp] = res[1]
    T.cuda.cta_sync()
    res[0] = res[1] - v
    for i in T.unroll(NWARP_T):
        if i < warp:
            res[0] = res[0] + wtot[slot, i]


@T.prim_func
def topk_kernel(s_h: T.handle, len_h: T.handle, bt_h: T.handle, o_h: T.handle):
    batch = T.int32()
    width = T.int32()
    S = T.match_buffer(s_h, (batch, MAX_TOK), "float32", align=16)
    L = T.match_buffer(len_h, (batch,), "int32")
    BT = T.match_buffer(bt_h, (batch, width), "int32")
    O = T.match_buffer(o_h, (batch, TOPK), "int32")

    T.device_entry()
    b = T.cta_id([batch])
    tid = T.thread_id([THREADS_T])
    warp = T.warp_id([NWARP_T])
    lane = T.lane_id([32])

    hist = T.alloc_shared((256,), "int32")
    ssel = T.alloc_shared((2,), "int32")
    wtot = T.alloc_shared((2, NWARP_T), "int32")

    fv = T.alloc_local((EPT,), "float32")
    keys = T.alloc_local((EPT,), "uint32")
    cnt = T.alloc_local((8,), "int32")
    uv = T.alloc_local((2,), "uint32")             # radix prefix, mask
    iv = T.alloc_local((4,), "int32")              # k_rem, running count above, n_gt, n_eq
    r0 = T.alloc_local((2,), "int32")
    r1 = T.alloc_local((2,), "int32")
    ow = T.alloc_local((2,), "int32")              # output offset, equal keys seen

    n: T.let[T.int32] = L[b]

    # ---- orderable keys of this thread's 32 positions (0 = absent)
    for e4 in T.unroll(EPT // 4):
        for i in T.vectorized(4):
            fv[e4 * 4 + i] = S[b, tid * EPT + e4 * 4 + i]
    for e in T.unroll(EPT):
        u: T.let[T.uint32] = T.reinterpret("uint32", fv[e])
        ko: T.let[T.uint32] = T.if_then_else(T.bitwise_and(u, T.uint32(0x80000000)) != T.uint32(0),
                                             T.bitwise_xor(u, T.uint32(0xFFFFFFFF)),
                                             T.bitwise_or(u, T.uint32(0x80000000)))
        keys[e] = T.if_then_else(tid * EPT + e < n, ko, T.uint32(0))

    # ---- exact key of the TOPK-th largest score (radix select, 4 x 8 bits)
    uv[0] = T.uint32(0)
    uv[1] = T.uint32(0)
    iv[0] = TOPK
    if n > TOPK:
        for ps in T.unroll(4):
            if tid < 256:
                hist[tid] = 0
            T.cuda.cta_sync()
            for e in T.unroll(EPT):
                if keys[e] != T.uint32(0):
                    if T.bitwise_and(keys[e], uv[1]) == uv[0]:
                        T.cuda.atomic_add(T.address_of(hist[T.cast(T.bitwise_and(
                            T.shift_right(keys[e], T.uint32(24 - 8 * ps)), T.uint32(255)), "int32")]), 1)
            T.cuda.cta_sync()
            if warp == 0:
                # lane l owns bins 255 - 8 l - q (q = 0..7, descending); inclusive scan over lanes
                iv[1] = 0
                for q in T.unroll(8):
                    cnt[q] = hist[255 - 8 * lane - q]
                    iv[1] = iv[1] + cnt[q]
                r0[0] = iv[1]
                for sh in T.unroll(5):
                    upv: T.let[T.int32] = T.tvm_warp_shuffle_up(0xFFFFFFFF, r0[0], 1 << sh, 32, 32)
                    if lane >= (1 << sh):
                        r0[0] = r0[0] + upv
                iv[1] = r0[0] - iv[1]                  # keys in the bins above this lane's bins
                for q in T.unroll(8):
                    if iv[1] < iv[0]:
                        if iv[1] + cnt[q] >= iv[0]:
                            ssel[0] = 255 - 8 * lane - q
                            ssel[1] = iv[0] - iv[1]
                    iv[1] = iv[1] + cnt[q]
            T.cuda.cta_sync()
            uv[0] = T.bitwise_or(uv[0], T.shift_left(T.cast(ssel[0], "uint32"), T.uint32(24 - 8 * ps)))
            uv[1] = T.bitwise_or(uv[1], T.shift_left(T.uint32(255), T.uint32(24 - 8 * ps)))
            iv[0] = ssel[1]
            T.cuda.cta_sync()
    kth: T.let[T.uint32] = uv[0]                       # 0 when everything present is taken
    k_eq: T.let[T.int32] = iv[0]

    # ---- per-thread counts: above kth, equal to kth (present keys only)
    iv[2] = 0
    iv[3] = 0
    for e in T.unroll(EPT):
        if keys[e] != T.uint32(0):
            if keys[e] > kth:
                iv[2] = iv[2] + 1
            if keys[e] == kth:
                iv[3] = iv[3] + 1
    n_eq: T.let[T.int32] = iv[3]
    block_excl_scan(n_eq, r0, wtot, 0, tid, warp, lane)
    take_eq: T.let[T.int32] = T.min(T.max(k_eq - r0[0], 0), n_eq)
    n_sel: T.let[T.int32] = iv[2] + take_eq
    block_excl_scan(n_sel, r1, wtot, 1, tid, warp, lane)

    # ---- write the selected positions in ascending order
    ow[0] = r1[0]
    ow[1] = 0
    for e in T.unroll(EPT):
        if keys[e] != T.uint32(0):
            pos: T.let[T.int32] = tid * EPT + e
            if keys[e] > kth:
                O[b, ow[0]] = BT[b, pos // PAGE] * PAGE + pos % PAGE
                ow[0] = ow[0] + 1
            elif keys[e] == kth:
                if ow[1] < take_eq:
                    O[b, ow[0]] = BT[b, pos // PAGE] * PAGE + pos % PAGE
                    ow[0] = ow[0] + 1
                ow[1] = ow[1] + 1
    total: T.let[T.int32] = T.min(n, TOPK)
    for e in T.unroll(TOPK // THREADS_T):
        if tid + THREADS_T * e >= total:
            O[b, tid + THREADS_T * e] = -1


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


def _compiled():
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (score_kernel, topk_kernel))
        _CACHE["exes"] = exes
    return exes


def _workspace(device: torch.device, batch: int) -> torch.Tensor:
    key = ("ws", str(device), batch)
    ws = _CACHE.get(key)
    if ws is None:
        ws = torch.empty((batch, MAX_TOK), dtype=torch.float32, device=device)
        _CACHE[key] = ws
    return ws


def solve(q_index_fp8: torch.Tensor, k_index_cache: torch.Tensor, weights: torch.Tensor, seq_lens: torch.Tensor,
          block_table: torch.Tensor) -> torch.Tensor:
    score, topk = _compiled()
    batch = q_index_fp8.shape[0]
    assert block_table.shape[1] <= MAX_PAGES
    out = torch.empty((batch, TOPK), dtype=torch.int32, device=q_index_fp8.device)
    if batch == 0:
        return out
    q32 = q_index_fp8.contiguous().view(torch.uint8).view(torch.int32)                  # [B, 64, 32]
    c32 = k_index_cache.contiguous().view(torch.uint8).reshape(k_index_cache.shape[0], PAGE_BYTES).view(torch.int32)
    lens = seq_lens.to(torch.int32).contiguous()
    bt = block_table.to(torch.int32).contiguous()
    ws = _workspace(q_index_fp8.device, batch)
    score(q32, c32, weights.to(torch.float32).contiguous(), lens, bt, ws)
    topk(ws, lens, bt, out)
    return out
