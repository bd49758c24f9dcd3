# RetNet multi-scale retention, parallel form (8 heads, key dim 256, value dim 512, 8 x 1024 tokens) in
# TIRx: a causal flash-attention-like tensor-core kernel without softmax (ldmatrix + mma.sync m16n8k16,
# bf16 in, fp32 accumulate). Same algorithm and launch geometry as the CuTe DSL solution of this problem
# (which passed on the H200 at 0.412 ms device time).
#
#     o_i = sum_{j <= i} gamma_h^(i - j) (q_i . k_j / 16) v_j,   gamma_h = 1 - 2^(-5 - h)
# Launch geometry
# - Grid (row tiles of 64 queries, B*H); the heavy (late) row tiles are launched first. 256 threads =
#   8 warps as 4 row strips (16 rows each, warp % 4) x 2 column halves (warp // 4); one CTA per SM
#   (136 KiB of dynamic shared memory; every tile is stored in 16-byte chunks XOR-swizzled by row % 8 so
#   that the ldmatrix loads are conflict-free).
# - Q_I [64 x 256] is staged once with cp.async (16 B, zero-filled past T). For key tiles J = 0..I:
#     S = Q_I K_J^T: each warp computes its 16 rows x 32 of the 64 key columns (no duplicated work);
#     P = S / 16 * exp2((i - j) log2 gamma) (zero above the diagonal), rounded to bf16 and exchanged
#     through a 64 x 64 shared tile; O[16 rows x 256 value columns per warp] += P V_J (V through
#     ldmatrix.trans), 128 fp32 accumulators per thread.
#   Loads are split-phase: V_J is fetched while S is computed, K_{J+1} while P V_J is computed.
# - Epilogue: O (bf16 pairs) stored for rows < T.
# Differences from the CuTe DSL version: each warp's 32 S columns are contiguous (the CuTe tiled MMA
# interleaves the two column halves in 8-column strips); log2 gamma is computed once per CTA in fp64,
# because TVM compiles device code with fast math and the approximate fp32 log2 has an absolute error
# of ~2^-22, i.e. a relative error of ~1e-3 on log2 gamma = -3.5e-4 of the slowest head. The
# per-element exp2 stays the fast hardware one (relative error ~2^-22), as in the CuTe DSL kernel.
# Numerics: fp32 accumulation; P carries one bf16 rounding (2^-9 relative), inside the bf16 allowance.
# What limits it / expected time: like the CuTe DSL kernel (0.41 ms device on the H200): warp-level
# mma.sync, 128 fp32 accumulators per thread (register cap 255, one CTA = 8 warps per SM), two
# barriers per key tile. Faster than eager (2.9 ms) and torch.compile (3.9 ms), ~8x the SOL (0.052 ms).
#
# Host path: compiled once per process (B*H, T and the tile count symbolic); tvm-ffi runs the kernel on
# torch's current stream.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

HEADS = 8
DK = 256
DV = 512
TILE = 64
THREADS = 256
QK_SCALE = DK ** -0.5           # 1/16, exact
QCH = DK // 8                   # 16-byte chunks per q/k row (32)
VCH = DV // 8                   # 16-byte chunks per v row (64)


