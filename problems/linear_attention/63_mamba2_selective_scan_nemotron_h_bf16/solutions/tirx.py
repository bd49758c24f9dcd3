# Mamba-2 SSD scan (Nemotron-H 8B mixer: 128 heads x 64, state 128, 8 B/C groups) as one fused TIRx
# kernel: chunked (128-token) SSD on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), the
# fp32 state kept in registers across the whole sequence.
#
# Per (batch, head) one CTA of 8 warps walks the chunks in order. For chunk c with cum = inclusive
# cumsum of delta*A, S = state [P=64, N=128] entering the chunk:
#   y_i = exp(cum_i) C_i . S  +  sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) delta_j x_j  +  D x_i
#   S'  = exp(cum_end) S + sum_s [delta_s exp(cum_end - cum_s) x_s] B_s^T
# - Data: cp.async double buffering; the next chunk's x [128x64], B and C [128x128] (bf16, rows past
#   the end zero-filled, 16-byte pieces XOR-swizzled by row for conflict-free ldmatrix) are in flight
#   while the current chunk is computed (179 KiB of dynamic shared memory, 1 CTA per SM).
# - Per-token scalars (threads 0..127, one token each): delta = softplus(dt + dt_bias) and delta*A in
#   fp64, a block prefix sum (warp shfl_up scans + warp totals), then exp(cum_end - cum) and
#   exp(cum_end) in fp64: the chunk decay is applied 32 times to slowly decaying heads (exp(dt A) up to
#   0.9999), where fast-math exp's ~2-ulp error would compound into the fp32-compared final state.
# - y: warp w owns rows 16w .. 16w+15 and all 64 head dims (32 fp32 accumulators). C S^T (S copied to
#   shared memory as bf16 each chunk, 64 mma) scaled by exp(cum_i); then for each 16-column block
#   j <= i: the C B^T tile (16 mma), scaled by exp(cum_i - cum_j) and masked in registers, becomes the
#   A fragment (FlashAttention-2 register reuse) of an mma with delta_j x_j (x via ldmatrix.trans,
#   scaled in registers). y + D x is written as bf16 pairs.
# - State: warp w owns head dims 16 (w % 4) .. +16 and state columns 64 (w // 4) .. +64 (32 fp32).
#   S' needs fp32 accuracy (final_state is compared at fp32 precision): the A operand
#   w_s x_s (w_s = delta_s exp(cum_end - cum_s), fp32) is split exactly into three bf16 terms
#   (8+8+8 mantissa bits; B is bf16 already, so every product is exact) and each 16-token k-step
#   accumulates the three mma (small terms first) into a fresh fragment that is added to the fp32
#   state with ordinary fp32 adds (so tensor-core accumulation rounding never touches the carried
#   state).
# What limits it / expected time: tensor-core work (~2900 mma.sync per CTA-chunk, 60% of it the 3x
# split for the exact state; the triangular y work also leaves warps unevenly loaded) and 256 CTAs
# on 132 SMs (two waves, 1 CTA/SM by shared memory). Expected ~0.2 ms vs the ~67 us memory SOL; far
# faster than eager PyTorch, which materializes [B, chunks, G, 16, 128, 128] decay tensors. Next
# steps: wgmma, moving C B^T to a shared per-group pre-pass, a P-split with 2 CTAs/SM.
#
# Streams: the compiled function is called with torch tensors; tvm-ffi installs torch's current
# stream as TVM's environment stream for the call. Only the compiled module is cached.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

H = 128
P = 64
N = 128
G = 8
HPG = H // G                    # heads per group
CL = 128                        # chunk length
THREADS = 256

# dynamic shared memory layout (bf16 elements)
OFF_B = 0                       # [2][128][128]
OFF_C = 2 * CL * N              # [2][128][128]
OFF_X = 4 * CL * N              # [2][128][64]
OFF_S = 4 * CL * N + 2 * CL * P  # [64][128] state copy
POOL = OFF_S + P * N


