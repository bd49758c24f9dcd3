# Gemma 3n AltUp collapse (three bias-free 2048 x 2048 unembedding GEMMs, per-token RMS rescale to the main
# stream, mean of the 4 streams), bf16 in / bf16 out: two TIRx kernels.
#
# Same decomposition as the CuTe DSL solution (which passed on the H200 at 0.337 ms device time):
# 1. gemm (batched over the 3 alternate streams, grid ceil(T/128) x ceil(H/128) x 3):
#    P_i = h_i @ W_i^T with bf16 tensor-core products and fp32 accumulation. CTA tile 128 x 128, K in stages of
#    32 through a 4-stage cp.async pipeline (16-byte cp.async.cg, shared rows padded to 40 bf16 so the
#    ldmatrix loads are conflict-free), 80 KiB dynamic shared memory, 2 CTAs per SM; 8 warps of 64 x 32
#    (4 x 4 m16n8k16 tiles). Epilogue: per-row partial sums of p^2 from the fp32 accumulators over the
#    CTA's 128 columns (quad xor-shuffles, the 4 column warps combined through shared memory in a fixed order:
#    deterministic) into ss[i, t, column tile]; P rounded to bf16 (the problem allows it) and stored as bf16x2
#    pairs into a [3, T, H] workspace. Rows / columns past T / H are clamped on load, masked on store and
#    excluded from the sums.
# 2. combine: one CTA per token, thread j owns columns 8j..8j+7 (16-byte accesses): target = sqrt(mean(h0^2))
#    (CTA reduction), mag_i = sqrt(max(sum of the partials / H, 1e-5)), out = (h0 + sum_i P_i target / mag_i)/4
#    in fp32, rounded once to bf16.
# Difference from the CuTe DSL version, and why: the CuTe kernel uses the Hopper warpgroup MMA (wgmma
# m64n256k16, 128 x 256 tiles) fed by TMA with a producer warp and a TMA-store epilogue; the TIRx solutions
# of this repository have no wgmma / TMA pipeline yet, so this one uses the warp-level mma.sync template that
# passed on the H200 in problems 27, 33 and 47 (about 270 TFLOP/s there). Partial sums are per 128-column
# tile (16 per row) instead of per 256-column tile (8 per row).
# Expected speed: 206 GFLOP at ~270-300 TFLOP/s -> ~0.7-0.8 ms device time, about 2x slower than the CuTe
# DSL kernel (0.337 ms), still ~6x faster than eager PyTorch (5.07 ms, fp32 GEMMs) and torch.compile (8.7 ms).
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator of the generated CUDA; not yet
# run on the H200.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules per hidden size; the P / ss workspaces per (device, T, H).

import torch
import tvm
from tvm.script import tirx as T

STREAMS = 4
EPS = 1e-5
THREADS = 256
BM = 128
BN = 128
BK = 32
LDS = BK + 8
STAGES = 4
A_ST = BM * LDS
B_ST = BN * LDS
STAGE = A_ST + B_ST
POOL = STAGES * STAGE
MT = 4
NT = 4
VEC = 8


