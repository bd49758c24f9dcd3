# Qwen3-VL-32B attention output projection in FP8 (8192 tokens, 8192 -> 5120): dynamic per-(token, 128)
# activation quantization, then a 128x128 block-scaled FP8 GEMM, in TIRx. Two kernels, the same decomposition
# as the CuTe DSL solution (which passed on the H200 at 1.355 ms device time):
#
# - k_quant: one warp per (token, 128-channel group), 4 bf16 per lane: group amax by warp shuffles,
#   scale = max(amax, 1e-12) / 448 and x / scale with correctly rounded division (TVM builds device code with
#   fast math, so plain division would be approximate), then e4m3 by cvt.rn.satfinite (round to nearest even;
#   |x / scale| <= 448 already, the clamp is kept for the rounding slack). Codes [T, K] (4 per 32-bit word) and
#   fp32 scales [T, K / 128] go to cached workspaces.
# - k_gemm: out = dequant(q) dequant(W)^T on the FP8 tensor cores, e4m3 x e4m3 -> fp32 (the products are exact).
#   CTA tile 128 tokens x 128 output columns (grid with token tiles fastest, as in the CuTe version), 8 warps of
#   64 x 32; the K loop steps by one 128-wide scale block through a 3-stage cp.async ring (16-byte pieces
#   XOR-swizzled by row, conflict-free 8 x 16-byte ldmatrix tiles = the e4m3 fragments). Each block's products
#   go into a fresh fp32 partial, then acc += partial * (s_x[row, block] * s_w[column block, block]): the
#   per-block promotion of the CuTe version, i.e. the reference's dequantization up to summation order. bf16 out.
# Difference from the CuTe DSL solution, and why: the warp-level mma.sync m16n8k32 e4m3 instead of the Hopper
# warpgroup MMA (wgmma m64n128k32) reading swizzled shared memory through descriptors: the TIRx kernels of this
# repository have no warpgroup-MMA pipeline, and the warp-level FP8 path keeps the same operands (e4m3 codes,
# no conversion pass), the same block loop and the same promotion arithmetic. The activation scales of a block
# are read per accumulator row from global memory (L1/L2) instead of being staged in shared memory.
#
# Expected time: 687 GFLOP of FP8 work. The warp-level MMA issues at well under the warpgroup rate on Hopper, so
# this kernel is expected to be slower than the CuTe one (1.355 ms device), likely 2-3 ms; still far under eager
# (15.3 ms) and torch.compile (14.2 ms), which dequantize and run an fp32 GEMM.
# k_gemm compiles to 255 registers per thread with 76 bytes of spill and uses 96 KiB of dynamic shared memory:
# one CTA (8 warps) per SM.
# Streams: compiled functions are called with torch tensors; tvm-ffi installs torch's current stream for each
# call, so both kernels run in order on it. Workspaces (codes, scales) are cached per (device, T, K).
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

BLOCK = 128
FP8_MAX = 448.0
BM = 128
BN = 128
BK = 128                       # bytes (= e4m3 values) of K per stage = one scale block
STAGES = 3
THREADS = 256


