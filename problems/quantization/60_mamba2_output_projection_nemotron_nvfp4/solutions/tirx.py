# Nemotron-H-8B Mamba2 output stage with an NVFP4 W4A4 out_proj (8192 tokens, d_inner 8192 -> hidden 4096):
# gated group RMSNorm, dynamic NVFP4 activation quantization and the GEMM, in TIRx. Three launches, the
# decomposition of the CuTe DSL solution:
#
# - k_normq (one warp per (token, group of d_inner / 8 channels), lane l owns a contiguous run of
#   d_inner / 256 channels): u = y * silu(z) in fp32, u * rsqrt(mean(u^2) + 1e-5) * norm_weight, then per
#   16-element block the reference's NVFP4 encoder: block scale = e4m3(min(amax / (6 g), 448)) (div.rn,
#   cvt.rn.satfinite), denominator = scale * g, codes from x / denominator (div.rn) by the E2M1 thresholds
#   (ties to the even code, saturating at 6; blocks whose scale rounds to zero encode zeros). It writes
#   code * block scale, exact in bf16, to a bf16 workspace: quantize and dequantize in one pass.
# - k_wdq: weight code * e4m3 block scale -> bf16 workspace (exact), one thread per 16-element block.
# - k_gemm: out = (A @ W^T) * (g_a * g_w) -> bf16, mma.sync m16n8k16 bf16 with fp32 accumulation: CTA tile
#   128 x 128 x 64, 8 warps of 64 x 32, 3-stage cp.async ring (16-byte pieces XOR-swizzled by row,
#   conflict-free ldmatrix), 96 KiB shared, 2 CTAs per SM. Grouped raster: 8 consecutive M tiles sweep the
#   N tiles together.
# Differences from the CuTe DSL solution: warp-level mma.sync instead of the warpgroup MMA, and the grouped
# raster instead of M tiles fastest: the skill's evidence is that with the 134 MB bf16 activation (larger
# than L2) the tile order, not the MMA instruction, limited that GEMM (problem 59's warp-level GEMM with a
# grouped raster ran the same 550 GFLOP as fast as problem 60's warpgroup GEMM). The encoder divisions are
# correctly rounded (div.rn) where CuTe used the default division.
#
# Expected time: about problem 59's 1.7 ms device (same GEMM size and kernel style) plus ~0.1 ms for the
# norm pass (~400 MB of traffic): not faster than the CuTe version's 1.83 ms by construction, but far under
# torch.compile (12.1 ms) and eager (21.1 ms), which run fp32 GEMMs on dequantized operands.
# Streams: compiled functions are called with torch tensors; tvm-ffi installs torch's current stream for
# each call, so the three launches run in order on it. Workspaces cached per (device, shape).
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

SF = 16
GROUPS = 8
EPS = 1e-5
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BM = 128
BN = 128
BK = 64
STAGES = 3
THREADS = 256
GROUP_M = 8


def _e4m3_value(b):
    # e4m3 byte (int32 0..255) -> fp32 exactly: exponent field > 0: 2^(e - 7) (1 + m / 8), else m 2^-9
    return T.if_then_else(
        T.bitwise_and(b, 0x78) != 0,
        T.reinterpret("float32", T.bitwise_or(T.shift_left(T.bitwise_and(b, 0x80), 24),
                                              T.shift_left(T.bitwise_and(b, 0x7F), 20) + 0x3C000000)),
        T.cast(T.bitwise_and(b, 7), "float32") * T.float32(2.0 ** -9)
        * T.if_then_else(T.bitwise_and(b, 0x80) != 0, T.float32(-1.0), T.float32(1.0)))


def _e2m1_value(c):
    # 4-bit code (bit 3 = sign) -> fp32: m / 2 for m < 4, else 2 or 4 times (1 + (m & 1) / 2)
    return (T.if_then_else(T.bitwise_and(c, 8) != 0, T.float32(-1.0), T.float32(1.0))
            * T.if_then_else(T.bitwise_and(c, 7) < 4,
                             T.cast(T.bitwise_and(c, 7), "float32") * T.float32(0.5),
                             T.if_then_else(T.bitwise_and(c, 7) < 6, T.float32(2.0), T.float32(4.0))
                             * (T.float32(1.0) + T.cast(T.bitwise_and(c, 1), "float32") * T.float32(0.5))))


