# Qwen3-Omni vision patch merger (LayerNorm over 1152 channels, 2x2 merge to 4608, Linear 4608->4608 + exact
# GELU, Linear 4608->2048), bf16 in / bf16 out: three TIRx kernels.
#
# 1. layernorm: one warp per patch (8 warps per CTA). Lane l holds the 16-byte chunks l, l+32, .. of the
#    patch (144 chunks of 8 bf16; 4 or 5 per lane), mean and biased variance in fp32 from registers (two
#    passes, xor-shuffle sums), y = (x - mean) * rstd * w + b, rounded to bf16 and stored with 16-byte
#    stores. Rows 4m..4m+3 are contiguous, so the output [16384, 1152] is already the merged [4096, 4608].
# 2./3. bf16 tensor-core GEMM template C = A @ B^T + bias (mma.sync m16n8k16, fp32 accumulation): CTA tile
#    128 x 128, K in stages of 32 through a 4-stage cp.async pipeline (16-byte cp.async.cg, smem rows padded
#    to 40 bf16 for conflict-free ldmatrix), 80 KiB dynamic shared memory, 2 CTAs per SM (<= 128 registers);
#    8 warps of 64 x 32 (4 x 4 mma tiles), ldmatrix.x4 fragments. Epilogue adds the fp32 bias and applies the
#    exact erf GELU (fc1) or nothing (fc2), rounds to bf16 and stores bf16x2 pairs; rows / columns beyond
#    M / N are clamped on load and masked on store.
#    The bf16 rounding of the normalized patches and of the GELU output (the reference keeps fp32) is the
#    deviation the problem statement allows for tensor-core products.
#
# Limits: 252 GFLOP on mma.sync (which reaches roughly half of the H200's wgmma peak; no wgmma / TMA
# pipeline here): expected ~0.5-0.7 ms vs a ~0.25 ms tensor-core SOL. Eager PyTorch does fp32 GEMMs
# without TF32 (~5 ms): expected ~7-10x faster.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules per shape; intermediates are allocated per call.

import torch
import tvm
from tvm.script import tirx as T

MERGE = 4
EPS = 1e-6
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
INV_SQRT2 = 0.7071067811865476


def make_layernorm(hidden):
    chunks = hidden // 8
    per_lane = (chunks + 31) // 32

    @T.prim_func
    def layernorm(x_handle: T.handle, w_handle: T.handle, b_handle: T.handle, y_handle: T.handle):
        n = T.int32()
        X = T.match_buffer(x_handle, (n, chunks, 8), "bfloat16", align=16)
        W = T.match_buffer(w_handle, (chunks, 8), "bfloat16", align=16)
        B = T.match_buffer(b_handle, (chunks, 8), "bfloat16", align=16)
        Y = T.match_buffer(y_handle, (n, chunks, 8), "bfloat16", align=16)

        T.device_entry()
        cta = T.cta_id([T.ceildiv(n, 8)])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])
        xb = T.alloc_local((per_lane * 8,), "bfloat16")
        wb = T.alloc_local((8,), "bfloat16")
        bb = T.alloc_local((8,), "bfloat16")
        xf = T.alloc_local((per_lane * 8,), "float32")
        st = T.alloc_local((3,), "float32")

        row: T.let[T.int32] = cta * 8 + warp
        if row < n:
            st[0] = T.float32(0.0)
            for c in T.unroll(per_lane):
                if c * 32 + lane < chunks:
                    for i in T.vectorized(8):
                        xb[c * 8 + i] = X[row, c * 32 + lane, i]
                    for i in T.unroll(8):
                        xf[c * 8 + i] = T.cast(xb[c * 8 + i], "float32")
                        st[0] = st[0] + xf[c * 8 + i]
                else:
                    for i in T.unroll(8):
                        xf[c * 8 + i] = T.float32(0.0)
            for s in T.unroll(5):
                st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
            T.ptx.div.rn.f32(st[1], st[0], T.float32(hidden))
            st[0] = T.float32(0.0)
            for c in T.unroll(per_lane):
                if c * 32 + lane < chunks:
                    for i in T.unroll(8):
                        st[0] = st[0] + (xf[c * 8 + i] - st[1]) * (xf[c * 8 + i] - st[1])
            for s in T.unroll(5):
                st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
            T.ptx.div.rn.f32(st[2], st[0], T.float32(hidden))
            st[2] = T.rsqrt(st[2] + T.float32(EPS))
            for c in T.unroll(per_lane):
                if c * 32 + lane < chunks:
                    for i in T.vectorized(8):
                        wb[i] = W[c * 32 + lane, i]
                    for i in T.vectorized(8):
                        bb[i] = B[c * 32 + lane, i]
                    for i in T.unroll(8):
                        xb[c * 8 + i] = T.cast((xf[c * 8 + i] - st[1]) * st[2] * T.cast(wb[i], "float32")
                                               + T.cast(bb[i], "float32"), "bfloat16")
                    for i in T.vectorized(8):
                        Y[row, c * 32 + lane, i] = xb[c * 8 + i]

    return layernorm