@T.prim_func
def ssd_scan(x_h: T.handle, dt_h: T.handle, alog_h: T.handle, b_h: T.handle, c_h: T.handle, d_h: T.handle,
             dtb_h: T.handle, s0_h: T.handle, y_h: T.handle, fs_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    X = T.match_buffer(x_h, (batch, seqlen, H, P), "bfloat16", align=16)
    DT = T.match_buffer(dt_h, (batch, seqlen, H), "bfloat16")
    ALOG = T.match_buffer(alog_h, (H,), "float32")
    Bm = T.match_buffer(b_h, (batch, seqlen, G, N), "bfloat16", align=16)
    Cm = T.match_buffer(c_h, (batch, seqlen, G, N), "bfloat16", align=16)
    DD = T.match_buffer(d_h, (H,), "float32")
    DTB = T.match_buffer(dtb_h, (H,), "float32")
    S0 = T.match_buffer(s0_h, (batch, H, P, N), "float32", align=16)
    Y = T.match_buffer(y_h, (batch, seqlen, H, P), "bfloat16", align=16)
    FS = T.match_buffer(fs_h, (batch, H, P, N), "float32", align=16)

    T.device_entry()
    h, b = T.cta_id([H, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((POOL,), "bfloat16", scope="shared.dyn")
    Bs = T.decl_buffer((2, CL, N), "bfloat16", data=pool.data, elem_offset=OFF_B)
    Cs = T.decl_buffer((2, CL, N), "bfloat16", data=pool.data, elem_offset=OFF_C)
    Xs = T.decl_buffer((2, CL, P), "bfloat16", data=pool.data, elem_offset=OFF_X)
    Sh = T.decl_buffer((P, N), "bfloat16", data=pool.data, elem_offset=OFF_S)
    wt = T.alloc_shared((CL,), "float32")           # delta_s exp(cum_end - cum_s)
    ec = T.alloc_shared((CL,), "float32")           # exp(cum_i)
    cf = T.alloc_shared((CL,), "float32")           # cum_i
    dl = T.alloc_shared((CL,), "float32")           # delta_s
    red = T.alloc_shared((4,), "float64")           # per-warp sums of delta*A

    st = T.alloc_local((32,), "float32")            # state fragments [n-tile 8][4]
    ya = T.alloc_local((32,), "float32")            # y fragments [p-tile 8][4]
    cb = T.alloc_local((8,), "float32")             # C B^T tile [2][4]
    tp = T.alloc_local((4,), "float32")             # fresh state-update fragment
    af = T.alloc_local((4,), "uint32")
    a3 = T.alloc_local((12,), "uint32")             # three bf16 split planes of the state A operand
    bf = T.alloc_local((4,), "uint32")
    fv = T.alloc_local((8,), "float32")
    rv = T.alloc_local((8,), "float32")
    hb = T.alloc_local((8,), "bfloat16")
    dtv = T.alloc_local((1,), "bfloat16")
    sd = T.alloc_local((4,), "float64")             # delta, dA, scan, cum
    sc = T.alloc_local((2,), "float32")             # exp(cum_end), D
    xv = T.alloc_local((2,), "bfloat16")
    pk = T.alloc_local((2,), "bfloat16")

    grp: T.let[T.int32] = h // HPG
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    mw: T.let[T.int32] = warp % 4                   # state: head-dim tile
    nw: T.let[T.int32] = warp // 4                  # state: half of the state columns
    nch: T.let[T.int32] = T.ceildiv(seqlen, CL)

    # carried state into the fragments
    for nt in T.unroll(8):
        for hh in T.unroll(2):
            for e in T.vectorized(2):
                st[nt * 4 + hh * 2 + e] = S0[b, h, mw * 16 + hh * 8 + g, nw * 64 + nt * 8 + tq * 2 + e]
    sc[1] = DD[h]

    # prologue: chunk 0 in flight, its dt in a register
    for r in T.unroll(8):
        brow: T.let[T.int32] = (tid + r * THREADS) // 16
        bch: T.let[T.int32] = (tid + r * THREADS) % 16
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Bs[0, brow, T.bitwise_xor(bch, brow % 8) * 8]),
            T.address_of(Bm[b, T.min(brow, seqlen - 1), grp, bch * 8]), 16,
            T.if_then_else(brow < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Cs[0, brow, T.bitwise_xor(bch, brow % 8) * 8]),
            T.address_of(Cm[b, T.min(brow, seqlen - 1), grp, bch * 8]), 16,
            T.if_then_else(brow < seqlen, T.uint32(16), T.uint32(0)))
    for r in T.unroll(4):
        xrow: T.let[T.int32] = (tid + r * THREADS) // 8
        xch: T.let[T.int32] = (tid + r * THREADS) % 8
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Xs[0, xrow, T.bitwise_xor(xch, xrow % 8) * 8]),
            T.address_of(X[b, T.min(xrow, seqlen - 1), h, xch * 8]), 16,
            T.if_then_else(xrow < seqlen, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()
    dtv[0] = T.bfloat16(0.0)
    if tid < CL:
        if tid < seqlen:
            dtv[0] = DT[b, tid, h]

    for c in range(nch):
        cb0: T.let[T.int32] = c % 2
        # ---- per-token scalars, part 1 (threads 0..127): delta, delta*A, warp-inclusive scan
        # (all warps run the shuffles, converged; warps 4..7 scan zeros and store nothing)
        sd[0] = T.float64(0.0)
        if tid < CL:
            if c * CL + tid < seqlen:
                sd[0] = T.cast(T.cast(dtv[0], "float32"), "float64") + T.cast(DTB[h], "float64")
                sd[0] = T.if_then_else(sd[0] > T.float64(20.0), sd[0], T.log1p(T.exp(sd[0])))
        sd[1] = sd[0] * (T.float64(0.0) - T.exp(T.cast(ALOG[h], "float64")))
        sd[2] = sd[1]
        for r in T.unroll(5):
            sd[3] = T.tvm_warp_shuffle_up(0xFFFFFFFF, sd[2], 1 << r, 32, 32)
            if lane >= (1 << r):
                sd[2] = sd[2] + sd[3]
        if tid < CL:
            if lane == 31:
                red[warp] = sd[2]
        T.ptx.cp.async_.wait_all()
        T.cuda.cta_sync()

        # ---- prefetch chunk c + 1 into the other buffer (last read during chunk c - 1)
        if c + 1 < nch:
            for r in T.unroll(8):
                brow2: T.let[T.int32] = (tid + r * THREADS) // 16
                bch2: T.let[T.int32] = (tid + r * THREADS) % 16
                tr: T.let[T.int32] = (c + 1) * CL + brow2
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Bs[1 - cb0, brow2, T.bitwise_xor(bch2, brow2 % 8) * 8]),
                    T.address_of(Bm[b, T.min(tr, seqlen - 1), grp, bch2 * 8]), 16,
                    T.if_then_else(tr < seqlen, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Cs[1 - cb0, brow2, T.bitwise_xor(bch2, brow2 % 8) * 8]),
                    T.address_of(Cm[b, T.min(tr, seqlen - 1), grp, bch2 * 8]), 16,
                    T.if_then_else(tr < seqlen, T.uint32(16), T.uint32(0)))
            for r in T.unroll(4):
                xrow2: T.let[T.int32] = (tid + r * THREADS) // 8
                xch2: T.let[T.int32] = (tid + r * THREADS) % 8
                tx: T.let[T.int32] = (c + 1) * CL + xrow2
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Xs[1 - cb0, xrow2, T.bitwise_xor(xch2, xrow2 % 8) * 8]),
                    T.address_of(X[b, T.min(tx, seqlen - 1), h, xch2 * 8]), 16,
                    T.if_then_else(tx < seqlen, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

        # ---- per-token scalars, part 2: cum, weights (fp64 exp), next chunk's dt
        sd[3] = (red[0] + red[1]) + (red[2] + red[3])          # cum_end (every thread)
        sc[0] = T.cast(T.exp(sd[3]), "float32")
        if tid < CL:
            for w2 in T.unroll(3):
                if w2 < warp:
                    sd[2] = sd[2] + red[w2]
            wt[tid] = T.cast(sd[0] * T.exp(sd[3] - sd[2]), "float32")
            ec[tid] = T.cast(T.exp(sd[2]), "float32")
            cf[tid] = T.cast(sd[2], "float32")
            dl[tid] = T.cast(sd[0], "float32")
            dtv[0] = T.bfloat16(0.0)
            if (c + 1) * CL + tid < seqlen:
                dtv[0] = DT[b, (c + 1) * CL + tid, h]
        # ---- bf16 copy of the entering state for C S^T
        for nt in T.unroll(8):
            for hh in T.unroll(2):
                for e in T.unroll(2):
                    pk[e] = T.cast(st[nt * 4 + hh * 2 + e], "bfloat16")
                for e in T.vectorized(2):
                    Sh[mw * 16 + hh * 8 + g, T.bitwise_xor(nw * 8 + nt, g) * 8 + tq * 2 + e] = pk[e]
        T.cuda.cta_sync()

        # ---- y, part 1: exp(cum_i) C_i . S (rows 16 warp .. +16, all 64 head dims)
        for e in T.unroll(32):
            ya[e] = T.float32(0.0)
        arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
        for ks in range(N // 16):
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Cs[cb0, arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            for pp in T.unroll(4):
                srow: T.let[T.int32] = pp * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Sh[srow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, srow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3])
        for pt in T.unroll(8):
            for e in T.unroll(4):
                ya[pt * 4 + e] = ya[pt * 4 + e] * ec[warp * 16 + g + (e // 2) * 8]

        # ---- y, part 2: causal blocks j <= i
        for jb in range(warp + 1):
            for e in T.unroll(8):
                cb[e] = T.float32(0.0)
            for ks in range(N // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[0], af[1], af[2], af[3],
                    T.address_of(Cs[cb0, arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
                jrow: T.let[T.int32] = jb * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Bs[cb0, jrow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, jrow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        cb[j2 * 4], cb[j2 * 4 + 1], cb[j2 * 4 + 2], cb[j2 * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        cb[j2 * 4], cb[j2 * 4 + 1], cb[j2 * 4 + 2], cb[j2 * 4 + 3])
            # decay + causal mask, then the tile becomes an A fragment (bf16 pairs)
            for j2 in T.unroll(2):
                for e in T.unroll(4):
                    fv[j2 * 4 + e] = T.if_then_else(
                        jb * 16 + j2 * 8 + tq * 2 + e % 2 <= warp * 16 + g + (e // 2) * 8,
                        cb[j2 * 4 + e] * T.exp(cf[warp * 16 + g + (e // 2) * 8] - cf[jb * 16 + j2 * 8 + tq * 2 + e % 2]),
                        T.float32(0.0))
            for q in T.unroll(4):
                af[q] = T.bitwise_or(
                    T.cast(T.reinterpret("uint16", T.cast(fv[q * 2], "bfloat16")), "uint32"),
                    T.shift_left(T.cast(T.reinterpret("uint16", T.cast(fv[q * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
            # B operand: delta_j x_j (x via ldmatrix.trans, scaled in registers)
            xrow3: T.let[T.int32] = jb * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for pp in T.unroll(4):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Xs[cb0, xrow3, T.bitwise_xor(pp * 2 + lane // 16, xrow3 % 8) * 8]))
                for q in T.unroll(4):
                    bf[q] = T.bitwise_or(
                        T.cast(T.reinterpret("uint16", T.cast(
                            T.reinterpret("float32", T.shift_left(bf[q], T.uint32(16)))
                            * dl[jb * 16 + (q % 2) * 8 + tq * 2], "bfloat16")), "uint32"),
                        T.shift_left(T.cast(T.reinterpret("uint16", T.cast(
                            T.reinterpret("float32", T.bitwise_and(bf[q], T.uint32(0xFFFF0000)))
                            * dl[jb * 16 + (q % 2) * 8 + tq * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        ya[(pp * 2 + j2) * 4], ya[(pp * 2 + j2) * 4 + 1], ya[(pp * 2 + j2) * 4 + 2], ya[(pp * 2 + j2) * 4 + 3])

        # ---- y, part 3: + D x, store bf16 pairs
        for hh in T.unroll(2):
            yrow: T.let[T.int32] = warp * 16 + hh * 8 + g
            if c * CL + yrow < seqlen:
                for pt in T.unroll(8):
                    for e in T.vectorized(2):
                        xv[e] = Xs[cb0, yrow, T.bitwise_xor(pt, yrow % 8) * 8 + tq * 2 + e]
                    for e in T.unroll(2):
                        pk[e] = T.cast(ya[pt * 4 + hh * 2 + e] + sc[1] * T.cast(xv[e], "float32"), "bfloat16")
                    for e in T.vectorized(2):
                        Y[b, c * CL + yrow, h, pt * 8 + tq * 2 + e] = pk[e]

        # ---- state: S = exp(cum_end) S + sum_s (w_s x_s) B_s^T, exact 3-way bf16 split of w_s x_s
        for e in T.unroll(32):
            st[e] = st[e] * sc[0]
        for ks in range(CL // 16):
            xrow4: T.let[T.int32] = ks * 16 + lane % 8 + (lane // 16) * 8
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Xs[cb0, xrow4, T.bitwise_xor(mw * 2 + (lane // 8) % 2, xrow4 % 8) * 8]))
            for q in T.unroll(4):
                fv[q * 2] = T.reinterpret("float32", T.shift_left(af[q], T.uint32(16))) * wt[ks * 16 + (q // 2) * 8 + tq * 2]
                fv[q * 2 + 1] = T.reinterpret("float32", T.bitwise_and(af[q], T.uint32(0xFFFF0000))) * wt[ks * 16 + (q // 2) * 8 + tq * 2 + 1]
            for e in T.unroll(8):
                hb[e] = T.cast(fv[e], "bfloat16")
                rv[e] = fv[e] - T.cast(hb[e], "float32")
            for q in T.unroll(4):
                a3[q] = T.bitwise_or(T.cast(T.reinterpret("uint16", hb[q * 2]), "uint32"),
                                     T.shift_left(T.cast(T.reinterpret("uint16", hb[q * 2 + 1]), "uint32"), T.uint32(16)))
            for e in T.unroll(8):
                hb[e] = T.cast(rv[e], "bfloat16")
                rv[e] = rv[e] - T.cast(hb[e], "float32")
            for q in T.unroll(4):
                a3[4 + q] = T.bitwise_or(T.cast(T.reinterpret("uint16", hb[q * 2]), "uint32"),
                                         T.shift_left(T.cast(T.reinterpret("uint16", hb[q * 2 + 1]), "uint32"), T.uint32(16)))
            for e in T.unroll(8):
                hb[e] = T.cast(rv[e], "bfloat16")
            for q in T.unroll(4):
                a3[8 + q] = T.bitwise_or(T.cast(T.reinterpret("uint16", hb[q * 2]), "uint32"),
                                         T.shift_left(T.cast(T.reinterpret("uint16", hb[q * 2 + 1]), "uint32"), T.uint32(16)))
            brow3: T.let[T.int32] = ks * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for pp in T.unroll(4):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Bs[cb0, brow3, T.bitwise_xor(nw * 8 + pp * 2 + lane // 16, brow3 % 8) * 8]))
                for j2 in T.unroll(2):
                    for e in T.unroll(4):
                        tp[e] = T.float32(0.0)
                    for sp in T.unroll(3):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            tp[0], tp[1], tp[2], tp[3],
                            a3[(2 - sp) * 4], a3[(2 - sp) * 4 + 1], a3[(2 - sp) * 4 + 2], a3[(2 - sp) * 4 + 3],
                            bf[j2 * 2], bf[j2 * 2 + 1], tp[0], tp[1], tp[2], tp[3])
                    for e in T.unroll(4):
                        st[(pp * 2 + j2) * 4 + e] = st[(pp * 2 + j2) * 4 + e] + tp[e]

    # final state
    for nt in T.unroll(8):
        for hh in T.unroll(2):
            for e in T.vectorized(2):
                FS[b, h, mw * 16 + hh * 8 + g, nw * 64 + nt * 8 + tq * 2 + e] = st[nt * 4 + hh * 2 + e]


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
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": ssd_scan}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
          D: torch.Tensor, dt_bias: torch.Tensor, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exe = _compiled()
    batch, seqlen = x.shape[0], x.shape[1]
    y = torch.empty_like(x)
    final_state = torch.empty((batch, H, P, N), dtype=torch.float32, device=x.device)
    if seqlen == 0:
        final_state.copy_(initial_state)
        return y, final_state
    exe(x.contiguous(), dt.contiguous(), A_log.contiguous().float(), B.contiguous(), C.contiguous(),
        D.contiguous().float(), dt_bias.contiguous().float(), initial_state.contiguous().float(), y, final_state)
    return y, final_state
