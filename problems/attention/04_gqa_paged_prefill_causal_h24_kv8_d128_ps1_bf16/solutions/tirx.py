# Causal GQA prefill over a paged KV cache (Llama 3.2 3B: 24 query heads on 8 KV heads, head dim 128,
# page size 1, bf16) as one TIRx FlashAttention-2 kernel on tensor cores (mma.sync m16n8k16, fp32 accum).
#
# Differs from the CuTe DSL solution (one CTA per (request, 64-query tile, query head), one warpgroup on
# wgmma, 800 us on the H200, ~10x the tensor floor): here the 3 query heads of a KV head are packed into the
# row dimension (rows r = token * 3 + head-in-group; a CTA owns 64 consecutive rows = 21.3 tokens x 3 heads
# of one request and one KV head, each row keeps its own causal limit), so each gathered K/V tile serves 3x
# the rows; and the tensor-core path is the warp-level m16n8k16 one of this repository's TIRx kernels for
# problems 05 / 07 (head-packed, 210-250 TFLOP/s useful on the H200), whose kernel this one generalises to
# 8 KV heads. Everything else is the same FlashAttention-2 decomposition.
#
# Kernel (one per call): 1-D grid of 8 x (ceil(Tq * 3 / 64) + B) CTAs; cta % 8 is the KV head, cta // 8 the
# row-tile index, mapped to (request, tile) by scanning qo_indptr on the device (spare CTAs exit; no host
# synchronisation); requests and tiles are enumerated from the last so the tiles with the most visible keys
# start first. 4 warps x 16 rows. Per KV tile of 64 tokens (token j of a request is page
# kv_indices[kv_indptr[b] + j]): cp.async gathers K and V rows of the KV head (256 B each; rows past kv_len
# zero-filled) into XOR-swizzled shared memory (conflict-free ldmatrix), double-buffered; only keys up to the
# last one visible from the tile's last row are loaded. S = Q K^T in two half-depth fp32 chains; base-2 online
# softmax (sm_scale * log2 e folded in) with the bottom-right causal mask per row; P re-packed in registers as
# bf16 A fragments for O += P V (V via ldmatrix.trans). Epilogue O / l to bf16, lse = m + log2(l).
# 80 KiB shared memory: 2 CTAs (8 warps) per SM.
#
# What limits it / expected time: tensor-core work, 77 GFLOP visible (1.11x executed with tile padding) at
# mma.sync rates; by the rates of the sibling kernels expect ~0.3-0.4 ms vs the 77.5 us SOL. The K/V gather
# (16-byte scattered row copies, page size 1) is 3x smaller per FLOP than in the per-head layout.
# Next steps: wgmma with 128-row tiles and a producer warp; split-KV for the longest requests.
#
# Streams: the compiled function is called with torch tensors; tvm-ffi installs torch's current stream as
# TVM's environment stream for the call. Only the compiled module is cached.
#
# Verification: compile-checked on CPU (sm_90a) and checked in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HEADS = 24                      # query heads
KVH = 8                         # KV heads
GROUP = HEADS // KVH            # query heads per KV head (packed into the row dimension)
D = 128
PAGE = 1
ROWS = 64                       # rows (token x head) per CTA
KT = 64                         # keys per tile
THREADS = 128
DCH = D // 8                    # 16-byte pieces per row
LOG2E = 1.0 / math.log(2.0)
M_INIT = -1.0e30