def _make_normq(epl: int):
    """Norm + quantize kernel for d_inner = 256 * epl (epl channels per lane, a power of two)."""
    dim = 256 * epl
    nb = max(epl // SF, 1)              # 16-element blocks per lane
    per = min(epl, SF)                  # elements of one block held by this lane
    span = max(SF // epl, 1)            # lanes sharing one block
    vec = 8 if epl % 8 == 0 else 1

    @T.prim_func
    def k_normq(y_h: T.handle, z_h: T.handle, w_h: T.handle, g_h: T.handle, a_h: T.handle):
        ntok = T.int32()
        Y = T.match_buffer(y_h, (ntok, dim), "bfloat16", align=16)
        Z = T.match_buffer(z_h, (ntok, dim), "bfloat16", align=16)
        W = T.match_buffer(w_h, (dim,), "bfloat16", align=16)
        G = T.match_buffer(g_h, (1,), "float32")
        A = T.match_buffer(a_h, (ntok, dim), "bfloat16", align=16)
        T.device_entry()
        blk = T.cta_id([ntok])                          # 8 warps = the 8 groups of one token
        warp = T.warp_id([8])
        lane = T.lane_id([32])
        yv = T.alloc_local((epl,), "bfloat16")
        zv = T.alloc_local((epl,), "bfloat16")
        wv = T.alloc_local((epl,), "bfloat16")
        ov = T.alloc_local((epl,), "bfloat16")
        u = T.alloc_local((epl,), "float32")
        red = T.alloc_local((6,), "float32")            # sum sq, rstd, amax, scale, denominator, x / den
        cd = T.alloc_local((1,), "int32")

        t: T.let[T.int32] = blk
        c0: T.let[T.int32] = warp * (32 * epl) + lane * epl
        for v in T.unroll(epl // vec):
            for i in T.vectorized(vec):
                yv[v * vec + i] = Y[t, c0 + v * vec + i]
            for i in T.vectorized(vec):
                zv[v * vec + i] = Z[t, c0 + v * vec + i]
            for i in T.vectorized(vec):
                wv[v * vec + i] = W[c0 + v * vec + i]
        red[0] = T.float32(0.0)
        for i in T.unroll(epl):
            u[i] = T.cast(yv[i], "float32") * (T.cast(zv[i], "float32")
                                               / (T.float32(1.0) + T.exp(T.float32(0.0) - T.cast(zv[i], "float32"))))
            red[0] = red[0] + u[i] * u[i]
        for s in T.unroll(5):
            red[0] = red[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[0], 16 >> s, 32, 32)
        red[1] = T.rsqrt(red[0] * T.float32(1.0 / (32 * epl)) + T.float32(EPS))
        for i in T.unroll(epl):
            u[i] = u[i] * red[1] * T.cast(wv[i], "float32")
        for bi in T.unroll(nb):
            red[2] = T.float32(0.0)
            for e in T.unroll(per):
                red[2] = T.max(red[2], T.abs(u[bi * per + e]))
            for s in T.unroll(span.bit_length() - 1):
                red[2] = T.max(red[2], T.tvm_warp_shuffle_xor(0xFFFFFFFF, red[2], 1 << s, 32, 32))
            T.ptx.div.rn.f32(red[3], red[2], T.float32(E2M1_MAX) * G[0])
            red[3] = T.min(red[3], T.float32(E4M3_MAX))
            # round to e4m3 (nearest even, satfinite) and back to fp32
            cd[0] = T.bitwise_and(T.reinterpret("int32", T.cuda.fp8x4_e4m3_from_float4(
                red[3], T.float32(0.0), T.float32(0.0), T.float32(0.0))), 255)
            red[3] = _e4m3_value(cd[0])
            red[4] = red[3] * G[0]
            for e in T.unroll(per):
                T.ptx.div.rn.f32(red[5], u[bi * per + e], T.max(red[4], T.float32(1e-30)))
                cd[0] = (T.cast(T.abs(red[5]) > T.float32(0.25), "int32") + T.cast(T.abs(red[5]) >= T.float32(0.75), "int32")
                         + T.cast(T.abs(red[5]) > T.float32(1.25), "int32") + T.cast(T.abs(red[5]) >= T.float32(1.75), "int32")
                         + T.cast(T.abs(red[5]) > T.float32(2.5), "int32") + T.cast(T.abs(red[5]) >= T.float32(3.5), "int32")
                         + T.cast(T.abs(red[5]) > T.float32(5.0), "int32")
                         + T.if_then_else(red[5] < T.float32(0.0), 8, 0))
                ov[bi * per + e] = T.cast(T.if_then_else(red[4] > T.float32(0.0), _e2m1_value(cd[0]) * red[3],
                                                         T.float32(0.0)), "bfloat16")
        for v in T.unroll(epl // vec):
            for i in T.vectorized(vec):
                A[t, c0 + v * vec + i] = ov[v * vec + i]

    return k_normq


@T.prim_func
def k_wdq(w_h: T.handle, s_h: T.handle, o_h: T.handle, kb16: T.int32):
    n = T.int32()
    W = T.match_buffer(w_h, (n, kb16 * 2), "int32", align=16)       # 8 codes per word
    S = T.match_buffer(s_h, (n, kb16), "uint8")                      # e4m3, one per 16 elements
    O = T.match_buffer(o_h, (n, kb16 * 16), "bfloat16", align=16)
    T.device_entry()
    blk = T.cta_id([T.ceildiv(n * kb16, 256)])
    tid = T.thread_id([256])
    wv = T.alloc_local((2,), "int32")
    ov = T.alloc_local((16,), "bfloat16")
    sv = T.alloc_local((1,), "float32")
    i: T.let[T.int32] = blk * 256 + tid
    if i < n * kb16:
        r: T.let[T.int32] = i // kb16
        q: T.let[T.int32] = i % kb16
        sv[0] = _e4m3_value(T.cast(S[r, q], "int32"))
        for j in T.vectorized(2):
            wv[j] = W[r, q * 2 + j]
        for e in T.unroll(16):
            ov[e] = T.cast(_e2m1_value(T.bitwise_and(T.shift_right(wv[e // 8], (e % 8) * 4), 15)) * sv[0], "bfloat16")
        for j in T.vectorized(8):
            O[r, q * 16 + j] = ov[j]
        for j in T.vectorized(8):
            O[r, q * 16 + 8 + j] = ov[8 + j]


@T.prim_func
def k_gemm(a_h: T.handle, b_h: T.handle, ga_h: T.handle, gw_h: T.handle, c_h: T.handle, kb64: T.int32):
    M = T.int32()
    N = T.int32()
    A = T.match_buffer(a_h, (M, kb64 * BK), "bfloat16", align=16)
    B = T.match_buffer(b_h, (N, kb64 * BK), "bfloat16", align=16)
    GA = T.match_buffer(ga_h, (1,), "float32")
    GW = T.match_buffer(gw_h, (1,), "float32")
    C = T.match_buffer(c_h, (M, N), "bfloat16", align=4)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
    cta = T.cta_id([T.ceildiv(M, BM) * T.ceildiv(N, BN)])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((STAGES * (BM + BN) * BK,), "bfloat16", scope="shared.dyn")
    As = T.decl_buffer((STAGES, BM, BK), "bfloat16", data=pool.data, elem_offset=0)
    Bs = T.decl_buffer((STAGES, BN, BK), "bfloat16", data=pool.data, elem_offset=STAGES * BM * BK)

    acc = T.alloc_local((64,), "float32")       # [m-tile 4][n-tile 4][4]
    af = T.alloc_local((16,), "uint32")
    bf = T.alloc_local((8,), "uint32")
    pk = T.alloc_local((2,), "bfloat16")
    gs = T.alloc_local((1,), "float32")

    # grouped raster: GROUP_M consecutive M tiles, M fastest, sweep the N tiles together
    n_mt: T.let[T.int32] = T.ceildiv(M, BM)
    n_nt: T.let[T.int32] = T.ceildiv(N, BN)
    first: T.let[T.int32] = (cta // (GROUP_M * n_nt)) * GROUP_M
    gsz: T.let[T.int32] = T.min(n_mt - first, GROUP_M)
    loc: T.let[T.int32] = cta % (GROUP_M * n_nt)
    m0: T.let[T.int32] = (first + loc % gsz) * BM
    n0: T.let[T.int32] = (loc // gsz) * BN
    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    wm: T.let[T.int32] = warp // 4
    wn: T.let[T.int32] = warp % 4

    for e in T.unroll(64):
        acc[e] = T.float32(0.0)
    for st in T.unroll(STAGES - 1):
        if st < kb64:
            for r in T.unroll(BM * BK // 8 // THREADS):
                row: T.let[T.int32] = (tid + r * THREADS) // 8
                ch: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(As[st, row, T.bitwise_xor(ch, row % 8) * 8]),
                    T.address_of(A[T.min(m0 + row, M - 1), st * BK + ch * 8]), 16,
                    T.if_then_else(m0 + row < M, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Bs[st, row, T.bitwise_xor(ch, row % 8) * 8]),
                    T.address_of(B[T.min(n0 + row, N - 1), st * BK + ch * 8]), 16,
                    T.if_then_else(n0 + row < N, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()

    for kt in range(kb64):
        cur: T.let[T.int32] = kt % STAGES
        T.ptx.cp.async_.wait_group(STAGES - 2)
        T.cuda.cta_sync()
        # refill the stage read in iteration kt - 1 (every warp has passed the barrier above)
        if kt + STAGES - 1 < kb64:
            nx: T.let[T.int32] = (kt + STAGES - 1) % STAGES
            kk: T.let[T.int32] = (kt + STAGES - 1) * BK
            for r in T.unroll(BM * BK // 8 // THREADS):
                row2: T.let[T.int32] = (tid + r * THREADS) // 8
                ch2: T.let[T.int32] = (tid + r * THREADS) % 8
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(As[nx, row2, T.bitwise_xor(ch2, row2 % 8) * 8]),
                    T.address_of(A[T.min(m0 + row2, M - 1), kk + ch2 * 8]), 16,
                    T.if_then_else(m0 + row2 < M, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Bs[nx, row2, T.bitwise_xor(ch2, row2 % 8) * 8]),
                    T.address_of(B[T.min(n0 + row2, N - 1), kk + ch2 * 8]), 16,
                    T.if_then_else(n0 + row2 < N, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        for ks in T.unroll(BK // 16):
            for mi in T.unroll(4):
                arow: T.let[T.int32] = wm * 64 + mi * 16 + lane % 8 + ((lane // 8) % 2) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                    T.address_of(As[cur, arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            for jj in T.unroll(2):
                brow: T.let[T.int32] = wn * 32 + jj * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[jj * 4], bf[jj * 4 + 1], bf[jj * 4 + 2], bf[jj * 4 + 3],
                    T.address_of(Bs[cur, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
            for mi in T.unroll(4):
                for nj in T.unroll(4):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        acc[(mi * 4 + nj) * 4], acc[(mi * 4 + nj) * 4 + 1], acc[(mi * 4 + nj) * 4 + 2], acc[(mi * 4 + nj) * 4 + 3],
                        af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3], bf[nj * 2], bf[nj * 2 + 1],
                        acc[(mi * 4 + nj) * 4], acc[(mi * 4 + nj) * 4 + 1], acc[(mi * 4 + nj) * 4 + 2], acc[(mi * 4 + nj) * 4 + 3])

    gs[0] = GA[0] * GW[0]
    for mi in T.unroll(4):
        for hh in T.unroll(2):
            row3: T.let[T.int32] = m0 + wm * 64 + mi * 16 + hh * 8 + g
            if row3 < M:
                for nj in T.unroll(4):
                    col: T.let[T.int32] = n0 + wn * 32 + nj * 8 + tq * 2
                    if col < N:
                        for e in T.unroll(2):
                            pk[e] = T.cast(acc[(mi * 4 + nj) * 4 + hh * 2 + e] * gs[0], "bfloat16")
                        for e in T.vectorized(2):
                            C[row3, col + e] = pk[e]


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


def _compiled(d_inner):
    key = ("exes", d_inner)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (_make_normq(d_inner // 256), k_wdq, k_gemm))
        _CACHE[key] = exes
    return exes


def _ws(name, shape, device):
    key = (name, str(device), tuple(shape))
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return t


def solve(y, z, norm_weight, act_global_scale, weight_packed, weight_scale, weight_global_scale):
    t, d_inner = y.shape
    hidden = weight_packed.shape[0]
    epl = d_inner // 256
    if d_inner % 256 or epl & (epl - 1) or d_inner % BK or hidden % 2:
        raise ValueError("d_inner must be 256 times a power of two and a multiple of 64")
    normq, wdq, gemm = _compiled(d_inner)
    dev = y.device
    out = torch.empty((t, hidden), dtype=torch.bfloat16, device=dev)
    if t == 0:
        return out
    a = _ws("a", (t, d_inner), dev)
    w = _ws("w", (hidden, d_inner), dev)
    ga = act_global_scale.reshape(1).float()
    normq(y.contiguous(), z.contiguous(), norm_weight.contiguous(), ga, a)
    wdq(weight_packed.contiguous().view(torch.int32), weight_scale.contiguous().view(torch.uint8), w, d_inner // 16)
    gemm(a, w, ga, weight_global_scale.reshape(1).float(), out, d_inner // BK)
    return out
