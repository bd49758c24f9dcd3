"""Gated DeltaNet single-token decode (Qwen3-Next, 16 value heads, 8 q/k heads, d = 128) in CuTe DSL.

Observation: with the state in k-last layout S[v, :] (one 512-byte fp32 row per value index v), every
row is updated independently:
    pred_v  = alpha * <S[v,:], kn>          delta_v = beta * (v_v - pred_v)
    S'[v,:] = alpha * S[v,:] + delta_v * kn o_v = scale * <S'[v,:], qn>
so the kernel is a single streaming pass over the state (read once, written once, in place).

Algorithm
- Grid (4 row blocks, 16 value heads, B requests); 256 threads = 16 groups of 16 lanes. CTA
  (rb, h, b) updates rows rb*32 + g and rb*32 + 16 + g of state[b, h] (group g), 4096 CTAs in all.
- Lane l of a group owns the state columns 4l..4l+3 and 64+4l..64+4l+3 (two 16-byte fp32 chunks,
  so one ld.global.v4 of a half-warp covers 256 contiguous bytes of a row). All four 16-byte state
  loads of a thread are issued before any math (64 bytes in flight per thread).
- q/k head h // 2: each lane loads the matching 2 x 4 bf16 of q and k (8-byte loads), the sums of
  squares are reduced over the 16 lanes with xor shuffles (every lane gets the total), giving
  kn = k * rsqrt(|k|^2 + 1e-6) and qn likewise, in fp32 registers. Each CTA recomputes them (256 B
  of q/k per CTA, L2-resident).
- Gates per thread in fp32: alpha = exp(-exp(A_log[h]) * softplus(a + dt_bias[h])) (softplus with
  torch's threshold 20), beta = sigmoid(b).
- Per row: <S, kn> (8 FMAs + 4 shuffles), delta, the rank-one update, <S', qn> (8 FMAs + 4 shuffles);
  S' is stored with 16-byte stores into the input state (problem.yaml allows the in-place update,
  input 3), lane 0 stores o_v (bf16).
What limits it: DRAM bandwidth - 64 MiB of state read + 64 MiB written (134 MB in all); the math is
~20 instructions per 4 state elements. SOL (memory) ~ 0.028 ms at 4.8 TB/s; expected ~0.035-0.04 ms.
Host path: compiled once per process (tvm-ffi, symbolic batch), torch tensors passed directly; the
launch uses the caller's current torch stream (tvm-ffi env stream).

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

QK_HEADS = 8
V_HEADS = 16
D = 128
L2_EPS = 1e-6
LANES = 16                     # lanes per state row
CH = 4                         # fp32 per 16-byte chunk
THREADS = 256
GROUPS = THREADS // LANES      # 16 row groups per CTA
ROWS_PER_GROUP = 2
ROWS_PER_CTA = GROUPS * ROWS_PER_GROUP   # 32
ROW_BLOCKS = D // ROWS_PER_CTA           # 4


def _add(a, b):
    return a + b


@cute.jit
def _ld_bf16x4_f32(row: cute.Tensor, chunk) -> cute.TensorSSA:
    r = cute.make_rmem_tensor((CH,), BFloat16)
    cute.autovec_copy(cute.zipped_divide(row, (CH,))[(None, chunk)], r)
    return r.load().to(Float32)


@cute.kernel
def _gdn_decode_kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mS: cute.Tensor,
                       mAlog: cute.Tensor, mA: cute.Tensor, mDt: cute.Tensor, mB: cute.Tensor,
                       mO: cute.Tensor, scale: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    rb, h, b = cute.arch.block_idx()
    g = tidx // LANES
    l = tidx % LANES
    hk = h // (V_HEADS // QK_HEADS)

    # issue the state loads first (rows rb*32 + g + 16*j, chunks l and l + 16)
    rows = []
    srs = []
    for j in cutlass.range_constexpr(ROWS_PER_GROUP):
        r = rb * ROWS_PER_CTA + j * GROUPS + g
        gS = cute.zipped_divide(mS[b, h, r, None], (CH,))
        for c in cutlass.range_constexpr(2):
            t = cute.make_rmem_tensor((CH,), Float32)
            cute.autovec_copy(gS[(None, l + c * LANES)], t)
            srs.append(t)
        rows.append(r)

    # q / k of this lane's columns, L2-normalized over the 16 lanes of the group
    qv = []
    kv = []
    qss = Float32(0.0)
    kss = Float32(0.0)
    for c in cutlass.range_constexpr(2):
        q = _ld_bf16x4_f32(mQ[b, 0, hk, None], l + c * LANES)
        k = _ld_bf16x4_f32(mK[b, 0, hk, None], l + c * LANES)
        qss = qss + (q * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        kss = kss + (k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        qv.append(q)
        kv.append(k)
    qss = cute.arch.warp_reduction(qss, _add, threads_in_group=LANES)
    kss = cute.arch.warp_reduction(kss, _add, threads_in_group=LANES)
    qscale = cute.math.rsqrt(qss + L2_EPS)
    kscale = cute.math.rsqrt(kss + L2_EPS)
    qn = [qv[0] * qscale, qv[1] * qscale]
    kn = [kv[0] * kscale, kv[1] * kscale]

    # gates (fp32)
    x = Float32(mA[b, 0, h]) + mDt[h]
    sp = x
    if x <= Float32(20.0):
        sp = cute.math.log1p(cute.math.exp(x))
    alpha = cute.math.exp(-cute.math.exp(mAlog[h]) * sp)
    beta = Float32(1.0) / (Float32(1.0) + cute.math.exp(-Float32(mB[b, 0, h])))

    for j in cutlass.range_constexpr(ROWS_PER_GROUP):
        r = rows[j]
        s0 = srs[2 * j].load()
        s1 = srs[2 * j + 1].load()
        dk = (s0 * kn[0]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0) + \
            (s1 * kn[1]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dk = cute.arch.warp_reduction(dk, _add, threads_in_group=LANES)
        vv = Float32(mV[b, 0, h, r])
        delta = beta * (vv - alpha * dk)
        n0 = s0 * alpha + kn[0] * delta
        n1 = s1 * alpha + kn[1] * delta
        srs[2 * j].store(n0)
        srs[2 * j + 1].store(n1)
        gS = cute.zipped_divide(mS[b, h, r, None], (CH,))
        cute.autovec_copy(srs[2 * j], gS[(None, l)])
        cute.autovec_copy(srs[2 * j + 1], gS[(None, l + LANES)])
        dq = (n0 * qn[0]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0) + \
            (n1 * qn[1]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dq = cute.arch.warp_reduction(dq, _add, threads_in_group=LANES)
        if l == 0:
            mO[b, 0, h, r] = (dq * scale).to(BFloat16)


@cute.jit
def _gdn_decode(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mS: cute.Tensor, mAlog: cute.Tensor,
                mA: cute.Tensor, mDt: cute.Tensor, mB: cute.Tensor, mO: cute.Tensor, scale: Float32,
                stream: cuda.CUstream):
    batch = mQ.shape[0]
    _gdn_decode_kernel(mQ, mK, mV, mS, mAlog, mA, mDt, mB, mO, scale).launch(
        grid=[ROW_BLOCKS, V_HEADS, batch], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        n = cute.sym_int32()
        q = make_fake_compact_tensor(BFloat16, (n, 1, QK_HEADS, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        k = make_fake_compact_tensor(BFloat16, (n, 1, QK_HEADS, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        v = make_fake_compact_tensor(BFloat16, (n, 1, V_HEADS, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        s = make_fake_compact_tensor(Float32, (n, V_HEADS, D, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        alog = make_fake_compact_tensor(Float32, (V_HEADS,), assumed_align=4)
        a = make_fake_compact_tensor(BFloat16, (n, 1, V_HEADS), stride_order=(2, 1, 0), assumed_align=2)
        dt = make_fake_compact_tensor(Float32, (V_HEADS,), assumed_align=4)
        bb = make_fake_compact_tensor(BFloat16, (n, 1, V_HEADS), stride_order=(2, 1, 0), assumed_align=2)
        o = make_fake_compact_tensor(BFloat16, (n, 1, V_HEADS, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_gdn_decode, q, k, v, s, alog, a, dt, bb, o, Float32(1.0), stream,
                          options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(q, k, v, state, A_log, a, dt_bias, b, scale):
    batch = q.shape[0]
    out = torch.empty((batch, 1, V_HEADS, D), dtype=q.dtype, device=q.device)
    if batch > 0:
        _get_compiled()(q.contiguous(), k.contiguous(), v.contiguous(), state, A_log.contiguous(),
                        a.contiguous(), dt_bias.contiguous(), b.contiguous(), out, float(scale))
    return out, state
