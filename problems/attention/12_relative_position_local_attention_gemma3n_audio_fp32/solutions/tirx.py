# Gemma 3n audio local attention (13-frame causal window, sinusoidal relative position bias through a
# 1536 x 1536 projection, per-dimension query scale, logit softcap 50; 8 heads x 192, fp32) in TIRx.
# Same three-kernel decomposition as the verified CuTe DSL solution of this problem:
# 1. timing_kernel [13, 1536]: sin/cos(d * w_i), w_i = exp(i * -(ln 1e4 / 767)), fp32 steps as in the
#    reference. Grid 13, 256 threads.
# 2. rel_kernel [13, 1536] = timing @ pos_proj_weight^T: 96 CTAs x 8 warps, a warp computes 2 output
#    columns for the 13 distances (lanes stride over the 1536 inputs: coalesced weight rows, timing table
#    in shared memory, 13 x 2 accumulators per lane, then warp butterfly sums).
# 3. attn_kernel: grid (ceil(T / 32) frame tiles, B * 8 heads), 256 threads = 8 warps; warp w handles the
#    4 query frames t0 + 4w .. t0 + 4w + 3.
#    - The CTA stages (cp.async, 16 B, zero-filled outside [0, T)) the k and v rows of frames
#      t0 - 12 .. t0 + 31 of its head and rel[:, head] in shared memory (76 KiB dynamic, 2 CTAs per SM).
#    - Lane l owns dims l + 32 i (i < 6). Per group of 4 queries it forms the 52 partial logits
#      q_g . (k_{t_g - d} + r_d) (64 slots g * 16 + d), then a reduce-scatter over the 32 lanes
#      (32 + 16 + 8 + 4 + 2 = 62 shuffles) leaves query l / 8, distances 2 (l % 8) + {0, 1} on lane l;
#      softcap 50 tanh(x / 50), masking (before the clip start, padding keys, fillers d > 12), softmax
#      over the 8 lanes of a query (3 + 3 shuffles), and 52 indexed shuffles broadcast the probabilities
#      for out = sum_d p_d v_{t-d}; padding query frames are written as zeros.
# Numerics: fp32 with the reference's order where it matters (k + r before the dot, x / 50 before tanh,
# q scaled by fp32(192^-0.5 / ln 2) * softplus(per_dim_scale)); softplus is evaluated in fp64 and rounded.
# TVM compiles device code with --use_fast_math, which turns fp32 tanhf / expf / sinf / cosf and '/' into
# tanh.approx / ex2.approx / sin.approx / cos.approx / div.approx. The first version used them and failed on
# the H200 (max error 5.68e-5 vs allowance 1.04e-5); a CPU model of the error at full size put tanh.approx
# first (~2^-21 absolute on x / 50 gives ~6.6x the allowance), then sin/cos.approx of the timing table
# (~1x) and ex2.approx in the softmax (~0.5x). So tanh, exp, sin, cos are evaluated in fp64 (fast math does
# not touch fp64; the PTX keeps only ex2.approx of an integer inside fp64 tanh, which is exact) and rounded to
# fp32, and x / 50 and p / sum use div.rn. Cost: 2 fp64 tanh + 2 fp64 exp per thread per CTA.
# What limits it: DRAM for q, k, v, out (295 MB; SOL ~0.063 ms); the CuTe version of this design measured
# 0.134 ms of kernel time on the H200 (three kernels together).
# Streams: the compiled functions are called with torch tensors; tvm-ffi installs torch's current stream
# as TVM's environment stream for each call, so the three kernels run in order on that stream.
# Verification: the fast-math version failed on the H200 (see Numerics); this version is compile-checked on
# CPU (sm_90a) and numerically checked with the CPU emulator of the generated CUDA (which now models the
# device arithmetic: no approximate fp32 intrinsics remain); H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

HEADS = 8
D = 192
HID = HEADS * D                # 1536
HALF = HID // 2                # 768
WIN = 13                       # distances 0..12
SOFTCAP = 50.0
Q_SCALE = D ** -0.5 / math.log(2.0)
TS_COEF = -(math.log(1.0e4 / 1.0) / (HALF - 1))
DPL = D // 32                  # 6 dims per lane
TQ = 32                        # query frames per CTA
QPW = 4                        # queries per warp
ROWS = TQ + WIN - 1            # 44 staged k/v rows
THREADS = 256
OPW = 2                        # rel columns per warp
REL_CTAS = HID // (8 * OPW)    # 96
CPR = D // 4                   # 16-byte pieces per row (48)