def make_gemm(k_dim, gelu):
    nk = k_dim // BK
    assert k_dim % BK == 0

    @T.prim_func
    def gemm(a_handle: T.handle, b_handle: T.handle, bias_handle: T.handle, c_handle: T.handle):
        m = T.int32()
        n = T.int32()
        A = T.match_buffer(a_handle, (m, k_dim), "bfloat16", align=16)
        B = T.match_buffer(b_handle, (n, k_dim), "bfloat16", align=16)
        BIAS = T.match_buffer(bias_handle, (n,), "bfloat16")
        C = T.match_buffer(c_handle, (m, n), "bfloat16", align=4)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        bx, by = T.cta_id([T.ceildiv(m, BM), T.ceildiv(n, BN)])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
        acc = T.alloc_local((MT * NT * 4,), "float32")
        af = T.alloc_local((MT * 4,), "uint32")
        bfr = T.alloc_local((NT * 2,), "uint32")
        arow = T.alloc_local((2,), "int32")
        brow = T.alloc_local((2,), "int32")
        bs = T.alloc_local((2,), "float32")
        y = T.alloc_local((2,), "float32")
        ov = T.alloc_local((2,), "bfloat16")

        wm: T.let[T.int32] = warp % 2
        wn: T.let[T.int32] = warp // 2
        lr: T.let[T.int32] = lane % 8
        lj: T.let[T.int32] = lane // 8
        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4

        for u in T.unroll(2):
            arow[u] = T.min(bx * BM + (u * THREADS + tid) // 4, m - 1)
            brow[u] = T.min(by * BN + (u * THREADS + tid) // 4, n - 1)
        for i in T.unroll(MT * NT * 4):
            acc[i] = T.float32(0.0)

        for s in T.unroll(STAGES - 1):
            if s < nk:
                for u in T.unroll(2):
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(A[arow[u], s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(B[brow[u], s * BK + ((u * THREADS + tid) % 4) * 8]), 16)
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
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 4) * LDS + ((u * THREADS + tid) % 4) * 8]),
                        T.address_of(B[brow[u], nxt * BK + ((u * THREADS + tid) % 4) * 8]), 16)
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

        for nn in T.unroll(NT):
            col: T.let[T.int32] = by * BN + wn * 32 + nn * 8 + 2 * tq
            for e in T.unroll(2):
                bs[e] = T.if_then_else(col + e < n, T.cast(BIAS[T.min(col + e, n - 1)], "float32"), T.float32(0.0))
            for i in T.unroll(MT):
                for h in T.unroll(2):
                    r: T.let[T.int32] = bx * BM + wm * 64 + i * 16 + g + 8 * h
                    if r < m:
                        for e in T.unroll(2):
                            y[e] = acc[(i * NT + nn) * 4 + h * 2 + e] + bs[e]
                            if gelu:
                                y[e] = T.float32(0.5) * y[e] * (T.float32(1.0) + T.erf(y[e] * T.float32(INV_SQRT2)))
                            ov[e] = T.cast(y[e], "bfloat16")
                        if col + 1 < n:
                            for e in T.vectorized(2):
                                C[r, col + e] = ov[e]
                        elif col < n:
                            C[r, col] = ov[0]

    return gemm


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


def _compiled(hidden=1152):
    key = ("exes", hidden)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        merged = MERGE * hidden
        funcs = (make_layernorm(hidden), make_gemm(merged, True), make_gemm(merged, False))
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def solve(hidden_states, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    patches, hidden = hidden_states.shape
    merged = MERGE * hidden
    out_hidden = fc2_weight.shape[0]
    assert hidden % 8 == 0 and merged % BK == 0 and out_hidden % 2 == 0
    _compiled()                                    # the full-size build, also when called at another size
    layernorm, fc1, fc2 = _compiled(hidden)
    dev = hidden_states.device
    tokens = patches // MERGE
    xn = torch.empty((patches, hidden), dtype=torch.bfloat16, device=dev)
    h = torch.empty((tokens, merged), dtype=torch.bfloat16, device=dev)
    out = torch.empty((tokens, out_hidden), dtype=hidden_states.dtype, device=dev)
    c = hidden // 8
    layernorm(hidden_states.contiguous().view(patches, c, 8), norm_weight.contiguous().view(c, 8),
              norm_bias.contiguous().view(c, 8), xn.view(patches, c, 8))
    fc1(xn.view(tokens, merged), fc1_weight.contiguous(), fc1_bias.contiguous(), h)
    fc2(h, fc2_weight.contiguous(), fc2_bias.contiguous(), out)
    return out
