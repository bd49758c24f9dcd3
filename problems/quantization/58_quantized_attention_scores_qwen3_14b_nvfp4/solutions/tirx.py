# Causal GQA attention scores of Qwen3-14B from NVFP4 queries and keys (40 q / 8 kv heads, head dim 128,
# 4 sequences x 512 queries against a 2048-key padded buffer) in TIRx. Three launches:
#
# - k_dequant (q, then k): one thread per 16-element NVFP4 block: 8 packed bytes + one e4m3 scale ->
#   16 bf16 values code * scale (exact in bf16: at most 6 significant bits); the fp32 global scales are
#   applied to the fp32 dot products.
# - k_scores: one CTA per (64-query tile, batch x head), 4 warps of 16 query rows, walking the key tiles
#   of 64: Q [64 x 128] is copied once and kept in registers as mma A fragments; K tiles stream through a
#   2-stage cp.async ring (16-byte pieces XOR-swizzled by row, conflict-free ldmatrix), so the loads and
#   products of tile i + 1 overlap the stores of tile i. Per tile: S = Q K^T with mma.sync m16n8k16 (bf16,
#   fp32 accumulate), times sm_scale * q_gs * k_gs, mask (key j visible from query i iff
#   j <= kv_len - Lq + i) to -inf, bf16, staged per warp through shared memory and written as 16-byte row
#   pieces (element-wise when the key length is not a multiple of 8). Tiles entirely in the masked future
#   skip their load and product and only write -inf.
# Difference from the CuTe DSL solution: that one launched one CTA per (128-key tile, 64-query tile, head),
# loading Q and K for every output tile with nothing overlapped inside the CTA (0.206 ms device, a third
# of the HBM write rate for the 336 MB output); here each CTA keeps Q and double-buffers K across the key
# dimension, the change its skill proposed as the next experiment.
#
# What limits it: writing the 336 MB bf16 score tensor (SOL ~0.072 ms); the dequantized copies (~37 MB)
# and the re-reads of K tiles by the 8 query tiles and 5 heads of a group come from L2.
# Streams: compiled functions are called with torch tensors; tvm-ffi installs torch's current stream for
# each call, so the three launches run in order on it. Workspaces cached per (device, shape).
#
# Verification: compile-checked on CPU (sm_90a) and run through the CPU CUDA emulator; H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

HD = 128
SF = 16
GROUP = 5
BQ = 64
BKEY = 64
THREADS = 128
OPAD = BKEY + 8                 # staging row pitch (bf16), keeps the 16-byte reads conflict-light


