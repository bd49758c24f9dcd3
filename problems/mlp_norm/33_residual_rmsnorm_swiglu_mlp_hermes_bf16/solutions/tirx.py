# Hermes 3 (Llama 3.1 8B) MLP half-layer: residual add, RMSNorm, SwiGLU MLP (4096 -> 2 x 14336 -> 4096), bf16;
# three TIRx kernels.
#
# 1. add_rmsnorm: one CTA per token (256 threads, 16 channels each via two 16-byte loads per input):
#    s = h + r in fp32 (stored as the bf16 residual output), sum of squares with xor shuffles + one shared
#    memory step, n = s * rsqrt(mean + 1e-5) * w rounded to bf16 (the GEMM input).
# 2. gate/up GEMM with fused SwiGLU: bf16 tensor-core template (mma.sync m16n8k16, fp32 accumulation; CTA tile
#    128 x 128, K stages of 32 through a 4-stage cp.async pipeline, 80 KiB dynamic shared memory, 2 CTAs / SM;
#    8 warps of 64 x 32; ldmatrix.x4 fragments from 40-bf16 padded rows). The CTA's 128 B rows are 64 gate rows
#    and the matching 64 up rows, so every thread holds g and u of the same outputs and the epilogue writes
#    act = silu(g) * u as bf16 [T, 14336] (no [T, 28672] intermediate).
# 3. down GEMM: the same template, plain bf16 epilogue -> out [T, 4096].
#    Rows past T = 4033 are clamped on load and masked on store. The bf16 rounding of n and of act (the
#    reference keeps fp32) is the deviation the problem statement allows for tensor-core products.
#
# Limits: 1.42 TFLOP on mma.sync (roughly half of the H200's wgmma peak; no wgmma / TMA pipeline here):
# expected ~3-3.5 ms vs a ~1.5 ms tensor-core SOL. Eager PyTorch runs fp32 GEMMs without TF32 (~25-30 ms):
# expected ~8x faster.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules per shape; intermediates are allocated per call.

import torch
import tvm
from tvm.script import tirx as T

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


