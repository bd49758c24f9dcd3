# FP8 fused gate/up projection with SiLU gating (Qwen3-VL 8B MLP; e4m3 activations with per-token scales,
# e4m3 weights with 128x128 block scales) in TIRx: an e4m3 -> bf16 conversion kernel and a bf16
# tensor-core GEMM (mma.sync m16n8k16, fp32 accumulation) that applies the block scales exactly.
#
# - k_fp8: e4m3 bytes -> bf16 (bit manipulation; every e4m3 value is exact in bf16), 16 bytes per
#   thread. Used for x [T, 4096] and the weight [24576, 4096] (the unscaled codes: exact).
# - k_gemm: CTA tile 128 tokens x (64 gate + the matching 64 up columns), BK = 64, 8 warps of
#   64 tokens x (16 gate + 16 up columns), 3-stage cp.async pipeline (16-byte pieces XOR-swizzled by
#   row, conflict-free ldmatrix). The weight scale is constant over a 128 x 128 block, so the products of
#   each 128-wide k block go to a fresh fp32 partial fragment that is then added to the accumulator times
#   that block's scale (the gate and up tiles of a warp have their own scales): the same exact scaling
#   as the reference's dequantized fp32 weight, up to summation order. Epilogue: h = acc * x_scale[row];
#   out = silu(h_gate) * h_up -> bf16 pairs. The grid runs token tiles fastest, so CTAs resident
#   together share one weight panel (the 201 MB bf16 weight streams from DRAM about once; the 33 MB
#   activation stays in L2).
#   ~180 registers (accumulator + partial): 1 CTA (8 warps) per SM, 96 KiB of dynamic shared memory.
#
# What limits it / expected time: tensor-core work (825 GFLOP; the H200 has FP8 tensor cores, but this
# first version runs bf16 mma.sync, ~40-50% of the dense bf16 peak) -> ~2-2.5 ms, plus ~75 us of
# conversion traffic (x and the weight expanded to bf16 once per call). Eager PyTorch dequantizes to fp32
# and runs an fp32 GEMM without TF32 (~15-20 ms). Next steps: FP8 wgmma (e4m3 operands directly, 2x the
# bf16 rate) with a TMA producer warp.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi installs torch's current stream
# as TVM's environment stream for each call, so they run in order on it. Workspaces are cached per
# (device, shape) and fully rewritten each call.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

SBLK = 128                      # weight scale block (rows and columns)
BM = 128
BN = 128                        # 64 gate + 64 up columns
BK = 64
STAGES = 3
THREADS = 256


def _e4m3_f32(b):
    # e4m3 byte (int32 0..255) -> fp32 (exact): normal 2^(e-7) (1 + m/8), subnormal m 2^-9
    return T.if_then_else(
        T.bitwise_and(T.shift_right(b, 3), 15) > 0,
        T.reinterpret("float32", T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(b, 7), 1), 31),
                                              T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(b, 3), 15) + 120, 23),
                                                           T.shift_left(T.bitwise_and(b, 7), 20)))),
        T.cast(T.bitwise_and(b, 7), "float32") * T.float32(2.0 ** -9)
        * T.if_then_else(T.bitwise_and(b, 128) > 0, T.float32(-1.0), T.float32(1.0)))


