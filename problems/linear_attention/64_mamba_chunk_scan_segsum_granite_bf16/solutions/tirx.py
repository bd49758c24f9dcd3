# Mamba-2 chunk scan (Granite 4.0 H Tiny: 48 heads x 64, state 128, one B/C group, chunk 256) as one TIRx
# kernel: a flash-attention-like pass on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation).
# Same algorithm and launch geometry as the CuTe DSL solution of this problem (0.376 ms device on the H200).
#
# For chunk c, head h and a tile I of 64 query rows i (cum = running sum of dt*A inside the chunk):
#     y_i = exp(cum_i) (C_i . S_h[c])  +  sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j  +  D_h x_i
# - Grid (4 row tiles I, 48 heads, batch x chunks); 128 threads = 4 warps, warp w owns rows 16w..16w+15
#   of the tile and all 64 head dims (32 fp32 accumulators per thread).
# - Prologue: cum over the chunk (2 tokens per thread, warp shfl_up scan + shared warp totals; dt = 0 past
#   L), dt kept in shared memory; cp.async (16 B, zero-filled past L) of C_I [64 x 128]; the entering state
#   S_h [64 x 128] fp32 is converted to bf16 in shared memory. Tiles are stored with their 16-byte pieces
#   XOR-swizzled by row (conflict-free ldmatrix). C_I's A fragments (8 k-steps) stay in registers.
# - State term: acc = C_I S_h^T (B operand from the state rows via ldmatrix), rows scaled by exp(cum_i).
# - For J = 0..I: cp.async B_J [64 x 128] and x_J [64 x 64]; for each 16-key block: G = C_I B^T (fp32),
#   M = G exp(cum_i - cum_j) dt_j (zero above the diagonal on J = I), packed to bf16 as the A fragment
#   (register reuse, as P in flash attention) of acc += M x (x through ldmatrix.trans). On J = I the
#   16-key blocks right of a warp's rows are skipped.
# - Epilogue: y = acc + D_h x_i (x_I is the last tile in shared memory), bf16 pairs, rows < L.
# Differences from the CuTe DSL version: the key tile is processed in 16-key blocks (G is 16 x 16 per warp
# instead of 16 x 64), so fully masked blocks of the diagonal tile are skipped; cum is in natural-log units
# with TVM's (fast-math) exp instead of log2 units with exp2, the same approximate hardware path.
# Numerics: C.B^T is exact (bf16 products, fp32 accumulation); M and the bf16 state copy carry 2^-9
# relative rounding, as in the CuTe DSL version that passed (its torch emulation: 0.15x the allowance).
# What limits it: C.B^T recomputed per head (about half of the executed FLOPs), warp-level mma.sync, no
# double buffering inside a CTA (~57 KiB shared memory, several CTAs per SM overlap instead). Expected
# near the CuTe DSL version (~0.38 ms device); SOL 0.065 ms; eager 6.3 ms (torch.compile fails on the
# reference).
#
# Streams: the compiled function is called with torch tensors; tvm-ffi installs torch's current stream as
# TVM's environment stream for the call. Only the compiled module is cached (batch, L, chunks symbolic).
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HEADS = 48
P = 64
N = 128
CHUNK = 256
TILE = 64                       # query rows per CTA (and key rows per J step)
NT = CHUNK // TILE              # 4 row tiles per chunk
THREADS = 128

# dynamic shared memory layout (bf16 elements)
OFF_C = 0                       # [64][128]
OFF_B = TILE * N                # [64][128]
OFF_S = 2 * TILE * N            # [64][128] entering state, bf16
OFF_X = 3 * TILE * N            # [64][64]
POOL = 3 * TILE * N + TILE * P


