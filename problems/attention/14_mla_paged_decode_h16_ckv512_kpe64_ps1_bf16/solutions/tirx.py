# MLA paged decode (DeepSeek-V3 absorbed form at TP=8: 16 heads, latent 512 + rotary 64, page size 1,
# bf16) in TIRx: split-KV flash decoding on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation),
# then a merge. Same decomposition as the verified CuTe DSL solution of this problem.
#
# The 16 heads of a request are the 16 rows of one MMA tile; keys are [ckv | kpe] (576 dims) and the
# values are the ckv part of the same shared-memory tile (each token's 1152 bytes are gathered once).
#
# Kernel 1 (mla_decode_partial): grid (32 splits, B requests), 128 threads = 4 warps.
# - Request b's tokens are cut into chunks of max(256, ceil(len/32)) tokens; CTA (s, b) takes chunk s
#   and does nothing when the chunk starts past the end.
# - Q = [q_nope | q_pe] (16 x 576 bf16) is staged in shared memory once (cp.async, with block 0); its A
#   fragments are re-read with ldmatrix per k-step.
# - Blocks of 64 tokens: the [ckv | kpe] rows are gathered through the page ids with 16-byte cp.async
#   (thread t copies half of token t/2's 72 pieces) into a 2-stage ring of [64 x 576] tiles whose 16-byte
#   pieces are XOR-swizzled by row (conflict-free ldmatrix); block i+1 is in flight while block i is
#   computed. Tokens past the chunk end read a clamped (valid) page and get logit -inf.
# - Warp w computes the logits of tokens 16w..16w+15 (36 k-steps x 2 n-tiles, 4 interleaved fp32
#   accumulators: short accumulation chains, the base-2 lse is compared at fp32 precision), scales them
#   to base 2 and masks them, and stores its fragments to shared memory. After a barrier every warp
#   reads all 4 fragments (same lane layout, so a 16 x 64 tile in accumulator layout) and runs the
#   same online softmax, so all warps hold identical P and statistics; P (bf16) is the A operand of
#   O_w += P V[:, 128w:128w+128] (V = ckv part through ldmatrix.trans): 64 fp32 registers per thread.
# - Each warp writes its normalized O slice and (warp 0) the partial base-2 lse to a workspace.
# Kernel 2 (mla_decode_merge): grid (16 heads, B), 128 threads x 4 elements; lse = M + log2 sum
# 2^(lse_s - M); bf16 output; zero-length requests: 0 and -inf.
# What limits it: the CuTe version of this design measured 0.0876 ms on the H200 against a 0.0186 ms
# DRAM floor, i.e. latency/issue-bound with one CTA (4 warps, 166 KiB shared memory) per SM, not
# bandwidth-bound; this port is expected to behave the same.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi installs torch's current
# stream as TVM's environment stream for each call, so both kernels run in order on that stream.
# Verification: compile-checked on CPU (sm_90a) and numerically checked with the CPU emulator of the
# generated CUDA; H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HEADS = 16
CKV = 512
KPE = 64
KD = CKV + KPE                 # 576
THREADS = 128
NWARPS = THREADS // 32
BLK = 64                       # tokens per block
NCH = KD // 8                  # 72 16-byte pieces per token
NCH_C = CKV // 8               # 64 of them from the latent row
HALF = NCH // 2                # 36 pieces per thread
KSTEPS = KD // 16              # 36
CHUNK = 256
SPLITS = 32
OUT_VEC = 4
LOG2E = 1.0 / math.log(2.0)
M_INIT = -1.0e30