@T.prim_func
def k_fp8(x_h: T.handle, y_h: T.handle, n16: T.int32):
    X = T.match_buffer(x_h, (n16 * 4,), "int32", align=16)          # 16 e4m3 bytes per 4 words
    Y = T.match_buffer(y_h, (n16 * 16,), "bfloat16", align=16)
    T.device_entry()
    blk = T.cta_id([T.ceildiv(n16, 256)])
    tid = T.thread_id([256])
    wv = T.alloc_local((4,), "int32")
    ov = T.alloc_local((16,), "bfloat16")
    i: T.let[T.int32] = blk * 256 + tid
    if i < n16:
        for q in T.vectorized(4):
            wv[q] = X[i * 4 + q]
        for e in T.unroll(16):
            ov[e] = T.cast(_e4m3_f32(T.bitwise_and(T.shift_right(wv[e // 4], (e % 4) * 8), 255)), "bfloat16")
        for q in T.vectorized(8):
            Y[i * 16 + q] = ov[q]
        for q in T.vectorized(8):
            Y[i * 16 + 8 + q] = ov[8 + q]


@T.prim_func
def k_gemm(a_h: T.handle, b_h: T.handle, xs_h: T.handle, ws_h: T.handle, c_h: T.handle, kb128: T.int32):
    M = T.int32()
    N2 = T.int32()
    nsb = T.int32()
    A = T.match_buffer(a_h, (M, kb128 * SBLK), "bfloat16", align=16)
    B = T.match_buffer(b_h, (N2, kb128 * SBLK), "bfloat16", align=16)
    XS = T.match_buffer(xs_h, (M, 1), "float32")
    WS = T.match_buffer(ws_h, (nsb, kb128), "float32")
    C = T.match_buffer(c_h, (M, N2 // 2), "bfloat16")

    T.device_entry()
    mt, nt = T.cta_id([T.ceildiv(M, BM), N2 // BN])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((STAGES * (BM + BN) * BK,), "bfloat16", scope="shared.dyn")
    As = T.decl_buffer((STAGES, BM, BK), "bfloat16", data=pool.data, elem_offset=0)
    Bs = T.decl_buffer((STAGES, BN, BK), "bfloat16", data=pool.data, elem_offset=STAGES * BM * BK)

    acc = T.alloc_local((64,), "float32")           # [m-tile 4][n-tile 4][4]; n-tiles 0, 1 gate, 2, 3 up
    part = T.alloc_local((64,), "float32")          # products of the current 128-wide k block
    af = T.alloc_local((16,), "uint32")
    bf = T.alloc_local((8,), "uint32")
    sc = T.alloc_local((2,), "float32")             # block scales (gate, up)
    hv = T.alloc_local((2,), "float32")
    pk = T.alloc_local((2,), "bfloat16")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    wm: T.let[T.int32] = warp // 4
    wn: T.let[T.int32] = warp % 4
    inter: T.let[T.int32] = N2 // 2
    m0: T.let[T.int32] = mt * BM
    n0: T.let[T.int32] = nt * (BN // 2)             # first gate column of the CTA
    kb64: T.let[T.int32] = kb128 * 2

    for e in T.unroll(64):
        acc[e] = T.float32(0.0)
    # B tile rows 0..63: gate rows n0 .. n0+63; rows 64..127: up rows inter + n0 ..
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
                    T.address_of(B[(row // 64) * inter + n0 + row % 64, st * BK + ch * 8]), 16)
        T.ptx.cp.async_.commit_group()

    for kt in range(kb64):
        cur: T.let[T.int32] = kt % STAGES
        T.ptx.cp.async_.wait_group(STAGES - 2)
        T.cuda.cta_sync()
        if kt + STAGES - 1 < kb64:
            for r in T.unroll(BM * BK // 8 // THREADS):
                row2: T.let[T.int32] = (tid + r * THREADS) // 8
                ch2: T.let[T.int32] = (tid + r * THREADS) % 8
                kk: T.let[T.int32] = (kt + STAGES - 1) * BK
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(As[(kt + STAGES - 1) % STAGES, row2, T.bitwise_xor(ch2, row2 % 8) * 8]),
                    T.address_of(A[T.min(m0 + row2, M - 1), kk + ch2 * 8]), 16,
                    T.if_then_else(m0 + row2 < M, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Bs[(kt + STAGES - 1) % STAGES, row2, T.bitwise_xor(ch2, row2 % 8) * 8]),
                    T.address_of(B[(row2 // 64) * inter + n0 + row2 % 64, kk + ch2 * 8]), 16)
        T.ptx.cp.async_.commit_group()
        if kt % 2 == 0:
            for e in T.unroll(64):
                part[e] = T.float32(0.0)
        for ks in T.unroll(BK // 16):
            for mi in T.unroll(4):
                arow: T.let[T.int32] = wm * 64 + mi * 16 + lane % 8 + ((lane // 8) % 2) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                    T.address_of(As[cur, arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            for jj in T.unroll(2):
                # jj = 0: gate rows 16 wn .. +16 of the tile; jj = 1: the matching up rows
                brow: T.let[T.int32] = jj * 64 + wn * 16 + lane % 8 + (lane // 16) * 8
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[jj * 4], bf[jj * 4 + 1], bf[jj * 4 + 2], bf[jj * 4 + 3],
                    T.address_of(Bs[cur, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
            for mi in T.unroll(4):
                for nj in T.unroll(4):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        part[(mi * 4 + nj) * 4], part[(mi * 4 + nj) * 4 + 1], part[(mi * 4 + nj) * 4 + 2], part[(mi * 4 + nj) * 4 + 3],
                        af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3], bf[nj * 2], bf[nj * 2 + 1],
                        part[(mi * 4 + nj) * 4], part[(mi * 4 + nj) * 4 + 1], part[(mi * 4 + nj) * 4 + 2], part[(mi * 4 + nj) * 4 + 3])
        if kt % 2 == 1:
            sc[0] = WS[n0 // SBLK, kt // 2]
            sc[1] = WS[(inter + n0) // SBLK, kt // 2]
            for mi in T.unroll(4):
                for nj in T.unroll(4):
                    for e in T.unroll(4):
                        acc[(mi * 4 + nj) * 4 + e] = acc[(mi * 4 + nj) * 4 + e] + part[(mi * 4 + nj) * 4 + e] * sc[nj // 2]

    # epilogue: h = acc * x_scale; out = silu(gate) * up
    for mi in T.unroll(4):
        for hh in T.unroll(2):
            row3: T.let[T.int32] = m0 + wm * 64 + mi * 16 + hh * 8 + g
            if row3 < M:
                for nj in T.unroll(2):
                    for e in T.unroll(2):
                        hv[0] = acc[(mi * 4 + nj) * 4 + hh * 2 + e] * XS[row3, 0]
                        hv[1] = acc[(mi * 4 + nj + 2) * 4 + hh * 2 + e] * XS[row3, 0]
                        pk[e] = T.cast(hv[0] / (T.float32(1.0) + T.exp(T.float32(0.0) - hv[0])) * hv[1], "bfloat16")
                    for e in T.vectorized(2):
                        C[row3, n0 + wn * 16 + nj * 8 + tq * 2 + e] = pk[e]


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
                     for f in (k_fp8, k_gemm))
        _CACHE["exes"] = exes
    return exes


def _ws(name, shape, dtype, device):
    key = (name, str(device), tuple(shape))
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.empty(shape, dtype=dtype, device=device)
    return t


def solve(x_fp8: torch.Tensor, x_scale: torch.Tensor, gate_up_weight: torch.Tensor,
          gate_up_weight_scale: torch.Tensor) -> torch.Tensor:
    cvt, gemm = _compiled()
    tokens, hidden = x_fp8.shape
    n2 = gate_up_weight.shape[0]
    dev = x_fp8.device
    out = torch.empty((tokens, n2 // 2), dtype=torch.bfloat16, device=dev)
    if tokens == 0:
        return out
    if hidden % SBLK or (n2 // 2) % SBLK:
        raise ValueError("hidden and intermediate sizes must be multiples of 128")
    xb = _ws("x", (tokens, hidden), torch.bfloat16, dev)
    wb = _ws("w", (n2, hidden), torch.bfloat16, dev)
    cvt(x_fp8.contiguous().view(torch.int32).view(-1), xb.view(-1), tokens * hidden // 16)
    cvt(gate_up_weight.contiguous().view(torch.int32).view(-1), wb.view(-1), n2 * hidden // 16)
    gemm(xb, wb, x_scale.contiguous().float(), gate_up_weight_scale.contiguous().float(), out, hidden // SBLK)
    return out