def make_gemm(hidden):
    nk = hidden // BK
    ntn = (hidden + BN - 1) // BN
    assert hidden % BK == 0

    @T.prim_func
    def gemm(h_handle: T.handle, w_handle: T.handle, p_handle: T.handle, ss_handle: T.handle):
        m = T.int32()
        A = T.match_buffer(h_handle, (STREAMS, m, hidden), "bfloat16", align=16)
        B = T.match_buffer(w_handle, (STREAMS - 1, hidden, hidden), "bfloat16", align=16)
        C = T.match_buffer(p_handle, (STREAMS - 1, m, hidden), "bfloat16", align=16)
        SS = T.match_buffer(ss_handle, (STREAMS - 1, m, ntn), "float32")

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        bx, by, bl = T.cta_id([T.ceildiv(m, BM), ntn, STREAMS - 1])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
        red = T.alloc_shared((4, BM), "float32")
        acc = T.alloc_local((MT * NT * 4,), "float32")
        af = T.alloc_local((MT * 4,), "uint32")
        bfr = T.alloc_local((NT * 2,), "uint32")
        arow = T.alloc_local((2,), "int32")
        brow = T.alloc_local((2,), "int32")
        sq = T.alloc_local((1,), "float32")
        ov = T.alloc_local((2,), "bfloat16")

        wm: T.let[T.int32] = warp % 2
        wn: T.let[T.int32] = warp // 2
        lr: T.let[T.int32] = lane % 8
        lj: T.let[T.int32] = lane // 8
        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4

        for u in T.unroll(2):
            arow[u] = T.min(bx * BM + (u * THREADS + tid) // 4, m - 1)
            brow[u] = T.min(by * BN + (u * THREADS + tid) // 4, hidden - 1)
        for i in T.unroll(MT * NT * 4):
            acc[i] = T.float32(0.0)

        for s in T.unroll(STAGES - 1):
            if s < nk:
                for u in T.unroll(2):
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(A[bl + 1, arow[u], s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(B[bl, brow[u], s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
            T.ptx.cp.async_.commit_group()

        for kt in range(nk):
            T.ptx.cp.async_.wait_group(STAGES - 2)
            T.cuda.cta_sync()
            nxt: T.let[T.int32] = kt + STAGES - 1
            if nxt < nk:
                for u in T.unroll(2):
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(A[bl + 1, arow[u], nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(B[bl, brow[u], nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
            T.ptx.cp.async_.commit_group()

            buf: T.let[T.int32] = (kt % STAGES) * STAGE
            for kk in T.unroll(BK // 16):
                for i in T.unroll(MT):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                        T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * LDS + kk * 16 + 8 * (lj // 2)]))
                for pq in T.unroll(2):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                        T.address_of(pool[buf + A_ST + (wn * 32 + pq * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
                for i in T.unroll(MT):
                    for nn in T.unroll(NT):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            acc[(i * NT + nn) * 4 + 0], acc[(i * NT + nn) * 4 + 1], acc[(i * NT + nn) * 4 + 2], acc[(i * NT + nn) * 4 + 3],
                            af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                            bfr[nn * 2 + 0], bfr[nn * 2 + 1],
                            acc[(i * NT + nn) * 4 + 0], acc[(i * NT + nn) * 4 + 1], acc[(i * NT + nn) * 4 + 2], acc[(i * NT + nn) * 4 + 3])
        T.ptx.cp.async_.wait_group(0)

        # ---- epilogue 1: per-row sum of p^2 over this CTA's valid columns (fp32 accumulators) ----
        # accumulator (i, nn, h, e) sits at row wm*64 + i*16 + g + 8h, column wn*32 + nn*8 + 2tq + e
        for i in T.unroll(MT):
            for h in T.unroll(2):
                sq[0] = T.float32(0.0)
                for nn in T.unroll(NT):
                    for e in T.unroll(2):
                        sq[0] = sq[0] + T.if_then_else(
                            by * BN + wn * 32 + nn * 8 + 2 * tq + e < hidden,
                            acc[(i * NT + nn) * 4 + h * 2 + e] * acc[(i * NT + nn) * 4 + h * 2 + e], T.float32(0.0))
                sq[0] = sq[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sq[0], 1, 32, 32)
                sq[0] = sq[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sq[0], 2, 32, 32)
                if tq == 0:
                    red[wn, wm * 64 + i * 16 + g + 8 * h] = sq[0]
        T.cuda.cta_sync()
        if tid < BM:
            if bx * BM + tid < m:
                SS[bl, bx * BM + tid, by] = ((red[0, tid] + red[1, tid]) + red[2, tid]) + red[3, tid]

        # ---- epilogue 2: P rounded to bf16, bf16x2 stores ----
        for nn in T.unroll(NT):
            col: T.let[T.int32] = by * BN + wn * 32 + nn * 8 + 2 * tq
            if col < hidden:                       # hidden is even: col < hidden implies col + 1 < hidden
                for i in T.unroll(MT):
                    for h in T.unroll(2):
                        r: T.let[T.int32] = bx * BM + wm * 64 + i * 16 + g + 8 * h
                        if r < m:
                            for e in T.unroll(2):
                                ov[e] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + e], "bfloat16")
                            for e in T.vectorized(2):
                                C[bl, r, col + e] = ov[e]

    return gemm


def make_combine(hidden):
    nch = hidden // VEC
    threads = min(256, ((nch + 31) // 32) * 32)
    per = (nch + threads - 1) // threads
    nwarps = threads // 32
    ntn = (hidden + BN - 1) // BN
    inv_h = 1.0 / hidden

    @T.prim_func
    def combine(h_handle: T.handle, p1_handle: T.handle, p2_handle: T.handle, p3_handle: T.handle,
                ss_handle: T.handle, o_handle: T.handle):
        m = T.int32()
        # the main stream and the three P_i as separate [T, H] buffers (a stream offset m * H folded into the
        # address made TVM give up on the 16-byte vector loads)
        H = T.match_buffer(h_handle, (m, nch, VEC), "bfloat16", align=16)
        P1 = T.match_buffer(p1_handle, (m, nch, VEC), "bfloat16", align=16)
        P2 = T.match_buffer(p2_handle, (m, nch, VEC), "bfloat16", align=16)
        P3 = T.match_buffer(p3_handle, (m, nch, VEC), "bfloat16", align=16)
        SS = T.match_buffer(ss_handle, (STREAMS - 1, m, ntn), "float32")
        O = T.match_buffer(o_handle, (m, nch, VEC), "bfloat16", align=16)

        T.device_entry()
        t = T.cta_id([m])
        tid = T.thread_id([threads])
        warp = T.warp_id([nwarps])
        lane = T.lane_id([32])

        hb = T.alloc_local((per * VEC,), "bfloat16")
        pb = T.alloc_local(((STREAMS - 1) * per * VEC,), "bfloat16")
        ob = T.alloc_local((VEC,), "bfloat16")
        sc = T.alloc_local((STREAMS - 1,), "float32")
        st = T.alloc_local((2,), "float32")
        red = T.alloc_shared((nwarps,), "float32")

        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.vectorized(VEC):
                    hb[k * VEC + i] = H[t, tid + k * threads, i]
                for i in T.vectorized(VEC):
                    pb[(k * (STREAMS - 1) + 0) * VEC + i] = P1[t, tid + k * threads, i]
                for i in T.vectorized(VEC):
                    pb[(k * (STREAMS - 1) + 1) * VEC + i] = P2[t, tid + k * threads, i]
                for i in T.vectorized(VEC):
                    pb[(k * (STREAMS - 1) + 2) * VEC + i] = P3[t, tid + k * threads, i]
        for s in T.unroll(STREAMS - 1):
            sc[s] = SS[s, t, 0]
            for j in T.unroll(ntn - 1):
                sc[s] = sc[s] + SS[s, t, j + 1]
            sc[s] = T.rsqrt(T.max(sc[s] * T.float32(inv_h), T.float32(EPS)))
        st[0] = T.float32(0.0)
        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.unroll(VEC):
                    st[0] = st[0] + T.cast(hb[k * VEC + i], "float32") * T.cast(hb[k * VEC + i], "float32")
        for sh in T.unroll(5):
            st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> sh, 32, 32)
        if lane == 0:
            red[warp] = st[0]
        T.cuda.cta_sync()
        st[0] = red[0]
        for w in T.unroll(nwarps - 1):
            st[0] = st[0] + red[w + 1]
        st[1] = T.sqrt(st[0] * T.float32(inv_h))
        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.unroll(VEC):
                    st[0] = T.cast(hb[k * VEC + i], "float32")
                    for s in T.unroll(STREAMS - 1):
                        st[0] = st[0] + T.cast(pb[(k * (STREAMS - 1) + s) * VEC + i], "float32") * (st[1] * sc[s])
                    ob[i] = T.cast(st[0] * T.float32(1.0 / STREAMS), "bfloat16")
                for i in T.vectorized(VEC):
                    O[t, tid + k * threads, i] = ob[i]

    return combine, threads


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


def _compiled(hidden=2048):
    key = ("exes", hidden)
    exes = _CACHE.get(key)
    if exes is None:
        assert hidden % BK == 0 and hidden % VEC == 0
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (make_gemm(hidden), make_combine(hidden)[0]))
        _CACHE[key] = exes
    return exes


def _workspace(device, ntok, hidden):
    key = ("ws", str(device), ntok, hidden)
    ws = _CACHE.get(key)
    if ws is None:
        ntn = (hidden + BN - 1) // BN
        ws = _CACHE[key] = (torch.empty((STREAMS - 1, ntok, hidden), dtype=torch.bfloat16, device=device),
                            torch.empty((STREAMS - 1, ntok, ntn), dtype=torch.float32, device=device))
    return ws


def solve(hidden_states: torch.Tensor, unembed_weights: torch.Tensor) -> torch.Tensor:
    streams, ntok, hidden = hidden_states.shape
    assert streams == STREAMS
    _compiled()                                    # the full-size build, also when called at another size
    gemm, combine = _compiled(hidden)
    out = torch.empty((ntok, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    if ntok > 0:
        p, ss = _workspace(hidden_states.device, ntok, hidden)
        h = hidden_states.contiguous()
        gemm(h, unembed_weights.contiguous(), p, ss)
        nch = hidden // VEC
        pv = p.view(STREAMS - 1, ntok, nch, VEC)
        combine(h[0].view(ntok, nch, VEC), pv[0], pv[1], pv[2], ss, out.view(ntok, nch, VEC))
    return out
