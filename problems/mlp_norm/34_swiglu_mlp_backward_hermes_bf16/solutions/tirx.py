# SwiGLU MLP backward (Hermes 3 / Llama 3.1 8B: hidden 4096, intermediate 14336, T = 4096 tokens, bf16 in/out)
# in TIRx: four launches of one bf16 tensor-core GEMM template, in stream order (same decomposition as the
# CuTe DSL solution):
#
#   G1  d_act = dout @ w_down               [T, I]   A = dout (K-major), B = w_down (N-major)
#       epilogue (SwiGLU backward in registers): reads g, u of the saved gate_up at each accumulator
#       pair's (row, col) and writes d_gate_up[:, col] = d_act * u * silu'(g),
#       d_gate_up[:, I + col] = d_act * silu(g) and act = silu(g) * u (bf16; d_act never reaches memory)
#   G2  dw_down    = dout^T @ act           [H, I]   A = dout^T (M-major), B = act (N-major)
#   G3  dw_gate_up = d_gate_up^T @ x        [2I, H]  A = d_gate_up^T (M-major), B = x (N-major)
#   G4  dx         = d_gate_up @ w_gate_up  [T, H]   A = d_gate_up (K-major), B = w_gate_up (N-major)
#
# Transposed operands are read in place (no transpose kernels), as in the CuTe solution, but through the
# warp-level path: an MN-major tile is copied to shared memory as 32 k-rows x 128 (rows padded to 136 bf16)
# and turned into mma fragments by the transposing 8x8 matrix load (ldmatrix.trans); K-major tiles are
# 128 rows x 32 k (rows padded to 40) with the plain matrix load.
#
# GEMM template: mma.sync m16n8k16 bf16 -> fp32, CTA tile 128 x 128, K steps of 32 through a 4-stage
# cp.async ring (74 KiB shared memory, 2 CTAs per SM), 8 warps of 64 x 32 (4 x 4 mma tiles). Loads past
# the matrix edge (rows, columns and the K tail: K = T need not be a multiple of 32) are zero-filled by
# cp.async with source size 0 from a clamped address; stores are masked. Outputs are stored as bf16 pairs.
# Difference from the CuTe solution and why: the CuTe version uses Hopper warpgroup MMA with TMA
# (128 x 256 x 64 tiles, measured 4.39 ms, 66% of the bf16 peak); this one uses the warp-level mma.sync path
# the other TIRx GEMMs of this repo use (and the CPU emulator can check). That path measured 27-30% of the
# bf16 peak on problems 27 and 33, so expect ~9-10 ms here: ~2x slower than the CuTe solution, still ~6x
# faster than eager (58.6 ms) and ~10x faster than torch.compile (93 ms).
# The intermediates act and d_gate_up are bf16 (the problem allows bf16 tensor-core products with fp32
# accumulation); g, u come from the saved gate_up as given.
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator (scripts/cuda_emu)
# at smoke size and at a custom size with several tiles and M / N / K tails; H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules; the act / d_gate_up workspaces per (device, T, intermediate).

import torch
import tvm
from tvm.script import tirx as T

THREADS = 256
BM = 128
BN = 128
BK = 32
LDK = BK + 8                    # K-major tile row (bf16): 128 rows x 32 k
LDM = BM + 8                    # MN-major tile row (bf16): 32 k-rows x 128
A_ST = max(BM * LDK, BK * LDM)  # 5120
B_ST = BK * LDM                 # 4352
STAGE = A_ST + B_ST
STAGES = 4
POOL = STAGES * STAGE
MT = 4
NT = 4


