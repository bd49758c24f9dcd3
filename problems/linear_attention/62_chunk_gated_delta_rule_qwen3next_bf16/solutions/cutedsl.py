"""Gated delta rule prefill (Qwen3-Next: 32 value heads reading 16 q/k heads, d = 128, carried state,
4 x 4096 tokens) in CuTe DSL: the exact token-by-token recurrence in fp32 on CUDA cores, with the state
held in registers for the whole sequence (same structure as the problem-74 DeltaNet kernel).

Why a recurrence and not the chunked (WY) tensor-core form: final_state is compared at fp32 precision
(3x the fp32 reference's own error), which bf16/TF32 tensor-core products cannot meet; on fp32 CUDA cores
the chunked form costs at least as many FLOPs as the recurrence, whose inner step is the same 3 rank-1
state passes per token (and the decay folds into a scalar, see below).

Algebra per value head, for every value column v independently (columns never interact):
    S <- a_t S,  dk_v = <S[:, v], kn>,  u_v = beta (v_v - dk_v),  S[:, v] += kn u_v,
    o_v = <S_new[:, v], qn> = <a_t S_old[:, v], qn> + u_v <kn, qn>
State representation (precision + no per-element decay): S_t = gamma_t (Sb + dS_t), gamma_t = product of a
since the last fold. Per token: gamma *= a_t, dk = gamma <Sb + dS, kn>, sq = gamma <Sb + dS, qn>,
dS += kn (u / gamma). Every 32 tokens (or earlier if gamma < 2^-64) Sb <- gamma (Sb + dS), dS <- 0,
gamma <- 1. The small dS keeps the per-token rounding small (a plain fp32 S += kn u lands near the fp32
allowance on long slowly-decaying heads) and the decay costs nothing per element. Torch emulation of this
exact scheme at the full size: state error 0.3-0.4x the allowance.

Launch geometry
- Grid (32 value heads, B) = 128 CTAs (one per SM), 256 threads = 8 warps. Warp w owns value columns
  16w..16w+15; lane = 4p + ks owns columns v0 = 16w + 2p, v0 + 1 and the key rows k = 16j + 4ks + e
  (j < 8, e < 4): 64 fp32 of Sb and 64 of dS in registers.
- Tokens are processed in blocks of 32. Raw q/k (head h // 2) and v rows (bf16; consecutive tokens are
  heads*128 elements apart) come in with cp.async (16 B per copy, double-buffered: block i+1 is in flight
  while block i is computed); g and beta are prefetched into registers. After a CTA barrier each warp
  prepares 4 tokens (warp-shuffle sums of squares; kn = k rsqrt(|k|^2 + 1e-6), qn = scale q
  rsqrt(|q|^2 + 1e-6), <kn, qn>, a = exp(g)) into fp32 shared memory.
- Per token a thread reads its 32 kn and 32 qn values (8 + 8 conflict-free ld.shared.v4), does 64 adds +
  128 FMAs for its partial dk/sq (4 accumulators each), sums them over the 4 ks lanes with 2 xor
  shuffles, then u, o and 64 FMAs into dS. o (bf16 pairs) goes to a shared 32 x 128 tile that is written
  to global with 16-byte stores after the block. Finally gamma (Sb + dS) is stored to final_state.
What limits it: fp32 issue rate on 128 SMs: per token and thread ~260 FP instructions + 16 LDS + 8
shuffles; 4096 tokens x 8 warps x ~300 / 4 issue slots ~ 2.5 M cycles ~ 1.3-1.4 ms (the fp32 floor of
this recurrence, 3.4e10 FP ops / 31 TFLOP-issue/s, is ~1.1 ms). The SOL model (bf16 tensor-core chunked
form, 8.6e10 FLOP, 423 MB) gives ~0.09 ms, out of reach at fp32 state accuracy without split-precision
(3xTF32-style) tensor-core products, which would be the next step.
Host path: compiled once per process (tvm-ffi; batch and T symbolic), torch tensors passed directly,
launch on the caller's current torch stream.

Numerics fix (after the H200 run of 2026-11-30 failed: final_state max error 6.1e-6 vs the allowance
2.4e-6, 4877 of 2.1M elements over; o passed): the per-token decay a_t = exp(g_t) came from the libdevice
exp (range reduction + ex2.approx, ~1-2 ulp). The state is multiplied by a_t on every token, so on the
slowly decaying heads (memory of thousands of tokens) each a_t error scales the whole state and the errors
compound over the memory length. A CPU torch model of this kernel's arithmetic at the full size
(4 x 4096) showed the sensitivity: with a correctly rounded exp the state error is 0.3-0.5x the allowance,
with a random 2-ulp-sized error on a_t 1.2x, with a 1-ulp bias 17x. Now a_t comes from an own exp
(Cody-Waite reduction, degree-9 Taylor polynomial by FMAs, exact power-of-two scaling; numpy model:
max 0.69 ulp, unbiased) and the L2 norms from rsqrt.approx plus one FMA Newton step (<= 1 ulp). Both run
only in the per-block preparation (32 values per block), so the per-token loop is unchanged.

Verification: compile-checked on CPU (sm_90a); the first version failed on the H200 (above); this fixed
version is in the H200 results (results/h200/, by kernel sha256).
"""

