# Attention block with NVFP4 weights (64-head GQA decoder: hidden 8192, 64 query / 8 KV heads of 128,
# 4 x 1024-token prefill) in TIRx: dequantization, two bf16 tensor-core GEMMs, RoPE and a causal
# FlashAttention-2 kernel (mma.sync m16n8k16, fp32 accumulation), seven kernels.
#
# - k_dequant: e2m1 code * e4m3 block scale has at most 6 significant bits, so both weights are exact in
#   bf16 (written once per call: 168 MB + 134 MB); the fp32 global scales multiply the accumulators.
# - k_gemm (QKV and O): CTA tile 128 x 128 x 64, 8 warps of 64 x 32, 3-stage cp.async pipeline (16-byte
#   pieces XOR-swizzled by row, conflict-free ldmatrix), 96 KiB of dynamic shared memory, <= 128
#   registers (2 CTAs per SM), grouped raster (8 M tiles sweep the N tiles together). Output bf16.
# - k_rope_table (input-independent, cached per sequence length): cos / sin of pos * theta^(-2i/128)
#   computed in fp64. k_rope: rotate-half RoPE of q and k in fp32 from the bf16 qkv, written as bf16
#   [T, heads, 128] (v is read in place from qkv).
# - k_attn: causal GQA attention; the 8 query heads of a KV head are packed as rows token * 8 + head, a
#   CTA owns 64 rows (8 tokens), 4 warps x 16 rows; K / V tiles of 64 tokens by cp.async, double-buffered;
#   online softmax in base 2; P re-packed as bf16 A fragments for P V. Row tiles with the most keys
#   start first. Output [T, 8192] bf16.
# Numerics: the reference keeps qkv, the rotated q / k and the attention output in fp32; here they are
# bf16 operands of the next tensor-core product (relative errors ~2^-9 per term against a 3-ulp bf16
# tolerance on the output).
#
# What limits it / expected time: tensor-core work, 1.24 TFLOP in the two GEMMs plus ~70 GFLOP of
# attention, at mma.sync rates (~40-50% of the H200's dense bf16 peak) -> ~3-3.5 ms, plus ~0.1 ms of
# dequantization / RoPE traffic; eager PyTorch runs fp32 GEMMs without TF32 on dequantized fp32 weights
# (~25 ms). Next step: wgmma with a TMA producer warp for the GEMMs.
#
# Streams: all compiled functions are called with torch tensors; tvm-ffi installs torch's current stream
# as TVM's environment stream for each call, so they run in order on it. Workspaces are cached per
# (device, shape) and fully rewritten each call.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HD = 128
GQA = 8
ROPE_THETA = 500000.0
BM = 128
BN = 128
BK = 64
STAGES = 3
THREADS = 256
GROUP = 8
AROWS = 64                      # attention rows (token x head) per CTA
KT = 64                         # keys per tile
LOG2E = 1.0 / math.log(2.0)
M_INIT = -1.0e30


