# GQA paged decode (5 query heads on 1 KV head, head dim 128, page size 1, bf16) in TIRx: split-KV flash
# decoding on tensor cores (warp-level mma.sync m16n8k16, fp32 accumulation), then a merge kernel. Same
# decomposition as the verified CuTe DSL solution of this problem.
#
# Kernel 1 (decode_partial): grid (32 splits, B requests), 128 threads = 4 warps.
# - Request b's tokens are cut into chunks of max(256, ceil(len/32)) tokens (at most 32 chunks); CTA (s, b)
#   takes chunk s and exits at once when the chunk starts past the end (581 of 2048 CTAs work at full size).
# - The 5 query heads are the rows of a 16-row MMA tile (rows 5..15 zero): Q is staged in shared memory once
#   and kept as register A fragments (8 k-steps) for the whole chunk.
# - The chunk is walked in blocks of 64 tokens. Thread t gathers one half K row and one half V row of token
#   t/2 (8 x 16-byte cp.async each, rows past the chunk end zero-filled from a clamped page) into a 2-stage
#   ring of [64 x 128] K and V tiles, 16-byte pieces XOR-swizzled by row (conflict-free ldmatrix); block
#   i+1 is in flight while block i is computed.
# - Differs from the CuTe solution (deliberately, both are cheap): the page ids of block i+2 are loaded into
#   a register while block i is computed, so issuing a block never waits on the kv_indices load; and only
#   the 5 real head rows run the softmax (the P fragments of rows 8..15 are zero).
# - Warp w takes tokens 16w..16w+15 of every block: S = Q K^T (two 4-step accumulation chains added in fp32),
#   online softmax in base 2 (sm_scale * log2 e folded in, quad shuffles for the row max), P re-packed as
#   bf16 A fragments for O += P V (V through ldmatrix.trans, 16 head-dim n-tiles), O [16 x 128] fp32 in
#   registers.
# - The 4 warp states (max, sum, O rows 0..4) are merged through shared memory; the CTA writes its normalized
#   fp32 partial output [5 x 128] and partial base-2 lse to a workspace cached per (device, B).
# Kernel 2 (decode_merge): grid (B), 160 threads: thread t merges head t/32, elements 4(t%32)..+3 over the
# request's chunks (lse = M + log2 sum 2^(lse_s - M)); bf16 output; zero-length requests: 0 and -inf.
# Shared memory: 68 KiB dynamic (Q + 2 x K/V stages) + 10 KiB for the warp merge, about 2 CTAs per SM.
# What likely limits it: the latency of page-size-1 gathers (every token is an independent 256-byte row)
# with one block in flight per CTA, and the critical-path CTA of the 15050-token request (471 tokens, 8
# blocks); the CuTe version measured 0.0655 ms device time vs a 0.0163 ms DRAM SOL.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi installs torch's current stream as
# TVM's environment stream for each call, so both kernels run in order on the caller's stream.
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator; H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HEADS = 5
D = 128
MROWS = 16                      # MMA rows (heads padded to 16)
THREADS = 128
WARPS = THREADS // 32
BLK = 64                        # tokens per block (16 per warp)
DCH = D // 8                    # 16-byte pieces per row
CHUNK = 256                     # minimum tokens per split
SPLITS = 32                     # max splits per request
OUT_VEC = 4
LOG2E = 1.0 / math.log(2.0)
M_INIT = -1.0e30


