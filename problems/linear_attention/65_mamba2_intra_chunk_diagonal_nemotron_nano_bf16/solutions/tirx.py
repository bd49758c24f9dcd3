# Mamba-2 intra-chunk diagonal block (Nemotron Nano 9B v2 mixer: 128 heads x 80, state 128, 8 groups,
# chunk 128) as one TIRx kernel on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation).
#
# Algorithm: one CTA per (chunk, B/C group, batch) = 32 x 8 x 2 CTAs of 8 warps, 2 CTAs per SM
# (~99 KiB of dynamic shared memory, <= 128 registers).
# - C B^T of the chunk is shared by the group's 16 heads, so it is computed once per CTA: C and B
#   [128 x 128] arrive by cp.async (16-byte pieces XOR-swizzled by row, conflict-free ldmatrix), warp w
#   computes the causal part of row block w (16 mma per 16x16 block) and stores it as bf16 in a padded
#   [128 x 136] shared array (pitch chosen so that the per-thread bf16-pair reads are conflict-free).
# - Then the CTA loops over the 16 heads of the group. Per head: x [128 x 80] was prefetched by
#   cp.async during the previous head (double buffer); threads 0..127 turn dt into the inclusive
#   cumsum of dt*A (warp shfl_up scans + per-warp totals) and all threads write dt_j x_j as bf16 into
#   a padded [128 x 88] array (B operand, ldmatrix.trans, conflict-free pitch).
# - y = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j: the work is split into 16 units
#   (row block, half of the 10 head-dim tiles); warp w takes (block w, tiles 0..4) and
#   (block 7 - w, tiles 5..9), so every warp does 9 block steps (balanced triangle). A step reads the
#   C B^T tile from shared memory, applies the decay and the causal mask in registers, packs it as the
#   A fragment, and issues 5 mma against dt x. y is stored as bf16 pairs; rows past the sequence end
#   (short last chunk: B, C, x zero-filled) are not stored.
# Numerics: bf16 operands (C B^T tile, decay-scaled, and dt x are rounded to bf16) with fp32
# accumulation; the output is bf16 (tolerance ~3 bf16 ulps of max|y|).
#
# What limits it / expected time: DRAM traffic (x, B, C, y: ~370 MB, ~78 us at 4.8 TB/s) plus the
# per-head barriers; tensor work is ~3.2M mma.sync (~20-30 us spread over the SMs). dt is read with
# one 4-byte load per token and head (stride 512 B). Expected ~100-130 us; far faster than eager
# PyTorch, which materializes [B, chunks, G, 16, 128, 128] fp32 decay tensors.
#
# Streams: the compiled function is called with torch tensors; tvm-ffi installs torch's current
# stream as TVM's environment stream for the call. Only the compiled module is cached.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

H = 128
P = 80
N = 128
G = 8
HPG = H // G
CL = 128
THREADS = 256
CBP = 136                       # pitch (bf16) of the C B^T array
XDP = 88                        # pitch (bf16) of the dt*x array
OFF_R = CL * CBP                # start of the reused region
OFF_CST = OFF_R                 # C staging [128][128] (swizzled)
OFF_BST = OFF_R + CL * N        # B staging [128][128]
OFF_XR = OFF_R                  # x raw [2][128][80] (after C B^T is done)
OFF_XD = OFF_R + 2 * CL * P     # dt*x [128][88]
POOL = OFF_R + 2 * CL * N


