# Gated linear attention (GLA 1.3B geometry: 4 heads, key dim 256, value dim 512) forward in TIRx:
# chunked form (64-token chunks) on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), two
# kernels.
#
# Chunked form used (per head, chunk of C = 64 tokens, cum = inclusive cumsum of gk inside the chunk,
# E = exp(cum) per token and key channel, S = state [K, V] entering the chunk):
#   Qd = (q / 16) * E,  Ki = k / E,  A = tril(Qd Ki^T)  (A[t, s] = sum_k q k exp(cum_t - cum_s), s <= t)
#   o  = Qd S + A v
#   S' = diag(exp(cum_last)) (S + Ki^T v)
# (exact rewriting of the reference's chunk step; |cum| over 64 tokens stays far inside the fp32 and
# bf16 exponent range for gk = logsigmoid(.)/16 >= -0.4 per step.)
#
# Kernel 1 (gla_prep): grid (chunks, 4 heads, B), 256 threads. Thread c owns key channel c: it scans
# the chunk's 64 tokens (cum in fp32), writes Qd and Ki as bf16 into shared memory (16-byte chunks
# XOR-swizzled by row so that ldmatrix is conflict-free) and exp(cum_last) to global. Then the CTA
# copies Qd / Ki to a global workspace with 16-byte vectors and computes A = Qd Ki^T (64 x 64,
# K = 256) with ldmatrix + mma.sync: warp w owns the 16-row tile w // 2 and four 8-column tiles;
# the causal mask (s <= t) is applied and A is stored as bf16. Fully parallel over chunks.
# Kernel 2 (gla_state): grid (8 value slices of 64 columns, 4 heads, B), 256 threads, 2 CTAs per SM
# (112 KiB of dynamic shared memory each, <= 128 registers). The slice's fp32 state [256 x 64] lives
# in the mma accumulator fragments of the 8 warps (warp w: key rows 32w .. 32w+31, 64 fp32 registers
# per thread) for the whole sequence. Per chunk: cp.async brings Ki and the v slice (rows past the
# sequence end zero-filled); the state is written to shared memory as bf16; o = Qd S + A v
# (warp w: rows 16 (w // 2), columns 32 (w % 2) .. +32; 16 + 4 k-steps) is written as bf16 pairs;
# after a barrier the next chunk's Qd and A are prefetched with cp.async while the warps update the
# state: S += Ki^T v (ldmatrix.trans for both operands, 4 k-steps), then each accumulator row is
# scaled by exp(cum_last). Chunks are sequential only in kernel 2.
# Numerics: the products use bf16 operands (Qd, Ki, A, v, and the state copy for Qd S) with fp32
# accumulation; the state itself stays fp32. The output is bf16 (tolerance ~3 bf16 ulps of max|o|);
# the bf16 rounding of the operands adds errors of ~2^-9 of individual terms.
#
# What limits it / expected time: tensor-core work is ~23 GFLOP (the SOL model's 20 GFLOP plus the
# 64x64 intra-chunk products) done with mma.sync (Hopper's legacy path, roughly half of wgmma's
# rate), the 16 sequential chunk steps per slice, and kernel 2's cp.async waits (Ki / v of the next
# chunk are loaded only after the state update; the second CTA on the SM hides part of it). Workspace
# traffic: Qd / Ki / A written once (37 MB) and read by the 8 slices (mostly L2 hits). Expected
# ~60-100 us vs the ~24 us SOL; far faster than eager PyTorch (32 chunk iterations over a
# materialized [N, 32, 32, 256] decay tensor). Next steps: wgmma with the state in registers,
# a cluster of the 8 slices sharing Qd / Ki through distributed shared memory.
#
# Streams: both compiled functions are called with torch tensors; tvm-ffi installs torch's current
# stream as TVM's environment stream for each call, so the two kernels run in order on it. The
# workspace is cached per (device, B, T) and fully rewritten by kernel 1 before kernel 2 reads it.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

