# Varlen bidirectional attention with 2D RoPE (Qwen2.5-VL vision encoder: 16 heads x 80, images packed
# by cu_seqlens) in TIRx: a RoPE pre-pass for the keys and a FlashAttention-2 kernel on bf16 tensor
# cores (mma.sync m16n8k16, fp32 accumulation).
#
# Kernel 1 (rope_k): rotated keys k * cos + rotate_half(k) * sin in fp32, stored as bf16
#   [T, 16, 80] (one pass over the K third of qkv and cos / sin; every key tile is then reused by all the
#   query tiles of its image without re-reading cos / sin).
# Kernel 2 (vit_attn): grid (13 query tiles of 64 tokens, 16 heads, images), 128 threads = 4 warps x 16
#   rows; CTAs past their image's length exit (images over 832 tokens: CTA qt also takes tiles qt + 13, ...). The CTA rotates its 64 query rows itself (fp32, then
#   bf16 into shared memory), then walks all key tiles of the image (bidirectional, 64 keys each):
#   cp.async brings rotated K and raw V rows (160 B each, rows past the image zero-filled) into padded
#   shared arrays (pitch 88 bf16: conflict-free ldmatrix), double-buffered; S = Q K^T (5 k-steps x 8 key
#   tiles per warp), online softmax in base 2 (scale * log2 e folded in, keys past the image masked),
#   P re-packed as bf16 A fragments for O += P V (V via ldmatrix.trans, 10 head-dim tiles). The output
#   O / l goes to [T, 1280] as bf16 pairs.
# Numerics: the reference keeps rotated q / k in fp32; here they are rounded to bf16 for the tensor
# cores (logit errors ~1e-3, far inside the bf16 output tolerance; the products accumulate in fp32).
#
# What limits it / expected time: tensor-core work (91 GFLOP at mma.sync rates, ~40-50% of the H200's
# dense bf16 peak) -> ~0.2-0.3 ms vs the ~0.09 ms compute SOL; the pre-pass moves ~60 MB more.
# Far faster than eager PyTorch (a Python loop over 32 images with [16, L, L] fp32 logits each).
# Next step: wgmma with 128-row tiles.
#
# Streams: both compiled functions are called with torch tensors; tvm-ffi installs torch's current
# stream as TVM's environment stream for each call, so they run in order on it. The rotated-key
# workspace is cached per (device, T) and rewritten by kernel 1 on every call.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HEADS = 16
HD = 80
HALF = HD // 2
HIDDEN = HEADS * HD
PITCH = 88                      # padded shared-memory row (bf16)
ROWS = 64
KT = 64
MAXT = 13                       # query tiles per image (<= 832 tokens)
THREADS = 128
LOG2E = 1.0 / math.log(2.0)
M_INIT = -1.0e30