@T.prim_func
def timing_kernel(t_h: T.handle):
    TM = T.match_buffer(t_h, (WIN, HID), "float32", align=16)
    T.device_entry()
    d = T.cta_id([WIN])
    tid = T.thread_id([THREADS])
    x = T.alloc_local((1,), "float32")
    for it in T.unroll(HID // THREADS):
        i: T.let[T.int32] = tid + THREADS * it
        # fp32 argument and product as in the reference; exp / sin / cos in fp64 (fast math leaves fp64 exact),
        # rounded to fp32: sin.approx / cos.approx at |x| up to 12 would cost ~1e-6 absolute per entry
        x[0] = T.cast(d, "float32") * T.cast(
            T.exp(T.cast(T.cast(i % HALF, "float32") * T.float32(TS_COEF), "float64")), "float32")
        TM[d, i] = T.if_then_else(i < HALF, T.cast(T.sin(T.cast(x[0], "float64")), "float32"),
                                  T.cast(T.cos(T.cast(x[0], "float64")), "float32"))


@T.prim_func
def rel_kernel(t_h: T.handle, w_h: T.handle, r_h: T.handle):
    TM = T.match_buffer(t_h, (WIN, HID), "float32", align=16)
    W = T.match_buffer(w_h, (HID, HID), "float32", align=16)
    R = T.match_buffer(r_h, (WIN, HID), "float32", align=16)
    T.device_entry()
    cb = T.cta_id([REL_CTAS])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])
    sT = T.alloc_buffer((WIN * HID,), "float32", scope="shared.dyn")
    acc = T.alloc_local((OPW * WIN,), "float32")
    w = T.alloc_local((OPW,), "float32")
    tv = T.alloc_local((1,), "float32")
    for it in T.unroll(WIN * HID // THREADS):
        sT[tid + THREADS * it] = TM[(tid + THREADS * it) // HID, (tid + THREADS * it) % HID]
    T.cuda.cta_sync()
    o0: T.let[T.int32] = (cb * 8 + warp) * OPW
    for e in T.unroll(OPW * WIN):
        acc[e] = T.float32(0.0)
    for m in range(HID // 32):
        for c in T.unroll(OPW):
            w[c] = W[o0 + c, lane + 32 * m]
        for d in T.unroll(WIN):
            tv[0] = sT[d * HID + lane + 32 * m]
            for c in T.unroll(OPW):
                acc[c * WIN + d] = acc[c * WIN + d] + tv[0] * w[c]
    for e in T.unroll(OPW * WIN):
        for r in T.unroll(5):
            acc[e] = acc[e] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[e], 16 >> r, 32, 32)
    if lane == 0:
        for c in T.unroll(OPW):
            for d in T.unroll(WIN):
                R[d, o0 + c] = acc[c * WIN + d]


@T.prim_func
def attn_kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, pds_h: T.handle, r_h: T.handle, pad_h: T.handle,
                o_h: T.handle):
    B = T.int32()
    NT = T.int32()
    Q = T.match_buffer(q_h, (B, NT, HEADS, D), "float32", align=16)
    K = T.match_buffer(k_h, (B, NT, HEADS, D), "float32", align=16)
    V = T.match_buffer(v_h, (B, NT, HEADS, D), "float32", align=16)
    PDS = T.match_buffer(pds_h, (D,), "float32")
    R = T.match_buffer(r_h, (WIN, HID), "float32", align=16)
    PAD = T.match_buffer(pad_h, (B, NT), "uint8")
    O = T.match_buffer(o_h, (B, NT, HEADS, D), "float32", align=16)

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
    tb, bh = T.cta_id([T.ceildiv(NT, TQ), B * HEADS])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([8])
    lane = T.lane_id([32])

    pool = T.alloc_buffer((2 * ROWS * D + WIN * D,), "float32", scope="shared.dyn")
    sK = T.decl_buffer((ROWS, D), "float32", data=pool.data, elem_offset=0)
    sV = T.decl_buffer((ROWS, D), "float32", data=pool.data, elem_offset=ROWS * D)
    sR = T.decl_buffer((WIN, D), "float32", data=pool.data, elem_offset=2 * ROWS * D)

    fs = T.alloc_local((DPL,), "float32")
    sd = T.alloc_local((1,), "float64")
    qs = T.alloc_local((QPW * DPL,), "float32")
    kr = T.alloc_local((DPL,), "float32")
    part = T.alloc_local((QPW * 16,), "float32")
    snd = T.alloc_local((1,), "float32")
    kp = T.alloc_local((1,), "float32")
    lg = T.alloc_local((2,), "float32")
    cap = T.alloc_local((1,), "float32")
    mx = T.alloc_local((1,), "float32")
    sm = T.alloc_local((1,), "float32")
    pr = T.alloc_local((2,), "float32")
    pb = T.alloc_local((1,), "float32")
    acc = T.alloc_local((QPW * DPL,), "float32")

    b: T.let[T.int32] = bh // HEADS
    h: T.let[T.int32] = bh % HEADS
    t0: T.let[T.int32] = tb * TQ

    # ---- stage k / v rows of frames t0 - 12 .. t0 + 31 (zero outside [0, T)) and rel[:, h]
    for it in T.unroll((ROWS * CPR + THREADS - 1) // THREADS):
        if tid + THREADS * it < ROWS * CPR:
            r: T.let[T.int32] = (tid + THREADS * it) // CPR
            c: T.let[T.int32] = (tid + THREADS * it) % CPR
            f: T.let[T.int32] = t0 - (WIN - 1) + r
            fc: T.let[T.int32] = T.max(T.min(f, NT - 1), 0)
            ok: T.let[T.bool] = (f >= 0) and (f < NT)
            T.ptx.cp.async_.cg.shared.global_(T.address_of(sK[r, c * 4]), T.address_of(K[b, fc, h, c * 4]), 16,
                                              T.if_then_else(ok, T.uint32(16), T.uint32(0)))
            T.ptx.cp.async_.cg.shared.global_(T.address_of(sV[r, c * 4]), T.address_of(V[b, fc, h, c * 4]), 16,
                                              T.if_then_else(ok, T.uint32(16), T.uint32(0)))
    for it in T.unroll((WIN * CPR + THREADS - 1) // THREADS):
        if tid + THREADS * it < WIN * CPR:
            rr: T.let[T.int32] = (tid + THREADS * it) // CPR
            cc: T.let[T.int32] = (tid + THREADS * it) % CPR
            T.ptx.cp.async_.cg.shared.global_(T.address_of(sR[rr, cc * 4]), T.address_of(R[rr, h * D + cc * 4]), 16)
    T.ptx.cp.async_.commit_group()

    # ---- per-dim query scale fp32(Q_SCALE) * softplus(per_dim_scale) and this warp's 4 queries
    for i in T.unroll(DPL):
        sd[0] = T.cast(PDS[lane + 32 * i], "float64")
        sd[0] = T.if_then_else(sd[0] > T.float64(20.0), sd[0], T.log1p(T.exp(sd[0])))
        fs[i] = T.float32(Q_SCALE) * T.cast(sd[0], "float32")
    tw: T.let[T.int32] = t0 + warp * QPW
    for g in T.unroll(QPW):
        for i in T.unroll(DPL):
            qs[g * DPL + i] = Q[b, T.min(tw + g, NT - 1), h, lane + 32 * i] * fs[i]

    T.ptx.cp.async_.wait_all()
    T.cuda.cta_sync()

    # ---- partial logits, slot g * 16 + d
    for e in T.unroll(QPW * 16):
        part[e] = T.float32(0.0)
    for jr in T.unroll(QPW + WIN - 1):             # staged row warp*4 + jr = frame tw - 12 + jr
        for i in T.unroll(DPL):
            kr[i] = sK[warp * QPW + jr, lane + 32 * i]
        for g in T.unroll(QPW):
            if g + WIN - 1 - jr >= 0 and g + WIN - 1 - jr < WIN:
                for i in T.unroll(DPL):
                    part[g * 16 + g + WIN - 1 - jr] = part[g * 16 + g + WIN - 1 - jr] + qs[g * DPL + i] * (
                        kr[i] + sR[g + WIN - 1 - jr, lane + 32 * i])

    # ---- reduce-scatter over the lanes: lane l ends with slots 2l, 2l + 1 in part[0], part[1]
    for s in T.unroll(32):
        snd[0] = T.if_then_else(T.bitwise_and(lane, 16) != 0, part[s], part[s + 32])
        kp[0] = T.if_then_else(T.bitwise_and(lane, 16) != 0, part[s + 32], part[s])
        part[s] = kp[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, snd[0], 16, 32, 32)
    for s in T.unroll(16):
        snd[0] = T.if_then_else(T.bitwise_and(lane, 8) != 0, part[s], part[s + 16])
        kp[0] = T.if_then_else(T.bitwise_and(lane, 8) != 0, part[s + 16], part[s])
        part[s] = kp[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, snd[0], 8, 32, 32)
    for s in T.unroll(8):
        snd[0] = T.if_then_else(T.bitwise_and(lane, 4) != 0, part[s], part[s + 8])
        kp[0] = T.if_then_else(T.bitwise_and(lane, 4) != 0, part[s + 8], part[s])
        part[s] = kp[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, snd[0], 4, 32, 32)
    for s in T.unroll(4):
        snd[0] = T.if_then_else(T.bitwise_and(lane, 2) != 0, part[s], part[s + 4])
        kp[0] = T.if_then_else(T.bitwise_and(lane, 2) != 0, part[s + 4], part[s])
        part[s] = kp[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, snd[0], 2, 32, 32)
    for s in T.unroll(2):
        snd[0] = T.if_then_else(T.bitwise_and(lane, 1) != 0, part[s], part[s + 2])
        kp[0] = T.if_then_else(T.bitwise_and(lane, 1) != 0, part[s + 2], part[s])
        part[s] = kp[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, snd[0], 1, 32, 32)

    # ---- softcap, mask, softmax over the 13 distances of query lane / 8 (8 lanes x 2)
    tqf: T.let[T.int32] = tw + lane // 8
    for e in T.unroll(2):
        dd: T.let[T.int32] = 2 * (lane % 8) + e
        kf: T.let[T.int32] = tqf - dd
        okk: T.let[T.bool] = (dd < WIN) and (kf >= 0) and (tqf < NT)
        # x / 50 correctly rounded (div.rn), tanh in fp64 rounded to fp32 (tanh.approx: ~2^-21 off, modelled)
        T.ptx.div.rn.f32(cap[0], part[e], T.float32(SOFTCAP))
        lg[e] = T.if_then_else(
            okk and (PAD[b, T.max(T.min(kf, NT - 1), 0)] == T.uint8(0)),
            T.float32(SOFTCAP) * T.cast(T.tanh(T.cast(cap[0], "float64")), "float32"), T.float32("-inf"))
    mx[0] = T.max(lg[0], lg[1])
    for r in T.unroll(3):
        mx[0] = T.max(mx[0], T.tvm_warp_shuffle_xor(0xFFFFFFFF, mx[0], 1 << r, 32, 32))
    mx[0] = T.if_then_else(mx[0] == T.float32("-inf"), T.float32(0.0), mx[0])
    for e in T.unroll(2):
        pr[e] = T.cast(T.exp(T.cast(lg[e] - mx[0], "float64")), "float32")      # not ex2.approx
    sm[0] = pr[0] + pr[1]
    for r in T.unroll(3):
        sm[0] = sm[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sm[0], 1 << r, 32, 32)
    sm[0] = T.if_then_else(sm[0] == T.float32(0.0), T.float32(1.0), sm[0])
    for e in T.unroll(2):
        T.ptx.div.rn.f32(pr[e], pr[e], sm[0])                                    # not div.approx

    # ---- out_g = sum_d p[g, d] v_{t_g - d}; p[g, d] lives on lane 8 g + d / 2, element d % 2
    for e in T.unroll(QPW * DPL):
        acc[e] = T.float32(0.0)
    for jr in T.unroll(QPW + WIN - 1):
        for i in T.unroll(DPL):
            kr[i] = sV[warp * QPW + jr, lane + 32 * i]
        for g in T.unroll(QPW):
            if g + WIN - 1 - jr >= 0 and g + WIN - 1 - jr < WIN:
                pb[0] = T.tvm_warp_shuffle(0xFFFFFFFF, pr[(g + WIN - 1 - jr) % 2],
                                           8 * g + (g + WIN - 1 - jr) // 2, 32, 32)
                for i in T.unroll(DPL):
                    acc[g * DPL + i] = acc[g * DPL + i] + pb[0] * kr[i]
    for g in T.unroll(QPW):
        if tw + g < NT:
            for i in T.unroll(DPL):
                O[b, tw + g, h, lane + 32 * i] = T.if_then_else(PAD[b, tw + g] == T.uint8(0), acc[g * DPL + i],
                                                               T.float32(0.0))


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
                     for f in (timing_kernel, rel_kernel, attn_kernel))
        _CACHE["exes"] = exes
    return exes


def _workspace(device: torch.device):
    key = ("ws", str(device))
    ws = _CACHE.get(key)
    if ws is None:
        ws = (torch.empty((WIN, HID), dtype=torch.float32, device=device),
              torch.empty((WIN, HID), dtype=torch.float32, device=device))
        _CACHE[key] = ws
    return ws


def solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_dim_scale: torch.Tensor,
          pos_proj_weight: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    timing, rel, attn = _compiled()
    b, t, h, d = q.shape
    assert (h, d) == (HEADS, D)
    out = torch.empty_like(q)
    if b == 0 or t == 0:
        return out
    tm, rl = _workspace(q.device)
    timing(tm)
    rel(tm, pos_proj_weight.contiguous(), rl)
    attn(q.contiguous(), k.contiguous(), v.contiguous(), per_dim_scale.contiguous(), rl,
         padding_mask.contiguous().view(torch.uint8), out)
    return out