@T.prim_func
def chunk_scan(x_h: T.handle, dt_h: T.handle, a_h: T.handle, b_h: T.handle, c_h: T.handle, cs_h: T.handle,
               d_h: T.handle, y_h: T.handle):
    bsz = T.int32()
    seqlen = T.int32()
    nc = T.int32()
    X = T.match_buffer(x_h, (bsz, seqlen, HEADS, P), "bfloat16", align=16)
    DT = T.match_buffer(dt_h, (bsz, seqlen, HEADS), "float32")
    AA = T.match_buffer(a_h, (HEADS,), "float32")
    Bm = T.match_buffer(b_h, (bsz, seqlen, 1, N), "bfloat16", align=16)
    Cm = T.match_buffer(c_h, (bsz, seqlen, 1, N), "bfloat16", align=16)
    CS = T.match_buffer(cs_h, (bsz, nc, HEADS, P, N), "float32", align=16)
    DD = T.match_buffer(d_h, (HEADS,), "float32")
    Y = T.match_buffer(y_h, (bsz, seqlen, HEADS, P), "bfloat16", align=16)

    T.device_entry()
    ti, h, bc = T.cta_id([NT, HEADS, bsz * nc])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([4])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((POOL,), "bfloat16", scope="shared.dyn")
    Cs = T.decl_buffer((TILE, N), "bfloat16", data=pool.data, elem_offset=OFF_C)
    Bs = T.decl_buffer((TILE, N), "bfloat16", data=pool.data, elem_offset=OFF_B)
    Sh = T.decl_buffer((P, N), "bfloat16", data=pool.data, elem_offset=OFF_S)
    Xs = T.decl_buffer((TILE, P), "bfloat16", data=pool.data, elem_offset=OFF_X)
    cum = T.alloc_shared((CHUNK,), "float32")
    dts = T.alloc_shared((CHUNK,), "float32")
    red = T.alloc_shared((4,), "float32")

    ya = T.alloc_local((32,), "float32")            # y fragments [p-tile 8][4]
    cfr = T.alloc_local((32,), "uint32")            # C_I A fragments [k-step 8][4]
    cb = T.alloc_local((8,), "float32")             # C B^T tile [2][4]
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    fv = T.alloc_local((8,), "float32")
    f4 = T.alloc_local((4,), "float32")
    h4 = T.alloc_local((4,), "bfloat16")
    sc = T.alloc_local((6,), "float32")             # d0, d1, inclusive scan, neighbour, base, D
    xv = T.alloc_local((2,), "bfloat16")
    pk = T.alloc_local((2,), "bfloat16")

    b: T.let[T.int32] = bc // nc
    c: T.let[T.int32] = bc % nc
    c0: T.let[T.int32] = c * CHUNK
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4

    # ---- C_I tile in flight (rows past L zero-filled)
    for r in T.unroll(8):
        crow: T.let[T.int32] = (tid + r * THREADS) // 16
        cch: T.let[T.int32] = (tid + r * THREADS) % 16
        tc: T.let[T.int32] = c0 + ti * TILE + crow
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Cs[crow, T.bitwise_xor(cch, crow % 8) * 8]),
            T.address_of(Cm[b, T.min(tc, seqlen - 1), 0, cch * 8]), 16,
            T.if_then_else(tc < seqlen, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()

    # ---- cum over the chunk: thread -> tokens 2 tid, 2 tid + 1 (dt = 0 past L)
    sc[0] = T.float32(0.0)
    sc[1] = T.float32(0.0)
    if c0 + 2 * tid < seqlen:
        sc[0] = DT[b, c0 + 2 * tid, h]
    if c0 + 2 * tid + 1 < seqlen:
        sc[1] = DT[b, c0 + 2 * tid + 1, h]
    dts[2 * tid] = sc[0]
    dts[2 * tid + 1] = sc[1]
    sc[0] = sc[0] * AA[h]
    sc[1] = sc[1] * AA[h]
    sc[2] = sc[0] + sc[1]
    for r in T.unroll(5):
        sc[3] = T.tvm_warp_shuffle_up(0xFFFFFFFF, sc[2], 1 << r, 32, 32)
        if lane >= (1 << r):
            sc[2] = sc[2] + sc[3]
    if lane == 31:
        red[warp] = sc[2]

    # ---- entering state -> bf16, swizzled (thread -> row cid // 32, columns 4 (cid % 32) .. +3)
    for it in T.unroll(P * N // 4 // THREADS):
        srow: T.let[T.int32] = (tid + it * THREADS) // 32
        sq4: T.let[T.int32] = (tid + it * THREADS) % 32
        for e in T.vectorized(4):
            f4[e] = CS[b, c, h, srow, sq4 * 4 + e]
        for e in T.unroll(4):
            h4[e] = T.cast(f4[e], "bfloat16")
        for e in T.vectorized(4):
            Sh[srow, T.bitwise_xor(sq4 // 2, srow % 8) * 8 + (sq4 % 2) * 4 + e] = h4[e]
    T.cuda.cta_sync()
    sc[4] = T.float32(0.0)
    for w in T.unroll(3):
        if w < warp:
            sc[4] = sc[4] + red[w]
    sc[4] = sc[4] + sc[2] - (sc[0] + sc[1])         # exclusive prefix of this thread's pair
    cum[2 * tid] = sc[4] + sc[0]
    cum[2 * tid + 1] = sc[4] + sc[0] + sc[1]
    T.ptx.cp.async_.wait_group(0)
    T.cuda.cta_sync()

    # ---- C_I fragments, kept in registers
    arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
    for ks in T.unroll(N // 16):
        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
            cfr[ks * 4], cfr[ks * 4 + 1], cfr[ks * 4 + 2], cfr[ks * 4 + 3],
            T.address_of(Cs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))

    # ---- state term: exp(cum_i) C_i . S
    for e in T.unroll(32):
        ya[e] = T.float32(0.0)
    for ks in T.unroll(N // 16):
        for pp in T.unroll(4):
            prow: T.let[T.int32] = pp * 16 + lane % 8 + (lane // 16) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                bf[0], bf[1], bf[2], bf[3],
                T.address_of(Sh[prow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, prow % 8) * 8]))
            for j2 in T.unroll(2):
                T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                    ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3],
                    cfr[ks * 4], cfr[ks * 4 + 1], cfr[ks * 4 + 2], cfr[ks * 4 + 3], bf[j2 * 2], bf[j2 * 2 + 1],
                    ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3])
    for pt in T.unroll(8):
        for e in T.unroll(4):
            ya[pt * 4 + e] = ya[pt * 4 + e] * T.exp(cum[ti * TILE + warp * 16 + g + (e // 2) * 8])

    # ---- intra-chunk terms
    for J in range(ti + 1):
        T.cuda.cta_sync()                           # previous J's reads of Bs / Xs are done
        for r in T.unroll(8):
            brow: T.let[T.int32] = (tid + r * THREADS) // 16
            bch: T.let[T.int32] = (tid + r * THREADS) % 16
            tb: T.let[T.int32] = c0 + J * TILE + brow
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Bs[brow, T.bitwise_xor(bch, brow % 8) * 8]),
                T.address_of(Bm[b, T.min(tb, seqlen - 1), 0, bch * 8]), 16,
                T.if_then_else(tb < seqlen, T.uint32(16), T.uint32(0)))
        for r in T.unroll(4):
            xrow: T.let[T.int32] = (tid + r * THREADS) // 8
            xch: T.let[T.int32] = (tid + r * THREADS) % 8
            tx: T.let[T.int32] = c0 + J * TILE + xrow
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Xs[xrow, T.bitwise_xor(xch, xrow % 8) * 8]),
                T.address_of(X[b, T.min(tx, seqlen - 1), h, xch * 8]), 16,
                T.if_then_else(tx < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        T.ptx.cp.async_.wait_group(0)
        T.cuda.cta_sync()

        # 16-key blocks; on the diagonal tile only blocks jb <= warp hold visible keys
        for jb in range(T.if_then_else(J < ti, 4, warp + 1)):
            for e in T.unroll(8):
                cb[e] = T.float32(0.0)
            for ks in T.unroll(N // 16):
                jrow: T.let[T.int32] = jb * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Bs[jrow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, jrow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        cb[j2 * 4], cb[j2 * 4 + 1], cb[j2 * 4 + 2], cb[j2 * 4 + 3],
                        cfr[ks * 4], cfr[ks * 4 + 1], cfr[ks * 4 + 2], cfr[ks * 4 + 3], bf[j2 * 2], bf[j2 * 2 + 1],
                        cb[j2 * 4], cb[j2 * 4 + 1], cb[j2 * 4 + 2], cb[j2 * 4 + 3])
            # decay * dt_j + causal mask, then the tile becomes an A fragment (bf16 pairs)
            for j2 in T.unroll(2):
                for e in T.unroll(4):
                    fv[j2 * 4 + e] = T.if_then_else(
                        (J < ti) or (jb * 16 + j2 * 8 + tq * 2 + e % 2 <= warp * 16 + g + (e // 2) * 8),
                        cb[j2 * 4 + e] * (T.exp(cum[ti * TILE + warp * 16 + g + (e // 2) * 8]
                                                - cum[J * TILE + jb * 16 + j2 * 8 + tq * 2 + e % 2])
                                          * dts[J * TILE + jb * 16 + j2 * 8 + tq * 2 + e % 2]),
                        T.float32(0.0))
            for q in T.unroll(4):
                af[q] = T.bitwise_or(
                    T.cast(T.reinterpret("uint16", T.cast(fv[q * 2], "bfloat16")), "uint32"),
                    T.shift_left(T.cast(T.reinterpret("uint16", T.cast(fv[q * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
            # B operand: x rows of the block (ldmatrix.trans)
            xrow3: T.let[T.int32] = jb * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for pp in T.unroll(4):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Xs[xrow3, T.bitwise_xor(pp * 2 + lane // 16, xrow3 % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3])

    # ---- epilogue: y + D x (x_I is the last tile in Xs), bf16 pairs, rows < L
    sc[5] = DD[h]
    for hh in T.unroll(2):
        yrow: T.let[T.int32] = warp * 16 + hh * 8 + g
        if c0 + ti * TILE + yrow < seqlen:
            for pt in T.unroll(8):
                for e in T.vectorized(2):
                    xv[e] = Xs[yrow, T.bitwise_xor(pt, yrow % 8) * 8 + tq * 2 + e]
                for e in T.unroll(2):
                    pk[e] = T.cast(ya[pt * 4 + hh * 2 + e] + sc[5] * T.cast(xv[e], "float32"), "bfloat16")
                for e in T.vectorized(2):
                    Y[b, c0 + ti * TILE + yrow, h, pt * 8 + tq * 2 + e] = pk[e]


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; caching jit() once keeps the host call path short.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled():
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": chunk_scan}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(x, dt, A, B, C, chunk_states, D):
    bsz, L, h, p = x.shape
    assert (h, p, B.shape[2], B.shape[3]) == (HEADS, P, 1, N)
    y = torch.empty_like(x)
    if bsz == 0 or L == 0:
        return y
    assert chunk_states.shape[1] == math.ceil(L / CHUNK)
    _compiled()(x.contiguous(), dt.to(torch.float32).contiguous(), A.to(torch.float32).contiguous(),
                B.contiguous(), C.contiguous(), chunk_states.to(torch.float32).contiguous(),
                D.to(torch.float32).contiguous(), y)
    return y