H = 4
DK = 256
DV = 512
C = 64                          # chunk length
VS = 64                         # value columns per kernel-2 CTA
NV = DV // VS                   # 8 slices
THREADS = 256
QSCALE = DK ** -0.5             # 1/16, exact


@T.prim_func
def gla_prep(q_h: T.handle, k_h: T.handle, g_h: T.handle, qd_h: T.handle, ki_h: T.handle, am_h: T.handle,
             ecl_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    nch = T.int32()
    Q = T.match_buffer(q_h, (batch, seqlen, H, DK), "bfloat16", align=16)
    K = T.match_buffer(k_h, (batch, seqlen, H, DK), "bfloat16", align=16)
    G = T.match_buffer(g_h, (batch, seqlen, H, DK), "bfloat16", align=16)
    QD = T.match_buffer(qd_h, (batch, H, nch, C, DK), "bfloat16", align=16)
    KI = T.match_buffer(ki_h, (batch, H, nch, C, DK), "bfloat16", align=16)
    AM = T.match_buffer(am_h, (batch, H, nch, C, C), "bfloat16", align=16)
    ECL = T.match_buffer(ecl_h, (batch, H, nch, DK), "float32", align=16)

    T.device_entry()
    ci, h, b = T.cta_id([nch, H, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((2 * C * DK,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((C, DK), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((C, DK), "bfloat16", data=pool.data, elem_offset=C * DK)

    sc = T.alloc_local((5,), "float32")             # cum, E, g, q, k
    vb = T.alloc_local((8,), "bfloat16")
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((8,), "uint32")
    acc = T.alloc_local((16,), "float32")

    # ---- scan over the chunk: thread tid owns key channel tid
    sc[0] = T.float32(0.0)
    for t0 in range(C // 8):
        for t1 in T.unroll(8):
            tt: T.let[T.int32] = ci * C + t0 * 8 + t1
            if tt < seqlen:
                sc[2] = T.cast(G[b, tt, h, tid], "float32")
                sc[3] = T.cast(Q[b, tt, h, tid], "float32")
                sc[4] = T.cast(K[b, tt, h, tid], "float32")
            else:
                sc[2] = T.float32(0.0)
                sc[3] = T.float32(0.0)
                sc[4] = T.float32(0.0)
            sc[0] = sc[0] + sc[2]
            sc[1] = T.exp(sc[0])
            Qs[t0 * 8 + t1, T.bitwise_xor(tid // 8, t1) * 8 + tid % 8] = T.cast(sc[3] * T.float32(QSCALE) * sc[1], "bfloat16")
            Ks[t0 * 8 + t1, T.bitwise_xor(tid // 8, t1) * 8 + tid % 8] = T.cast(sc[4] / sc[1], "bfloat16")
    ECL[b, h, ci, tid] = T.exp(sc[0])
    T.cuda.cta_sync()

    # ---- Qd / Ki to the workspace (16-byte vectors, un-swizzled)
    for r in T.unroll(8):
        row: T.let[T.int32] = (tid + r * THREADS) // 32
        ch: T.let[T.int32] = (tid + r * THREADS) % 32
        for i in T.vectorized(8):
            vb[i] = Qs[row, T.bitwise_xor(ch, row % 8) * 8 + i]
        for i in T.vectorized(8):
            QD[b, h, ci, row, ch * 8 + i] = vb[i]
        for i in T.vectorized(8):
            vb[i] = Ks[row, T.bitwise_xor(ch, row % 8) * 8 + i]
        for i in T.vectorized(8):
            KI[b, h, ci, row, ch * 8 + i] = vb[i]

    # ---- A = Qd Ki^T on tensor cores: warp -> rows 16 (w // 2), columns 32 (w % 2) .. +32
    mt: T.let[T.int32] = warp // 2
    ntb: T.let[T.int32] = (warp % 2) * 4
    for e in T.unroll(16):
        acc[e] = T.float32(0.0)
    for ks in range(DK // 16):
        arow: T.let[T.int32] = mt * 16 + lane % 8 + ((lane // 8) % 2) * 8
        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
            af[0], af[1], af[2], af[3],
            T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
        for jj in T.unroll(2):
            brow: T.let[T.int32] = (ntb + jj * 2) * 8 + lane % 8 + (lane // 16) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                bf[jj * 4], bf[jj * 4 + 1], bf[jj * 4 + 2], bf[jj * 4 + 3],
                T.address_of(Ks[brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
        for j in T.unroll(4):
            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                acc[j * 4], acc[j * 4 + 1], acc[j * 4 + 2], acc[j * 4 + 3],
                af[0], af[1], af[2], af[3], bf[j * 2], bf[j * 2 + 1],
                acc[j * 4], acc[j * 4 + 1], acc[j * 4 + 2], acc[j * 4 + 3])
    for j in T.unroll(4):
        for e in T.unroll(4):
            AM[b, h, ci, mt * 16 + lane // 4 + (e // 2) * 8, (ntb + j) * 8 + (lane % 4) * 2 + e % 2] = T.cast(
                T.if_then_else((ntb + j) * 8 + (lane % 4) * 2 + e % 2 <= mt * 16 + lane // 4 + (e // 2) * 8,
                               acc[j * 4 + e], T.float32(0.0)), "bfloat16")


@T.prim_func
def gla_state(qd_h: T.handle, ki_h: T.handle, am_h: T.handle, ecl_h: T.handle, v_h: T.handle, o_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    nch = T.int32()
    QD = T.match_buffer(qd_h, (batch, H, nch, C, DK), "bfloat16", align=16)
    KI = T.match_buffer(ki_h, (batch, H, nch, C, DK), "bfloat16", align=16)
    AM = T.match_buffer(am_h, (batch, H, nch, C, C), "bfloat16", align=16)
    ECL = T.match_buffer(ecl_h, (batch, H, nch, DK), "float32", align=16)
    V = T.match_buffer(v_h, (batch, seqlen, H, DV), "bfloat16", align=16)
    O = T.match_buffer(o_h, (batch, seqlen, H, DV), "bfloat16", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
    vs, h, b = T.cta_id([NV, H, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((2 * C * DK + DK * VS + C * C + C * VS,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((C, DK), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((C, DK), "bfloat16", data=pool.data, elem_offset=C * DK)
    Sb = T.decl_buffer((DK, VS), "bfloat16", data=pool.data, elem_offset=2 * C * DK)
    As = T.decl_buffer((C, C), "bfloat16", data=pool.data, elem_offset=2 * C * DK + DK * VS)
    Vs = T.decl_buffer((C, VS), "bfloat16", data=pool.data, elem_offset=2 * C * DK + DK * VS + C * C)

    st = T.alloc_local((64,), "float32")            # state fragments [m-tile 2][n-tile 8][4]
    oa = T.alloc_local((16,), "float32")            # output fragments [n-tile 4][4]
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    ec = T.alloc_local((4,), "float32")
    pk = T.alloc_local((2,), "bfloat16")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    for e in T.unroll(64):
        st[e] = T.float32(0.0)

    # prefetch Qd and A of chunk 0 (Qd: 2048 16-byte pieces, A: 512)
    for r in T.unroll(8):
        qrow: T.let[T.int32] = (tid + r * THREADS) // 32
        qch: T.let[T.int32] = (tid + r * THREADS) % 32
        T.ptx.cp.async_.cg.shared.global_(T.address_of(Qs[qrow, T.bitwise_xor(qch, qrow % 8) * 8]),
                                          T.address_of(QD[b, h, 0, qrow, qch * 8]), 16)
    for r in T.unroll(2):
        arow0: T.let[T.int32] = (tid + r * THREADS) // 8
        ach0: T.let[T.int32] = (tid + r * THREADS) % 8
        T.ptx.cp.async_.cg.shared.global_(T.address_of(As[arow0, T.bitwise_xor(ach0, arow0 % 8) * 8]),
                                          T.address_of(AM[b, h, 0, arow0, ach0 * 8]), 16)
    T.ptx.cp.async_.commit_group()

    for ci in range(nch):
        # ---- Ki and the v slice of this chunk
        for r in T.unroll(8):
            krow: T.let[T.int32] = (tid + r * THREADS) // 32
            kch: T.let[T.int32] = (tid + r * THREADS) % 32
            T.ptx.cp.async_.cg.shared.global_(T.address_of(Ks[krow, T.bitwise_xor(kch, krow % 8) * 8]),
                                              T.address_of(KI[b, h, ci, krow, kch * 8]), 16)
        for r in T.unroll(2):
            vrow: T.let[T.int32] = (tid + r * THREADS) // 8
            vch: T.let[T.int32] = (tid + r * THREADS) % 8
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Vs[vrow, T.bitwise_xor(vch, vrow % 8) * 8]),
                T.address_of(V[b, T.min(ci * C + vrow, seqlen - 1), h, vs * VS + vch * 8]), 16,
                T.if_then_else(ci * C + vrow < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        for mi in T.unroll(2):
            for hh in T.unroll(2):
                ec[mi * 2 + hh] = ECL[b, h, ci, warp * 32 + mi * 16 + hh * 8 + g]
        # ---- state (bf16 copy) to shared memory: element (row, col) of the warp's fragments
        for mi in T.unroll(2):
            for nj in T.unroll(8):
                for hh in T.unroll(2):
                    for i in T.unroll(2):
                        pk[i] = T.cast(st[(mi * 8 + nj) * 4 + hh * 2 + i], "bfloat16")
                    for i in T.vectorized(2):
                        Sb[warp * 32 + mi * 16 + hh * 8 + g, T.bitwise_xor(nj, g) * 8 + tq * 2 + i] = pk[i]
        T.ptx.cp.async_.wait_all()
        T.cuda.cta_sync()

        # ---- o = Qd S + A v: warp -> rows 16 om, value columns 32 (w % 2) .. +32
        om: T.let[T.int32] = warp // 2
        onb: T.let[T.int32] = (warp % 2) * 4
        for e in T.unroll(16):
            oa[e] = T.float32(0.0)
        for ks in range(DK // 16):
            arow: T.let[T.int32] = om * 16 + lane % 8 + ((lane // 8) % 2) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            srow: T.let[T.int32] = ks * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for jj in T.unroll(2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Sb[srow, T.bitwise_xor(onb + jj * 2 + lane // 16, srow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        oa[(jj * 2 + j2) * 4], oa[(jj * 2 + j2) * 4 + 1], oa[(jj * 2 + j2) * 4 + 2], oa[(jj * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        oa[(jj * 2 + j2) * 4], oa[(jj * 2 + j2) * 4 + 1], oa[(jj * 2 + j2) * 4 + 2], oa[(jj * 2 + j2) * 4 + 3])
        for ks in T.unroll(C // 16):
            arow2: T.let[T.int32] = om * 16 + lane % 8 + ((lane // 8) % 2) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(As[arow2, T.bitwise_xor(ks * 2 + lane // 16, arow2 % 8) * 8]))
            vrow2: T.let[T.int32] = ks * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for jj in T.unroll(2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Vs[vrow2, T.bitwise_xor(onb + jj * 2 + lane // 16, vrow2 % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        oa[(jj * 2 + j2) * 4], oa[(jj * 2 + j2) * 4 + 1], oa[(jj * 2 + j2) * 4 + 2], oa[(jj * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        oa[(jj * 2 + j2) * 4], oa[(jj * 2 + j2) * 4 + 1], oa[(jj * 2 + j2) * 4 + 2], oa[(jj * 2 + j2) * 4 + 3])
        for j in T.unroll(4):
            for hh in T.unroll(2):
                if ci * C + om * 16 + hh * 8 + g < seqlen:
                    for i in T.unroll(2):
                        pk[i] = T.cast(oa[j * 4 + hh * 2 + i], "bfloat16")
                    for i in T.vectorized(2):
                        O[b, ci * C + om * 16 + hh * 8 + g, h, vs * VS + (onb + j) * 8 + tq * 2 + i] = pk[i]
        T.cuda.cta_sync()

        # ---- prefetch Qd and A of the next chunk (their buffers are free now)
        if ci + 1 < nch:
            for r in T.unroll(8):
                qrow2: T.let[T.int32] = (tid + r * THREADS) // 32
                qch2: T.let[T.int32] = (tid + r * THREADS) % 32
                T.ptx.cp.async_.cg.shared.global_(T.address_of(Qs[qrow2, T.bitwise_xor(qch2, qrow2 % 8) * 8]),
                                                  T.address_of(QD[b, h, ci + 1, qrow2, qch2 * 8]), 16)
            for r in T.unroll(2):
                arow3: T.let[T.int32] = (tid + r * THREADS) // 8
                ach3: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(T.address_of(As[arow3, T.bitwise_xor(ach3, arow3 % 8) * 8]),
                                                  T.address_of(AM[b, h, ci + 1, arow3, ach3 * 8]), 16)
            T.ptx.cp.async_.commit_group()

        # ---- S = diag(exp(cum_last)) (S + Ki^T v): warp -> key rows 32w .. +32, all 64 columns
        for ks in T.unroll(C // 16):
            krow2: T.let[T.int32] = ks * 16 + lane % 8 + (lane // 16) * 8
            vrow3: T.let[T.int32] = ks * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for mi in T.unroll(2):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    af[0], af[1], af[2], af[3],
                    T.address_of(Ks[krow2, T.bitwise_xor(warp * 4 + mi * 2 + (lane // 8) % 2, krow2 % 8) * 8]))
                for jp in T.unroll(4):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        bf[0], bf[1], bf[2], bf[3],
                        T.address_of(Vs[vrow3, T.bitwise_xor(jp * 2 + lane // 16, vrow3 % 8) * 8]))
                    for j2 in T.unroll(2):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            st[(mi * 8 + jp * 2 + j2) * 4], st[(mi * 8 + jp * 2 + j2) * 4 + 1],
                            st[(mi * 8 + jp * 2 + j2) * 4 + 2], st[(mi * 8 + jp * 2 + j2) * 4 + 3],
                            af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                            st[(mi * 8 + jp * 2 + j2) * 4], st[(mi * 8 + jp * 2 + j2) * 4 + 1],
                            st[(mi * 8 + jp * 2 + j2) * 4 + 2], st[(mi * 8 + jp * 2 + j2) * 4 + 3])
        for mi in T.unroll(2):
            for nj in T.unroll(8):
                for e in T.unroll(4):
                    st[(mi * 8 + nj) * 4 + e] = st[(mi * 8 + nj) * 4 + e] * ec[mi * 2 + e // 2]
        T.cuda.cta_sync()


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
                     for f in (gla_prep, gla_state))
        _CACHE["exes"] = exes
    return exes


def _workspace(device: torch.device, batch: int, nch: int):
    key = ("ws", str(device), batch, nch)
    ws = _CACHE.get(key)
    if ws is None:
        qd = torch.empty((batch, H, nch, C, DK), dtype=torch.bfloat16, device=device)
        ki = torch.empty((batch, H, nch, C, DK), dtype=torch.bfloat16, device=device)
        am = torch.empty((batch, H, nch, C, C), dtype=torch.bfloat16, device=device)
        ecl = torch.empty((batch, H, nch, DK), dtype=torch.float32, device=device)
        ws = (qd, ki, am, ecl)
        _CACHE[key] = ws
    return ws


def solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor) -> torch.Tensor:
    prep, state = _compiled()
    batch, seqlen = q.shape[0], q.shape[1]
    o = torch.empty((batch, seqlen, H, DV), dtype=q.dtype, device=q.device)
    if batch == 0 or seqlen == 0:
        return o
    nch = (seqlen + C - 1) // C
    qd, ki, am, ecl = _workspace(q.device, batch, nch)
    prep(q.contiguous(), k.contiguous(), gk.contiguous(), qd, ki, am, ecl)
    state(qd, ki, am, ecl, v.contiguous(), o)
    return o
