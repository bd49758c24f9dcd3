# Qwen3-VL-8B fused QKV projection in FP8 (8192 tokens, hidden 4096 -> 32 q + 8 k + 8 v heads of 128) with per-head
# query/key RMSNorm, in TIRx: one block-scaled FP8 GEMM kernel with a fused normalization epilogue, the same
# decomposition as the CuTe DSL solution (which passed on the H200 at 0.856 ms device time).
#
# - GEMM qkv = dequant(x) dequant(W)^T on the FP8 tensor cores, e4m3 x e4m3 -> fp32 (the products are exact).
#   CTA tile 128 tokens x 128 columns = exactly one head (grid token tiles fastest x 48 heads), 8 warps of 64 x 32.
#   The K loop steps by one 128-wide scale block through a 3-stage cp.async ring (16-byte pieces XOR-swizzled by
#   row, conflict-free 8 x 16-byte ldmatrix tiles = the e4m3 fragments). Each block's products go into a fresh
#   fp32 partial, then acc += partial * (s_x[token, block] * s_w[head, block]) (per-block promotion, the
#   reference's dequantization up to summation order).
# - Epilogue: for q and k heads the row sum of squares over the head's 128 columns: the thread's 8 columns, the 4
#   lanes of a quad (2 xor shuffles), then the 4 warps that share the rows through 2 KiB of shared memory (fixed
#   order); x * rsqrt(mean + 1e-6) * norm_weight in fp32; v stored as is; bf16 outputs.
# Difference from the CuTe DSL solution, and why: the warp-level mma.sync m16n8k32 e4m3 instead of the Hopper
# warpgroup MMA (wgmma m64n128k32): the TIRx kernels of this repository have no warpgroup-MMA pipeline. With
# warpgroup MMAs a warpgroup holds whole 128-column rows and the row sums need only the quad shuffles; here a row
# is spread over 4 warps, hence the shared-memory step. The activation scales are read per accumulator row from
# global memory (L1/L2) instead of being staged in shared memory. rsqrt is the hardware approximation (the build
# uses fast math), as in the CuTe version; outputs are bf16.
#
# Expected time: 412 GFLOP of FP8 work; the warp-level MMA issues at well under the warpgroup rate on Hopper, so
# this is expected to be slower than the CuTe kernel (0.856 ms device), perhaps 1.3-2 ms; still far under eager
# (9.3 ms) and torch.compile (8.7 ms), which dequantize and run an fp32 GEMM.
# k_gemm compiles to 255 registers per thread with 32 bytes of spill, 96 KiB dynamic + 2 KiB static shared memory:
# one CTA (8 warps) per SM.
# Streams: the compiled function is called with torch tensors; tvm-ffi installs torch's current stream for the
# call. No workspaces.
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

BLOCK = 128
HD = 128
EPS = 1e-6
BM = 128
BN = 128                       # one head
BK = 128                       # bytes (= e4m3 values) of K per stage = one scale block
STAGES = 3
THREADS = 256


