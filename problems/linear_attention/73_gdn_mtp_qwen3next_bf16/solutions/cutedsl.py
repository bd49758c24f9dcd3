"""Gated DeltaNet multi-token (draft verification) step (Qwen3-Next, 8 q/k heads, 16 v heads, head dim
128) as one CuTe DSL kernel: every per-token state is written straight from registers. Same algorithm,
launch geometry and precision scheme as the TIRx solution of this problem (which passed on the H200 at
0.050 ms device time, 70% of the DRAM speed of light).

Algorithm
- The value columns of a head's state are independent: with S = state^T [K, V], column v obeys
  S[:, v] <- a S[:, v];  S[:, v] += k beta (v_v - S[:, v].k);  o_v = scale S[:, v].q.
  Grid: (4 value slices of 32 columns, 16 value heads, B requests), 256 threads = 8 warps; warp w owns
  columns 4w .. 4w+3 of the slice. Lane l owns column 4w + l // 8 and its 16 k-rows
  {32 j + 4 (l % 8) + i : j, i < 4}: the pool state (k-last, each column one contiguous 512-byte row)
  is read with 4 16-byte loads per lane, and each per-token state is written with 4 16-byte stores per
  lane; per store instruction the 8 lanes of a column cover one contiguous 128-byte line.
- Per chunk of up to 8 tokens (one chunk at the full size, T = 4): warp t % 8 prepares token t: it loads
  k and q of head h // 2 (8 bytes per lane; tokens past T read a clamped row and are zeroed), sums the
  squares over the warp (5 xor shuffles), and stores the L2-normalized k and scale * normalized q as
  fp32 in shared memory, together with the CTA's 32 v values and the gates
  alpha = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b). rsqrt and the gates are evaluated
  in fp64 and rounded once, as in the TIRx kernel (the states are compared at fp32 precision). One
  barrier, then every lane runs the tokens of the chunk in the reference's order: S = a S; p = S.k
  (4 independent FMA chains, then 3 xor shuffles over the column's 8 lanes); d = beta (v - p);
  S = S + d k; o = S.(scale q) (same reduction); store S; lane 0 of the column puts o in shared memory.
  After a second barrier the outputs of the chunk are written as 16-byte bf16 vectors.
- The pool is only read (gathered through initial_state_indices); nothing is written back to it.
Differences from the TIRx version: none in the algorithm (tokens past T are loaded from a clamped row and
zeroed instead of branching around the load).
What limits it: DRAM traffic (32 pool states read, 33.5 MB; 4 x 32 states written, 134 MB); SOL ~35 us;
the TIRx kernel measured 50 us of device time; expected about the same. Faster than eager (1.05 ms) and
torch.compile (0.84 ms); the end-to-end time is dominated by the host path at this size.
Host path: compiled once per process (tvm-ffi; batch, tokens and pool size symbolic), torch tensors passed
directly, launch on the caller's current torch stream.

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
COLS = 32                       # value columns per CTA
NSLICE = D // COLS              # 4
THREADS = 256
WARPS = THREADS // 32
KG = 8                          # lanes per column
TCH = 8                         # tokens per chunk (one warp prepares one token)
L2_EPS = 1e-6


@cute.kernel
def _gdn_mtp_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mST: cute.Tensor, mIdx: cute.Tensor,
                    mAlog: cute.Tensor, mA: cute.Tensor, mDtb: cute.Tensor, mB: cute.Tensor, mO: cute.Tensor,
                    mNS: cute.Tensor, scale: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    vs, h, bi = cute.arch.block_idx()
    warp = tidx // 32
    lane = tidx % 32
    ntok = mQ.shape[1]
    hk = h // (HV // HQ)
    kg = lane % KG
    col = warp * 4 + lane // KG
    vcol = vs * COLS + col
    slot = Int32(mIdx[bi])

    smem = cutlass.utils.SmemAllocator()
    sK = smem.allocate_tensor(Float32, cute.make_layout((TCH, D), stride=(D, 1)), byte_alignment=16)
    sQ = smem.allocate_tensor(Float32, cute.make_layout((TCH, D), stride=(D, 1)), byte_alignment=16)
    sV = smem.allocate_tensor(Float32, cute.make_layout((TCH, COLS), stride=(COLS, 1)), byte_alignment=16)
    sG = smem.allocate_tensor(Float32, cute.make_layout((TCH, 2), stride=(2, 1)), byte_alignment=16)
    sO = smem.allocate_tensor(Float32, cute.make_layout((TCH, COLS), stride=(COLS, 1)), byte_alignment=16)

    # s[i, j]: state row 32 j + 4 kg + i of column vcol (pool loads in flight during the preparation)
    s = cute.make_rmem_tensor((4, 4), Float32)
    kr = cute.make_rmem_tensor((4, 4), Float32)
    qr = cute.make_rmem_tensor((4, 4), Float32)
    gST = cute.zipped_divide(mST[slot, h, vcol, None], (4,))
    for j in cutlass.range_constexpr(4):
        cute.autovec_copy(gST[(None, j * 8 + kg)], s[None, j])

    for ch in cutlass.range((ntok + TCH - 1) // TCH):
        # ---- preparation: warp w handles token ch * 8 + w
        tp = ch * TCH + warp
        ok = tp < ntok
        tc = cutlass.min(tp, ntok - 1)
        kv = cute.make_rmem_tensor((4,), BFloat16)
        qv = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.zipped_divide(mK[bi, tc, hk, None], (4,))[(None, lane)], kv)
        cute.autovec_copy(cute.zipped_divide(mQ[bi, tc, hk, None], (4,))[(None, lane)], qv)
        kf = cute.make_rmem_tensor((4,), Float32)
        qf = cute.make_rmem_tensor((4,), Float32)
        kss = Float32(0.0)
        qss = Float32(0.0)
        for i in cutlass.range_constexpr(4):
            kx = Float32(cutlass.select_(ok, Float32(kv[i]), Float32(0.0)))
            qx = Float32(cutlass.select_(ok, Float32(qv[i]), Float32(0.0)))
            kf[i] = kx
            qf[i] = qx
            kss = kss + kx * kx
            qss = qss + qx * qx
        for r in cutlass.range_constexpr(5):   # all warps shuffle (idle ones on zeros): converged
            kss = kss + cute.arch.shuffle_sync_bfly(kss, offset=16 >> r)
            qss = qss + cute.arch.shuffle_sync_bfly(qss, offset=16 >> r)
        if ok:
            # rsqrt(sum + eps) in fp64, rounded once to fp32
            kinv = Float32(Float64(1.0) / cute.math.sqrt(Float64(kss + Float32(L2_EPS))))
            qinv = Float32(Float64(1.0) / cute.math.sqrt(Float64(qss + Float32(L2_EPS))))
            for i in cutlass.range_constexpr(4):
                kf[i] = kf[i] * kinv
                qf[i] = (qf[i] * qinv) * scale
            cute.autovec_copy(kf, cute.zipped_divide(sK[warp, None], (4,))[(None, lane)])
            cute.autovec_copy(qf, cute.zipped_divide(sQ[warp, None], (4,))[(None, lane)])
            sV[warp, lane] = Float32(mV[bi, tp, h, vs * COLS + lane])
            if lane == 0:
                x = Float64(Float32(mA[bi, tp, h])) + Float64(mDtb[h])
                sp = x
                if x <= Float64(20.0):
                    sp = cute.math.log1p(cute.math.exp(x))
                lg = -cute.math.exp(Float64(mAlog[h])) * sp
                sG[warp, 0] = Float32(cute.math.exp(lg))
                sG[warp, 1] = Float32(Float64(1.0) / (Float64(1.0) + cute.math.exp(-Float64(Float32(mB[bi, tp, h])))))
        cute.arch.barrier()

        # ---- the recurrence over the chunk's tokens
        for tl in cutlass.range(cutlass.min(TCH, ntok - ch * TCH)):
            t = ch * TCH + tl
            for j in cutlass.range_constexpr(4):
                cute.autovec_copy(cute.zipped_divide(sK[tl, None], (4,))[(None, j * 8 + kg)], kr[None, j])
                cute.autovec_copy(cute.zipped_divide(sQ[tl, None], (4,))[(None, j * 8 + kg)], qr[None, j])
            alpha = sG[tl, 0]
            for j in cutlass.range_constexpr(4):
                for i in cutlass.range_constexpr(4):
                    s[i, j] = alpha * s[i, j]
            pk = []
            for j in cutlass.range_constexpr(4):
                acc = s[0, j] * kr[0, j]
                for i in cutlass.range_constexpr(1, 4):
                    acc = acc + s[i, j] * kr[i, j]
                pk.append(acc)
            p = (pk[0] + pk[1]) + (pk[2] + pk[3])
            for r in cutlass.range_constexpr(3):
                p = p + cute.arch.shuffle_sync_bfly(p, offset=4 >> r)
            d = sG[tl, 1] * (sV[tl, col] - p)
            for j in cutlass.range_constexpr(4):
                for i in cutlass.range_constexpr(4):
                    s[i, j] = s[i, j] + d * kr[i, j]
            gNS = cute.zipped_divide(mNS[bi, t, h, vcol, None], (4,))
            for j in cutlass.range_constexpr(4):
                cute.autovec_copy(s[None, j], gNS[(None, j * 8 + kg)])
            pq = []
            for j in cutlass.range_constexpr(4):
                acc = s[0, j] * qr[0, j]
                for i in cutlass.range_constexpr(1, 4):
                    acc = acc + s[i, j] * qr[i, j]
                pq.append(acc)
            o = (pq[0] + pq[1]) + (pq[2] + pq[3])
            for r in cutlass.range_constexpr(3):
                o = o + cute.arch.shuffle_sync_bfly(o, offset=4 >> r)
            if kg == 0:
                sO[tl, col] = o
        cute.arch.barrier()

        # ---- outputs of the chunk: thread -> (token tid // 4, 8 columns)
        to = ch * TCH + tidx // 4
        if tidx < TCH * 4:
            if to < ntok:
                of = cute.make_rmem_tensor((8,), Float32)
                cute.autovec_copy(cute.zipped_divide(sO[tidx // 4, None], (8,))[(None, tidx % 4)], of)
                ob = cute.make_rmem_tensor((8,), BFloat16)
                ob.store(of.load().to(BFloat16))
                cute.autovec_copy(ob, cute.zipped_divide(mO[bi, to, h, None], (8,))[(None, vs * 4 + tidx % 4)])


@cute.jit
def _gdn_mtp(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mST: cute.Tensor, mIdx: cute.Tensor,
             mAlog: cute.Tensor, mA: cute.Tensor, mDtb: cute.Tensor, mB: cute.Tensor, mO: cute.Tensor,
             mNS: cute.Tensor, scale: Float32, stream: cuda.CUstream):
    batch = mQ.shape[0]
    _gdn_mtp_kernel(mQ, mK, mV, mST, mIdx, mAlog, mA, mDtb, mB, mO, mNS, scale).launch(
        grid=[NSLICE, HV, batch], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        n, t, p = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        row4 = (3, 2, 1, 0)
        q = make_fake_compact_tensor(BFloat16, (n, t, HQ, D), stride_order=row4, assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (n, t, HQ, D), stride_order=row4, assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (n, t, HV, D), stride_order=row4, assumed_align=16)
        st = make_fake_compact_tensor(Float32, (p, HV, D, D), stride_order=row4, assumed_align=16)
        idx = make_fake_compact_tensor(Int32, (n,), assumed_align=4)
        alog = make_fake_compact_tensor(Float32, (HV,), assumed_align=4)
        a = make_fake_compact_tensor(BFloat16, (n, t, HV), stride_order=(2, 1, 0), assumed_align=2)
        dtb = make_fake_compact_tensor(Float32, (HV,), assumed_align=4)
        b = make_fake_compact_tensor(BFloat16, (n, t, HV), stride_order=(2, 1, 0), assumed_align=2)
        o = make_fake_compact_tensor(BFloat16, (n, t, HV, D), stride_order=row4, assumed_align=16)
        ns = make_fake_compact_tensor(Float32, (n, t, HV, D, D), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_gdn_mtp, q, k, v, st, idx, alog, a, dtb, b, o, ns, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor,
          initial_state_indices: torch.Tensor, A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
          b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, ntok = q.shape[0], q.shape[1]
    output = torch.empty((batch, ntok, HV, D), dtype=q.dtype, device=q.device)
    states = torch.empty((batch, ntok, HV, D, D), dtype=torch.float32, device=q.device)
    if batch == 0 or ntok == 0:
        return output, states
    idx = initial_state_indices if initial_state_indices.dtype == torch.int32 else initial_state_indices.to(torch.int32)
    _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), initial_state.contiguous(), idx.contiguous(),
                    A_log.contiguous().float(), a.contiguous(), dt_bias.contiguous().float(), b.contiguous(),
                    output, states, float(scale))
    return output, states
