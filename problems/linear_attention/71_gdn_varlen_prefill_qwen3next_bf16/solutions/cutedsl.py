"""Gated DeltaNet varlen prefill (Qwen3-Next, 8 q/k heads, 16 v heads, head dim 128) as one CuTe DSL
kernel: the exact token-by-token recurrence, with the state kept in registers. Same algorithm, launch
geometry and precision scheme as the TIRx solution of this problem (which passed on the H200 at
0.349 ms device time).

Algorithm
- The value columns of a head's state are independent: with S = state^T [K, V], column v obeys
  S[:, v] <- a S[:, v] + k * beta (v_v - a S[:, v].k)   and   o_v = S[:, v].(scale q).
  Grid: (8 value slices of 16 columns, 16 value heads, N sequences), 128 threads = 4 warps per CTA;
  each warp owns 4 columns. Lane l of a warp owns column 4 warp + l // 8 and the 16 k-rows
  {32 j + 4 (l % 8) + i : j, i < 4} of it (16-byte groups interleaved so that the 8 lanes of a
  column read 8 distinct bank quads of shared memory; the other 24 lanes read the same addresses as
  broadcasts). The carried state is read from / written to the k-last fp32 layout with 16-byte
  vector accesses (each column is one contiguous 512-byte row).
- Per token: partial dots S.k and S.q over the lane's 16 rows (4 independent FMA chains each), summed
  over the column's 8 lanes with 3 xor shuffles (offsets 4, 2, 1); d = beta (v - a S.k);
  o = a S.q + (k.q) d (= S_new.q); then the rank-1 update of the lane's 16 state entries.
- State precision: a compensated pair hi + lo (float-float) per entry, because plain fp32 rounding
  over ~900 sequential steps reached the fp32 tolerance on new_state in an emulation:
  kd' = a lo + k d; hi' = fma(a, hi, kd'); lo' = fma(a, hi, -hi') + kd' (the fma residual is the exact
  rounding error of a hi, up to the tiny rounding of kd'), with explicit fused multiply-adds so that
  the residual is not lost to a compiler rewrite. new_state = hi + lo; the dots use hi only.
- Token staging: blocks of 16 tokens. For each block the CTA stages in shared memory k and scale*q as
  fp32 [16 x 128] (16-byte global loads, 2 + 2 per thread), the CTA's 16 columns of v, the gates
  alpha = exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b) (in fp64, as in the TIRx
  kernel) and k.q (16-lane shuffle reduction). Double-buffered: the global loads of block n+1 are
  issued into registers before the token loop of block n and written to the other buffer after it;
  one barrier per block. Outputs of a block go through shared memory and are written one block later
  as 16-byte bf16 vectors.
- Sequences are independent CTAs (the grid's z index); a CTA reads its bounds from cu_seqlens, so there
  is no host synchronisation. Empty sequences copy their state.
Differences from the TIRx version: none in the algorithm. Tokens past a sequence's end are loaded from
a clamped (valid) row and zeroed when staged, instead of branching around the load.
What limits it / expected time: like the TIRx kernel (0.35 ms device on the H200, 5x its own issue
estimate): the 890-token sequence's 128 CTAs leave one warp per scheduler, so the per-token latency
chain (shared loads, FMA chains, 3 dependent shuffle rounds, the compensated update) is exposed. Far
faster than eager (5.0 ms) and torch.compile (4.0 ms); far from the chunked-form SOL (0.004 ms).
Host path: compiled once per process (tvm-ffi; token and sequence counts symbolic), torch tensors
passed directly, launch on the caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32

HQ = 8
HV = 16
D = 128
TB = 16                         # tokens per staged block
COLS = 16                       # value columns per CTA
NSLICE = D // COLS              # 8 CTAs per (sequence, head)
THREADS = 128
KG = 8                          # lanes per column
KP = D // KG                    # state rows per lane (16)
VEC = 8                         # bf16 per 16-byte access


@cute.kernel
def _gdn_prefill_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mST: cute.Tensor,
                        mAlog: cute.Tensor, mA: cute.Tensor, mDtb: cute.Tensor, mB: cute.Tensor,
                        mCu: cute.Tensor, mO: cute.Tensor, mNS: cute.Tensor, scale: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    vs, h, sq = cute.arch.block_idx()
    warp = tidx // 32
    lane = tidx % 32
    hk = h // (HV // HQ)
    kg = lane % KG
    col = warp * 4 + lane // KG                 # column within the CTA's slice
    vcol = vs * COLS + col                      # value column of the head
    bos = Int32(mCu[sq])
    eos = Int32(mCu[sq + 1])
    seqlen = eos - bos
    nblk = (seqlen + TB - 1) // TB
    s_tok = tidx // 16                          # + 8 r: token of this thread's k/q vectors
    s_ch = tidx % 16                            # 16-byte chunk of the row
    v_tok = tidx // 2                           # v / output rows (threads 0..31)
    v_ch = vs * 2 + tidx % 2                    # 16-byte chunk of the v / o row

    smem = cutlass.utils.SmemAllocator()
    sK = smem.allocate_tensor(Float32, cute.make_layout((2, TB, D), stride=(TB * D, D, 1)), byte_alignment=16)
    sQ = smem.allocate_tensor(Float32, cute.make_layout((2, TB, D), stride=(TB * D, D, 1)), byte_alignment=16)
    sV = smem.allocate_tensor(Float32, cute.make_layout((2, TB, COLS), stride=(TB * COLS, COLS, 1)),
                              byte_alignment=16)
    sG = smem.allocate_tensor(Float32, cute.make_layout((2, 3, TB), stride=(3 * TB, TB, 1)),
                              byte_alignment=16)                 # alpha, beta, k.(scale q)
    sO = smem.allocate_tensor(Float32, cute.make_layout((2, TB, COLS), stride=(TB * COLS, COLS, 1)),
                              byte_alignment=16)

    # hi[i, j], lo[i, j]: state row 32 j + 4 kg + i of column vcol
    hi = cute.make_rmem_tensor((4, 4), Float32)
    lo = cute.make_rmem_tensor((4, 4), Float32)
    kr = cute.make_rmem_tensor((4, 4), Float32)
    qr = cute.make_rmem_tensor((4, 4), Float32)
    kraw = cute.make_rmem_tensor((VEC, 2), BFloat16)
    qraw = cute.make_rmem_tensor((VEC, 2), BFloat16)
    vraw = cute.make_rmem_tensor((VEC,), BFloat16)
    graw = cute.make_rmem_tensor((2,), Float32)
    gST = cute.zipped_divide(mST[sq, h, vcol, None], (4,))
    for j in cutlass.range_constexpr(4):
        cute.autovec_copy(gST[(None, j * 8 + kg)], hi[None, j])
    lo.fill(0.0)

    for blk in cutlass.range(nblk + 1):
        # blk == 0: prologue (stage block 0). blk >= 1: process block blk - 1 from buffer (blk - 1) % 2
        # while block blk is loaded, then stage block blk into buffer blk % 2.
        tb = bos + blk * TB
        if blk < nblk:
            for r in cutlass.range_constexpr(2):
                tk = cutlass.min(tb + s_tok + 8 * r, eos - 1)
                cute.autovec_copy(cute.zipped_divide(mK[tk, hk, None], (VEC,))[(None, s_ch)], kraw[None, r])
                cute.autovec_copy(cute.zipped_divide(mQ[tk, hk, None], (VEC,))[(None, s_ch)], qraw[None, r])
            if tidx < 2 * TB:
                tv = cutlass.min(tb + v_tok, eos - 1)
                cute.autovec_copy(cute.zipped_divide(mV[tv, h, None], (VEC,))[(None, v_ch)], vraw)
            if tidx < TB:
                tg = cutlass.min(tb + tidx, eos - 1)
                graw[0] = Float32(mA[tg, h])
                graw[1] = Float32(mB[tg, h])

        if blk > 0:
            cur = (blk - 1) % 2
            ntok = cutlass.min(TB, seqlen - (blk - 1) * TB)
            for t in cutlass.range(ntok):
                for j in cutlass.range_constexpr(4):
                    cute.autovec_copy(cute.zipped_divide(sK[cur, t, None], (4,))[(None, j * 8 + kg)], kr[None, j])
                    cute.autovec_copy(cute.zipped_divide(sQ[cur, t, None], (4,))[(None, j * 8 + kg)], qr[None, j])
                pk = []
                pq = []
                for j in cutlass.range_constexpr(4):
                    a_k = hi[0, j] * kr[0, j]
                    a_q = hi[0, j] * qr[0, j]
                    for i in cutlass.range_constexpr(1, 4):
                        a_k = a_k + hi[i, j] * kr[i, j]
                        a_q = a_q + hi[i, j] * qr[i, j]
                    pk.append(a_k)
                    pq.append(a_q)
                p1 = (pk[0] + pk[1]) + (pk[2] + pk[3])
                p2 = (pq[0] + pq[1]) + (pq[2] + pq[3])
                for s in cutlass.range_constexpr(3):
                    p1 = p1 + cute.arch.shuffle_sync_bfly(p1, offset=4 >> s)
                    p2 = p2 + cute.arch.shuffle_sync_bfly(p2, offset=4 >> s)
                alpha = sG[cur, 0, t]
                d = sG[cur, 1, t] * (sV[cur, t, col] - alpha * p1)
                o = alpha * p2 + sG[cur, 2, t] * d
                if kg == 0:
                    sO[cur, t, col] = o
                for j in cutlass.range_constexpr(4):
                    for i in cutlass.range_constexpr(4):
                        kd = alpha * lo[i, j] + kr[i, j] * d
                        f0 = cute.math.fma(alpha, hi[i, j], kd)
                        f1 = cute.math.fma(alpha, hi[i, j], -f0)
                        lo[i, j] = f1 + kd
                        hi[i, j] = f0
            if blk > 1:
                # outputs of block blk - 2 (buffer blk % 2, complete since the last barrier)
                pt = bos + (blk - 2) * TB
                if tidx < 2 * TB:
                    if pt + v_tok < eos:
                        of = cute.make_rmem_tensor((VEC,), Float32)
                        cute.autovec_copy(cute.zipped_divide(sO[blk % 2, v_tok, None], (VEC,))[(None, tidx % 2)], of)
                        ob = cute.make_rmem_tensor((VEC,), BFloat16)
                        ob.store(of.load().to(BFloat16))
                        cute.autovec_copy(ob, cute.zipped_divide(mO[pt + v_tok, h, None], (VEC,))[(None, v_ch)])

        if blk < nblk:
            nb = blk % 2
            for r in cutlass.range_constexpr(2):
                ok = tb + s_tok + 8 * r < eos
                kf = cute.make_rmem_tensor((VEC,), Float32)
                qf = cute.make_rmem_tensor((VEC,), Float32)
                part = Float32(0.0)
                for i in cutlass.range_constexpr(VEC):
                    kx = Float32(cutlass.select_(ok, Float32(kraw[i, r]), Float32(0.0)))
                    qx = Float32(cutlass.select_(ok, Float32(qraw[i, r]), Float32(0.0))) * scale
                    kf[i] = kx
                    qf[i] = qx
                    part = part + kx * qx
                cute.autovec_copy(kf, cute.zipped_divide(sK[nb, s_tok + 8 * r, None], (VEC,))[(None, s_ch)])
                cute.autovec_copy(qf, cute.zipped_divide(sQ[nb, s_tok + 8 * r, None], (VEC,))[(None, s_ch)])
                for s in cutlass.range_constexpr(4):
                    part = part + cute.arch.shuffle_sync_bfly(part, offset=8 >> s)
                if tidx % 16 == 0:
                    sG[nb, 2, s_tok + 8 * r] = part
            if tidx < 2 * TB:
                okv = tb + v_tok < eos
                vf = cute.make_rmem_tensor((VEC,), Float32)
                for i in cutlass.range_constexpr(VEC):
                    vf[i] = Float32(cutlass.select_(okv, Float32(vraw[i]), Float32(0.0)))
                cute.autovec_copy(vf, cute.zipped_divide(sV[nb, v_tok, None], (VEC,))[(None, tidx % 2)])
            if tidx < TB:
                # gates in fp64, as in the TIRx kernel
                x = Float64(graw[0]) + Float64(mDtb[h])
                sp = x
                if x <= Float64(20.0):
                    sp = cute.math.log1p(cute.math.exp(x))
                lg = -cute.math.exp(Float64(mAlog[h])) * sp
                sG[nb, 0, tidx] = Float32(cute.math.exp(lg))
                sG[nb, 1, tidx] = Float32(Float64(1.0) / (Float64(1.0) + cute.math.exp(-Float64(graw[1]))))
        cute.arch.barrier()

    # outputs of the last block (buffer (nblk - 1) % 2)
    if nblk > 0:
        lt = bos + (nblk - 1) * TB
        if tidx < 2 * TB:
            if lt + v_tok < eos:
                of2 = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(cute.zipped_divide(sO[(nblk - 1) % 2, v_tok, None], (VEC,))[(None, tidx % 2)], of2)
                ob2 = cute.make_rmem_tensor((VEC,), BFloat16)
                ob2.store(of2.load().to(BFloat16))
                cute.autovec_copy(ob2, cute.zipped_divide(mO[lt + v_tok, h, None], (VEC,))[(None, v_ch)])

    for j in cutlass.range_constexpr(4):
        for i in cutlass.range_constexpr(4):
            hi[i, j] = hi[i, j] + lo[i, j]
    gNS = cute.zipped_divide(mNS[sq, h, vcol, None], (4,))
    for j in cutlass.range_constexpr(4):
        cute.autovec_copy(hi[None, j], gNS[(None, j * 8 + kg)])


@cute.jit
def _gdn_prefill(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mST: cute.Tensor, mAlog: cute.Tensor,
                 mA: cute.Tensor, mDtb: cute.Tensor, mB: cute.Tensor, mCu: cute.Tensor, mO: cute.Tensor,
                 mNS: cute.Tensor, scale: Float32, stream: cuda.CUstream):
    nseq = mST.shape[0]
    _gdn_prefill_kernel(mQ, mK, mV, mST, mAlog, mA, mDtb, mB, mCu, mO, mNS, scale).launch(
        grid=[NSLICE, HV, nseq], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        tot, n, n1 = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (tot, HQ, D), stride_order=(2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (tot, HQ, D), stride_order=(2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (tot, HV, D), stride_order=(2, 1, 0), assumed_align=16)
        st = make_fake_compact_tensor(Float32, (n, HV, D, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        alog = make_fake_compact_tensor(Float32, (HV,), assumed_align=4)
        a = make_fake_compact_tensor(BFloat16, (tot, HV), stride_order=(1, 0), assumed_align=2)
        dtb = make_fake_compact_tensor(Float32, (HV,), assumed_align=4)
        b = make_fake_compact_tensor(BFloat16, (tot, HV), stride_order=(1, 0), assumed_align=2)
        cu = make_fake_compact_tensor(cutlass.Int64, (n1,), assumed_align=8)
        o = make_fake_compact_tensor(BFloat16, (tot, HV, D), stride_order=(2, 1, 0), assumed_align=16)
        ns = make_fake_compact_tensor(Float32, (n, HV, D, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_gdn_prefill, q, k, v, st, alog, a, dtb, b, cu, o, ns, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, A_log: torch.Tensor,
          a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor, cu_seqlens: torch.Tensor,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = q.shape[0]
    nseq = cu_seqlens.shape[0] - 1
    output = torch.empty((total, HV, D), dtype=q.dtype, device=q.device)
    new_state = torch.empty((nseq, HV, D, D), dtype=torch.float32, device=q.device)
    if nseq == 0:
        return output, new_state
    if total == 0:
        new_state.copy_(state)
        return output, new_state
    cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), state.contiguous().float(),
                    A_log.contiguous().float(), a.contiguous(), dt_bias.contiguous().float(), b.contiguous(),
                    cu.contiguous(), output, new_state, float(scale))
    return output, new_state