@T.prim_func
def mla_decode_partial(qn_h: T.handle, qp_h: T.handle, ckv_h: T.handle, kpe_h: T.handle, ip_h: T.handle,
                       idx_h: T.handle, po_h: T.handle, pl_h: T.handle, scale_log2: T.float32):
    batch = T.int32()
    pages = T.int32()
    nidx = T.int32()
    QN = T.match_buffer(qn_h, (batch, HEADS, CKV), "bfloat16", align=16)
    QP = T.match_buffer(qp_h, (batch, HEADS, KPE), "bfloat16", align=16)
    CK = T.match_buffer(ckv_h, (pages, 1, CKV), "bfloat16", align=16)
    KP = T.match_buffer(kpe_h, (pages, 1, KPE), "bfloat16", align=16)
    IP = T.match_buffer(ip_h, (batch + 1,), "int32")
    IDX = T.match_buffer(idx_h, (nidx,), "int32")
    PO = T.match_buffer(po_h, (batch, SPLITS, HEADS, CKV), "float32", align=16)
    PL = T.match_buffer(pl_h, (batch, SPLITS, HEADS), "float32")

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
    split, b = T.cta_id([SPLITS, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([NWARPS])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((HEADS * KD + 2 * BLK * KD,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((HEADS, KD), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((2, BLK, KD), "bfloat16", data=pool.data, elem_offset=HEADS * KD)
    SX = T.alloc_shared((NWARPS, 32, 8), "float32")

    oa = T.alloc_local((64,), "float32")            # O fragments [16 n-tiles][4]
    sc = T.alloc_local((32,), "float32")            # logits [4 accumulators][2 n-tiles][4]
    pf = T.alloc_local((32,), "float32")            # block logits / P [8 n-tiles][4]
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    mx = T.alloc_local((2,), "float32")             # running max (rows g, g + 8)
    ls = T.alloc_local((2,), "float32")             # running partial sums (this lane's columns)
    tmx = T.alloc_local((2,), "float32")
    al = T.alloc_local((2,), "float32")
    ov = T.alloc_local((2,), "float32")

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
        lr: T.let[T.int32] = tid // 2                  # token row this thread gathers
        lh: T.let[T.int32] = tid % 2                   # which half of its 72 pieces

        # ---- Q (16 rows x 72 pieces, 9 per thread) and block 0 into stage 0: one group
        for r in T.unroll(HEADS * NCH // THREADS):
            qi: T.let[T.int32] = (tid + r * THREADS) // NCH
            qc: T.let[T.int32] = (tid + r * THREADS) % NCH
            if qc < NCH_C:
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Qs[qi, T.bitwise_xor(qc, qi % 8) * 8]), T.address_of(QN[b, qi, qc * 8]), 16)
            else:
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Qs[qi, T.bitwise_xor(qc, qi % 8) * 8]),
                    T.address_of(QP[b, qi, (qc - NCH_C) * 8]), 16)
        page0: T.let[T.int32] = IDX[base + T.min(lr, cn - 1)]
        for e in T.unroll(HALF):
            if lh * HALF + e < NCH_C:
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Ks[0, lr, T.bitwise_xor(lh * HALF + e, lr % 8) * 8]),
                    T.address_of(CK[page0, 0, (lh * HALF + e) * 8]), 16)
            else:
                T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Ks[0, lr, T.bitwise_xor(lh * HALF + e, lr % 8) * 8]),
                    T.address_of(KP[page0, 0, (lh * HALF + e - NCH_C) * 8]), 16)
        T.ptx.cp.async_.commit_group()

        for e in T.unroll(64):
            oa[e] = T.float32(0.0)
        for hh in T.unroll(2):
            mx[hh] = T.float32(M_INIT)
            ls[hh] = T.float32(0.0)
        arow: T.let[T.int32] = lane % 8 + ((lane // 8) % 2) * 8
        brow: T.let[T.int32] = warp * 16 + lane % 8 + (lane // 16) * 8

        for blk in range(nblk):
            # ---- gather block blk + 1 into the other stage (freed by the last barrier)
            if blk + 1 < nblk:
                nst: T.let[T.int32] = (blk + 1) % 2
                page: T.let[T.int32] = IDX[base + T.min((blk + 1) * BLK + lr, cn - 1)]
                for e in T.unroll(HALF):
                    if lh * HALF + e < NCH_C:
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(Ks[nst, lr, T.bitwise_xor(lh * HALF + e, lr % 8) * 8]),
                            T.address_of(CK[page, 0, (lh * HALF + e) * 8]), 16)
                    else:
                        T.ptx.cp.async_.cg.shared.global_(
                            T.address_of(Ks[nst, lr, T.bitwise_xor(lh * HALF + e, lr % 8) * 8]),
                            T.address_of(KP[page, 0, (lh * HALF + e - NCH_C) * 8]), 16)
            T.ptx.cp.async_.commit_group()
            T.ptx.cp.async_.wait_group(1)
            T.cuda.cta_sync()
            st: T.let[T.int32] = blk % 2

            # ---- logits of this warp's 16 tokens over all 576 dims (4 interleaved accumulators)
            for e in T.unroll(32):
                sc[e] = T.float32(0.0)
            for ks in T.unroll(KSTEPS):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[0], af[1], af[2], af[3],
                    T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    bf[0], bf[1], bf[2], bf[3],
                    T.address_of(Ks[st, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                for j2 in T.unroll(2):
                    T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                        sc[(ks % 4) * 8 + j2 * 4], sc[(ks % 4) * 8 + j2 * 4 + 1],
                        sc[(ks % 4) * 8 + j2 * 4 + 2], sc[(ks % 4) * 8 + j2 * 4 + 3],
                        af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                        sc[(ks % 4) * 8 + j2 * 4], sc[(ks % 4) * 8 + j2 * 4 + 1],
                        sc[(ks % 4) * 8 + j2 * 4 + 2], sc[(ks % 4) * 8 + j2 * 4 + 3])
            for i in T.unroll(8):
                sc[i] = (sc[i] + sc[8 + i]) + (sc[16 + i] + sc[24 + i])
            for j2 in T.unroll(2):
                for e in T.unroll(4):
                    sc[j2 * 4 + e] = T.if_then_else(
                        blk * BLK + warp * 16 + j2 * 8 + tq * 2 + e % 2 < cn,
                        sc[j2 * 4 + e] * scale_log2, T.float32("-inf"))
            for h4 in T.unroll(2):
                for i in T.vectorized(4):
                    SX[warp, lane, h4 * 4 + i] = sc[h4 * 4 + i]
            T.cuda.cta_sync()

            # ---- every warp: the whole 16 x 64 tile (n-tile 2 w2 + j2 = warp w2's fragment j2)
            for w2 in T.unroll(NWARPS):
                for h4 in T.unroll(2):
                    for i in T.vectorized(4):
                        pf[w2 * 8 + h4 * 4 + i] = SX[w2, lane, h4 * 4 + i]
            for hh in T.unroll(2):
                tmx[hh] = mx[hh]
                for nt in T.unroll(8):
                    for e in T.unroll(2):
                        tmx[hh] = T.max(tmx[hh], pf[nt * 4 + hh * 2 + e])
                tmx[hh] = T.max(tmx[hh], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[hh], 1, 32, 32))
                tmx[hh] = T.max(tmx[hh], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[hh], 2, 32, 32))
                al[hh] = T.exp2(mx[hh] - tmx[hh])
                mx[hh] = tmx[hh]
                ls[hh] = ls[hh] * al[hh]
                for nt in T.unroll(8):
                    for e in T.unroll(2):
                        pf[nt * 4 + hh * 2 + e] = T.exp2(pf[nt * 4 + hh * 2 + e] - tmx[hh])
                        ls[hh] = ls[hh] + pf[nt * 4 + hh * 2 + e]
            for nt in T.unroll(16):
                for e in T.unroll(4):
                    oa[nt * 4 + e] = oa[nt * 4 + e] * al[e // 2]

            # ---- O_w += P V[:, 128 w .. +128]
            for kk in T.unroll(BLK // 16):
                for q in T.unroll(4):
                    af[q] = T.bitwise_or(
                        T.cast(T.reinterpret("uint16", T.cast(pf[(kk * 2 + q // 2) * 4 + (q % 2) * 2], "bfloat16")), "uint32"),
                        T.shift_left(T.cast(T.reinterpret("uint16", T.cast(pf[(kk * 2 + q // 2) * 4 + (q % 2) * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
                vrow: T.let[T.int32] = kk * 16 + lane % 8 + ((lane // 8) % 2) * 8
                for pp in T.unroll(8):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        bf[0], bf[1], bf[2], bf[3],
                        T.address_of(Ks[st, vrow, T.bitwise_xor(warp * 16 + pp * 2 + lane // 16, vrow % 8) * 8]))
                    for j2 in T.unroll(2):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3],
                            af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                            oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3])
            T.cuda.cta_sync()                          # stage st and SX are free again

        # ---- normalized partial output slice and partial lse
        for hh in T.unroll(2):
            ls[hh] = ls[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[hh], 1, 32, 32)
            ls[hh] = ls[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[hh], 2, 32, 32)
            al[hh] = T.float32(1.0) / ls[hh]
        for nt in T.unroll(16):
            for hh in T.unroll(2):
                for e in T.unroll(2):
                    ov[e] = oa[nt * 4 + hh * 2 + e] * al[hh]
                for e in T.vectorized(2):
                    PO[b, split, hh * 8 + g, warp * 128 + nt * 8 + tq * 2 + e] = ov[e]
        if warp == 0:
            if tq == 0:
                for hh in T.unroll(2):
                    PL[b, split, hh * 8 + g] = mx[hh] + T.log2(ls[hh])


@T.prim_func
def mla_decode_merge(ip_h: T.handle, po_h: T.handle, pl_h: T.handle, out_h: T.handle, lse_h: T.handle):
    batch = T.int32()
    IP = T.match_buffer(ip_h, (batch + 1,), "int32")
    PO = T.match_buffer(po_h, (batch, SPLITS, HEADS, CKV), "float32", align=16)
    PL = T.match_buffer(pl_h, (batch, SPLITS, HEADS), "float32")
    OUT = T.match_buffer(out_h, (batch, HEADS, CKV), "bfloat16", align=16)
    LSE = T.match_buffer(lse_h, (batch, HEADS), "float32")

    T.device_entry()
    hq, b = T.cta_id([HEADS, batch])
    tid = T.thread_id([THREADS])

    o = T.alloc_local((OUT_VEC,), "float32")
    ob = T.alloc_local((OUT_VEC,), "bfloat16")
    pv = T.alloc_local((OUT_VEC,), "float32")
    mm = T.alloc_local((1,), "float32")
    w = T.alloc_local((1,), "float32")
    wsum = T.alloc_local((1,), "float32")

    dd: T.let[T.int32] = tid * OUT_VEC
    n_tot: T.let[T.int32] = IP[b + 1] - IP[b]
    chunk: T.let[T.int32] = T.max(CHUNK, T.ceildiv(n_tot, SPLITS))
    ns: T.let[T.int32] = T.ceildiv(n_tot, chunk)      # splits kernel 1 wrote (0 if empty)

    if ns > 0:
        mm[0] = PL[b, 0, hq]
        for sp in range(ns - 1):
            mm[0] = T.max(mm[0], PL[b, sp + 1, hq])
        wsum[0] = T.float32(0.0)
        for i in T.unroll(OUT_VEC):
            o[i] = T.float32(0.0)
        for sp in range(ns):
            w[0] = T.exp2(PL[b, sp, hq] - mm[0])
            wsum[0] = wsum[0] + w[0]
            for i in T.vectorized(OUT_VEC):
                pv[i] = PO[b, sp, hq, dd + i]
            for i in T.unroll(OUT_VEC):
                o[i] = o[i] + w[0] * pv[i]
        w[0] = T.float32(1.0) / wsum[0]
        for i in T.unroll(OUT_VEC):
            ob[i] = T.cast(o[i] * w[0], "bfloat16")
        for i in T.vectorized(OUT_VEC):
            OUT[b, hq, dd + i] = ob[i]
        if tid == 0:
            LSE[b, hq] = mm[0] + T.log2(wsum[0])
    else:
        for i in T.unroll(OUT_VEC):
            ob[i] = T.bfloat16(0.0)
        for i in T.vectorized(OUT_VEC):
            OUT[b, hq, dd + i] = ob[i]
        if tid == 0:
            LSE[b, hq] = T.float32("-inf")


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
                     for f in (mla_decode_partial, mla_decode_merge))
        _CACHE["exes"] = exes
    return exes


def _workspace(device: torch.device, batch: int):
    key = ("ws", str(device), batch)
    ws = _CACHE.get(key)
    if ws is None:
        ws = (torch.empty((batch, SPLITS, HEADS, CKV), dtype=torch.float32, device=device),
              torch.empty((batch, SPLITS, HEADS), dtype=torch.float32, device=device))
        _CACHE[key] = ws
    return ws


def solve(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
          kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    partial, merge = _compiled()
    batch = q_nope.shape[0]
    out = torch.empty((batch, HEADS, CKV), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((batch, HEADS), dtype=torch.float32, device=q_nope.device)
    if batch == 0:
        return out, lse
    po, pl = _workspace(q_nope.device, batch)
    indptr = kv_indptr if kv_indptr.dtype == torch.int32 else kv_indptr.to(torch.int32)
    indices = kv_indices if kv_indices.dtype == torch.int32 else kv_indices.to(torch.int32)
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q_nope.device)
    partial(q_nope.contiguous(), q_pe.contiguous(), ckv_cache.contiguous(), kpe_cache.contiguous(),
            indptr.contiguous(), indices.contiguous(), po, pl, float(sm_scale) * LOG2E)
    merge(indptr.contiguous(), po, pl, out, lse)
    return out, lse