@T.prim_func
def k_dequant(w_h: T.handle, s_h: T.handle, o_h: T.handle):
    n = T.int32()
    W = T.match_buffer(w_h, (n, HD // 8), "int32", align=16)         # 8 codes per word
    S = T.match_buffer(s_h, (n, HD // SF), "uint8")
    O = T.match_buffer(o_h, (n, HD), "bfloat16", align=16)
    T.device_entry()
    blk = T.cta_id([T.ceildiv(n * (HD // SF), 256)])
    tid = T.thread_id([256])
    wv = T.alloc_local((2,), "int32")
    ov = T.alloc_local((16,), "bfloat16")
    sv = T.alloc_local((1,), "float32")
    cv = T.alloc_local((1,), "int32")
    i: T.let[T.int32] = blk * 256 + tid
    if i < n * (HD // SF):
        r: T.let[T.int32] = i // (HD // SF)
        q: T.let[T.int32] = i % (HD // SF)
        sb: T.let[T.int32] = T.cast(S[r, q], "int32")
        # e4m3 -> fp32 exactly: exponent field > 0: 2^(e - 7) (1 + m / 8); else m 2^-9
        sv[0] = T.if_then_else(
            T.bitwise_and(sb, 0x78) != 0,
            T.reinterpret("float32", T.bitwise_or(T.shift_left(T.bitwise_and(sb, 0x80), 24),
                                                  T.shift_left(T.bitwise_and(sb, 0x7F), 20) + 0x3C000000)),
            T.cast(T.bitwise_and(sb, 7), "float32") * T.float32(2.0 ** -9)
            * T.if_then_else(T.bitwise_and(sb, 0x80) != 0, T.float32(-1.0), T.float32(1.0)))
        for j in T.vectorized(2):
            wv[j] = W[r, q * 2 + j]
        for e in T.unroll(16):
            cv[0] = T.bitwise_and(T.shift_right(wv[e // 8], (e % 8) * 4), 15)
            # e2m1 magnitude m: 0, .5, 1, 1.5 for m < 4 (m / 2); 2, 3, 4, 6 for m >= 4
            ov[e] = T.cast(T.if_then_else(T.bitwise_and(cv[0], 8) != 0, T.float32(-1.0), T.float32(1.0))
                           * T.if_then_else(T.bitwise_and(cv[0], 7) < 4,
                                            T.cast(T.bitwise_and(cv[0], 7), "float32") * T.float32(0.5),
                                            T.if_then_else(T.bitwise_and(cv[0], 7) < 6, T.float32(2.0), T.float32(4.0))
                                            * (T.float32(1.0) + T.cast(T.bitwise_and(cv[0], 1), "float32") * T.float32(0.5)))
                           * sv[0], "bfloat16")
        for j in T.vectorized(8):
            O[r, q * 16 + j] = ov[j]
        for j in T.vectorized(8):
            O[r, q * 16 + 8 + j] = ov[8 + j]


@T.prim_func
def k_scores(q_h: T.handle, k_h: T.handle, len_h: T.handle, qg_h: T.handle, kg_h: T.handle, o_h: T.handle,
             heads: T.int32, sm_scale: T.float32):
    nbh = T.int32()
    lq = T.int32()
    nbkv = T.int32()
    lk = T.int32()
    nb = T.int32()
    Q = T.match_buffer(q_h, (nbh, lq, HD), "bfloat16", align=16)
    K = T.match_buffer(k_h, (nbkv, lk, HD), "bfloat16", align=16)
    LENS = T.match_buffer(len_h, (nb,), "int32")
    QG = T.match_buffer(qg_h, (1,), "float32")
    KG = T.match_buffer(kg_h, (1,), "float32")
    O = T.match_buffer(o_h, (nbh, lq, lk), "bfloat16", align=16)

    T.device_entry()
    qt, bh = T.cta_id([T.ceildiv(lq, BQ), nbh])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([4])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((BQ * HD + 2 * BKEY * HD + 4 * 16 * OPAD,), "bfloat16", scope="shared.dyn")
    Qs = T.decl_buffer((BQ, HD), "bfloat16", data=pool.data, elem_offset=0)
    Ks = T.decl_buffer((2, BKEY, HD), "bfloat16", data=pool.data, elem_offset=BQ * HD)
    Os = T.decl_buffer((4, 16, OPAD), "bfloat16", data=pool.data, elem_offset=BQ * HD + 2 * BKEY * HD)

    qf = T.alloc_local((32,), "uint32")         # A fragments, 8 k-steps x 4
    bf = T.alloc_local((4,), "uint32")
    acc = T.alloc_local((32,), "float32")       # 8 n-tiles x 4
    ov = T.alloc_local((8,), "bfloat16")
    sc = T.alloc_local((1,), "float32")

    g: T.let[T.int32] = lane // 4
    tq: T.let[T.int32] = lane % 4
    b: T.let[T.int32] = bh // heads
    kvh: T.let[T.int32] = b * (heads // GROUP) + (bh % heads) // GROUP
    q0: T.let[T.int32] = qt * BQ
    qpos0: T.let[T.int32] = LENS[b] - lq                         # position of query 0
    qlast: T.let[T.int32] = qpos0 + T.min(q0 + BQ, lq) - 1       # position of the tile's last query
    ntk: T.let[T.int32] = T.ceildiv(lk, BKEY)
    rows0: T.let[T.int32] = q0 + warp * 16                        # first query row of this warp

    sc[0] = sm_scale * QG[0] * KG[0]
    for r in T.unroll(BQ * (HD // 8) // THREADS):
        qr: T.let[T.int32] = (tid + r * THREADS) // (HD // 8)
        qc: T.let[T.int32] = (tid + r * THREADS) % (HD // 8)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(Qs[qr, T.bitwise_xor(qc, qr % 8) * 8]), T.address_of(Q[bh, T.min(q0 + qr, lq - 1), qc * 8]),
            16, T.if_then_else(q0 + qr < lq, T.uint32(16), T.uint32(0)))
    if qlast >= 0:
        for r in T.unroll(BKEY * (HD // 8) // THREADS):
            kr: T.let[T.int32] = (tid + r * THREADS) // (HD // 8)
            kc: T.let[T.int32] = (tid + r * THREADS) % (HD // 8)
            T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Ks[0, kr, T.bitwise_xor(kc, kr % 8) * 8]), T.address_of(K[kvh, T.min(kr, lk - 1), kc * 8]),
                16, T.if_then_else(kr < lk, T.uint32(16), T.uint32(0)))
    T.ptx.cp.async_.commit_group()

    for kt in range(ntk):
        buf: T.let[T.int32] = kt % 2
        k0: T.let[T.int32] = kt * BKEY
        T.ptx.cp.async_.wait_all()
        T.cuda.cta_sync()
        # next K tile into the other buffer (last read in iteration kt - 1, before the barrier above)
        if kt + 1 < ntk:
            if k0 + BKEY <= qlast:
                for r in T.unroll(BKEY * (HD // 8) // THREADS):
                    kr2: T.let[T.int32] = (tid + r * THREADS) // (HD // 8)
                    kc2: T.let[T.int32] = (tid + r * THREADS) % (HD // 8)
                    kn: T.let[T.int32] = k0 + BKEY + kr2
                    T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Ks[1 - buf, kr2, T.bitwise_xor(kc2, kr2 % 8) * 8]),
                        T.address_of(K[kvh, T.min(kn, lk - 1), kc2 * 8]), 16,
                        T.if_then_else(kn < lk, T.uint32(16), T.uint32(0)))
        T.ptx.cp.async_.commit_group()
        if kt == 0:
            arow: T.let[T.int32] = warp * 16 + lane % 8 + ((lane // 8) % 2) * 8
            for ks in T.unroll(HD // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    qf[ks * 4], qf[ks * 4 + 1], qf[ks * 4 + 2], qf[ks * 4 + 3],
                    T.address_of(Qs[arow, T.bitwise_xor(ks * 2 + lane // 16, arow % 8) * 8]))
        for e in T.unroll(32):
            acc[e] = T.float32(0.0)
        if k0 <= qlast:
            for ks in T.unroll(HD // 16):
                for jj in T.unroll(BKEY // 16):
                    brow: T.let[T.int32] = jj * 16 + lane % 8 + (lane // 16) * 8
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        bf[0], bf[1], bf[2], bf[3],
                        T.address_of(Ks[buf, brow, T.bitwise_xor(ks * 2 + (lane // 8) % 2, brow % 8) * 8]))
                    for j2 in T.unroll(2):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            acc[(jj * 2 + j2) * 4], acc[(jj * 2 + j2) * 4 + 1], acc[(jj * 2 + j2) * 4 + 2], acc[(jj * 2 + j2) * 4 + 3],
                            qf[ks * 4], qf[ks * 4 + 1], qf[ks * 4 + 2], qf[ks * 4 + 3], bf[j2 * 2], bf[j2 * 2 + 1],
                            acc[(jj * 2 + j2) * 4], acc[(jj * 2 + j2) * 4 + 1], acc[(jj * 2 + j2) * 4 + 2], acc[(jj * 2 + j2) * 4 + 3])
        # scale, mask, bf16 into this warp's staging rows
        for nt in T.unroll(BKEY // 8):
            for hh in T.unroll(2):
                for e in T.unroll(2):
                    Os[warp, g + hh * 8, nt * 8 + tq * 2 + e] = T.cast(T.if_then_else(
                        k0 + nt * 8 + tq * 2 + e <= qpos0 + rows0 + g + hh * 8,
                        acc[nt * 4 + hh * 2 + e] * sc[0], T.float32("-inf")), "bfloat16")
        T.cuda.cta_sync()
        # 16 rows x 64 keys per warp: lane writes 4 pieces of 8 keys (8 lanes per 128-byte row)
        for it in T.unroll(4):
            orow: T.let[T.int32] = (lane + it * 32) // 8
            oc: T.let[T.int32] = (lane + it * 32) % 8
            if rows0 + orow < lq:
                if lk % 8 == 0 and k0 + oc * 8 + 8 <= lk:
                    for j in T.vectorized(8):
                        ov[j] = Os[warp, orow, oc * 8 + j]
                    for j in T.vectorized(8):
                        O[bh, rows0 + orow, k0 + oc * 8 + j] = ov[j]
                else:
                    for j in T.serial(8):
                        if k0 + oc * 8 + j < lk:
                            O[bh, rows0 + orow, k0 + oc * 8 + j] = Os[warp, orow, oc * 8 + j]


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
                     for f in (k_dequant, k_scores))
        _CACHE["exes"] = exes
    return exes


def _ws(name, shape, device):
    key = (name, str(device), tuple(shape))
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return t


def solve(q_packed, q_scale, q_global_scale, k_packed, k_scale, k_global_scale, kv_lens, sm_scale):
    dq, scores = _compiled()
    b, heads, lq, _ = q_packed.shape
    _, kv_heads, lk, _ = k_packed.shape
    if heads != GROUP * kv_heads:
        raise ValueError("expects 5 query heads per KV head")
    dev = q_packed.device
    out = torch.empty((b, heads, lq, lk), dtype=torch.bfloat16, device=dev)
    if b == 0 or lq == 0 or lk == 0:
        return out
    qd = _ws("q", (b * heads, lq, HD), dev)
    kd = _ws("k", (b * kv_heads, lk, HD), dev)
    dq(q_packed.contiguous().view(torch.int32).view(-1, HD // 8), q_scale.contiguous().view(torch.uint8).view(-1, HD // SF),
       qd.view(-1, HD))
    dq(k_packed.contiguous().view(torch.int32).view(-1, HD // 8), k_scale.contiguous().view(torch.uint8).view(-1, HD // SF),
       kd.view(-1, HD))
    scores(qd, kd, kv_lens.to(torch.int32).contiguous(), q_global_scale.reshape(1).float(),
           k_global_scale.reshape(1).float(), out.view(b * heads, lq, lk), heads, float(sm_scale))
    return out