@T.prim_func
def k_gemm(a_h: T.handle, b_h: T.handle, xs_h: T.handle, ws_h: T.handle, qn_h: T.handle, kn_h: T.handle,
           oq_h: T.handle, ok_h: T.handle, ov_h: T.handle, nkb: T.int32, qh: T.int32, kvh: T.int32):
    M = T.int32()
    N = T.int32()
    A = T.match_buffer(a_h, (M, nkb * BK), "uint8", align=16)
    B = T.match_buffer(b_h, (N, nkb * BK), "uint8", align=16)
    XS = T.match_buffer(xs_h, (M, nkb), "float32")
    WS = T.match_buffer(ws_h, (N // BLOCK, nkb), "float32")
    QN = T.match_buffer(qn_h, (HD,), "bfloat16")
    KN = T.match_buffer(kn_h, (HD,), "bfloat16")
    OQ = T.match_buffer(oq_h, (M, qh * HD), "bfloat16", align=16)
    OK = T.match_buffer(ok_h, (M, kvh * HD), "bfloat16", align=16)
    OV = T.match_buffer(ov_h, (M, kvh * HD), "bfloat16", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
    mt, nt = T.cta_id([T.ceildiv(M, BM), N // BN])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((STAGES * (BM + BN) * BK,), "uint8", scope="shared.dyn")
    As = T.decl_buffer((STAGES, BM, BK), "uint8", data=pool.data, elem_offset=0)
    Bs = T.decl_buffer((STAGES, BN, BK), "uint8", data=pool.data, elem_offset=STAGES * BM * BK)

    acc = T.alloc_local((64,), "float32")       # [m-tile 4][n-tile 4][4]
    part = T.alloc_local((64,), "float32")      # products of the current 128-wide k block
    af = T.alloc_local((16,), "uint32")
    bf = T.alloc_local((8,), "uint32")
    sc = T.alloc_local((2,), "float32")         # combined scales of the 2 rows of one m tile
    ws = T.alloc_local((1,), "float32")
    pk = T.alloc_local((2,), "bfloat16")
    ss = T.alloc_local((8,), "float32")         # row sums of squares / inverse rms of this thread's 8 rows
    red = T.alloc_shared((4, BM), "float32")    # per 32-column quarter row sums of squares

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    wm: T.let[T.int32] = warp // 4              # 64-row half of the tile
    wn: T.let[T.int32] = warp % 4               # 32-column quarter of the tile
    m0: T.let[T.int32] = mt * BM
    n0: T.let[T.int32] = nt * BN

    for e in T.unroll(64):
        acc[e] = T.float32(0.0)
    for st in T.unroll(STAGES - 1):
        if st < nkb:
            for r in T.unroll(BM * 8 // THREADS):
                ra: T.let[T.int32] = (tid + r * THREADS) // 8
                ca: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(As[st, ra, T.bitwise_xor(ca, ra % 8) * 16]),
                    T.address_of(A[T.min(m0 + ra, M - 1), st * BK + ca * 16]), 16,
                    T.if_then_else(m0 + ra < M, T.uint32(16), T.uint32(0)))
            for r in T.unroll(BN * 8 // THREADS):
                rb: T.let[T.int32] = (tid + r * THREADS) // 8
                cb: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Bs[st, rb, T.bitwise_xor(cb, rb % 8) * 16]),
                    T.address_of(B[n0 + rb, st * BK + cb * 16]), 16)
        T.ptx.cp.async_.commit_group()

    for kt in range(nkb):
        cur: T.let[T.int32] = kt % STAGES
        T.ptx.cp.async_.wait_group(STAGES - 2)
        T.cuda.cta_sync()
        # refill the stage consumed in iteration kt - 1 (every warp has passed the barrier above)
        if kt + STAGES - 1 < nkb:
            nx: T.let[T.int32] = (kt + STAGES - 1) % STAGES
            kk: T.let[T.int32] = (kt + STAGES - 1) * BK
            for r in T.unroll(BM * 8 // THREADS):
                ra2: T.let[T.int32] = (tid + r * THREADS) // 8
                ca2: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(As[nx, ra2, T.bitwise_xor(ca2, ra2 % 8) * 16]),
                    T.address_of(A[T.min(m0 + ra2, M - 1), kk + ca2 * 16]), 16,
                    T.if_then_else(m0 + ra2 < M, T.uint32(16), T.uint32(0)))
            for r in T.unroll(BN * 8 // THREADS):
                rb2: T.let[T.int32] = (tid + r * THREADS) // 8
                cb2: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Bs[nx, rb2, T.bitwise_xor(cb2, rb2 % 8) * 16]),
                    T.address_of(B[n0 + rb2, kk + cb2 * 16]), 16)
        T.ptx.cp.async_.commit_group()
        for e in T.unroll(64):
            part[e] = T.float32(0.0)
        for ks in T.unroll(BK // 32):
            for mi in T.unroll(4):
                # matrices: rows 0-7 / 8-15 of the m tile x bytes 0-15 / 16-31 of the k32 step
                arow: T.let[T.int32] = wm * 64 + mi * 16 + lane % 8 + ((lane // 8) % 2) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                    T.address_of(As[cur, arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 16]))
            for jj in T.unroll(2):
                # matrices: n rows 0-7 x bytes 0-15 / 16-31, then n rows 8-15 (two n tiles of 8)
                brow: T.let[T.int32] = wn * 32 + jj * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[jj * 4], bf[jj * 4 + 1], bf[jj * 4 + 2], bf[jj * 4 + 3],
                    T.address_of(Bs[cur, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 16]))
            for mi in T.unroll(4):
                for nj in T.unroll(4):
                    T.ptx.mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32(
                        part[(mi * 4 + nj) * 4], part[(mi * 4 + nj) * 4 + 1], part[(mi * 4 + nj) * 4 + 2], part[(mi * 4 + nj) * 4 + 3],
                        af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3], bf[nj * 2], bf[nj * 2 + 1],
                        part[(mi * 4 + nj) * 4], part[(mi * 4 + nj) * 4 + 1], part[(mi * 4 + nj) * 4 + 2], part[(mi * 4 + nj) * 4 + 3])
        # per-block promotion: acc += partial * s_x[row, kt] * s_w[head nt, kt]
        ws[0] = WS[nt, kt]
        for mi in T.unroll(4):
            for hh in T.unroll(2):
                sc[hh] = XS[T.min(m0 + wm * 64 + mi * 16 + hh * 8 + g, M - 1), kt] * ws[0]
            for nj in T.unroll(4):
                for e in T.unroll(4):
                    acc[(mi * 4 + nj) * 4 + e] = acc[(mi * 4 + nj) * 4 + e] + part[(mi * 4 + nj) * 4 + e] * sc[e // 2]

    # ---- epilogue: the CTA tile is one head (nt < qh: query head, then key heads, then value heads) ----
    # row sums of squares: this thread's 8 columns per m tile, the 4 lanes of a quad, then the 4 warps (wn)
    # that share the rows through shared memory (fixed order)
    for mi in T.unroll(4):
        for hh in T.unroll(2):
            ss[mi * 2 + hh] = T.float32(0.0)
            for nj in T.unroll(4):
                for e in T.unroll(2):
                    ss[mi * 2 + hh] = ss[mi * 2 + hh] + acc[(mi * 4 + nj) * 4 + hh * 2 + e] * acc[(mi * 4 + nj) * 4 + hh * 2 + e]
            ss[mi * 2 + hh] = ss[mi * 2 + hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[mi * 2 + hh], 1, 32, 32)
            ss[mi * 2 + hh] = ss[mi * 2 + hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ss[mi * 2 + hh], 2, 32, 32)
            if tq == 0:
                red[wn, wm * 64 + mi * 16 + hh * 8 + g] = ss[mi * 2 + hh]
    T.cuda.cta_sync()
    for mi in T.unroll(4):
        for hh in T.unroll(2):
            rl: T.let[T.int32] = wm * 64 + mi * 16 + hh * 8 + g
            ss[mi * 2 + hh] = T.rsqrt((((red[0, rl] + red[1, rl]) + red[2, rl]) + red[3, rl]) * T.float32(1.0 / HD)
                                      + T.float32(EPS))
    for mi in T.unroll(4):
        for hh in T.unroll(2):
            row: T.let[T.int32] = m0 + wm * 64 + mi * 16 + hh * 8 + g
            if row < M:
                for nj in T.unroll(4):
                    cl: T.let[T.int32] = wn * 32 + nj * 8 + tq * 2
                    if nt < qh:
                        for e in T.unroll(2):
                            pk[e] = T.cast(acc[(mi * 4 + nj) * 4 + hh * 2 + e] * ss[mi * 2 + hh]
                                           * T.cast(QN[cl + e], "float32"), "bfloat16")
                        for e in T.vectorized(2):
                            OQ[row, nt * HD + cl + e] = pk[e]
                    elif nt < qh + kvh:
                        for e in T.unroll(2):
                            pk[e] = T.cast(acc[(mi * 4 + nj) * 4 + hh * 2 + e] * ss[mi * 2 + hh]
                                           * T.cast(KN[cl + e], "float32"), "bfloat16")
                        for e in T.vectorized(2):
                            OK[row, (nt - qh) * HD + cl + e] = pk[e]
                    else:
                        for e in T.unroll(2):
                            pk[e] = T.cast(acc[(mi * 4 + nj) * 4 + hh * 2 + e], "bfloat16")
                        for e in T.vectorized(2):
                            OV[row, (nt - qh - kvh) * HD + cl + e] = pk[e]


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
        exe = _CACHE["exe"] = _prepare(tvm.compile(tvm.IRModule({"main": k_gemm}), target=tvm.target.Target(TARGET),
                                                   tir_pipeline="tirx"))
    return exe


def solve(x_fp8, x_scale, qkv_weight, qkv_weight_scale, q_norm_weight, k_norm_weight):
    gemm = _compiled()
    t, k = x_fp8.shape
    n = qkv_weight.shape[0]
    kvh = n // HD // 6
    qh = 4 * kvh
    if (qh + 2 * kvh) * HD != n or k % BLOCK:
        raise ValueError("expected [32 q + 8 k + 8 v] x 128 weight rows (or the same 4:1:1 split) and K % 128 == 0")
    dev = x_fp8.device
    oq = torch.empty((t, qh, HD), dtype=torch.bfloat16, device=dev)
    ok = torch.empty((t, kvh, HD), dtype=torch.bfloat16, device=dev)
    ov = torch.empty((t, kvh, HD), dtype=torch.bfloat16, device=dev)
    if t == 0:
        return oq, ok, ov
    gemm(x_fp8.contiguous().view(torch.uint8), qkv_weight.contiguous().view(torch.uint8), x_scale.contiguous().float(),
         qkv_weight_scale.contiguous().float(), q_norm_weight.contiguous(), k_norm_weight.contiguous(),
         oq.view(t, qh * HD), ok.view(t, kvh * HD), ov.view(t, kvh * HD), k // BLOCK, qh, kvh)
    return oq, ok, ov