@T.prim_func
def gqa_prefill(q_h: T.handle, k_h: T.handle, v_h: T.handle, qo_h: T.handle, kvp_h: T.handle, kvi_h: T.handle,
                o_h: T.handle, lse_h: T.handle, scale_log2: T.float32):
    total_q = T.int32()
    pages = T.int32()
    nb1 = T.int32()
    nidx = T.int32()
    Q = T.match_buffer(q_h, (total_q, HEADS, D), "bfloat16", align=16)
    K = T.match_buffer(k_h, (pages, PAGE, KVH, D), "bfloat16", align=16)
    V = T.match_buffer(v_h, (pages, PAGE, KVH, D), "bfloat16", align=16)
    QO = T.match_buffer(qo_h, (nb1,), "int32")
    KVP = T.match_buffer(kvp_h, (nb1,), "int32")
    KVI = T.match_buffer(kvi_h, (nidx,), "int32")
    O = T.match_buffer(o_h, (total_q, HEADS, D), "bfloat16", align=16)
    LSE = T.match_buffer(lse_h, (total_q, HEADS), "float32")

    T.device_entry()
    cta = T.cta_id([KVH * (T.ceildiv(total_q * GROUP, ROWS) + nb1)])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([4])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((ROWS * D + 4 * KT * D,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((ROWS, D), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((2, KT, D), "bfloat16", data=pool.data, elem_offset=ROWS * D)
    Vs = T.decl_buffer((2, KT, D), "bfloat16", data=pool.data, elem_offset=ROWS * D + 2 * KT * D)
    loc = T.alloc_shared((2,), "int32")

    oa = T.alloc_local((D // 2,), "float32")        # O fragments [D/8 n-tiles][4]
    sa = T.alloc_local((KT // 2,), "float32")       # S fragments, first half of the head dim
    sb = T.alloc_local((KT // 2,), "float32")       # second half
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    mx = T.alloc_local((2,), "float32")
    ls = T.alloc_local((2,), "float32")
    tmx = T.alloc_local((2,), "float32")
    al = T.alloc_local((2,), "float32")
    pk = T.alloc_local((2,), "bfloat16")
    acc = T.alloc_local((1,), "int32")

    g: T.let[T.int32] = lane // 4
    kvh: T.let[T.int32] = cta % KVH               # KV head of this CTA
    tix: T.let[T.int32] = cta // KVH              # row-tile index (same for the 8 KV heads)
    tq: T.let[T.int32] = lane % 4

    # ---- which request / row tile this CTA owns: requests from the last, row tiles from the last
    # (the tiles with the most visible keys are dispatched first)
    if tid == 0:
        acc[0] = 0
        loc[0] = -1
        for bi in range(nb1 - 1):
            if loc[0] < 0:
                if tix < acc[0] + T.ceildiv((QO[nb1 - 1 - bi] - QO[nb1 - 2 - bi]) * GROUP, ROWS):
                    loc[0] = nb1 - 2 - bi
                    loc[1] = T.ceildiv((QO[nb1 - 1 - bi] - QO[nb1 - 2 - bi]) * GROUP, ROWS) - 1 - (tix - acc[0])
                acc[0] = acc[0] + T.ceildiv((QO[nb1 - 1 - bi] - QO[nb1 - 2 - bi]) * GROUP, ROWS)
    T.cuda.cta_sync()
    breq: T.let[T.int32] = loc[0]
    if breq >= 0:
        q0: T.let[T.int32] = QO[breq]
        lq: T.let[T.int32] = QO[breq + 1] - q0
        kvp0: T.let[T.int32] = KVP[breq]
        npg: T.let[T.int32] = KVP[breq + 1] - kvp0
        lkv: T.let[T.int32] = npg
        r0: T.let[T.int32] = loc[1] * ROWS
        nrows: T.let[T.int32] = lq * GROUP
        kend: T.let[T.int32] = (T.min(r0 + ROWS, nrows) - 1) // GROUP + lkv - lq + 1

        # ---- Q tile (rows past the request read its last row; never stored)
        for r in T.unroll(ROWS * DCH // THREADS):
            qr: T.let[T.int32] = (tid + r * THREADS) // DCH
            qc: T.let[T.int32] = (tid + r * THREADS) % DCH
            qrow: T.let[T.int32] = T.min(r0 + qr, nrows - 1)
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Qs[qr, T.bitwise_xor(qc, qr % 8) * 8]),
                T.address_of(Q[q0 + qrow // GROUP, kvh * GROUP + qrow % GROUP, qc * 8]), 16)
        for r in T.unroll(KT * DCH // THREADS):
            kr: T.let[T.int32] = (tid + r * THREADS) // DCH
            kc: T.let[T.int32] = (tid + r * THREADS) % DCH
            kj: T.let[T.int32] = T.min(kr, lkv - 1)
            pg: T.let[T.int32] = KVI[kvp0 + kj]
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Ks[0, kr, T.bitwise_xor(kc, kr % 8) * 8]), T.address_of(K[pg, 0, kvh, kc * 8]), 16,
                T.if_then_else(kr < lkv, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Vs[0, kr, T.bitwise_xor(kc, kr % 8) * 8]), T.address_of(V[pg, 0, kvh, kc * 8]), 16,
                T.if_then_else(kr < lkv, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()

        for e in T.unroll(D // 2):
            oa[e] = T.float32(0.0)
        for hh in T.unroll(2):
            mx[hh] = T.float32(M_INIT)
            ls[hh] = T.float32(0.0)
        arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
        qp0: T.let[T.int32] = (r0 + warp * 16 + g) // GROUP + lkv - lq        # row g's last visible key
        qp1: T.let[T.int32] = (r0 + warp * 16 + g + 8) // GROUP + lkv - lq    # row g + 8

        for kt in range(T.ceildiv(kend, KT)):
            buf: T.let[T.int32] = kt % 2
            T.ptx.cp.async_.wait_all()
            T.cuda.cta_sync()
            if (kt + 1) * KT < kend:
                for r in T.unroll(KT * DCH // THREADS):
                    kr2: T.let[T.int32] = (tid + r * THREADS) // DCH
                    kc2: T.let[T.int32] = (tid + r * THREADS) % DCH
                    kn: T.let[T.int32] = (kt + 1) * KT + kr2
                    kj2: T.let[T.int32] = T.min(kn, lkv - 1)
                    pg2: T.let[T.int32] = KVI[kvp0 + kj2]
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Ks[1 - buf, kr2, T.bitwise_xor(kc2, kr2 % 8) * 8]),
                        T.address_of(K[pg2, 0, kvh, kc2 * 8]), 16,
                        T.if_then_else(kn < lkv, T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Vs[1 - buf, kr2, T.bitwise_xor(kc2, kr2 % 8) * 8]),
                        T.address_of(V[pg2, 0, kvh, kc2 * 8]), 16,
                        T.if_then_else(kn < lkv, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.commit_group()

            # ---- S = Q K^T in two half-depth chains
            for e in T.unroll(KT // 2):
                sa[e] = T.float32(0.0)
                sb[e] = T.float32(0.0)
            for ks in T.unroll(D // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[0], af[1], af[2], af[3],
                    T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
                for jj in T.unroll(KT // 16):
                    brow: T.let[T.int32] = jj * 16 + lane % 8 + (lane // 16) * 8
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        bf[0], bf[1], bf[2], bf[3],
                        T.address_of(Ks[buf, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                    for j2 in T.unroll(2):
                        if ks < D // 32:
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3],
                                af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                                sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3])
                        else:
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                sb[(jj * 2 + j2) * 4], sb[(jj * 2 + j2) * 4 + 1], sb[(jj * 2 + j2) * 4 + 2], sb[(jj * 2 + j2) * 4 + 3],
                                af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                                sb[(jj * 2 + j2) * 4], sb[(jj * 2 + j2) * 4 + 1], sb[(jj * 2 + j2) * 4 + 2], sb[(jj * 2 + j2) * 4 + 3])

            # ---- online softmax (base 2) with the causal mask
            for hh in T.unroll(2):
                tmx[hh] = mx[hh]
                for nt in T.unroll(KT // 8):
                    for e in T.unroll(2):
                        sa[nt * 4 + hh * 2 + e] = T.if_then_else(
                            kt * KT + nt * 8 + tq * 2 + e <= T.if_then_else(hh == 0, qp0, qp1),
                            (sa[nt * 4 + hh * 2 + e] + sb[nt * 4 + hh * 2 + e]) * scale_log2, T.float32("-inf"))
                        tmx[hh] = T.max(tmx[hh], sa[nt * 4 + hh * 2 + e])
                tmx[hh] = T.max(tmx[hh], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[hh], 1, 32, 32))
                tmx[hh] = T.max(tmx[hh], T.tvm_warp_shuffle_xor(0xFFFFFFFF, tmx[hh], 2, 32, 32))
                al[hh] = T.exp2(mx[hh] - tmx[hh])
                mx[hh] = tmx[hh]
                ls[hh] = ls[hh] * al[hh]
                for nt in T.unroll(KT // 8):
                    for e in T.unroll(2):
                        sa[nt * 4 + hh * 2 + e] = T.exp2(sa[nt * 4 + hh * 2 + e] - tmx[hh])
                        ls[hh] = ls[hh] + sa[nt * 4 + hh * 2 + e]
            for nt in T.unroll(D // 8):
                for e in T.unroll(4):
                    oa[nt * 4 + e] = oa[nt * 4 + e] * al[e // 2]

            # ---- O += P V
            for kk in T.unroll(KT // 16):
                for q in T.unroll(4):
                    af[q] = T.bitwise_or(
                        T.cast(T.reinterpret("uint16", T.cast(sa[(kk * 2 + q // 2) * 4 + (q % 2) * 2], "bfloat16")), "uint32"),
                        T.shift_left(T.cast(T.reinterpret("uint16", T.cast(sa[(kk * 2 + q // 2) * 4 + (q % 2) * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
                vrow: T.let[T.int32] = kk * 16 + lane % 8 + ((lane // 8) % 2) * 8
                for pp in T.unroll(D // 16):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        bf[0], bf[1], bf[2], bf[3],
                        T.address_of(Vs[buf, vrow, T.bitwise_xor(pp * 2 + lane // 16, vrow % 8) * 8]))
                    for j2 in T.unroll(2):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3],
                            af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                            oa[(pp * 2 + j2) * 4], oa[(pp * 2 + j2) * 4 + 1], oa[(pp * 2 + j2) * 4 + 2], oa[(pp * 2 + j2) * 4 + 3])

        # ---- epilogue
        for hh in T.unroll(2):
            ls[hh] = ls[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[hh], 1, 32, 32)
            ls[hh] = ls[hh] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, ls[hh], 2, 32, 32)
            al[hh] = T.float32(1.0) / ls[hh]
        for hh in T.unroll(2):
            orow: T.let[T.int32] = r0 + warp * 16 + hh * 8 + g
            if orow < nrows:
                for nt in T.unroll(D // 8):
                    for e in T.unroll(2):
                        pk[e] = T.cast(oa[nt * 4 + hh * 2 + e] * al[hh], "bfloat16")
                    for e in T.vectorized(2):
                        O[q0 + orow // GROUP, kvh * GROUP + orow % GROUP, nt * 8 + tq * 2 + e] = pk[e]
                if tq == 0:
                    LSE[q0 + orow // GROUP, kvh * GROUP + orow % GROUP] = mx[hh] + T.log2(ls[hh])


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
        exe = tvm.compile(tvm.IRModule({"main": gqa_prefill}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def _i32(t: torch.Tensor) -> torch.Tensor:
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def solve(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
          kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    exe = _compiled()
    total_q = q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((total_q, HEADS), dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    kvi = _i32(kv_indices)
    if kvi.numel() == 0:
        kvi = torch.zeros(1, dtype=torch.int32, device=q.device)
    exe(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), _i32(qo_indptr), _i32(kv_indptr), kvi, out, lse,
        float(sm_scale) * LOG2E)
    return out, lse