@T.prim_func
def retention(q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle, ntiles: T.int32):
    nbh = T.int32()
    seqlen = T.int32()
    Q = T.match_buffer(q_h, (nbh, seqlen, DK), "bfloat16", align=16)
    K = T.match_buffer(k_h, (nbh, seqlen, DK), "bfloat16", align=16)
    V = T.match_buffer(v_h, (nbh, seqlen, DV), "bfloat16", align=16)
    O = T.match_buffer(o_h, (nbh, seqlen, DV), "bfloat16", align=16)

    T.device_entry()
    bx, bh = T.cta_id([ntiles, nbh])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((2 * TILE * DK + TILE * DV + TILE * TILE,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((TILE, DK), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((TILE, DK), "bfloat16", data=pool.data, elem_offset=TILE * DK)
    Vs = T.decl_buffer((TILE, DV), "bfloat16", data=pool.data, elem_offset=2 * TILE * DK)
    Ps = T.decl_buffer((TILE, TILE), "bfloat16", data=pool.data, elem_offset=2 * TILE * DK + TILE * DV)

    oa = T.alloc_local((128,), "float32")           # O fragments [n-tile 32][4]
    sa = T.alloc_local((16,), "float32")            # S fragments [n-tile 4][4]
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    pk = T.alloc_local((2,), "bfloat16")
    wt = T.alloc_local((1,), "float32")
    lgv = T.alloc_local((1,), "float32")

    tI: T.let[T.int32] = ntiles - 1 - bx            # heaviest row tiles first
    hd: T.let[T.int32] = bh % HEADS
    wm: T.let[T.int32] = warp % 4
    wn: T.let[T.int32] = warp // 4
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    lgv[0] = T.cast(T.log2(T.float64(1.0) - T.exp2(T.cast(-5 - hd, "float64"))), "float32")

    for e in T.unroll(128):
        oa[e] = T.float32(0.0)

    # ---- prologue: Q_I and K_0 (8 chunks of 16 bytes each per thread), rows past T zero-filled
    for r in T.unroll(8):
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Qs[(tid + r * THREADS) // QCH,
                            T.bitwise_xor((tid + r * THREADS) % QCH, ((tid + r * THREADS) // QCH) % 8) * 8]),
            T.address_of(Q[bh, T.min(tI * TILE + (tid + r * THREADS) // QCH, seqlen - 1), ((tid + r * THREADS) % QCH) * 8]),
            16, T.if_then_else(tI * TILE + (tid + r * THREADS) // QCH < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Ks[(tid + r * THREADS) // QCH,
                            T.bitwise_xor((tid + r * THREADS) % QCH, ((tid + r * THREADS) // QCH) % 8) * 8]),
            T.address_of(K[bh, T.min((tid + r * THREADS) // QCH, seqlen - 1), ((tid + r * THREADS) % QCH) * 8]),
            16, T.if_then_else((tid + r * THREADS) // QCH < seqlen, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()

    for J in range(tI + 1):
        T.ptx.cp.async_.wait_group(0)
        T.cuda.cta_sync()                           # K_J visible; the previous P V reads are finished
        # ---- V_J (16 chunks per thread), in flight during S
        for r in T.unroll(16):
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Vs[(tid + r * THREADS) // VCH,
                                T.bitwise_xor((tid + r * THREADS) % VCH, ((tid + r * THREADS) // VCH) % 8) * 8]),
                T.address_of(V[bh, T.min(J * TILE + (tid + r * THREADS) // VCH, seqlen - 1),
                               ((tid + r * THREADS) % VCH) * 8]),
                16, T.if_then_else(J * TILE + (tid + r * THREADS) // VCH < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()

        # ---- S = Q_I K_J^T: warp -> rows 16 wm, key columns 32 wn .. +32
        for e in T.unroll(16):
            sa[e] = T.float32(0.0)
        for ks in range(DK // 16):
            arow: T.let[T.int32] = wm * 16 + lane % 8 + ((lane // 8) % 2) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            for jj in T.unroll(2):
                brow: T.let[T.int32] = wn * 32 + jj * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Ks[brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3])
        # ---- P = S / 16 * gamma^(i - j), zero above the diagonal, bf16 to the shared P tile
        for j in T.unroll(4):
            for hh in T.unroll(2):
                for i in T.unroll(2):
                    wt[0] = T.cast((tI - J) * TILE + wm * 16 + hh * 8 + g - (wn * 32 + j * 8 + tq * 2 + i), "float32")
                    pk[i] = T.cast(T.if_then_else(
                        wt[0] >= T.float32(0.0),
                        sa[j * 4 + hh * 2 + i] * (T.exp2(wt[0] * lgv[0]) * T.float32(QK_SCALE)),
                        T.float32(0.0)), "bfloat16")
                for i in T.vectorized(2):
                    Ps[wm * 16 + hh * 8 + g, T.bitwise_xor(wn * 4 + j, g) * 8 + tq * 2 + i] = pk[i]

        T.ptx.cp.async_.wait_group(0)
        T.cuda.cta_sync()                           # P and V_J visible; all S reads of K_J finished
        if J < tI:
            for r in T.unroll(8):
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Ks[(tid + r * THREADS) // QCH,
                                    T.bitwise_xor((tid + r * THREADS) % QCH, ((tid + r * THREADS) // QCH) % 8) * 8]),
                    T.address_of(K[bh, T.min((J + 1) * TILE + (tid + r * THREADS) // QCH, seqlen - 1),
                                   ((tid + r * THREADS) % QCH) * 8]),
                    16, T.if_then_else((J + 1) * TILE + (tid + r * THREADS) // QCH < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()

        # ---- O += P V_J: warp -> rows 16 wm, value columns 256 wn .. +256 (32 n-tiles)
        for ks in T.unroll(TILE // 16):
            prow: T.let[T.int32] = wm * 16 + lane % 8 + ((lane // 8) % 2) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Ps[prow, T.bitwise_xor(ks * 2 + lane // 16, prow % 8) * 8]))
            vrow: T.let[T.int32] = ks * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for jj in T.unroll(16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Vs[vrow, T.bitwise_xor(wn * 32 + jj * 2 + lane // 16, vrow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        oa[(jj * 2 + j2) * 4], oa[(jj * 2 + j2) * 4 + 1], oa[(jj * 2 + j2) * 4 + 2], oa[(jj * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        oa[(jj * 2 + j2) * 4], oa[(jj * 2 + j2) * 4 + 1], oa[(jj * 2 + j2) * 4 + 2], oa[(jj * 2 + j2) * 4 + 3])

    # ---- epilogue: O rows < T as bf16 pairs
    for hh in T.unroll(2):
        if tI * TILE + wm * 16 + hh * 8 + g < seqlen:
            for j in T.unroll(32):
                for i in T.unroll(2):
                    pk[i] = T.cast(oa[j * 4 + hh * 2 + i], "bfloat16")
                for i in T.vectorized(2):
                    O[bh, tI * TILE + wm * 16 + hh * 8 + g, wn * 256 + j * 8 + tq * 2 + i] = pk[i]


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
        exe = tvm.compile(tvm.IRModule({"main": retention}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(q, k, v):
    b, h, t, dk = q.shape
    assert (h, dk, v.shape[-1]) == (HEADS, DK, DV)
    out = torch.empty((b, h, t, DV), dtype=q.dtype, device=q.device)
    if b == 0 or t == 0:
        return out
    _compiled()(q.contiguous().view(b * h, t, DK), k.contiguous().view(b * h, t, DK),
                v.contiguous().view(b * h, t, DV), out.view(b * h, t, DV), (t + TILE - 1) // TILE)
    return out