@T.prim_func
def rope_k(qkv_h: T.handle, cos_h: T.handle, sin_h: T.handle, kr_h: T.handle):
    total = T.int32()
    QKV = T.match_buffer(qkv_h, (total, 3 * HIDDEN), "bfloat16", align=16)
    COS = T.match_buffer(cos_h, (total, HD), "float32")
    SIN = T.match_buffer(sin_h, (total, HD), "float32")
    KR = T.match_buffer(kr_h, (total, HEADS, HD), "bfloat16", align=16)
    T.device_entry()
    blk = T.cta_id([T.ceildiv(total, 4)])
    tid = T.thread_id([256])
    t: T.let[T.int32] = blk * 4 + tid // 64
    if t < total:
        for i in T.unroll(HIDDEN // 64):
            e: T.let[T.int32] = (tid % 64) + 64 * i
            d: T.let[T.int32] = e % HD
            KR[t, e // HD, d] = T.cast(
                T.cast(QKV[t, HIDDEN + e], "float32") * COS[t, d]
                + T.if_then_else(d < HALF, T.float32(0.0) - T.cast(QKV[t, HIDDEN + e + HALF], "float32"),
                                 T.cast(QKV[t, HIDDEN + e - HALF], "float32")) * SIN[t, d], "bfloat16")


@T.prim_func
def vit_attn(qkv_h: T.handle, cos_h: T.handle, sin_h: T.handle, kr_h: T.handle, cu_h: T.handle, o_h: T.handle,
             scale_log2: T.float32):
    total = T.int32()
    nimg1 = T.int32()
    QKV = T.match_buffer(qkv_h, (total, 3 * HIDDEN), "bfloat16", align=16)
    COS = T.match_buffer(cos_h, (total, HD), "float32")
    SIN = T.match_buffer(sin_h, (total, HD), "float32")
    KR = T.match_buffer(kr_h, (total, HEADS, HD), "bfloat16", align=16)
    CU = T.match_buffer(cu_h, (nimg1,), "int32")
    O = T.match_buffer(o_h, (total, HIDDEN), "bfloat16", align=16)

    T.device_entry()
    qt, h, img = T.cta_id([MAXT, HEADS, nimg1 - 1])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([4])
    lane = T.lane_id([32])

    pool = T.alloc_buffer(((ROWS + 4 * KT) * PITCH,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((ROWS, PITCH), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((2, KT, PITCH), "bfloat16", data=pool.data, elem_offset=ROWS * PITCH)
    Vs = T.decl_buffer((2, KT, PITCH), "bfloat16", data=pool.data, elem_offset=(ROWS + 2 * KT) * PITCH)

    oa = T.alloc_local((HD // 2,), "float32")       # O fragments [10 n-tiles][4]
    sa = T.alloc_local((KT // 2,), "float32")       # S fragments [8 key tiles][4]
    af = T.alloc_local((4,), "uint32")
    bf = T.alloc_local((4,), "uint32")
    mx = T.alloc_local((2,), "float32")
    ls = T.alloc_local((2,), "float32")
    tmx = T.alloc_local((2,), "float32")
    al = T.alloc_local((2,), "float32")
    pk = T.alloc_local((2,), "bfloat16")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    t0: T.let[T.int32] = CU[img]
    n: T.let[T.int32] = CU[img + 1] - t0
    for qi in range(T.ceildiv(T.max(n - qt * ROWS, 0), MAXT * ROWS)):
        qtile: T.let[T.int32] = qt + qi * MAXT
        # ---- rotated queries of this tile (fp32 rotation, bf16 into shared memory)
        for i in T.unroll(ROWS * HD // THREADS):
            e: T.let[T.int32] = tid + i * THREADS
            r: T.let[T.int32] = e // HD
            d: T.let[T.int32] = e % HD
            tok: T.let[T.int32] = t0 + T.min(qtile * ROWS + r, n - 1)
            Qs[r, d] = T.cast(
                T.cast(QKV[tok, h * HD + d], "float32") * COS[tok, d]
                + T.if_then_else(d < HALF, T.float32(0.0) - T.cast(QKV[tok, h * HD + d + HALF], "float32"),
                                 T.cast(QKV[tok, h * HD + d - HALF], "float32")) * SIN[tok, d], "bfloat16")
        # ---- key / value tile 0
        for i in T.unroll(KT * (HD // 8) // THREADS):
            kr: T.let[T.int32] = (tid + i * THREADS) // (HD // 8)
            kc: T.let[T.int32] = (tid + i * THREADS) % (HD // 8)
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Ks[0, kr, kc * 8]), T.address_of(KR[t0 + T.min(kr, n - 1), h, kc * 8]), 16,
                T.if_then_else(kr < n, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Vs[0, kr, kc * 8]), T.address_of(QKV[t0 + T.min(kr, n - 1), 2 * HIDDEN + h * HD + kc * 8]), 16,
                T.if_then_else(kr < n, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()

        for e2 in T.unroll(HD // 2):
            oa[e2] = T.float32(0.0)
        for hh in T.unroll(2):
            mx[hh] = T.float32(M_INIT)
            ls[hh] = T.float32(0.0)
        arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8

        for kt in range(T.ceildiv(n, KT)):
            buf: T.let[T.int32] = kt % 2
            T.ptx.cp.async_.wait_all()
            T.cuda.cta_sync()
            if (kt + 1) * KT < n:
                for i in T.unroll(KT * (HD // 8) // THREADS):
                    kr2: T.let[T.int32] = (tid + i * THREADS) // (HD // 8)
                    kc2: T.let[T.int32] = (tid + i * THREADS) % (HD // 8)
                    kn: T.let[T.int32] = (kt + 1) * KT + kr2
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Ks[1 - buf, kr2, kc2 * 8]), T.address_of(KR[t0 + T.min(kn, n - 1), h, kc2 * 8]), 16,
                        T.if_then_else(kn < n, T.uint32(16), T.uint32(0)))
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Vs[1 - buf, kr2, kc2 * 8]),
                        T.address_of(QKV[t0 + T.min(kn, n - 1), 2 * HIDDEN + h * HD + kc2 * 8]), 16,
                        T.if_then_else(kn < n, T.uint32(16), T.uint32(0)))
                T.ptx.cp.async_.commit_group()

            # ---- S = Q K^T
            for e2 in T.unroll(KT // 2):
                sa[e2] = T.float32(0.0)
            for ks in T.unroll(HD // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    af[0], af[1], af[2], af[3], T.address_of(Qs[arow, ks * 16 + (lane // 16) * 8]))
                for jj in T.unroll(KT // 16):
                    brow: T.let[T.int32] = jj * 16 + lane % 8 + (lane // 16) * 8
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        bf[0], bf[1], bf[2], bf[3], T.address_of(Ks[buf, brow, ks * 16 + ((lane // 8) % 2) * 8]))
                    for j2 in T.unroll(2):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3],
                            af[0], af[1], af[2], af[3], bf[j2 * 2], bf[j2 * 2 + 1],
                            sa[(jj * 2 + j2) * 4], sa[(jj * 2 + j2) * 4 + 1], sa[(jj * 2 + j2) * 4 + 2], sa[(jj * 2 + j2) * 4 + 3])

            # ---- online softmax (base 2); keys past the image masked
            for hh in T.unroll(2):
                tmx[hh] = mx[hh]
                for nt in T.unroll(KT // 8):
                    for e in T.unroll(2):
                        sa[nt * 4 + hh * 2 + e] = T.if_then_else(
                            kt * KT + nt * 8 + tq * 2 + e < n, sa[nt * 4 + hh * 2 + e] * scale_log2, T.float32("-inf"))
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
            for nt in T.unroll(HD // 8):
                for e in T.unroll(4):
                    oa[nt * 4 + e] = oa[nt * 4 + e] * al[e // 2]

            # ---- O += P V
            for kk in T.unroll(KT // 16):
                for q in T.unroll(4):
                    af[q] = T.bitwise_or(
                        T.cast(T.reinterpret("uint16", T.cast(sa[(kk * 2 + q // 2) * 4 + (q % 2) * 2], "bfloat16")), "uint32"),
                        T.shift_left(T.cast(T.reinterpret("uint16", T.cast(sa[(kk * 2 + q // 2) * 4 + (q % 2) * 2 + 1], "bfloat16")), "uint32"), T.uint32(16)))
                vrow: T.let[T.int32] = kk * 16 + lane % 8 + ((lane // 8) % 2) * 8
                for pp in T.unroll(HD // 16):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        bf[0], bf[1], bf[2], bf[3], T.address_of(Vs[buf, vrow, (pp * 2 + lane // 16) * 8]))
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
            orow: T.let[T.int32] = qtile * ROWS + warp * 16 + hh * 8 + g
            if orow < n:
                for nt in T.unroll(HD // 8):
                    for e in T.unroll(2):
                        pk[e] = T.cast(oa[nt * 4 + hh * 2 + e] * al[hh], "bfloat16")
                    for e in T.vectorized(2):
                        O[t0 + orow, h * HD + nt * 8 + tq * 2 + e] = pk[e]
        T.cuda.cta_sync()   # shared memory is reused by the CTA's next query tile


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
                     for f in (rope_k, vit_attn))
        _CACHE["exes"] = exes
    return exes


def solve(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    krope, attn = _compiled()
    total = qkv.shape[0]
    out = torch.empty((total, HIDDEN), dtype=qkv.dtype, device=qkv.device)
    if total == 0 or cu_seqlens.numel() < 2:
        return out
    key = ("kr", str(qkv.device), total)
    kr = _CACHE.get(key)
    if kr is None:
        kr = _CACHE[key] = torch.empty((total, HEADS, HD), dtype=torch.bfloat16, device=qkv.device)
    qkv = qkv.contiguous()
    c = cos.contiguous().float()
    s = sin.contiguous().float()
    cu = (cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)).contiguous()
    krope(qkv, c, s, kr)
    attn(qkv, c, s, kr, cu, out, float(1.0 / math.sqrt(HD)) * LOG2E)
    return out