def _e2m1_bits(c):
    # 4-bit e2m1 code -> bf16 bit pattern (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign)
    return (T.if_then_else(c % 8 == 0, 0, T.if_then_else(c % 8 == 1, 0x3F00, 0x3F00 + (c % 8) * 64))
            + (c // 8) * 0x8000)


@T.prim_func
def k_dequant(w_h: T.handle, s_h: T.handle, o_h: T.handle, kb16: T.int32):
    n = T.int32()
    W = T.match_buffer(w_h, (n, kb16 * 2), "int32", align=16)       # 8 codes per word
    S = T.match_buffer(s_h, (n, kb16), "uint8")                      # e4m3, one per 16 elements
    O = T.match_buffer(o_h, (n, kb16 * 16), "bfloat16", align=16)
    T.device_entry()
    blk = T.cta_id([T.ceildiv(n * kb16, 256)])
    tid = T.thread_id([256])
    wv = T.alloc_local((2,), "int32")
    ov = T.alloc_local((16,), "bfloat16")
    sv = T.alloc_local((1,), "float32")
    idx: T.let[T.int32] = blk * 256 + tid
    if idx < n * kb16:
        r: T.let[T.int32] = idx // kb16
        q: T.let[T.int32] = idx % kb16
        sb: T.let[T.int32] = T.cast(S[r, q], "int32")
        # e4m3 -> fp32 (exact): normal 2^(e-7) (1 + m/8), subnormal m 2^-9
        sv[0] = T.if_then_else(
            T.bitwise_and(T.shift_right(sb, 3), 15) > 0,
            T.reinterpret("float32", T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(sb, 7), 1), 31),
                                                  T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(sb, 3), 15) + 120, 23),
                                                               T.shift_left(T.bitwise_and(sb, 7), 20)))),
            T.cast(T.bitwise_and(sb, 7), "float32") * T.float32(2.0 ** -9)
            * T.if_then_else(T.bitwise_and(sb, 128) > 0, T.float32(-1.0), T.float32(1.0)))
        for i in T.vectorized(2):
            wv[i] = W[r, q * 2 + i]
        for e in T.unroll(16):
            ov[e] = T.cast(T.reinterpret("float32", T.shift_left(T.cast(_e2m1_bits(
                T.bitwise_and(T.shift_right(wv[e // 8], (e % 8) * 4), 15)), "int32"), 16)) * sv[0], "bfloat16")
        for i in T.vectorized(8):
            O[r, q * 16 + i] = ov[i]
        for i in T.vectorized(8):
            O[r, q * 16 + 8 + i] = ov[8 + i]


def _make_gemm():
    @T.prim_func
    def k_gemm(a_h: T.handle, b_h: T.handle, gs_h: T.handle, c_h: T.handle, kb64: T.int32):
        M = T.int32()
        N = T.int32()
        A = T.match_buffer(a_h, (M, kb64 * BK), "bfloat16", align=16)
        B = T.match_buffer(b_h, (N, kb64 * BK), "bfloat16", align=16)
        GS = T.match_buffer(gs_h, (1,), "float32")
        C = T.match_buffer(c_h, (M, N), "bfloat16")

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        cta = T.cta_id([T.ceildiv(N, BN) * T.ceildiv(M, BM)])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_buffer((STAGES * (BM + BN) * BK,), "bfloat16", scope="shared.dyn")
        As = T.decl_buffer((STAGES, BM, BK), "bfloat16", data=pool.data, elem_offset=0)
        Bs = T.decl_buffer((STAGES, BN, BK), "bfloat16", data=pool.data, elem_offset=STAGES * BM * BK)

        acc = T.alloc_local((64,), "float32")       # [m-tile 4][n-tile 4][4]
        af = T.alloc_local((16,), "uint32")         # A fragments of the 4 m-tiles
        bf = T.alloc_local((8,), "uint32")          # B fragments of the 4 n-tiles
        pk = T.alloc_local((2,), "bfloat16")
        v = T.alloc_local((1,), "float32")

        # grouped raster: GROUP consecutive M tiles sweep the N tiles together (operand panels reused in L2)
        ntn: T.let[T.int32] = T.ceildiv(N, BN)
        ntm: T.let[T.int32] = T.ceildiv(M, BM)
        grp: T.let[T.int32] = cta // (GROUP * ntn)
        gsz: T.let[T.int32] = T.min(GROUP, ntm - grp * GROUP)
        mt: T.let[T.int32] = grp * GROUP + (cta % (GROUP * ntn)) % gsz
        nt: T.let[T.int32] = (cta % (GROUP * ntn)) // gsz
        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4
        wm: T.let[T.int32] = warp // 4
        wn: T.let[T.int32] = warp % 4
        m0: T.let[T.int32] = mt * BM
        n0: T.let[T.int32] = nt * BN

        for e in T.unroll(64):
            acc[e] = T.float32(0.0)
        # prologue: stages 0 and 1
        for st in T.unroll(STAGES - 1):
            if st < kb64:
                for r in T.unroll(BM * BK // 8 // THREADS):
                    row: T.let[T.int32] = (tid + r * THREADS) // 8
                    ch: T.let[T.int32] = (tid + r * THREADS) % 8
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(As[st, row, T.bitwise_xor(ch, row % 8) * 8]),
                        T.address_of(A[T.min(m0 + row, M - 1), st * BK + ch * 8]), 16,
                        T.if_then_else(m0 + row < M, T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Bs[st, row, T.bitwise_xor(ch, row % 8) * 8]),
                        T.address_of(B[T.min(n0 + row, N - 1), st * BK + ch * 8]), 16,
                        T.if_then_else(n0 + row < N, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

        for kt in range(kb64):
            cur: T.let[T.int32] = kt % STAGES
            T.ptx.cp.async_.wait_group(STAGES - 2)
            T.cuda.cta_sync()
            # issue stage kt + 2 (its buffer was consumed in iteration kt - 1)
            if kt + STAGES - 1 < kb64:
                for r in T.unroll(BM * BK // 8 // THREADS):
                    row2: T.let[T.int32] = (tid + r * THREADS) // 8
                    ch2: T.let[T.int32] = (tid + r * THREADS) % 8
                    kk: T.let[T.int32] = (kt + STAGES - 1) * BK
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(As[(kt + STAGES - 1) % STAGES, row2, T.bitwise_xor(ch2, row2 % 8) * 8]),
                        T.address_of(A[T.min(m0 + row2, M - 1), kk + ch2 * 8]), 16,
                        T.if_then_else(m0 + row2 < M, T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Bs[(kt + STAGES - 1) % STAGES, row2, T.bitwise_xor(ch2, row2 % 8) * 8]),
                        T.address_of(B[T.min(n0 + row2, N - 1), kk + ch2 * 8]), 16,
                        T.if_then_else(n0 + row2 < N, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()
            for ks in T.unroll(BK // 16):
                for mi in T.unroll(4):
                    arow: T.let[T.int32] = wm * 64 + mi * 16 + lane % 8 + ((lane // 8) % 2) * 8
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                        T.address_of(As[cur, arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
                for jj in T.unroll(2):
                    brow: T.let[T.int32] = wn * 32 + jj * 16 + lane % 8 + (lane // 16) * 8
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        bf[jj * 4], bf[jj * 4 + 1], bf[jj * 4 + 2], bf[jj * 4 + 3],
                        T.address_of(Bs[cur, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                for mi in T.unroll(4):
                    for nj in T.unroll(4):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            acc[(mi * 4 + nj) * 4], acc[(mi * 4 + nj) * 4 + 1], acc[(mi * 4 + nj) * 4 + 2], acc[(mi * 4 + nj) * 4 + 3],
                            af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3], bf[nj * 2], bf[nj * 2 + 1],
                            acc[(mi * 4 + nj) * 4], acc[(mi * 4 + nj) * 4 + 1], acc[(mi * 4 + nj) * 4 + 2], acc[(mi * 4 + nj) * 4 + 3])

        # epilogue
        for mi in T.unroll(4):
            for hh in T.unroll(2):
                row3: T.let[T.int32] = m0 + wm * 64 + mi * 16 + hh * 8 + g
                if row3 < M:
                    for nj in T.unroll(4):
                        col: T.let[T.int32] = n0 + wn * 32 + nj * 8 + tq * 2
                        if col < N:
                            for e in T.unroll(2):
                                v[0] = acc[(mi * 4 + nj) * 4 + hh * 2 + e] * GS[0]
                                pk[e] = T.cast(v[0], "bfloat16")
                            for e in T.vectorized(2):
                                C[row3, col + e] = pk[e]
    return k_gemm


@T.prim_func
def k_rope_table(t_h: T.handle):
    seq = T.int32()
    TB = T.match_buffer(t_h, (seq, HD // 2, 2), "float32")
    T.device_entry()
    blk = T.cta_id([T.ceildiv(seq * (HD // 2), 256)])
    tid = T.thread_id([256])
    a = T.alloc_local((1,), "float64")
    idx: T.let[T.int32] = blk * 256 + tid
    if idx < seq * (HD // 2):
        # angle = pos * theta^(-2i/128), in fp64 (input-independent table)
        a[0] = T.cast(idx // (HD // 2), "float64") * T.exp(T.float64(-math.log(ROPE_THETA) * 2.0 / HD) * T.cast(idx % (HD // 2), "float64"))
        TB[idx // (HD // 2), idx % (HD // 2), 0] = T.cast(T.cos(a[0]), "float32")
        TB[idx // (HD // 2), idx % (HD // 2), 1] = T.cast(T.sin(a[0]), "float32")


@T.prim_func
def k_rope(qkv_h: T.handle, t_h: T.handle, q_h: T.handle, k_h: T.handle, seq: T.int32):
    rows = T.int32()
    nqkv = T.int32()
    nq = T.int32()
    nkv = T.int32()
    QKV = T.match_buffer(qkv_h, (rows, nqkv), "bfloat16")
    TB = T.match_buffer(t_h, (seq, HD // 2, 2), "float32")
    QR = T.match_buffer(q_h, (rows, nq, HD), "bfloat16")
    KR = T.match_buffer(k_h, (rows, nkv, HD), "bfloat16")
    T.device_entry()
    r = T.cta_id([rows])
    tid = T.thread_id([256])
    pos: T.let[T.int32] = r % seq
    for i in range(T.ceildiv((nq + nkv) * HD, 256)):
        e: T.let[T.int32] = i * 256 + tid
        if e < (nq + nkv) * HD:
            d: T.let[T.int32] = e % HD
            v: T.let[T.float32] = (T.cast(QKV[r, e], "float32") * TB[pos, d % (HD // 2), 0]
                                   + T.if_then_else(d < HD // 2, T.float32(0.0) - T.cast(QKV[r, e + HD // 2], "float32"),
                                                    T.cast(QKV[r, e - HD // 2], "float32")) * TB[pos, d % (HD // 2), 1])
            if e < nq * HD:
                QR[r, e // HD, d] = T.cast(v, "bfloat16")
            else:
                KR[r, e // HD - nq, d] = T.cast(v, "bfloat16")


@T.prim_func
def k_attn(q_h: T.handle, k_h: T.handle, qkv_h: T.handle, o_h: T.handle, seq: T.int32, scale_log2: T.float32):
    rows = T.int32()
    nq = T.int32()
    nkv = T.int32()
    nqkv = T.int32()
    Q = T.match_buffer(q_h, (rows, nq, HD), "bfloat16", align=16)
    K = T.match_buffer(k_h, (rows, nkv, HD), "bfloat16", align=16)
    QKV = T.match_buffer(qkv_h, (rows, nqkv), "bfloat16", align=16)
    O = T.match_buffer(o_h, (rows, nq * HD), "bfloat16", align=16)

    T.device_entry()
    tile, kvh, b = T.cta_id([T.ceildiv(seq * GQA, AROWS), nkv, T.ceildiv(rows, seq)])
    tid = T.thread_id([128])
    warp = T.warp_id([4])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((AROWS * HD + 4 * KT * HD,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((AROWS, HD), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((2, KT, HD), "bfloat16", data=pool.data, elem_offset=AROWS * HD)
    Vs = T.decl_buffer((2, KT, HD), "bfloat16", data=pool.data, elem_offset=AROWS * HD + 2 * KT * HD)

    oa = T.alloc_local((HD // 2,), "float32")
    sa = T.alloc_local((KT // 2,), "float32")
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    mx = T.alloc_local((2,), "float32")
    ls = T.alloc_local((2,), "float32")
    tmx = T.alloc_local((2,), "float32")
    al = T.alloc_local((2,), "float32")
    pk = T.alloc_local((2,), "bfloat16")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    # row tiles from the last (most keys) to the first; rows = token * 8 + head-in-group
    r0: T.let[T.int32] = (T.ceildiv(seq * GQA, AROWS) - 1 - tile) * AROWS
    t0: T.let[T.int32] = b * seq
    kend: T.let[T.int32] = (T.min(r0 + AROWS, seq * GQA) - 1) // GQA + 1

    for r in T.unroll(AROWS * (HD // 8) // 128):
        qr: T.let[T.int32] = (tid + r * 128) // (HD // 8)
        qc: T.let[T.int32] = (tid + r * 128) % (HD // 8)
        qrow: T.let[T.int32] = T.min(r0 + qr, seq * GQA - 1)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Qs[qr, T.bitwise_xor(qc, qr % 8) * 8]),
            T.address_of(Q[t0 + qrow // GQA, kvh * GQA + qrow % GQA, qc * 8]), 16)
    for r in T.unroll(KT * (HD // 8) // 128):
        kr: T.let[T.int32] = (tid + r * 128) // (HD // 8)
        kc: T.let[T.int32] = (tid + r * 128) % (HD // 8)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Ks[0, kr, T.bitwise_xor(kc, kr % 8) * 8]), T.address_of(K[t0 + T.min(kr, seq - 1), kvh, kc * 8]), 16,
            T.if_then_else(kr < seq, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Vs[0, kr, T.bitwise_xor(kc, kr % 8) * 8]),
            T.address_of(QKV[t0 + T.min(kr, seq - 1), (nq + nkv + kvh) * HD + kc * 8]), 16,
            T.if_then_else(kr < seq, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()

    for e in T.unroll(HD // 2):
        oa[e] = T.float32(0.0)
    for hh in T.unroll(2):
        mx[hh] = T.float32(M_INIT)
        ls[hh] = T.float32(0.0)
    arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
    qp0: T.let[T.int32] = (r0 + warp * 16 + g) // GQA
    qp1: T.let[T.int32] = (r0 + warp * 16 + g + 8) // GQA

    for kt in range(T.ceildiv(kend, KT)):
        buf: T.let[T.int32] = kt % 2
        T.ptx.cp.async_.wait_all()
        T.cuda.cta_sync()
        if (kt + 1) * KT < kend:
            for r in T.unroll(KT * (HD // 8) // 128):
                kr2: T.let[T.int32] = (tid + r * 128) // (HD // 8)
                kc2: T.let[T.int32] = (tid + r * 128) % (HD // 8)
                kn: T.let[T.int32] = (kt + 1) * KT + kr2
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Ks[1 - buf, kr2, T.bitwise_xor(kc2, kr2 % 8) * 8]),
                    T.address_of(K[t0 + T.min(kn, seq - 1), kvh, kc2 * 8]), 16,
                    T.if_then_else(kn < seq, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Vs[1 - buf, kr2, T.bitwise_xor(kc2, kr2 % 8) * 8]),
                    T.address_of(QKV[t0 + T.min(kn, seq - 1), (nq + nkv + kvh) * HD + kc2 * 8]), 16,
                    T.if_then_else(kn < seq, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

        for e in T.unroll(KT // 2):
            sa[e] = T.float32(0.0)
        for ks in T.unroll(HD // 16):
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            for jj in T.unroll(KT // 16):
                brow: T.let[T.int32] = jj * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Ks[buf, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3])

        for hh in T.unroll(2):
            tmx[hh] = mx[hh]
            for nt in T.unroll(KT // 8):
                for e in T.unroll(2):
                    sa[nt * 4 + hh * 2 + e] = T.if_then_else(
                        kt * KT + nt * 8 + tq * 2 + e <= T.if_then_else(hh == 0, qp0, qp1),
                        sa[nt * 4 + hh * 2 + e] * scale_log2, T.float32("-inf"))
                    tmx[hh] = T.max(tmx[hh], sa[nt * 4 + hh * 2 + e])
            tmx[hh] = T.max(tmx[hh], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[hh], 1, 32, 32))
            tmx[hh] = T.max(tmx[hh], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[hh], 2, 32, 32))
            al[hh] = T.exp2(mx[hh] - tmx[hh])
            mx[hh] = tmx[hh]
            ls[hh] = ls[hh] * al[hh]
            for nt in T.unroll(KT // 8):
                for e in T.unroll(2):
                    sa[nt * 4 + hh * 2 + e] = T.exp2(sa[nt * 4 + hh * 2 + e] - tmx[hh])
                    ls[hh] = ls[hh] + sa[nt * 4 + hh * 2 + e]
        for nt in T.unroll(HD // 8):
            for e in T.unroll(4):
                oa[nt * 4 + e] = oa[nt * 4 + e] * al[e // 2]

        for kk in T.unroll(KT // 16):
            for q in T.unroll(4):
                af[q] = T.bitwise_or(
                    T.cast(T.reinterpret("uint16", T.cast(sa[(kk * 2 + q // 2) * 4 + (q % 2) * 2], "bfloat16")), "uint32"),
                    T.shift_left(T.cast(T.reinterpret("uint16", T.cast(sa[(kk * 2 + q // 2) * 4 + (q % 2) * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
            vrow: T.let[T.int32] = kk * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for pp in T.unroll(HD // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Vs[buf, vrow, T.bitwise_xor(pp * 2 + lane // 16, vrow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3])

    for hh in T.unroll(2):
        ls[hh] = ls[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[hh], 1, 32, 32)
        ls[hh] = ls[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[hh], 2, 32, 32)
        al[hh] = T.float32(1.0) / ls[hh]
    for hh in T.unroll(2):
        orow: T.let[T.int32] = r0 + warp * 16 + hh * 8 + g
        if orow < seq * GQA:
            for nt in T.unroll(HD // 8):
                for e in T.unroll(2):
                    pk[e] = T.cast(oa[nt * 4 + hh * 2 + e] * al[hh], "bfloat16")
                for e in T.vectorized(2):
                    O[t0 + orow // GQA, (kvh * GQA + orow % GQA) * HD + nt * 8 + tq * 2 + e] = pk[e]


k_proj = _make_gemm()

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
                     for f in (k_dequant, k_proj, k_rope_table, k_rope, k_attn))
        _CACHE["exes"] = exes
    return exes


def _ws(name, shape, dtype, device):
    key = (name, str(device), tuple(shape))
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.empty(shape, dtype=dtype, device=device)
    return t


def solve(hidden_states: torch.Tensor, qkv_weight: torch.Tensor, qkv_weight_scale: torch.Tensor,
          qkv_weight_global_scale: torch.Tensor, o_weight: torch.Tensor, o_weight_scale: torch.Tensor,
          o_weight_global_scale: torch.Tensor) -> torch.Tensor:
    dq, proj, rtab, rope, attn = _compiled()
    batch, seq, hidden = hidden_states.shape
    nqkv = qkv_weight.shape[0]
    qf = o_weight.shape[1] * 2
    nq = qf // HD
    nkv = (nqkv - qf) // 2 // HD
    dev = hidden_states.device
    rows = batch * seq
    out = torch.empty((batch, seq, hidden), dtype=hidden_states.dtype, device=dev)
    if rows == 0:
        return out
    if hidden % BK or qf % BK or nq != GQA * nkv:
        raise ValueError("unsupported geometry")
    wqkv = _ws("wqkv", (nqkv, hidden), torch.bfloat16, dev)
    wo = _ws("wo", (hidden, qf), torch.bfloat16, dev)
    qkv = _ws("qkv", (rows, nqkv), torch.bfloat16, dev)
    qr = _ws("qr", (rows, nq, HD), torch.bfloat16, dev)
    kr = _ws("kr", (rows, nkv, HD), torch.bfloat16, dev)
    ao = _ws("ao", (rows, qf), torch.bfloat16, dev)
    tkey = ("ropetab", str(dev), seq)
    tab = _CACHE.get(tkey)
    if tab is None:                                # input-independent constant table
        tab = torch.empty((seq, HD // 2, 2), dtype=torch.float32, device=dev)
        rtab(tab)
        _CACHE[tkey] = tab
    dq(qkv_weight.contiguous().view(torch.int32), qkv_weight_scale.contiguous().view(torch.uint8), wqkv, hidden // 16)
    dq(o_weight.contiguous().view(torch.int32), o_weight_scale.contiguous().view(torch.uint8), wo, qf // 16)
    proj(hidden_states.contiguous().view(rows, hidden), wqkv, qkv_weight_global_scale.contiguous().float(), qkv,
         hidden // BK)
    rope(qkv, tab, qr, kr, seq)
    attn(qr, kr, qkv, ao, seq, float(1.0 / math.sqrt(HD)) * LOG2E)
    proj(ao, wo, o_weight_global_scale.contiguous().float(), out.view(rows, hidden), qf // BK)
    return out
