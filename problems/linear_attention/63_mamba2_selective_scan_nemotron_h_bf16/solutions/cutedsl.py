"""Mamba-2 selective scan (Nemotron-H 8B mixer: 128 heads x 64, state 128, 8 B/C groups, carried state,
2 x 4096 tokens) in CuTe DSL: the exact token-by-token recurrence in fp32 on CUDA cores, with the state
held in registers for the whole sequence.

Likely slower than the TIRx solution (0.866 ms device on the H200), expected ~1.1-1.3 ms, still well ahead
of torch.compile (5.06 ms) and eager (8.5 ms). Difference from the TIRx solution and why: the TIRx kernel is
the chunked SSD on bf16 tensor cores (128-token chunks, flash-style C B^T tiles reused from registers, and
the state update with the fp32 operand split exactly into three bf16 terms). This version is the plain
recurrence, the simpler of the exact evaluations the problem allows: it was written without a GPU and
without a CPU emulator for CuTe DSL, and the tensor-core port (fragment layouts of the split state
update, swizzled operand tiles) is the part most likely to hide an untested index bug. The fp32 work is
2 x 64 x 128 FMAs per token and head (update + output), 34 GFLOP in all, which puts its floor near
0.6 ms, above the tensor-core version's measured time.

Recurrence per head (state h [P=64, N=128]):  a_t = exp(delta_t A),  h <- a_t h + delta_t x_t B_t^T,
y_t = h C_t + D x_t,  with delta_t = softplus(dt_t + dt_bias), A = -exp(A_log).
State representation (as the problem-62 kernel): h = gamma (Hb + dH), gamma = product of a since the last
fold. Per token gamma *= a_t, dH[p, :] += (delta x[p] / gamma) B, y[p] = gamma <Hb + dH, C> + D x[p].
Every 32 tokens (or earlier if gamma < 2^-64) Hb <- gamma (Hb + dH), dH <- 0, gamma <- 1. The small dH
keeps the per-token rounding small (a plain fp32 h = a h + ... rounds the whole state every token) and the
decay costs nothing per element.
Precision: a_t multiplies the whole state on every token; on slow heads (a up to 0.9999, memory longer
than the sequence) its error compounds (problem 62 failed on the H200 with a ~1-2 ulp fp32 exp for the
decay). delta, delta A and a_t are computed in fp64 and rounded once, as the TIRx kernel does.

Launch geometry
- Grid (128 heads, B) = 256 CTAs, 256 threads = 8 warps, ~77 KiB shared memory (2 CTAs per SM, one wave).
  Warp w owns state rows p = 8w..8w+7; lane = 4 i + ks owns row p = 8w + i and the state columns
  n = 16 j + 4 ks + e (j < 8, e < 4): 32 fp32 of Hb and 32 of dH in registers.
- Tokens in blocks of 32. Raw x rows (head h), B and C rows (group h // 16) come in with 16-byte cp.async,
  double-buffered (block i+1 in flight while block i is computed; rows past L clamped to the last token
  and never used); dt of the next block is prefetched into a register.
- Preparation per block: B and C to fp32 shared tiles (each thread 2 + 2 16-byte pieces); warp 0 computes
  delta and a for its 32 tokens.
- Per token a thread reads its 32 B and 32 C values (16 ld.shared.v4; the 4 ks lanes of a row read 64
  contiguous bytes, the 8 rows of a warp the same addresses), 32 FMAs into dH, 32 adds + 32 FMAs for its
  partial y, 2 xor shuffles over the ks lanes. y (bf16) goes to a shared 32 x 64 tile written to global
  with one 16-byte store per thread after the block.
- Finally Hb (after the last fold) is stored to final_state with 16-byte stores.
Host path: compiled once per process (tvm-ffi; batch and L symbolic), torch tensors passed directly,
launch on the caller's current torch stream.

Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32

H = 128
P = 64
N = 128
G = 8
HPG = H // G                   # heads per B/C group
TB = 32                        # tokens per block (also the regular fold period)
THREADS = 256
KS = 4                         # lanes sharing a state row (split of the state columns)
NJ = N // (4 * KS)             # 8 groups of 4 columns per lane
NE = NJ * 4                    # 32 state columns per lane
GAMMA_MIN = 2.0 ** -64         # fold early below this (keeps 1/gamma far from fp32 overflow)
XCH = P // 8                   # 16-byte chunks in an x row (8)
NCH = N // 8                   # 16-byte chunks in a B/C row (16)
BC_PER_THREAD = TB * NCH // THREADS       # 2


@cute.kernel
def _ssm_kernel(mX: cute.Tensor, mDt: cute.Tensor, mALog: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
                mD: cute.Tensor, mDtb: cute.Tensor, mS0: cute.Tensor, mY: cute.Tensor, mFS: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    h, bb, _ = cute.arch.block_idx()
    grp = h // HPG
    L = mX.shape[1]
    warp = tidx // 32
    lane = tidx % 32
    ks = lane % KS
    prow = warp * 8 + lane // KS

    smem = cutlass.utils.SmemAllocator()
    # raw bf16 rows: x [buffer, token, p]; B, C [buffer, tensor, token, n]
    sRX = smem.allocate_tensor(BFloat16, cute.make_layout((2, TB, P), stride=(TB * P, P, 1)), byte_alignment=128)
    sRBC = smem.allocate_tensor(BFloat16, cute.make_layout((2, 2, TB, N), stride=(2 * TB * N, TB * N, N, 1)),
                                byte_alignment=128)
    sBf = smem.allocate_tensor(Float32, cute.make_layout((TB, N), stride=(N, 1)), byte_alignment=128)
    sCf = smem.allocate_tensor(Float32, cute.make_layout((TB, N), stride=(N, 1)), byte_alignment=128)
    sY = smem.allocate_tensor(BFloat16, cute.make_layout((TB, P), stride=(P, 1)), byte_alignment=128)
    sDel = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)
    sDec = smem.allocate_tensor(Float32, cute.make_layout((TB,)), byte_alignment=16)

    g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)

    # ---- initial state -> registers: Hb[4 j + e] = S0[prow, 16 j + 4 ks + e] (16-byte loads)
    Hb = cute.make_rmem_tensor((NE,), Float32)
    dH = cute.make_rmem_tensor((NE,), Float32)
    for j in cutlass.range_constexpr(NJ):
        t4 = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(cute.zipped_divide(mS0[bb, h, prow, None], (4,))[(None, 4 * j + ks)], t4)
        for e in cutlass.range_constexpr(4):
            Hb[4 * j + e] = t4[e]
    dH.fill(0.0)
    gam = cute.make_rmem_tensor((1,), Float32)
    gam[0] = Float32(1.0)
    d_h = mD[h]
    a_rate = Float64(0.0) - cute.math.exp(Float64(mALog[h]))
    dtb = Float64(mDtb[h])

    nb = (L + TB - 1) // TB

    # ---- prologue: block 0
    _issue_raw(g2s, mX, mB, mC, sRX, sRBC, bb, h, grp, Int32(0), Int32(0), L, tidx)
    cute.arch.cp_async_commit_group()
    dt_reg = Float32(mDt[bb, cutlass.min(lane, L - 1), h])
    cute.arch.cp_async_wait_group(0)
    cute.arch.barrier()
    _prepare(sRBC, sBf, sCf, sDel, sDec, Int32(0), warp, lane, tidx, dt_reg, dtb, a_rate)
    cute.arch.barrier()

    for blk in cutlass.range(nb):
        buf = blk % 2
        t0 = blk * TB
        if blk + 1 < nb:
            _issue_raw(g2s, mX, mB, mC, sRX, sRBC, bb, h, grp, 1 - buf, t0 + TB, L, tidx)
            dt_reg = Float32(mDt[bb, cutlass.min(t0 + TB + lane, L - 1), h])
        cute.arch.cp_async_commit_group()
        n = cutlass.min(L - t0, TB)

        for tt in cutlass.range(n):
            gm = gam[0] * sDec[tt]
            if gm < Float32(GAMMA_MIN):
                # fold with the old gamma, restart from a_t (uniform branch: gamma is the same everywhere)
                _fold(Hb, dH, gam[0])
                gm = sDec[tt]
            gam[0] = gm
            xv = Float32(sRX[buf, tt, prow])
            xs = (sDel[tt] * xv) * (Float32(1.0) / gm)
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            gB = cute.zipped_divide(sBf[tt, None], (4,))
            gC = cute.zipped_divide(sCf[tt, None], (4,))
            for j in cutlass.range_constexpr(NJ):
                b4 = cute.make_rmem_tensor((4,), Float32)
                c4 = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(gB[(None, 4 * j + ks)], b4)
                cute.autovec_copy(gC[(None, 4 * j + ks)], c4)
                for e in cutlass.range_constexpr(4):
                    dH[4 * j + e] = dH[4 * j + e] + xs * b4[e]
                    s = Hb[4 * j + e] + dH[4 * j + e]
                    acc[e] = acc[e] + s * c4[e]
            y = (acc[0] + acc[1]) + (acc[2] + acc[3])
            y = y + cute.arch.shuffle_sync_bfly(y, offset=1)
            y = y + cute.arch.shuffle_sync_bfly(y, offset=2)
            if ks == 0:
                sY[tt, prow] = (y * gm + d_h * xv).to(BFloat16)

        _fold(Hb, dH, gam[0])
        gam[0] = Float32(1.0)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        # y tile -> global: thread -> (token tidx // 8, 16-byte chunk tidx % 8); rows past L skipped
        r = tidx // XCH
        cc = tidx % XCH
        if r < n:
            t8 = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(sY[r, None], (8,))[(None, cc)], t8)
            cute.autovec_copy(t8, cute.zipped_divide(mY[bb, t0 + r, h, None], (8,))[(None, cc)])
        if blk + 1 < nb:
            _prepare(sRBC, sBf, sCf, sDel, sDec, 1 - buf, warp, lane, tidx, dt_reg, dtb, a_rate)
        cute.arch.barrier()

    # ---- final state (after the last fold h = Hb), 16-byte stores
    for j in cutlass.range_constexpr(NJ):
        t4 = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            t4[e] = Hb[4 * j + e]
        cute.autovec_copy(t4, cute.zipped_divide(mFS[bb, h, prow, None], (4,))[(None, 4 * j + ks)])


@cute.jit
def _fold(Hb: cute.Tensor, dH: cute.Tensor, gm: Float32):
    """Hb <- gm (Hb + dH), dH <- 0."""
    for i in cutlass.range_constexpr(NE):
        Hb[i] = (Hb[i] + dH[i]) * gm
        dH[i] = Float32(0.0)


@cute.jit
def _issue_raw(g2s: cute.CopyAtom, mX: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, sRX: cute.Tensor,
               sRBC: cute.Tensor, bb: Int32, h: Int32, grp: Int32, buf: Int32, t0: Int32, L: Int32, tidx: Int32):
    """cp.async of token rows t0..t0+31 (clamped to L-1): x of head h, B and C of group grp, into buffer buf."""
    rx = tidx // XCH
    cx = tidx % XCH
    tx = cutlass.min(t0 + rx, L - 1)
    cute.copy(g2s, cute.zipped_divide(mX[bb, tx, h, None], (8,))[(None, cx)],
              cute.zipped_divide(sRX[buf, rx, None], (8,))[(None, cx)])
    for i in cutlass.range_constexpr(BC_PER_THREAD):
        cid = tidx + THREADS * i
        r = cid // NCH
        cc = cid % NCH
        tr = cutlass.min(t0 + r, L - 1)
        cute.copy(g2s, cute.zipped_divide(mB[bb, tr, grp, None], (8,))[(None, cc)],
                  cute.zipped_divide(sRBC[buf, 0, r, None], (8,))[(None, cc)])
        cute.copy(g2s, cute.zipped_divide(mC[bb, tr, grp, None], (8,))[(None, cc)],
                  cute.zipped_divide(sRBC[buf, 1, r, None], (8,))[(None, cc)])


@cute.jit
def _prepare(sRBC: cute.Tensor, sBf: cute.Tensor, sCf: cute.Tensor, sDel: cute.Tensor, sDec: cute.Tensor,
             buf: Int32, warp: Int32, lane: Int32, tidx: Int32, dt_reg: Float32, dtb: Float64, a_rate: Float64):
    """B, C of raw buffer buf -> fp32 tiles; warp 0: delta = softplus(dt + dt_bias), a = exp(delta A) (fp64)."""
    for i in cutlass.range_constexpr(BC_PER_THREAD):
        cid = tidx + THREADS * i
        r = cid // NCH
        cc = cid % NCH
        for m in cutlass.range_constexpr(2):
            t8 = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(sRBC[buf, m, r, None], (8,))[(None, cc)], t8)
            f8 = cute.make_rmem_tensor((8,), Float32)
            f8.store(t8.load().to(Float32))
            if m == 0:
                cute.autovec_copy(f8, cute.zipped_divide(sBf[r, None], (8,))[(None, cc)])
            else:
                cute.autovec_copy(f8, cute.zipped_divide(sCf[r, None], (8,))[(None, cc)])
    if warp == 0:
        z = Float64(dt_reg) + dtb
        sp = z
        if z <= Float64(20.0):
            sp = cute.math.log1p(cute.math.exp(z))
        sDel[lane] = Float32(sp)
        sDec[lane] = Float32(cute.math.exp(sp * a_rate))


@cute.jit
def _ssm(mX: cute.Tensor, mDt: cute.Tensor, mALog: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
         mD: cute.Tensor, mDtb: cute.Tensor, mS0: cute.Tensor, mY: cute.Tensor, mFS: cute.Tensor,
         stream: cuda.CUstream):
    _ssm_kernel(mX, mDt, mALog, mB, mC, mD, mDtb, mS0, mY, mFS).launch(
        grid=[H, mX.shape[0], 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _get_compiled():
    fn = _COMPILED.get("k")
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        b, l = cute.sym_int32(), cute.sym_int32()
        r4, r3 = (3, 2, 1, 0), (2, 1, 0)
        x = make_fake_compact_tensor(BFloat16, (b, l, H, P), stride_order=r4, assumed_align=16)
        dt = make_fake_compact_tensor(BFloat16, (b, l, H), stride_order=r3, assumed_align=2)
        alog = make_fake_compact_tensor(Float32, (H,), stride_order=(0,), assumed_align=4)
        bm = make_fake_compact_tensor(BFloat16, (b, l, G, N), stride_order=r4, assumed_align=16)
        cm = make_fake_compact_tensor(BFloat16, (b, l, G, N), stride_order=r4, assumed_align=16)
        dd = make_fake_compact_tensor(Float32, (H,), stride_order=(0,), assumed_align=4)
        dtb = make_fake_compact_tensor(Float32, (H,), stride_order=(0,), assumed_align=4)
        s0 = make_fake_compact_tensor(Float32, (b, H, P, N), stride_order=r4, assumed_align=16)
        y = make_fake_compact_tensor(BFloat16, (b, l, H, P), stride_order=r4, assumed_align=16)
        fs = make_fake_compact_tensor(Float32, (b, H, P, N), stride_order=r4, assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = cute.compile(_ssm, x, dt, alog, bm, cm, dd, dtb, s0, y, fs, stream, options="--enable-tvm-ffi")
        _COMPILED["k"] = fn
    return fn


def solve(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
          D: torch.Tensor, dt_bias: torch.Tensor, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen = x.shape[0], x.shape[1]
    y = torch.empty_like(x)
    final_state = torch.empty((batch, H, P, N), dtype=torch.float32, device=x.device)
    if seqlen == 0 or batch == 0:
        final_state.copy_(initial_state)
        return y, final_state
    _get_compiled()(x.contiguous(), dt.contiguous(), A_log.contiguous().float(), B.contiguous(), C.contiguous(),
                    D.contiguous().float(), dt_bias.contiguous().float(), initial_state.contiguous().float(),
                    y, final_state)
    return y, final_state