def make_gemm(a_kmajor, swiglu):
    """C[M, N] = sum_k A(m, k) B(n, k); A is [M, K] (a_kmajor) or [K, M]; B is [K, N].
    swiglu: C is act [M, N]; GU / DGU are the flat [M, 2N] saved gate_up / d_gate_up (otherwise unused)."""

    @T.prim_func
    def gemm(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle, gu_handle: T.handle, dgu_handle: T.handle):
        ra = T.int32()
        ca = T.int32()
        kd = T.int32()
        nb = T.int32()
        m = T.int32()
        n = T.int32()
        gl = T.int32()
        dl = T.int32()
        A = T.match_buffer(a_handle, (ra, ca), "bfloat16", align=16)
        B = T.match_buffer(b_handle, (kd, nb), "bfloat16", align=16)
        C = T.match_buffer(c_handle, (m, n), "bfloat16", align=4)
        GU = T.match_buffer(gu_handle, (gl,), "bfloat16", align=4)
        DGU = T.match_buffer(dgu_handle, (dl,), "bfloat16", align=4)

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
        gv = T.alloc_local((2,), "bfloat16")
        uv = T.alloc_local((2,), "bfloat16")
        o1 = T.alloc_local((2,), "bfloat16")
        o2 = T.alloc_local((2,), "bfloat16")
        o3 = T.alloc_local((2,), "bfloat16")
        f = T.alloc_local((4,), "float32")

        wm: T.let[T.int32] = warp % 2
        wn: T.let[T.int32] = warp // 2
        lr: T.let[T.int32] = lane % 8
        lj: T.let[T.int32] = lane // 8
        g: T.let[T.int32] = lane // 4
        tq: T.let[T.int32] = lane % 4
        nk: T.let[T.int32] = T.ceildiv(kd, BK)
        m0: T.let[T.int32] = bx * BM
        n0: T.let[T.int32] = by * BN

        for i in T.unroll(MT * NT * 4):
            acc[i] = T.float32(0.0)

        # ---- prologue: k-tiles 0 .. STAGES-2 ----
        # K-major A chunk c = u*256 + tid: tile row c // 4, k 8 (c % 4); MN-major chunk: k-row c // 16, col 8 (c % 16)
        for s in T.unroll(STAGES - 1):
            if s < nk:
                for u in T.unroll(2):
                    if a_kmajor:
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 4) * LDK + ((u * THREADS + tid) % 4) * 8]),
                            T.address_of(A[T.min(m0 + (u * THREADS + tid) // 4, m - 1),
                                           T.min(s * BK + ((u * THREADS + tid) % 4) * 8, kd - 8)]), 16,
                            T.if_then_else(s * BK + ((u * THREADS + tid) % 4) * 8 < kd, T.uint32(16), T.uint32(0)))
                    else:
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[s * STAGE + ((u * THREADS + tid) // 16) * LDM + ((u * THREADS + tid) % 16) * 8]),
                            T.address_of(A[T.min(s * BK + (u * THREADS + tid) // 16, kd - 1),
                                           T.min(m0 + ((u * THREADS + tid) % 16) * 8, m - 8)]), 16,
                            T.if_then_else(s * BK + (u * THREADS + tid) // 16 < kd and m0 + ((u * THREADS + tid) % 16) * 8 < m,
                                           T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[s * STAGE + A_ST + ((u * THREADS + tid) // 16) * LDM + ((u * THREADS + tid) % 16) * 8]),
                        T.address_of(B[T.min(s * BK + (u * THREADS + tid) // 16, kd - 1),
                                       T.min(n0 + ((u * THREADS + tid) % 16) * 8, n - 8)]), 16,
                        T.if_then_else(s * BK + (u * THREADS + tid) // 16 < kd and n0 + ((u * THREADS + tid) % 16) * 8 < n,
                                       T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

        for kt in range(nk):
            T.ptx.cp.async_.wait_group(STAGES - 2)
            T.cuda.cta_sync()
            nxt: T.let[T.int32] = kt + STAGES - 1
            if nxt < nk:
                for u in T.unroll(2):
                    if a_kmajor:
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 4) * LDK + ((u * THREADS + tid) % 4) * 8]),
                            T.address_of(A[T.min(m0 + (u * THREADS + tid) // 4, m - 1),
                                           T.min(nxt * BK + ((u * THREADS + tid) % 4) * 8, kd - 8)]), 16,
                            T.if_then_else(nxt * BK + ((u * THREADS + tid) % 4) * 8 < kd, T.uint32(16), T.uint32(0)))
                    else:
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(pool[(nxt % STAGES) * STAGE + ((u * THREADS + tid) // 16) * LDM + ((u * THREADS + tid) % 16) * 8]),
                            T.address_of(A[T.min(nxt * BK + (u * THREADS + tid) // 16, kd - 1),
                                           T.min(m0 + ((u * THREADS + tid) % 16) * 8, m - 8)]), 16,
                            T.if_then_else(nxt * BK + (u * THREADS + tid) // 16 < kd and m0 + ((u * THREADS + tid) % 16) * 8 < m,
                                           T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(pool[(nxt % STAGES) * STAGE + A_ST + ((u * THREADS + tid) // 16) * LDM + ((u * THREADS + tid) % 16) * 8]),
                        T.address_of(B[T.min(nxt * BK + (u * THREADS + tid) // 16, kd - 1),
                                       T.min(n0 + ((u * THREADS + tid) % 16) * 8, n - 8)]), 16,
                        T.if_then_else(nxt * BK + (u * THREADS + tid) // 16 < kd and n0 + ((u * THREADS + tid) % 16) * 8 < n,
                                       T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()

            buf: T.let[T.int32] = (kt % STAGES) * STAGE
            for kk in T.unroll(BK // 16):
                for i in T.unroll(MT):
                    if a_kmajor:
                        # matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                            af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                            T.address_of(pool[buf + (wm * 64 + i * 16 + lr + 8 * (lj % 2)) * LDK + kk * 16 + 8 * (lj // 2)]))
                    else:
                        # same four matrices, stored k-major rows: lane row = k, 8 consecutive m; transposed load
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                            af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                            T.address_of(pool[buf + (kk * 16 + 8 * (lj // 2) + lr) * LDM + wm * 64 + i * 16 + 8 * (lj % 2)]))
                for pq in T.unroll(2):
                    # matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15), stored as k rows
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        bfr[pq * 4 + 0], bfr[pq * 4 + 1], bfr[pq * 4 + 2], bfr[pq * 4 + 3],
                        T.address_of(pool[buf + A_ST + (kk * 16 + 8 * (lj % 2) + lr) * LDM + wn * 32 + pq * 16 + 8 * (lj // 2)]))
                for i in T.unroll(MT):
                    for nn in T.unroll(NT):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            acc[(i * NT + nn) * 4 + 0], acc[(i * NT + nn) * 4 + 1], acc[(i * NT + nn) * 4 + 2], acc[(i * NT + nn) * 4 + 3],
                            af[i * 4 + 0], af[i * 4 + 1], af[i * 4 + 2], af[i * 4 + 3],
                            bfr[nn * 2 + 0], bfr[nn * 2 + 1],
                            acc[(i * NT + nn) * 4 + 0], acc[(i * NT + nn) * 4 + 1], acc[(i * NT + nn) * 4 + 2], acc[(i * NT + nn) * 4 + 3])
        T.ptx.cp.async_.wait_group(0)

        # ---- epilogue: thread's accumulator (i, nn, h, e) is row m0 + wm*64 + i*16 + g + 8h,
        #      column n0 + wn*32 + nn*8 + 2*tq + e ----
        for nn in T.unroll(NT):
            col: T.let[T.int32] = n0 + wn * 32 + nn * 8 + 2 * tq
            for i in T.unroll(MT):
                for h in T.unroll(2):
                    r: T.let[T.int32] = m0 + wm * 64 + i * 16 + g + 8 * h
                    if r < m and col < n:
                        if swiglu:
                            for e in T.vectorized(2):
                                gv[e] = GU[r * (2 * n) + col + e]
                            for e in T.vectorized(2):
                                uv[e] = GU[r * (2 * n) + n + col + e]
                            for e in T.unroll(2):
                                # f: g, sigmoid(g), silu(g), u
                                f[0] = T.cast(gv[e], "float32")
                                f[3] = T.cast(uv[e], "float32")
                                f[1] = T.float32(1.0) / (T.float32(1.0) + T.exp(T.float32(0.0) - f[0]))
                                f[2] = f[0] * f[1]
                                o1[e] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + e] * f[3]
                                               * (f[1] * (T.float32(1.0) + f[0] * (T.float32(1.0) - f[1]))), "bfloat16")
                                o2[e] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + e] * f[2], "bfloat16")
                                o3[e] = T.cast(f[2] * f[3], "bfloat16")
                            for e in T.vectorized(2):
                                DGU[r * (2 * n) + col + e] = o1[e]
                            for e in T.vectorized(2):
                                DGU[r * (2 * n) + n + col + e] = o2[e]
                            for e in T.vectorized(2):
                                C[r, col + e] = o3[e]
                        else:
                            for e in T.unroll(2):
                                o1[e] = T.cast(acc[(i * NT + nn) * 4 + h * 2 + e], "bfloat16")
                            for e in T.vectorized(2):
                                C[r, col + e] = o1[e]

    return gemm


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}
_WORKSPACE = {}


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
        # G1 (K-major A, SwiGLU epilogue), M-major A (G2, G3), K-major A (G4)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": make_gemm(ak, sw)}), target=target, tir_pipeline="tirx"))
                     for ak, sw in ((True, True), (False, False), (True, False)))
        _CACHE["exes"] = exes
    return exes


def solve(dout, x, gate_up, w_gate_up, w_down):
    tokens, hidden = x.shape
    inter = w_down.shape[1]
    assert all(t.is_contiguous() for t in (dout, x, gate_up, w_gate_up, w_down))
    assert hidden % 8 == 0 and inter % 8 == 0
    g1, g_mmajor, g_kmajor = _compiled()
    dev = x.device
    dx = torch.empty_like(x)
    dwgu = torch.empty_like(w_gate_up)
    dwd = torch.empty_like(w_down)
    key = (str(dev), tokens, inter)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((tokens, inter), dtype=torch.bfloat16, device=dev),
              torch.empty((tokens, 2 * inter), dtype=torch.bfloat16, device=dev))
        _WORKSPACE[key] = ws
    act, dgu = ws
    gu_flat = gate_up.view(-1)
    dgu_flat = dgu.view(-1)
    if tokens > 0:
        g1(dout, w_down, act, gu_flat, dgu_flat)                 # d_act -> d_gate_up, act
        g_mmajor(dout, act, dwd, gu_flat, dgu_flat)              # dw_down = dout^T @ act
        g_mmajor(dgu, x, dwgu, gu_flat, dgu_flat)                # dw_gate_up = d_gate_up^T @ x
        g_kmajor(dgu, w_gate_up, dx, gu_flat, dgu_flat)          # dx = d_gate_up @ w_gate_up
    else:
        dwgu.zero_()
        dwd.zero_()
    return dx, dwgu, dwd