@T.prim_func
def k_quant(x_h: T.handle, q_h: T.handle, s_h: T.handle):
    ntok = T.int32()
    k4 = T.int32()
    ng = T.int32()
    X = T.match_buffer(x_h, (ntok, k4 * 4), "bfloat16", align=16)
    Q = T.match_buffer(q_h, (ntok, k4), "int32", align=16)          # 4 e4m3 codes per word
    S = T.match_buffer(s_h, (ntok, ng), "float32")

    T.device_entry()
    blk = T.cta_id([T.ceildiv(ntok * ng, 8)])
    warp = T.warp_id([8])
    lane = T.lane_id([32])
    xb = T.alloc_local((4,), "bfloat16")
    xf = T.alloc_local((4,), "float32")
    red = T.alloc_local((2,), "float32")        # amax, scale

    w: T.let[T.int32] = blk * 8 + warp
    if w < ntok * ng:
        t: T.let[T.int32] = w // ng
        gi: T.let[T.int32] = w % ng
        for i in T.vectorized(4):
            xb[i] = X[t, gi * BLOCK + lane * 4 + i]
        red[0] = T.float32(0.0)
        for i in T.unroll(4):
            xf[i] = T.cast(xb[i], "float32")
            red[0] = T.max(red[0], T.abs(xf[i]))
        for s in T.unroll(5):
            red[0] = T.max(red[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[0], 16 >> s, 32, 32))
        T.ptx.div.rn.f32(red[1], T.max(red[0], T.float32(1e-12)), T.float32(FP8_MAX))
        for i in T.unroll(4):
            T.ptx.div.rn.f32(xf[i], xf[i], red[1])
            xf[i] = T.min(T.max(xf[i], T.float32(-FP8_MAX)), T.float32(FP8_MAX))
        Q[t, gi * (BLOCK // 4) + lane] = T.reinterpret(
            "int32", T.cuda.fp8x4_e4m3_from_float4(xf[0], xf[1], xf[2], xf[3]))
        if lane == 0:
            S[t, gi] = red[1]


@T.prim_func
def k_gemm(a_h: T.handle, b_h: T.handle, xs_h: T.handle, ws_h: T.handle, c_h: T.handle, nkb: T.int32):
    M = T.int32()
    N = T.int32()
    nsb = T.int32()
    A = T.match_buffer(a_h, (M, nkb * BK), "uint8", align=16)
    B = T.match_buffer(b_h, (N, nkb * BK), "uint8", align=16)
    XS = T.match_buffer(xs_h, (M, nkb), "float32")
    WS = T.match_buffer(ws_h, (nsb, nkb), "float32")
    C = T.match_buffer(c_h, (M, N), "bfloat16", align=16)

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
        # per-block promotion: acc += partial * s_x[row, kt] * s_w[nt, kt]
        ws[0] = WS[nt, kt]
        for mi in T.unroll(4):
            for hh in T.unroll(2):
                sc[hh] = XS[T.min(m0 + wm * 64 + mi * 16 + hh * 8 + g, M - 1), kt] * ws[0]
            for nj in T.unroll(4):
                for e in T.unroll(4):
                    acc[(mi * 4 + nj) * 4 + e] = acc[(mi * 4 + nj) * 4 + e] + part[(mi * 4 + nj) * 4 + e] * sc[e // 2]

    for mi in T.unroll(4):
        for hh in T.unroll(2):
            row: T.let[T.int32] = m0 + wm * 64 + mi * 16 + hh * 8 + g
            if row < M:
                for nj in T.unroll(4):
                    for e in T.unroll(2):
                        pk[e] = T.cast(acc[(mi * 4 + nj) * 4 + hh * 2 + e], "bfloat16")
                    for e in T.vectorized(2):
                        C[row, n0 + wn * 32 + nj * 8 + tq * 2 + e] = pk[e]


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
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (k_quant, k_gemm))
        _CACHE["exes"] = exes
    return exes


def solve(attn_output, weight, weight_scale):
    quant, gemm = _compiled()
    t, k = attn_output.shape
    n = weight.shape[0]
    if k % BLOCK or n % BN:
        raise ValueError("in_features and out_features must be multiples of 128")
    dev = attn_output.device
    out = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
    if t == 0:
        return out
    key = ("ws", str(dev), t, k)
    ws = _CACHE.get(key)
    if ws is None:
        ws = _CACHE[key] = (torch.empty((t, k // 4), dtype=torch.int32, device=dev),
                            torch.empty((t, k // BLOCK), dtype=torch.float32, device=dev))
    q, qs = ws
    quant(attn_output.contiguous(), q, qs)
    gemm(q.view(torch.uint8), weight.contiguous().view(torch.uint8), qs, weight_scale.contiguous().float(), out,
         k // BLOCK)
    return out