@T.prim_func
def decode_partial(q_h: T.handle, k_h: T.handle, v_h: T.handle, ip_h: T.handle, idx_h: T.handle,
                   po_h: T.handle, pl_h: T.handle, scale_log2: T.float32):
    batch = T.int32()
    pages = T.int32()
    nidx = T.int32()
    Q = T.match_buffer(q_h, (batch, HEADS, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (pages, 1, 1, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (pages, 1, 1, D), "bfloat16", align=16)
    IP = T.match_buffer(ip_h, (batch + 1,), "int32")
    IDX = T.match_buffer(idx_h, (nidx,), "int32")
    PO = T.match_buffer(po_h, (batch, SPLITS, HEADS, D), "float32", align=16)
    PL = T.match_buffer(pl_h, (batch, SPLITS, HEADS), "float32")

    T.device_entry()
    split, b = T.cta_id([SPLITS, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((MROWS * D + 4 * BLK * D,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((MROWS, D), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((2, BLK, D), "bfloat16", data=pool.data, elem_offset=MROWS * D)
    Vs = T.decl_buffer((2, BLK, D), "bfloat16", data=pool.data, elem_offset=MROWS * D + 2 * BLK * D)
    sO = T.alloc_shared((WARPS * HEADS * D,), "float32")
    sM = T.alloc_shared((WARPS * HEADS,), "float32")
    sL = T.alloc_shared((WARPS * HEADS,), "float32")

    qa = T.alloc_local((D // 16 * 4,), "uint32")     # Q A fragments [8 k-steps][4]
    oa = T.alloc_local((D // 2,), "float32")         # O fragments [16 n-tiles][4]
    sa = T.alloc_local((8,), "float32")              # S fragments [2 n-tiles][4], head dim 0..63
    sb = T.alloc_local((8,), "float32")              # head dim 64..127
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    pgn = T.alloc_local((1,), "int32")
    mx = T.alloc_local((1,), "float32")
    ls = T.alloc_local((1,), "float32")
    tmx = T.alloc_local((1,), "float32")
    al = T.alloc_local((1,), "float32")
    mm = T.alloc_local((1,), "float32")
    wt = T.alloc_local((1,), "float32")
    lsum = T.alloc_local((1,), "float32")
    osum = T.alloc_local((1,), "float32")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    start: T.let[T.int32] = IP[b]
    n_tot: T.let[T.int32] = IP[b + 1] - start
    chunk: T.let[T.int32] = T.max(CHUNK, T.ceildiv(n_tot, SPLITS))
    c0: T.let[T.int32] = split * chunk

    if c0 < n_tot:
        cn: T.let[T.int32] = T.min(chunk, n_tot - c0)
        base: T.let[T.int32] = start + c0
        nblk: T.let[T.int32] = T.ceildiv(cn, BLK)
        kr: T.let[T.int32] = tid // 2                 # token row of the block this thread copies
        kh: T.let[T.int32] = (tid % 2) * (DCH // 2)   # first 16-byte piece (half row)

        # Q rows 0..4 from q[b], rows 5..15 zero-filled (thread t: row t/8, pieces 2(t%8), 2(t%8)+1)
        for e in T.unroll(2):
            qr: T.let[T.int32] = tid // 8
            qc: T.let[T.int32] = (tid % 8) * 2 + e
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Qs[qr, T.bitwise_xor(qc, qr % 8) * 8]),
                T.address_of(Q[b, T.min(qr, HEADS - 1), qc * 8]), 16,
                T.if_then_else(qr < HEADS, T.uint32(16), T.uint32(0)))
        # block 0
        pgn[0] = IDX[base + T.min(kr, cn - 1)]
        for e in T.unroll(DCH // 2):
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Ks[0, kr, T.bitwise_xor(kh + e, kr % 8) * 8]), T.address_of(K[pgn[0], 0, 0, (kh + e) * 8]),
                16, T.if_then_else(kr < cn, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Vs[0, kr, T.bitwise_xor(kh + e, kr % 8) * 8]), T.address_of(V[pgn[0], 0, 0, (kh + e) * 8]),
                16, T.if_then_else(kr < cn, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        pgn[0] = IDX[base + T.min(BLK + kr, cn - 1)]  # page of this thread's row in block 1

        for e in T.unroll(D // 2):
            oa[e] = T.float32(0.0)
        mx[0] = T.float32(M_INIT)
        ls[0] = T.float32(0.0)
        arow: T.let[T.int32] = lane % 8 + ((lane // 8) % 2) * 8
        brow: T.let[T.int32] = warp * 16 + lane % 8 + (lane // 16) * 8
        vrow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8

        for blk in range(nblk):
            buf: T.let[T.int32] = blk % 2
            T.ptx.cp.async_.wait_all()
            T.cuda.cta_sync()
            if blk == 0:
                for ks in T.unroll(D // 16):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        qa[ks * 4], qa[ks * 4 + 1], qa[ks * 4 + 2], qa[ks * 4 + 3],
                        T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
            if blk + 1 < nblk:
                kn: T.let[T.int32] = (blk + 1) * BLK + kr
                for e in T.unroll(DCH // 2):
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Ks[1 - buf, kr, T.bitwise_xor(kh + e, kr % 8) * 8]),
                        T.address_of(K[pgn[0], 0, 0, (kh + e) * 8]), 16,
                        T.if_then_else(kn < cn, T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Vs[1 - buf, kr, T.bitwise_xor(kh + e, kr % 8) * 8]),
                        T.address_of(V[pgn[0], 0, 0, (kh + e) * 8]), 16,
                        T.if_then_else(kn < cn, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.commit_group()
                pgn[0] = IDX[base + T.min((blk + 2) * BLK + kr, cn - 1)]

            # ---- S = Q K^T over this warp's 16 tokens, two half-depth chains
            for e in T.unroll(8):
                sa[e] = T.float32(0.0)
                sb[e] = T.float32(0.0)
            for ks in T.unroll(D // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Ks[buf, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                for j2 in T.unroll(2):
                    if ks < D // 32:
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            sa[j2 * 4], sa[j2 * 4 + 1], sa[j2 * 4 + 2], sa[j2 * 4 + 3],
                            qa[ks * 4], qa[ks * 4 + 1], qa[ks * 4 + 2], qa[ks * 4 + 3], bf[j2 * 2], bf[j2 * 2 + 1],
                            sa[j2 * 4], sa[j2 * 4 + 1], sa[j2 * 4 + 2], sa[j2 * 4 + 3])
                    else:
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            sb[j2 * 4], sb[j2 * 4 + 1], sb[j2 * 4 + 2], sb[j2 * 4 + 3],
                            qa[ks * 4], qa[ks * 4 + 1], qa[ks * 4 + 2], qa[ks * 4 + 3], bf[j2 * 2], bf[j2 * 2 + 1],
                            sb[j2 * 4], sb[j2 * 4 + 1], sb[j2 * 4 + 2], sb[j2 * 4 + 3])

            # ---- online softmax (base 2) on row g (heads live in rows 0..4; rows 8..15 are skipped)
            tmx[0] = mx[0]
            for j2 in T.unroll(2):
                for e in T.unroll(2):
                    sa[j2 * 4 + e] = T.if_then_else(
                        blk * BLK + warp * 16 + j2 * 8 + tq * 2 + e < cn,
                        (sa[j2 * 4 + e] + sb[j2 * 4 + e]) * scale_log2, T.float32("-inf"))
                    tmx[0] = T.max(tmx[0], sa[j2 * 4 + e])
            tmx[0] = T.max(tmx[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[0], 1, 32, 32))
            tmx[0] = T.max(tmx[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[0], 2, 32, 32))
            al[0] = T.exp2(mx[0] - tmx[0])
            mx[0] = tmx[0]
            ls[0] = ls[0] * al[0]
            for j2 in T.unroll(2):
                for e in T.unroll(2):
                    sa[j2 * 4 + e] = T.exp2(sa[j2 * 4 + e] - tmx[0])
                    ls[0] = ls[0] + sa[j2 * 4 + e]
            for nt in T.unroll(D // 8):
                for e in T.unroll(2):
                    oa[nt * 4 + e] = oa[nt * 4 + e] * al[0]

            # ---- O += P V (P rows 8..15 are zero)
            for q in T.unroll(2):
                af[q * 2] = T.bitwise_or(
                    T.cast(T.reinterpret("uint16", T.cast(sa[q * 4], "bfloat16")), "uint32"),
                    T.shift_left(T.cast(T.reinterpret("uint16", T.cast(sa[q * 4 + 1], "bfloat16")), "uint32"),
                                 T.uint32(16)))
                af[q * 2 + 1] = T.uint32(0)
            for pp in T.unroll(D // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Vs[buf, vrow, T.bitwise_xor(pp * 2 + lane // 16, vrow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3])

        # ---- merge the 4 warp states (rows 0..4 = heads) through shared memory
        ls[0] = ls[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[0], 1, 32, 32)
        ls[0] = ls[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[0], 2, 32, 32)
        if g < HEADS:
            for nt in T.unroll(D // 8):
                for e in T.vectorized(2):
                    sO[(warp * HEADS + g) * D + nt * 8 + tq * 2 + e] = oa[nt * 4 + e]
            if tq == 0:
                sM[warp * HEADS + g] = mx[0]
                sL[warp * HEADS + g] = ls[0]
        T.cuda.cta_sync()
        for h in T.unroll(HEADS):
            mm[0] = sM[h]
            for w in T.unroll(WARPS - 1):
                mm[0] = T.max(mm[0], sM[(w + 1) * HEADS + h])
            lsum[0] = T.float32(0.0)
            osum[0] = T.float32(0.0)
            for w in T.unroll(WARPS):
                wt[0] = T.exp2(sM[w * HEADS + h] - mm[0])
                lsum[0] = lsum[0] + sL[w * HEADS + h] * wt[0]
                osum[0] = osum[0] + sO[(w * HEADS + h) * D + tid] * wt[0]
            PO[b, split, h, tid] = osum[0] / lsum[0]
            if tid == 0:
                PL[b, split, h] = mm[0] + T.log2(lsum[0])


@T.prim_func
def decode_merge(ip_h: T.handle, po_h: T.handle, pl_h: T.handle, out_h: T.handle, lse_h: T.handle):
    batch = T.int32()
    IP = T.match_buffer(ip_h, (batch + 1,), "int32")
    PO = T.match_buffer(po_h, (batch, SPLITS, HEADS, D), "float32", align=16)
    PL = T.match_buffer(pl_h, (batch, SPLITS, HEADS), "float32")
    OUT = T.match_buffer(out_h, (batch, HEADS, D), "bfloat16", align=16)
    LSE = T.match_buffer(lse_h, (batch, HEADS), "float32")

    T.device_entry()
    b = T.cta_id([batch])
    tid = T.thread_id([HEADS * 32])

    o = T.alloc_local((OUT_VEC,), "float32")
    ob = T.alloc_local((OUT_VEC,), "bfloat16")
    pv = T.alloc_local((OUT_VEC,), "float32")
    mx = T.alloc_local((1,), "float32")
    w = T.alloc_local((1,), "float32")
    wsum = T.alloc_local((1,), "float32")

    hh: T.let[T.int32] = tid // 32
    dd: T.let[T.int32] = (tid % 32) * OUT_VEC
    n_tot: T.let[T.int32] = IP[b + 1] - IP[b]
    chunk: T.let[T.int32] = T.max(CHUNK, T.ceildiv(n_tot, SPLITS))
    n_act: T.let[T.int32] = T.ceildiv(n_tot, chunk)    # chunks kernel 1 wrote (0 if empty)

    if n_act > 0:
        mx[0] = PL[b, 0, hh]
        for sp in range(n_act - 1):
            mx[0] = T.max(mx[0], PL[b, sp + 1, hh])
        wsum[0] = T.float32(0.0)
        for i in T.unroll(OUT_VEC):
            o[i] = T.float32(0.0)
        for sp in range(n_act):
            w[0] = T.exp2(PL[b, sp, hh] - mx[0])
            wsum[0] = wsum[0] + w[0]
            for i in T.vectorized(OUT_VEC):
                pv[i] = PO[b, sp, hh, dd + i]
            for i in T.unroll(OUT_VEC):
                o[i] = o[i] + w[0] * pv[i]
        w[0] = T.float32(1.0) / wsum[0]
        for i in T.unroll(OUT_VEC):
            ob[i] = T.cast(o[i] * w[0], "bfloat16")
        for i in T.vectorized(OUT_VEC):
            OUT[b, hh, dd + i] = ob[i]
        if tid % 32 == 0:
            LSE[b, hh] = mx[0] + T.log2(wsum[0])
    else:
        for i in T.unroll(OUT_VEC):
            ob[i] = T.bfloat16(0.0)
        for i in T.vectorized(OUT_VEC):
            OUT[b, hh, dd + i] = ob[i]
        if tid % 32 == 0:
            LSE[b, hh] = T.float32("-inf")


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
                     for f in (decode_partial, decode_merge))
        _CACHE["exes"] = exes
    return exes


def _workspace(device: torch.device, batch: int):
    key = ("ws", str(device), batch)
    ws = _CACHE.get(key)
    if ws is None:
        ws = (torch.empty((batch, SPLITS, HEADS, D), dtype=torch.float32, device=device),
              torch.empty((batch, SPLITS, HEADS), dtype=torch.float32, device=device))
        _CACHE[key] = ws
    return ws


def _i32(t: torch.Tensor) -> torch.Tensor:
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def solve(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
          kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    partial, merge = _compiled()
    batch = q.shape[0]
    out = torch.empty((batch, HEADS, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, HEADS), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    po, pl = _workspace(q.device, batch)
    indptr = _i32(kv_indptr)
    indices = _i32(kv_indices)
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q.device)
    partial(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), indptr, indices, po, pl,
            float(sm_scale) * LOG2E)
    merge(indptr, po, pl, out, lse)
    return out, lse