@T.prim_func
def ssd_diag(x_h: T.handle, dt_h: T.handle, a_h: T.handle, b_h: T.handle, c_h: T.handle, y_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    X = T.match_buffer(x_h, (batch, seqlen, H, P), "bfloat16", align=16)
    DT = T.match_buffer(dt_h, (batch, seqlen, H), "float32")
    AA = T.match_buffer(a_h, (H,), "float32")
    Bm = T.match_buffer(b_h, (batch, seqlen, G, N), "bfloat16", align=16)
    Cm = T.match_buffer(c_h, (batch, seqlen, G, N), "bfloat16", align=16)
    Y = T.match_buffer(y_h, (batch, seqlen, H, P), "bfloat16", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
    c, grp, b = T.cta_id([T.ceildiv(seqlen, CL), G, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((POOL,), "bfloat16", scope="shared.dyn")
    CBu = T.decl_buffer((CL, CBP // 2), "uint32", data=pool.data, elem_offset=0)
    Cst = T.decl_buffer((CL, N), "bfloat16", data=pool.data, elem_offset=OFF_CST)
    Bst = T.decl_buffer((CL, N), "bfloat16", data=pool.data, elem_offset=OFF_BST)
    Xr = T.decl_buffer((2, CL, P), "bfloat16", data=pool.data, elem_offset=OFF_XR)
    Xd = T.decl_buffer((CL, XDP), "bfloat16", data=pool.data, elem_offset=OFF_XD)
    cf = T.alloc_shared((CL,), "float32")
    dts = T.alloc_shared((CL,), "float32")
    red = T.alloc_shared((4,), "float32")

    acc = T.alloc_local((40,), "float32")           # y fragments [unit 2][p-tile 5][4]
    cbacc = T.alloc_local((8,), "float32")
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    fv = T.alloc_local((8,), "float32")
    vb = T.alloc_local((8,), "bfloat16")
    sv = T.alloc_local((3,), "float32")             # dt*A scan, shuffle temp, dt
    dtn = T.alloc_local((1,), "float32")
    pk = T.alloc_local((2,), "bfloat16")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    t0: T.let[T.int32] = c * CL

    # ---- C and B of the chunk (zero rows past the end)
    for r in T.unroll(8):
        row: T.let[T.int32] = (tid + r * THREADS) // 16
        ch: T.let[T.int32] = (tid + r * THREADS) % 16
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Cst[row, T.bitwise_xor(ch, row % 8) * 8]),
            T.address_of(Cm[b, T.min(t0 + row, seqlen - 1), grp, ch * 8]), 16,
            T.if_then_else(t0 + row < seqlen, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Bst[row, T.bitwise_xor(ch, row % 8) * 8]),
            T.address_of(Bm[b, T.min(t0 + row, seqlen - 1), grp, ch * 8]), 16,
            T.if_then_else(t0 + row < seqlen, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()
    dtn[0] = T.float32(0.0)
    if tid < CL:
        if t0 + tid < seqlen:
            dtn[0] = DT[b, t0 + tid, grp * HPG]
    T.ptx.cp.async_.wait_all()
    T.cuda.cta_sync()

    # ---- causal C B^T: warp w -> row block w, column blocks 0..w (bf16 into CBu)
    arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
    for jb in range(warp + 1):
        for e in T.unroll(8):
            cbacc[e] = T.float32(0.0)
        jrow: T.let[T.int32] = jb * 16 + lane % 8 + (lane // 16) * 8
        for ks in T.unroll(N // 16):
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                af[0], af[1], af[2], af[3],
                T.address_of(Cst[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                bf[0], bf[1], bf[2], bf[3],
                T.address_of(Bst[jrow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, jrow % 8) * 8]))
            for j2 in T.unroll(2):
                T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                    cbacc[j2 * 4], cbacc[j2 * 4 + 1], cbacc[j2 * 4 + 2], cbacc[j2 * 4 + 3],
                    af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                    cbacc[j2 * 4], cbacc[j2 * 4 + 1], cbacc[j2 * 4 + 2], cbacc[j2 * 4 + 3])
        for j2 in T.unroll(2):
            for hh in T.unroll(2):
                CBu[warp * 16 + hh * 8 + g, (jb * 16 + j2 * 8 + tq * 2) // 2] = T.bitwise_or(
                    T.cast(T.reinterpret("uint16", T.cast(cbacc[j2 * 4 + hh * 2], "bfloat16")), "uint32"),
                    T.shift_left(T.cast(T.reinterpret("uint16", T.cast(cbacc[j2 * 4 + hh * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
    T.cuda.cta_sync()

    # ---- x of the first head (the staging region is free now)
    for r in T.unroll(5):
        xrow: T.let[T.int32] = (tid + r * THREADS) // 10
        xch: T.let[T.int32] = (tid + r * THREADS) % 10
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Xr[0, xrow, xch * 8]),
            T.address_of(X[b, T.min(t0 + xrow, seqlen - 1), grp * HPG, xch * 8]), 16,
            T.if_then_else(t0 + xrow < seqlen, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()

    for hl in range(HPG):
        h: T.let[T.int32] = grp * HPG + hl
        xb: T.let[T.int32] = hl % 2
        # ---- dt*A scan (warps 0..3, one token per thread)
        if tid < CL:
            sv[2] = dtn[0]
            sv[0] = sv[2] * AA[h]
            for r in T.unroll(5):
                sv[1] = T.tvm_warp_shuffle_up(0xFFFFFFFF, sv[0], 1 << r, 32, 32)
                if lane >= (1 << r):
                    sv[0] = sv[0] + sv[1]
            if lane == 31:
                red[warp] = sv[0]
            dts[tid] = sv[2]
        T.ptx.cp.async_.wait_all()
        T.cuda.cta_sync()
        # ---- next head's x and dt in flight
        if hl + 1 < HPG:
            for r in T.unroll(5):
                xrow2: T.let[T.int32] = (tid + r * THREADS) // 10
                xch2: T.let[T.int32] = (tid + r * THREADS) % 10
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Xr[1 - xb, xrow2, xch2 * 8]),
                    T.address_of(X[b, T.min(t0 + xrow2, seqlen - 1), h + 1, xch2 * 8]), 16,
                    T.if_then_else(t0 + xrow2 < seqlen, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.commit_group()
            if tid < CL:
                dtn[0] = T.float32(0.0)
                if t0 + tid < seqlen:
                    dtn[0] = DT[b, t0 + tid, h + 1]
        if tid < CL:
            for w2 in T.unroll(3):
                if w2 < warp:
                    sv[0] = sv[0] + red[w2]
            cf[tid] = sv[0]
        # ---- dt_j x_j as bf16 (B operand)
        for r in T.unroll(5):
            xrow3: T.let[T.int32] = (tid + r * THREADS) // 10
            xch3: T.let[T.int32] = (tid + r * THREADS) % 10
            for i in T.vectorized(8):
                vb[i] = Xr[xb, xrow3, xch3 * 8 + i]
            for i in T.unroll(8):
                vb[i] = T.cast(T.cast(vb[i], "float32") * dts[xrow3], "bfloat16")
            for i in T.vectorized(8):
                Xd[xrow3, xch3 * 8 + i] = vb[i]
        T.cuda.cta_sync()

        # ---- y: unit 0 = (row block warp, p-tiles 0..4), unit 1 = (row block 7 - warp, p-tiles 5..9)
        for e in T.unroll(40):
            acc[e] = T.float32(0.0)
        for u in T.unroll(2):
            ib: T.let[T.int32] = T.if_then_else(u == 0, warp, 7 - warp)
            for jb in range(ib + 1):
                for q in T.unroll(4):
                    af[q] = CBu[ib * 16 + (q % 2) * 8 + g, (jb * 16 + (q // 2) * 8 + tq * 2) // 2]
                for q in T.unroll(4):
                    for e in T.unroll(2):
                        fv[q * 2 + e] = T.if_then_else(
                            jb * 16 + (q // 2) * 8 + tq * 2 + e <= ib * 16 + (q % 2) * 8 + g,
                            T.reinterpret("float32", T.if_then_else(e == 0, T.shift_left(af[q], T.uint32(16)),
                                                                    T.bitwise_and(af[q], T.uint32(0xFFFF0000))))
                            * T.exp(cf[ib * 16 + (q % 2) * 8 + g] - cf[jb * 16 + (q // 2) * 8 + tq * 2 + e]),
                            T.float32(0.0))
                for q in T.unroll(4):
                    af[q] = T.bitwise_or(
                        T.cast(T.reinterpret("uint16", T.cast(fv[q * 2], "bfloat16")), "uint32"),
                        T.shift_left(T.cast(T.reinterpret("uint16", T.cast(fv[q * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
                xrow4: T.let[T.int32] = jb * 16 + lane % 8 + ((lane // 8) % 2) * 8
                for pp in T.unroll(2):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        bf[0], bf[1], bf[2], bf[3],
                        T.address_of(Xd[xrow4, (u * 5 + pp * 2 + lane // 16) * 8]))
                    for j2 in T.unroll(2):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            acc[(u * 5 + pp * 2 + j2) * 4], acc[(u * 5 + pp * 2 + j2) * 4 + 1],
                            acc[(u * 5 + pp * 2 + j2) * 4 + 2], acc[(u * 5 + pp * 2 + j2) * 4 + 3],
                            af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                            acc[(u * 5 + pp * 2 + j2) * 4], acc[(u * 5 + pp * 2 + j2) * 4 + 1],
                            acc[(u * 5 + pp * 2 + j2) * 4 + 2], acc[(u * 5 + pp * 2 + j2) * 4 + 3])
                T.ptx.ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16(
                    bf[0], bf[1], T.address_of(Xd[xrow4, (u * 5 + 4) * 8]))
                T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                    acc[(u * 5 + 4) * 4], acc[(u * 5 + 4) * 4 + 1], acc[(u * 5 + 4) * 4 + 2], acc[(u * 5 + 4) * 4 + 3],
                    af[0], af[1], af[2], af[3], bf[0], bf[1],
                    acc[(u * 5 + 4) * 4], acc[(u * 5 + 4) * 4 + 1], acc[(u * 5 + 4) * 4 + 2], acc[(u * 5 + 4) * 4 + 3])
            for hh in T.unroll(2):
                yrow: T.let[T.int32] = t0 + ib * 16 + hh * 8 + g
                if yrow < seqlen:
                    for pt in T.unroll(5):
                        for e in T.unroll(2):
                            pk[e] = T.cast(acc[(u * 5 + pt) * 4 + hh * 2 + e], "bfloat16")
                        for e in T.vectorized(2):
                            Y[b, yrow, h, (u * 5 + pt) * 8 + tq * 2 + e] = pk[e]


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
        exe = tvm.compile(tvm.IRModule({"main": ssd_diag}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    exe = _compiled()
    y = torch.empty_like(x)
    if x.shape[0] == 0 or x.shape[1] == 0:
        return y
    exe(x.contiguous(), dt.contiguous().float(), A.contiguous().float(), B.contiguous(), C.contiguous(), y)
    return y