import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

QK_HEADS = 16
V_HEADS = 32
D = 128
TB = 32                        # tokens per block (also the regular fold period)
THREADS = 256
NWARPS = THREADS // 32
KS = 4                         # lanes sharing a column pair (split of the key axis)
NJ = D // (4 * KS)             # 8 groups of 4 key rows per lane
NE = NJ * 4                    # 32 key rows per lane
L2_EPS = 1e-6
GAMMA_MIN = 2.0 ** -64         # fold early below this (keeps 1/gamma far from fp32 overflow)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125     # Cody-Waite split of ln 2 (n * LN2_HI exact for |n| < 2^11)
LN2_LO = 1.4286068203094172e-06
EXP_DEG = 9                    # Taylor degree of exp(r), |r| <= ln2 / 2: truncation < 3e-10
CHUNKS_PER_ROW = D // 8        # 16-byte chunks in a bf16 row
RAW_CHUNKS = TB * CHUNKS_PER_ROW          # 512 per tensor per block
RAW_PER_THREAD = RAW_CHUNKS // THREADS    # 2
TOK_PER_WARP = TB // NWARPS               # 4 tokens prepared per warp


def _add(a, b):
    return a + b


@cute.kernel
def _gdr_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                mS0: cute.Tensor, mO: cute.Tensor, mSt: cute.Tensor, scale: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    hv, bb, _ = cute.arch.block_idx()
    hk = hv // (V_HEADS // QK_HEADS)
    T = mQ.shape[1]
    warp = tidx // 32
    lane = tidx % 32
    p = lane // KS
    ks = lane % KS
    v0 = warp * 16 + 2 * p

    smem = cutlass.utils.SmemAllocator()
    # raw bf16 rows: [buffer, tensor (q, k, v), token, d]
    sRaw = smem.allocate_tensor(BFloat16, cute.make_layout((2, 3, TB, D), stride=(3 * TB * D, TB * D, D, 1)),
                                byte_alignment=128)
    sNK = smem.allocate_tensor(Float32, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sNQ = smem.allocate_tensor(Float32, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sO = smem.allocate_tensor(BFloat16, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sKQ = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)
    sBeta = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)
    sDec = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)

    g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)

    # ---- initial state -> registers: Sb[idx, c] = S0[k(idx), v0 + c], k(idx) = 16 j + 4 ks + e, idx = 4 j + e
    Sb = cute.make_rmem_tensor((NE, 2), Float32)
    dS = cute.make_rmem_tensor((NE, 2), Float32)
    for j in cutlass.range_constexpr(NJ):
        for e in cutlass.range_constexpr(4):
            kr = 16 * j + 4 * ks + e
            t2 = cute.make_rmem_tensor((2,), Float32)
            cute.autovec_copy(cute.zipped_divide(mS0[bb, hv, kr, None], (2,))[(None, v0 // 2)], t2)
            Sb[4 * j + e, 0] = t2[0]
            Sb[4 * j + e, 1] = t2[1]
    dS.fill(0.0)
    gam = cute.make_rmem_tensor((1,), Float32)
    gam[0] = Float32(1.0)

    nb = (T + TB - 1) // TB

    # ---- prologue: block 0
    _issue_raw(g2s, mQ, mK, mV, sRaw, bb, hk, hv, Int32(0), Int32(0), T, tidx)
    cute.arch.cp_async_commit_group()
    tl = cutlass.min(lane, T - 1)
    beta_reg = Float32(mBeta[bb, tl, hv])
    g_reg = mG[bb, tl, hv]
    cute.arch.cp_async_wait_group(0)
    cute.arch.barrier()
    _prepare(sRaw, sNK, sNQ, sKQ, sBeta, sDec, Int32(0), warp, lane, beta_reg, g_reg, scale)
    cute.arch.barrier()

    for blk in cutlass.range(nb):
        buf = blk % 2
        t0 = blk * TB
        if blk + 1 < nb:
            _issue_raw(g2s, mQ, mK, mV, sRaw, bb, hk, hv, 1 - buf, t0 + TB, T, tidx)
            tl = cutlass.min(t0 + TB + lane, T - 1)
            beta_reg = Float32(mBeta[bb, tl, hv])
            g_reg = mG[bb, tl, hv]
        cute.arch.cp_async_commit_group()
        n = cutlass.min(T - t0, TB)

        for tt in cutlass.range(n):
            kq = sKQ[tt]
            beta = sBeta[tt]
            gm = gam[0] * sDec[tt]
            if gm < Float32(GAMMA_MIN):
                # fold with the old gamma, restart from a_t
                _fold(Sb, dS, gam[0])
                gm = sDec[tt]
            gam[0] = gm
            vr = cute.make_rmem_tensor((2,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(sRaw[buf, 2, tt, None], (2,))[(None, v0 // 2)], vr)
            vv = vr.load().to(Float32)
            kreg = cute.make_rmem_tensor((NE,), Float32)
            acc = cute.make_rmem_tensor((4, 4), Float32)   # [dk0, dk1, sq0, sq1] x 4 partials
            acc.fill(0.0)
            gK = cute.zipped_divide(sNK[tt, None], (4,))
            gQ = cute.zipped_divide(sNQ[tt, None], (4,))
            for j in cutlass.range_constexpr(NJ):
                k4 = cute.make_rmem_tensor((4,), Float32)
                q4 = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(gK[(None, 4 * j + ks)], k4)
                cute.autovec_copy(gQ[(None, 4 * j + ks)], q4)
                for e in cutlass.range_constexpr(4):
                    kreg[4 * j + e] = k4[e]
                    for c in cutlass.range_constexpr(2):
                        s = Sb[4 * j + e, c] + dS[4 * j + e, c]
                        acc[c, e] = acc[c, e] + s * k4[e]
                        acc[2 + c, e] = acc[2 + c, e] + s * q4[e]
            red = []
            for r in cutlass.range_constexpr(4):
                x = (acc[r, 0] + acc[r, 1]) + (acc[r, 2] + acc[r, 3])
                x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
                x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
                red.append(x * gm)
            u0 = beta * (vv[0] - red[0])
            u1 = beta * (vv[1] - red[1])
            rg = Float32(1.0) / gm
            w0 = u0 * rg
            w1 = u1 * rg
            for idx in cutlass.range_constexpr(NE):
                dS[idx, 0] = dS[idx, 0] + kreg[idx] * w0
                dS[idx, 1] = dS[idx, 1] + kreg[idx] * w1
            if ks == 0:
                ob = cute.make_rmem_tensor((2,), BFloat16)
                ob[0] = (red[2] + u0 * kq).to(BFloat16)
                ob[1] = (red[3] + u1 * kq).to(BFloat16)
                cute.autovec_copy(ob, cute.zipped_divide(sO[tt, None], (2,))[(None, v0 // 2)])

        _fold(Sb, dS, gam[0])
        gam[0] = Float32(1.0)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        # o tile -> global (16-byte stores, rows past T skipped)
        for i in cutlass.range_constexpr(RAW_PER_THREAD):
            cid = tidx + THREADS * i
            r = cid // CHUNKS_PER_ROW
            cc = cid % CHUNKS_PER_ROW
            if r < n:
                t8 = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.zipped_divide(sO[r, None], (8,))[(None, cc)], t8)
                cute.autovec_copy(t8, cute.zipped_divide(mO[bb, t0 + r, hv, None], (8,))[(None, cc)])
        if blk + 1 < nb:
            _prepare(sRaw, sNK, sNQ, sKQ, sBeta, sDec, 1 - buf, warp, lane, beta_reg, g_reg, scale)
        cute.arch.barrier()

    # ---- final state (after the last fold: S = Sb)
    for j in cutlass.range_constexpr(NJ):
        for e in cutlass.range_constexpr(4):
            kr = 16 * j + 4 * ks + e
            t2 = cute.make_rmem_tensor((2,), Float32)
            t2[0] = Sb[4 * j + e, 0]
            t2[1] = Sb[4 * j + e, 1]
            cute.autovec_copy(t2, cute.zipped_divide(mSt[bb, hv, kr, None], (2,))[(None, v0 // 2)])


@cute.jit
def _exp_acc(x: Float32) -> Float32:
    """exp(x) for x <= 0 to ~0.5 ulp: x = n ln2 + r (Cody-Waite), Taylor polynomial of exp(r) by Horner
    (contracted to FMAs), times 2^n built from exact power-of-two multiplies. The libdevice exp (range
    reduction + ex2.approx, ~1-2 ulp) is not used: see the module docstring."""
    x = cute.arch.fmax(x, Float32(-80.0))
    n = cute.math.floor(x * Float32(LOG2E) + Float32(0.5))
    r = (x - n * Float32(LN2_HI)) - n * Float32(LN2_LO)
    p = Float32(1.0 / math.factorial(EXP_DEG))
    for c in cutlass.range_constexpr(EXP_DEG - 1):
        p = p * r + Float32(1.0 / math.factorial(EXP_DEG - 1 - c))
    e = p * r + Float32(1.0)
    m = Float32(0.0) - n                      # 0 <= m <= 116, an integer
    for b in cutlass.range_constexpr(6, -1, -1):
        big = m >= Float32(2.0 ** b)
        e = cutlass.select_(big, e * Float32(2.0 ** -(2 ** b)), e)
        m = cutlass.select_(big, m - Float32(2.0 ** b), m)
    return e


@cute.jit
def _rsqrt_acc(x: Float32) -> Float32:
    """rsqrt.approx (~2 ulp) plus one Newton step with an FMA residual (~0.5-1 ulp)."""
    y = cute.math.rsqrt(x)
    t = x * y
    res = Float32(1.0) - t * y
    return y + (Float32(0.5) * y) * res


@cute.jit
def _fold(Sb: cute.Tensor, dS: cute.Tensor, gm: Float32):
    """Sb <- gm (Sb + dS), dS <- 0."""
    for idx in cutlass.range_constexpr(NE):
        for c in cutlass.range_constexpr(2):
            Sb[idx, c] = (Sb[idx, c] + dS[idx, c]) * gm
            dS[idx, c] = Float32(0.0)


@cute.jit
def _issue_raw(g2s: cute.CopyAtom, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, sRaw: cute.Tensor,
               bb: Int32, hk: Int32, hv: Int32, buf: Int32, t0: Int32, T: Int32, tidx: Int32):
    """cp.async of token rows t0..t0+31 (clamped to T-1) of q, k (head hk) and v (head hv) into buffer buf."""
    for i in cutlass.range_constexpr(RAW_PER_THREAD):
        cid = tidx + THREADS * i
        r = cid // CHUNKS_PER_ROW
        cc = cid % CHUNKS_PER_ROW
        tr = cutlass.min(t0 + r, T - 1)
        cute.copy(g2s, cute.zipped_divide(mQ[bb, tr, hk, None], (8,))[(None, cc)],
                  cute.zipped_divide(sRaw[buf, 0, r, None], (8,))[(None, cc)])
        cute.copy(g2s, cute.zipped_divide(mK[bb, tr, hk, None], (8,))[(None, cc)],
                  cute.zipped_divide(sRaw[buf, 1, r, None], (8,))[(None, cc)])
        cute.copy(g2s, cute.zipped_divide(mV[bb, tr, hv, None], (8,))[(None, cc)],
                  cute.zipped_divide(sRaw[buf, 2, r, None], (8,))[(None, cc)])


@cute.jit
def _prepare(sRaw: cute.Tensor, sNK: cute.Tensor, sNQ: cute.Tensor, sKQ: cute.Tensor, sBeta: cute.Tensor,
             sDec: cute.Tensor, buf: Int32, warp: Int32, lane: Int32, beta_reg: Float32, g_reg: Float32,
             scale: Float32):
    """Warp w: tokens 4w..4w+3 of raw buffer buf -> kn, qn (fp32), <kn, qn>; warp 0 stores beta, exp(g)."""
    for i in cutlass.range_constexpr(TOK_PER_WARP):
        t = warp * TOK_PER_WARP + i
        rq = cute.make_rmem_tensor((4,), BFloat16)
        rk = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.zipped_divide(sRaw[buf, 0, t, None], (4,))[(None, lane)], rq)
        cute.autovec_copy(cute.zipped_divide(sRaw[buf, 1, t, None], (4,))[(None, lane)], rk)
        q = rq.load().to(Float32)
        k = rk.load().to(Float32)
        qss = cute.arch.warp_reduction((q * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), _add)
        kss = cute.arch.warp_reduction((k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), _add)
        qinv = _rsqrt_acc(qss + Float32(L2_EPS)) * scale
        kinv = _rsqrt_acc(kss + Float32(L2_EPS))
        qn = q * qinv
        kn = k * kinv
        oq = cute.make_rmem_tensor((4,), Float32)
        ok = cute.make_rmem_tensor((4,), Float32)
        oq.store(qn)
        ok.store(kn)
        cute.autovec_copy(oq, cute.zipped_divide(sNQ[t, None], (4,))[(None, lane)])
        cute.autovec_copy(ok, cute.zipped_divide(sNK[t, None], (4,))[(None, lane)])
        kq = cute.arch.warp_reduction((qn * kn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), _add)
        if lane == 0:
            sKQ[t] = kq
    if warp == 0:
        sBeta[lane] = beta_reg
        sDec[lane] = _exp_acc(g_reg)


@cute.jit
def _gdr(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
         mS0: cute.Tensor, mO: cute.Tensor, mSt: cute.Tensor, scale: Float32, stream: cuda.CUstream):
    _gdr_kernel(mQ, mK, mV, mG, mBeta, mS0, mO, mSt, scale).launch(
        grid=[V_HEADS, mQ.shape[0], 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        b, t = cute.sym_int32(), cute.sym_int32()
        r4, r3 = (3, 2, 1, 0), (2, 1, 0)
        q = make_fake_compact_tensor(BFloat16, (b, t, QK_HEADS, D), stride_order=r4, assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (b, t, QK_HEADS, D), stride_order=r4, assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (b, t, V_HEADS, D), stride_order=r4, assumed_align=16)
        g = make_fake_compact_tensor(Float32, (b, t, V_HEADS), stride_order=r3, assumed_align=4)
        beta = make_fake_compact_tensor(BFloat16, (b, t, V_HEADS), stride_order=r3, assumed_align=2)
        s0 = make_fake_compact_tensor(Float32, (b, V_HEADS, D, D), stride_order=r4, assumed_align=16)
        o = make_fake_compact_tensor(BFloat16, (b, t, V_HEADS, D), stride_order=r4, assumed_align=16)
        st = make_fake_compact_tensor(Float32, (b, V_HEADS, D, D), stride_order=r4, assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_gdr, q, k, v, g, beta, s0, o, st, Float32(1.0), stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v, g, beta, initial_state, scale):
    b, t, hqk, d = q.shape
    hv = v.shape[2]
    assert (hqk, hv, d) == (QK_HEADS, V_HEADS, D)
    out = torch.empty((b, t, hv, d), dtype=v.dtype, device=q.device)
    if t == 0 or b == 0:
        return out, initial_state.to(torch.float32).clone()
    state = torch.empty((b, hv, D, D), dtype=torch.float32, device=q.device)
    _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), g.to(torch.float32).contiguous(),
                    beta.contiguous(), initial_state.to(torch.float32).contiguous(), out, state, float(scale))
    return out, state