def make_add_rmsnorm(hidden):
    threads = min(256, hidden // 8)
    warps = threads // 32
    chunks = hidden // (threads * 8)
    stride = threads * 8
    assert chunks * stride == hidden and threads % 32 == 0

    @T.prim_func
    def add_rmsnorm(h_handle: T.handle, r_handle: T.handle, w_handle: T.handle, s_handle: T.handle,
                    n_handle: T.handle):
        n_tok = T.int32()
        H = T.match_buffer(h_handle, (n_tok, hidden), "bfloat16", align=16)
        R = T.match_buffer(r_handle, (n_tok, hidden), "bfloat16", align=16)
        W = T.match_buffer(w_handle, (hidden,), "bfloat16", align=16)
        S = T.match_buffer(s_handle, (n_tok, hidden), "bfloat16", align=16)
        N = T.match_buffer(n_handle, (n_tok, hidden), "bfloat16", align=16)

        T.device_entry()
        row = T.cta_id([n_tok])
        tid = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([32])
        hb = T.alloc_local((chunks * 8,), "bfloat16")
        rb = T.alloc_local((chunks * 8,), "bfloat16")
        wb = T.alloc_local((chunks * 8,), "bfloat16")
        sf = T.alloc_local((chunks * 8,), "float32")
        acc = T.alloc_local((1,), "float32")
        red = T.alloc_shared((warps,), "float32")

        for c in T.unroll(chunks):
            for i in T.vectorized(8):
                hb[c * 8 + i] = H[row, c * stride + tid * 8 + i]
            for i in T.vectorized(8):
                rb[c * 8 + i] = R[row, c * stride + tid * 8 + i]
            for i in T.vectorized(8):
                wb[c * 8 + i] = W[c * stride + tid * 8 + i]
        acc[0] = T.float32(0.0)
        for e in T.unroll(chunks * 8):
            sf[e] = T.cast(hb[e], "float32") + T.cast(rb[e], "float32")
            acc[0] = acc[0] + sf[e] * sf[e]
            hb[e] = T.cast(sf[e], "bfloat16")
        for c in T.unroll(chunks):
            for i in T.vectorized(8):
                S[row, c * stride + tid * 8 + i] = hb[c * 8 + i]
        for s in T.unroll(5):
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
        if lane == 0:
            red[warp] = acc[0]
        T.cuda.cta_sync()
        acc[0] = red[0]
        for w in T.unroll(warps - 1):
            acc[0] = acc[0] + red[w + 1]
        acc[0] = T.rsqrt(acc[0] * T.float32(1.0 / hidden) + T.float32(EPS))
        for e in T.unroll(chunks * 8):
            rb[e] = T.cast(sf[e] * acc[0] * T.cast(wb[e], "float32"), "bfloat16")
        for c in T.unroll(chunks):
            for i in T.vectorized(8):
                N[row, c * stride + tid * 8 + i] = rb[c * 8 + i]

    return add_rmsnorm


def make_gemm(k_dim, gateup):
    """C = A @ B^T (bf16 out). gateup: B holds [gate; up] rows (n_half each); C = silu(A Bg^T) * (A Bu^T)."""
    nk = k_dim // BK
    assert k_dim % BK == 0
    cols = BN // 2 if gateup else BN

    @T.prim_func
    def gemm(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle):
        m = T.int32()
        nb = T.int32()
        n = T.int32()
        A = T.match_buffer(a_handle, (m, k_dim), "bfloat16", align=16)
        B = T.match_buffer(b_handle, (nb, k_dim), "bfloat16", align=16)
        C = T.match_buffer(c_handle, (m, n), "bfloat16", align=4)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        bx, by = T.cta_id([T.ceildiv(m, BM), T.ceildiv(n, cols)])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        pool = T.alloc_shared((POOL,), "bfloat16", scope="shared.dyn")
        acc = T.alloc_local((MT * NT * 4,), "float32")
        af = T.alloc_local((MT * 4,), "uint32")
        bfr = T.alloc_local((NT * 2,), "uint32")
        arow = T.alloc_local((2,), "int32")
        brow = T.alloc_local((2,), "int32")
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
            if gateup:
                # smem B rows 0..63: gate rows by*64.., rows 64..127: the matching up rows (n_half = n)
                brow[u] = ((u * THREADS + tid) // 4) // 64 * n + T.min(by * 64 + ((u * THREADS + tid) // 4) % 64, n - 1)
            else:
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
                    if gateup:
                        # pair 0: this warp's 2 gate n tiles, pair 1: the matching up tiles
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                            bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                            T.address_of(pool[buf + A_ST + (pq * 64 + wn * 16 + lr + 8 * (lj // 2)) * LDS + kk * 16 + 8 * (lj % 2)]))
                    else:
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

        if gateup:
            for j in T.unroll(2):
                col: T.let[T.int32] = by * 64 + wn * 16 + j * 8 + 2 * tq
                for i in T.unroll(MT):
                    for h in T.unroll(2):
                        r: T.let[T.int32] = bx * BM + wm * 64 + i * 16 + g + 8 * h
                        if r < m and col < n:
                            for e in T.unroll(2):
                                y[0] = acc[(i * NT + j) * 4 + h * 2 + e]
                                ov[e] = T.cast(y[0] / (T.float32(1.0) + T.exp(T.float32(0.0) - y[0]))
                                               * acc[(i * NT + j + 2) * 4 + h * 2 + e], "bfloat16")
                            for e in T.vectorized(2):
                                C[r, col + e] = ov[e]
        else:
            for nn in T.unroll(NT):
                col: T.let[T.int32] = by * BN + wn * 32 + nn * 8 + 2 * tq
                for i in T.unroll(MT):
                    for h in T.unroll(2):
                        r: T.let[T.int32] = bx * BM + wm * 64 + i * 16 + g + 8 * h
                        if r < m and col < n:
                            for e in T.unroll(2):
                                ov[e] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + e], "bfloat16")
                            for e in T.vectorized(2):
                                C[r, col + e] = ov[e]

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


def _compiled(hidden=4096, inter=14336):
    key = ("exes", hidden, inter)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (make_add_rmsnorm(hidden), make_gemm(hidden, True), make_gemm(inter, False))
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def solve(hidden_states, residual, norm_weight, w_gate_up, w_down):
    n_tok, hidden = hidden_states.shape
    inter = w_down.shape[1]
    assert hidden % 256 == 0 and inter % 64 == 0 and hidden % 2 == 0
    _compiled()                                    # the full-size build, also when called at another size
    norm, gate_up, down = _compiled(hidden, inter)
    dev = hidden_states.device
    s = torch.empty_like(hidden_states)
    nrm = torch.empty_like(hidden_states)
    act = torch.empty((n_tok, inter), dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(hidden_states)
    if n_tok > 0:
        norm(hidden_states.contiguous(), residual.contiguous(), norm_weight.contiguous(), s, nrm)
        gate_up(nrm, w_gate_up.contiguous(), act)
        down(act, w_down.contiguous(), out)
    return out, s
