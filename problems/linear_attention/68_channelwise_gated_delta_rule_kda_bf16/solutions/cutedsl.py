"""Kimi Delta Attention (KDA: delta rule with a per-key-channel decay; 16 heads, d = 128, zero initial
state) in CuTe DSL: the exact token-by-token recurrence in fp32 on CUDA cores, with the state held in
registers for the whole sequence (same structure as the problem-74 DeltaNet kernel).

Algebra per head, for every value column v independently (columns never interact), a_t = exp(g_t):
    S[:, v] <- a_t * S[:, v]  (per key row),   dk_v = <S[:, v], kn>,  sq_v = <S[:, v], qn>,
    u_v = beta (v_v - dk_v),   S[:, v] += kn u_v,   o_v = sq_v + u_v <kn, qn>   (= S_new[:, v] . qn)
Only o (bf16) is compared, so plain fp32 state updates are accurate enough (torch emulation of this
scheme: 0.11x the allowance).

Launch geometry
- Grid: one CTA per (batch, head) = 128 CTAs (one per SM), 256 threads = 8 warps. Warp w owns value
  columns 16w..16w+15; lane = 4p + ks owns columns v0 = 16w + 2p, v0 + 1 and the key rows
  k = 16j + 4ks + e (j < 8, e < 4): 64 fp32 of S in registers.
- Tokens are processed in blocks of 32. Raw q/k/v/g rows (bf16; consecutive tokens of a head are
  H*128 elements apart) are brought in with cp.async (16 B per copy, double-buffered: block i+1 is in
  flight while block i is computed); beta is prefetched into a register. After a CTA barrier each warp
  prepares 4 tokens (warp-shuffle sums of squares; kn = k / max(|k|, 1e-12),
  qn = q / max(|q|, 1e-12) * 128^-0.5, <kn, qn>, a = exp(g)) into fp32 shared tiles.
- Per token a thread reads its 32 a, kn and qn values (3 x 8 conflict-free ld.shared.v4: the 4 lanes of
  a column pair read 64 contiguous bytes), decays its 64 state values (64 FMUL), does 128 FMAs for its
  partial dk/sq (4 accumulators each), sums them over the 4 ks lanes with 2 xor shuffles, then u, o and
  64 FMAs into S. o (bf16 pairs) goes to a shared 32 x 128 tile that is written to global with 16-byte
  stores after the block.
What limits it: fp32 issue rate on 128 SMs: per token and thread ~260 FP instructions + 24 LDS + 8
shuffles; ~1024 x 8 warps x 300 / 4 issue slots ~ 0.6 M cycles ~ 0.33 ms. The SOL model (tensor-core
chunked form, 2.15e10 FLOP, 168 MB) gives ~0.035 ms; the obvious next step towards it is the chunked form
on tensor cores (intra-chunk per-channel decay products in bf16 MMAs, fp32 state between chunks), which
the bf16 output tolerance would allow. Expected ~0.3-0.35 ms (eager runs tens of kernels per chunk).
Host path: compiled once per process (tvm-ffi; batch and T symbolic), torch tensors passed directly,
launch on the caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

HEADS = 16
D = 128
TB = 32                        # tokens per block
THREADS = 256
NWARPS = THREADS // 32
KS = 4                         # lanes sharing a column pair (split of the key axis)
NJ = D // (4 * KS)             # 8 groups of 4 key rows per lane
NE = NJ * 4                    # 32 key rows per lane
Q_SCALE = D ** -0.5
NORM_EPS = 1e-12
NRAW = 4                       # q, k, v, g
CHUNKS_PER_ROW = D // 8        # 16-byte chunks in a bf16 row
RAW_CHUNKS = TB * CHUNKS_PER_ROW          # 512 per tensor per block
RAW_PER_THREAD = RAW_CHUNKS // THREADS    # 2
TOK_PER_WARP = TB // NWARPS               # 4 tokens prepared per warp


def _add(a, b):
    return a + b


@cute.kernel
def _kda_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    hh, bb, _ = cute.arch.block_idx()
    T = mQ.shape[1]
    warp = tidx // 32
    lane = tidx % 32
    p = lane // KS
    ks = lane % KS
    v0 = warp * 16 + 2 * p

    smem = cutlass.utils.SmemAllocator()
    # raw bf16 rows: [buffer, tensor (q, k, v, g), token, d]
    sRaw = smem.allocate_tensor(BFloat16, cute.make_layout((2, NRAW, TB, D),
                                                           stride=(NRAW * TB * D, TB * D, D, 1)),
                                byte_alignment=128)
    sNK = smem.allocate_tensor(Float32, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sNQ = smem.allocate_tensor(Float32, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sA = smem.allocate_tensor(Float32, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sO = smem.allocate_tensor(BFloat16, cute.make_layout((TB, D), stride=(D, 1)), byte_alignment=128)
    sKQ = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)
    sBeta = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)

    g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)

    # S[idx, c] = S[k(idx), v0 + c], k(idx) = 16 j + 4 ks + e, idx = 4 j + e; zero initial state
    S = cute.make_rmem_tensor((NE, 2), Float32)
    S.fill(0.0)

    nb = (T + TB - 1) // TB

    # ---- prologue: block 0
    _issue_raw(g2s, mQ, mK, mV, mG, sRaw, bb, hh, Int32(0), Int32(0), T, tidx)
    cute.arch.cp_async_commit_group()
    beta_reg = Float32(mBeta[bb, cutlass.min(lane, T - 1), hh])
    cute.arch.cp_async_wait_group(0)
    cute.arch.barrier()
    _prepare(sRaw, sNK, sNQ, sA, sKQ, sBeta, Int32(0), warp, lane, beta_reg)
    cute.arch.barrier()

    for blk in cutlass.range(nb):
        buf = blk % 2
        t0 = blk * TB
        if blk + 1 < nb:
            _issue_raw(g2s, mQ, mK, mV, mG, sRaw, bb, hh, 1 - buf, t0 + TB, T, tidx)
            beta_reg = Float32(mBeta[bb, cutlass.min(t0 + TB + lane, T - 1), hh])
        cute.arch.cp_async_commit_group()
        n = cutlass.min(T - t0, TB)

        for tt in cutlass.range(n):
            kq = sKQ[tt]
            beta = sBeta[tt]
            vr = cute.make_rmem_tensor((2,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(sRaw[buf, 2, tt, None], (2,))[(None, v0 // 2)], vr)
            vv = vr.load().to(Float32)
            kreg = cute.make_rmem_tensor((NE,), Float32)
            acc = cute.make_rmem_tensor((4, 4), Float32)   # [dk0, dk1, sq0, sq1] x 4 partials
            acc.fill(0.0)
            gK = cute.zipped_divide(sNK[tt, None], (4,))
            gQ = cute.zipped_divide(sNQ[tt, None], (4,))
            gA = cute.zipped_divide(sA[tt, None], (4,))
            for j in cutlass.range_constexpr(NJ):
                k4 = cute.make_rmem_tensor((4,), Float32)
                q4 = cute.make_rmem_tensor((4,), Float32)
                a4 = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(gK[(None, 4 * j + ks)], k4)
                cute.autovec_copy(gQ[(None, 4 * j + ks)], q4)
                cute.autovec_copy(gA[(None, 4 * j + ks)], a4)
                for e in cutlass.range_constexpr(4):
                    kreg[4 * j + e] = k4[e]
                    for c in cutlass.range_constexpr(2):
                        s = S[4 * j + e, c] * a4[e]
                        S[4 * j + e, c] = s
                        acc[c, e] = acc[c, e] + s * k4[e]
                        acc[2 + c, e] = acc[2 + c, e] + s * q4[e]
            red = []
            for r in cutlass.range_constexpr(4):
                x = (acc[r, 0] + acc[r, 1]) + (acc[r, 2] + acc[r, 3])
                x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
                x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
                red.append(x)
            u0 = beta * (vv[0] - red[0])
            u1 = beta * (vv[1] - red[1])
            for idx in cutlass.range_constexpr(NE):
                S[idx, 0] = S[idx, 0] + kreg[idx] * u0
                S[idx, 1] = S[idx, 1] + kreg[idx] * u1
            if ks == 0:
                ob = cute.make_rmem_tensor((2,), BFloat16)
                ob[0] = (red[2] + u0 * kq).to(BFloat16)
                ob[1] = (red[3] + u1 * kq).to(BFloat16)
                cute.autovec_copy(ob, cute.zipped_divide(sO[tt, None], (2,))[(None, v0 // 2)])

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
                cute.autovec_copy(t8, cute.zipped_divide(mO[bb, t0 + r, hh, None], (8,))[(None, cc)])
        if blk + 1 < nb:
            _prepare(sRaw, sNK, sNQ, sA, sKQ, sBeta, 1 - buf, warp, lane, beta_reg)
        cute.arch.barrier()


@cute.jit
def _issue_raw(g2s: cute.CopyAtom, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
               sRaw: cute.Tensor, bb: Int32, hh: Int32, buf: Int32, t0: Int32, T: Int32, tidx: Int32):
    """cp.async of token rows t0..t0+31 (clamped to T-1) of q, k, v, g (head hh) into raw buffer buf."""
    for i in cutlass.range_constexpr(RAW_PER_THREAD):
        cid = tidx + THREADS * i
        r = cid // CHUNKS_PER_ROW
        cc = cid % CHUNKS_PER_ROW
        tr = cutlass.min(t0 + r, T - 1)
        for ti, mX in enumerate((mQ, mK, mV, mG)):
            cute.copy(g2s, cute.zipped_divide(mX[bb, tr, hh, None], (8,))[(None, cc)],
                      cute.zipped_divide(sRaw[buf, ti, r, None], (8,))[(None, cc)])


@cute.jit
def _prepare(sRaw: cute.Tensor, sNK: cute.Tensor, sNQ: cute.Tensor, sA: cute.Tensor, sKQ: cute.Tensor,
             sBeta: cute.Tensor, buf: Int32, warp: Int32, lane: Int32, beta_reg: Float32):
    """Warp w: tokens 4w..4w+3 of raw buffer buf -> kn, qn, exp(g) (fp32), <kn, qn>; warp 0 stores beta."""
    for i in cutlass.range_constexpr(TOK_PER_WARP):
        t = warp * TOK_PER_WARP + i
        rq = cute.make_rmem_tensor((4,), BFloat16)
        rk = cute.make_rmem_tensor((4,), BFloat16)
        rg = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.zipped_divide(sRaw[buf, 0, t, None], (4,))[(None, lane)], rq)
        cute.autovec_copy(cute.zipped_divide(sRaw[buf, 1, t, None], (4,))[(None, lane)], rk)
        cute.autovec_copy(cute.zipped_divide(sRaw[buf, 3, t, None], (4,))[(None, lane)], rg)
        q = rq.load().to(Float32)
        k = rk.load().to(Float32)
        qss = cute.arch.warp_reduction((q * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), _add)
        kss = cute.arch.warp_reduction((k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), _add)
        qinv = Float32(Q_SCALE) / cute.arch.fmax(cute.math.sqrt(qss), Float32(NORM_EPS))
        kinv = Float32(1.0) / cute.arch.fmax(cute.math.sqrt(kss), Float32(NORM_EPS))
        qn = q * qinv
        kn = k * kinv
        oq = cute.make_rmem_tensor((4,), Float32)
        ok = cute.make_rmem_tensor((4,), Float32)
        oa = cute.make_rmem_tensor((4,), Float32)
        oq.store(qn)
        ok.store(kn)
        for e in cutlass.range_constexpr(4):
            oa[e] = cute.math.exp(Float32(rg[e]))
        cute.autovec_copy(oq, cute.zipped_divide(sNQ[t, None], (4,))[(None, lane)])
        cute.autovec_copy(ok, cute.zipped_divide(sNK[t, None], (4,))[(None, lane)])
        cute.autovec_copy(oa, cute.zipped_divide(sA[t, None], (4,))[(None, lane)])
        kq = cute.arch.warp_reduction((qn * kn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), _add)
        if lane == 0:
            sKQ[t] = kq
    if warp == 0:
        sBeta[lane] = beta_reg


@cute.jit
def _kda(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
         mO: cute.Tensor, stream: cuda.CUstream):
    _kda_kernel(mQ, mK, mV, mG, mBeta, mO).launch(
        grid=[HEADS, mQ.shape[0], 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        b, t = cute.sym_int32(), cute.sym_int32()
        row4 = (3, 2, 1, 0)
        q, k, v, g, o = (make_fake_compact_tensor(BFloat16, (b, t, HEADS, D), stride_order=row4, assumed_align=16)
                         for _ in range(5))
        beta = make_fake_compact_tensor(BFloat16, (b, t, HEADS), stride_order=(2, 1, 0), assumed_align=2)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_kda, q, k, v, g, beta, o, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v, g, beta):
    b, t, h, d = q.shape
    assert (h, d) == (HEADS, D)
    out = torch.empty((b, t, h, d), dtype=v.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), out)
    return out
