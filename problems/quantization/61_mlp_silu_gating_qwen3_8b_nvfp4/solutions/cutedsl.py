"""Qwen3-8B SwiGLU MLP for a 32-token decode batch with NVFP4 weights (weight-only), in CuTe DSL. The packed
4-bit weights are streamed once and dequantized on the fly inside the GEMM kernels; four launches:

1. _wgemm_kernel (gate/up): H[T, 2 I] = x @ dequant(W13)^T * gs1 in fp32. Weights on the MMA's M side,
   tokens on N (as in the TIRx solution): a CTA (one warpgroup) owns 64 weight rows x 32 tokens and walks K in
   blocks of 64. Per block, a 4-stage cp.async ring brings the 64 x 32 packed bytes, the 64 x 4 e4m3 block
   scales and the 32 x 64 bf16 activations into shared memory; the 128 threads decode the packed bytes
   (code * e4m3 scale, exact in bf16) into a 128-byte-swizzled K-major bf16 tile, and one warpgroup MMA
   per k16 step (m64n32k16, fp32 accumulate) multiplies it with the activation tile. 384 CTAs.
2. _act_kernel: a = silu(h_gate) * h_up in fp32, stored as two bf16 planes hi = bf16(a), lo = bf16(a - hi)
   (16 significant bits; the problem keeps a in fp32), as in the TIRx solution.
3. _wgemm_kernel (down, K split 8): partial[s, T, N] = (a_hi + a_lo) @ dequant(W2)^T * gs2 over the s-th
   eighth of K (two MMAs per k16 step: hi and lo); 64 row tiles x 8 splits = 512 CTAs.
4. _sum_kernel: out = bf16(sum over the 8 partials) (deterministic, no atomics, no zeroing pass).
Differences from the TIRx solution, and why: TIRx built the MMA A fragments in registers from the packed
bytes (byte -> bf16-pair table, mma.sync). CuTe's warpgroup MMA reads A from shared memory, so the decoded
tile goes through shared memory; in exchange each CTA keeps 4 stages of packed weights in flight through
cp.async, which addresses what the TIRx skill identified as the limit (about 1 KB of loads in flight per
warp, 0.37 TB/s effective). The down projection reduces its K split through a partial buffer instead of
atomics, and the gate/up split of h happens in a separate tiny kernel.

Expected time: streaming 85 MB of packed weights and scales (SOL ~18 us); with ~3 CTAs per SM and 4 stages
of ~4.5 KB each in flight, maybe 40-80 us, vs 0.233 ms device for the TIRx version; torch.compile 1.2 ms.
Host path: one tvm-ffi compiled function per (hidden, intermediate) with the token count symbolic, launched
on the caller's current torch stream; fp32 / bf16 workspaces cached per (device, shape), fully rewritten.

Verification: compile-checked on CPU (sm_90a) and run through an unofficial PTX-to-C++ CPU emulator at smoke
and larger sizes with tails; H200 results: results/h200/ (by kernel sha256).
"""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Int32, Uint8
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.cute.nvgpu.warpgroup import Field
from cutlass.tensor_utils import LayoutEnum

SF = 16
KB = 64                         # K elements per block (32 packed bytes, 4 scales per row)
BMW = 64                        # weight rows per CTA (MMA M)
BT = 32                         # tokens per CTA (MMA N)
STAGES = 4
THREADS = 128                   # one warpgroup
KSPLIT = 8                      # K split of the down projection
EW_THREADS = 256


@cute.jit
def _e2m1(code: Int32) -> Float32:
    """4-bit E2M1 code (bit 3 = sign) -> value: magnitudes 0, .5, 1, 1.5 (= m / 2), 2, 3, 4, 6."""
    m = code & 7
    small = Float32(m) * Float32(0.5)
    big = Float32(cutlass.select_(m < 6, Float32(2.0), Float32(4.0))) * (Float32(1.0) + Float32(m & 1) * Float32(0.5))
    mag = Float32(cutlass.select_(m < 4, small, big))
    return Float32(cutlass.select_((code & 8) != 0, -mag, mag))


@cute.jit
def _issue(a16u8: cute.CopyAtom, a4s: cute.CopyAtom, a16bf: cute.CopyAtom, mWp: cute.Tensor, mWs: cute.Tensor,
           mXh: cute.Tensor, mXl: cute.Tensor, sP: cute.Tensor, sS: cute.Tensor, sXh: cute.Tensor, sXl: cute.Tensor,
           m0: Int32, t0: Int32, kb: Int32, st: Int32, tidx: Int32, two: cutlass.Constexpr):
    """cp.async of K block kb: packed rows m0 .. m0+63 (32 bytes each), their 4 e4m3 scales, and the
    activation rows t0 .. t0+31 (64 bf16 each, zero past T) into stage st."""
    T = mXh.shape[0]
    r = tidx // 2
    c = tidx % 2
    cute.copy(a16u8, cute.zipped_divide(mWp[m0 + r, None], (16,))[(None, kb * 2 + c)],
              cute.zipped_divide(sP[r, None, st], (16,))[(None, c)])
    if tidx < BMW:
        cute.copy(a4s, cute.zipped_divide(mWs[m0 + tidx, None], (4,))[(None, kb)],
                  cute.zipped_divide(sS[tidx, None, st], (4,))[(None, 0)])
    for it in cutlass.range_constexpr(BT * (KB // 8) // THREADS):
        cid = tidx + it * THREADS
        xr = cid // (KB // 8)
        xc = cid % (KB // 8)
        dh = cute.zipped_divide(sXh[xr, None, st], (8,))[(None, xc)]
        if t0 + xr < T:
            cute.copy(a16bf, cute.zipped_divide(mXh[t0 + xr, None], (8,))[(None, kb * (KB // 8) + xc)], dh)
        else:
            dh.fill(0.0)
        if cutlass.const_expr(two):
            dl = cute.zipped_divide(sXl[xr, None, st], (8,))[(None, xc)]
            if t0 + xr < T:
                cute.copy(a16bf, cute.zipped_divide(mXl[t0 + xr, None], (8,))[(None, kb * (KB // 8) + xc)], dl)
            else:
                dl.fill(0.0)


@cute.kernel
def _wgemm_kernel(mWp: cute.Tensor, mWs: cute.Tensor, mXh: cute.Tensor, mXl: cute.Tensor, mGs: cute.Tensor,
                  mOut: cute.Tensor, sA_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout,
                  tiled_mma: cute.TiledMma, two: cutlass.Constexpr):
    """mOut[s, t, n] = gs * sum over this split's K blocks of dequant(W)[n, k] * (Xh + Xl)[t, k].
    mWp [N, K/2] uint8 (element 2i low nibble), mWs [N, K/16] e4m3, mXh / mXl [T, K] bf16; N % 64 == 0."""
    tidx, _, _ = cute.arch.thread_idx()
    mt, tt, sp = cute.arch.block_idx()
    N = mWp.shape[0]
    T = mXh.shape[0]
    nkb_all = mXh.shape[1] // KB
    nsplit = mOut.shape[0]
    kps = (nkb_all + nsplit - 1) // nsplit
    kb0 = sp * kps
    nkb = cutlass.min(kps, nkb_all - kb0)
    m0 = mt * BMW
    t0 = tt * BT

    smem = cutlass.utils.SmemAllocator()
    sA = smem.allocate_tensor(BFloat16, sA_layout.outer, byte_alignment=1024, swizzle=sA_layout.inner)
    sXh = smem.allocate_tensor(BFloat16, sX_layout.outer, byte_alignment=1024, swizzle=sX_layout.inner)
    sXl = sXh
    if cutlass.const_expr(two):
        sXl = smem.allocate_tensor(BFloat16, sX_layout.outer, byte_alignment=1024, swizzle=sX_layout.inner)
    sP = smem.allocate_tensor(Uint8, cute.make_layout((BMW, KB // 2, STAGES), stride=(KB // 2, 1, BMW * KB // 2)),
                              byte_alignment=128)
    sS = smem.allocate_tensor(Float8E4M3FN, cute.make_layout((BMW, KB // SF, STAGES),
                                                             stride=(KB // SF, 1, BMW * KB // SF)), byte_alignment=128)
    a16u8 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint8,
                                num_bits_per_copy=128)
    a4s = cute.make_copy_atom(cpasync.CopyG2SOp(), Float8E4M3FN, num_bits_per_copy=32)
    a16bf = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                num_bits_per_copy=128)

    thr = tiled_mma.get_slice(tidx)
    fA = tiled_mma.make_fragment_A(thr.partition_A(sA))
    fXh = tiled_mma.make_fragment_B(thr.partition_B(sXh))
    fXl = tiled_mma.make_fragment_B(thr.partition_B(sXl))
    acc = cute.make_rmem_tensor(thr.partition_shape_C((BMW, BT)), Float32)
    acc.fill(0.0)
    tiled_mma.set(Field.ACCUMULATE, True)

    for p in cutlass.range_constexpr(STAGES - 1):
        if p < nkb:
            _issue(a16u8, a4s, a16bf, mWp, mWs, mXh, mXl, sP, sS, sXh, sXl, m0, t0, kb0 + p, Int32(p), tidx, two)
        cute.arch.cp_async_commit_group()
    for k in cutlass.range(nkb):
        ahead = k + STAGES - 1
        if ahead < nkb:
            # that stage was last used in iteration k - 1, which ended with a CTA barrier
            _issue(a16u8, a4s, a16bf, mWp, mWs, mXh, mXl, sP, sS, sXh, sXl, m0, t0, kb0 + ahead, ahead % STAGES,
                   tidx, two)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(STAGES - 1)
        cute.arch.barrier()
        st = k % STAGES
        # decode: thread t handles (row, 16-element block) units t and t + 128 of the 64 x 4
        for i in cutlass.range_constexpr(BMW * (KB // SF) // THREADS):
            u = tidx + i * THREADS
            r = u // (KB // SF)
            q = u % (KB // SF)
            sc = Float32(sS[r, q, st])
            pk = cute.make_rmem_tensor((SF // 2,), Uint8)
            cute.autovec_copy(cute.zipped_divide(sP[r, None, st], (SF // 2,))[(None, q)], pk)
            for h in cutlass.range_constexpr(2):
                f = cute.make_rmem_tensor((8,), Float32)
                for e in cutlass.range_constexpr(4):
                    byte = Int32(pk[4 * h + e])
                    f[2 * e] = _e2m1(byte & 15) * sc
                    f[2 * e + 1] = _e2m1(byte >> 4) * sc
                o = cute.make_rmem_tensor((8,), BFloat16)
                o.store(f.load().to(BFloat16))
                cute.autovec_copy(o, cute.zipped_divide(sA[r, None, 0], (8,))[(None, 2 * q + h)])
        cute.arch.fence_proxy("async.shared", space="cta")   # generic and cp.async writes -> wgmma reads
        cute.arch.barrier()
        cute.nvgpu.warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(fA, mode=[2])):
            cute.gemm(tiled_mma, acc, fA[None, None, kk, 0], fXh[None, None, kk, st], acc)
            if cutlass.const_expr(two):
                cute.gemm(tiled_mma, acc, fA[None, None, kk, 0], fXl[None, None, kk, st], acc)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.barrier()                       # sA and stage st are free again
    cute.arch.cp_async_wait_group(0)

    gs = mGs[0]
    coord = thr.partition_C(cute.make_identity_tensor((BMW, BT)))   # (weight row, token) of each element
    for i in cutlass.range_constexpr(cute.size(acc)):
        n = m0 + coord[i][0]
        t = t0 + coord[i][1]
        if t < T:
            if n < N:
                mOut[sp, t, n] = acc[i] * gs


@cute.kernel
def _act_kernel(mH: cute.Tensor, mAh: cute.Tensor, mAl: cute.Tensor):
    """mH [1, T, 2 I] fp32 (gate columns first) -> a = silu(gate) * up as bf16 hi / lo planes [T, I]."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    T = mAh.shape[0]
    inter = mAh.shape[1]
    idx = bidx * EW_THREADS + tidx
    if idx < T * inter:
        t = idx // inter
        j = idx % inter
        gv = mH[0, t, j]
        a = gv / (Float32(1.0) + cute.math.exp(-gv)) * mH[0, t, inter + j]
        hi = a.to(BFloat16)
        mAh[t, j] = hi
        mAl[t, j] = (a - Float32(hi)).to(BFloat16)


@cute.kernel
def _sum_kernel(mP: cute.Tensor, mOut: cute.Tensor):
    """mOut [T, N] bf16 = sum over the K splits of mP [S, T, N] fp32."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    T = mOut.shape[0]
    N = mOut.shape[1]
    idx = bidx * EW_THREADS + tidx
    if idx < T * N:
        t = idx // N
        n = idx % N
        s = Float32(0.0)
        for sp in cutlass.range_constexpr(KSPLIT):
            s = s + mP[sp, t, n]
        mOut[t, n] = s.to(BFloat16)


@cute.jit
def _mlp(mX: cute.Tensor, mW1p: cute.Tensor, mW1s: cute.Tensor, mG1: cute.Tensor, mW2p: cute.Tensor,
         mW2s: cute.Tensor, mG2: cute.Tensor, mH: cute.Tensor, mAh: cute.Tensor, mAl: cute.Tensor, mP: cute.Tensor,
         mOut: cute.Tensor, stream: cuda.CUstream):
    tiled_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                                  Float32, (1, 1, 1), tiler_mn=(BMW, BT))
    sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BMW, BT, KB), BFloat16, 1)
    sX_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BMW, BT, KB), BFloat16, STAGES)
    T = mX.shape[0]
    n1 = mW1p.shape[0]
    _wgemm_kernel(mW1p, mW1s, mX, mX, mG1, mH, sA_layout, sX_layout, tiled_mma, False).launch(
        grid=[n1 // BMW, (T + BT - 1) // BT, 1], block=[THREADS, 1, 1], stream=stream)
    n_act = T * mAh.shape[1]
    _act_kernel(mH, mAh, mAl).launch(grid=[(n_act + EW_THREADS - 1) // EW_THREADS, 1, 1], block=[EW_THREADS, 1, 1],
                                     stream=stream)
    n2 = mW2p.shape[0]
    _wgemm_kernel(mW2p, mW2s, mAh, mAl, mG2, mP, sA_layout, sX_layout, tiled_mma, True).launch(
        grid=[n2 // BMW, (T + BT - 1) // BT, KSPLIT], block=[THREADS, 1, 1], stream=stream)
    n_out = T * n2
    _sum_kernel(mP, mOut).launch(grid=[(n_out + EW_THREADS - 1) // EW_THREADS, 1, 1], block=[EW_THREADS, 1, 1],
                                 stream=stream)


_COMPILED = {}
_WS = {}


def _compiled(hidden, inter):
    key = (hidden, inter)
    fn = _COMPILED.get(key)
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        t = cute.sym_int32()

        def ten(dt, shape, align=16):
            return make_fake_compact_tensor(dt, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                            assumed_align=align)

        args = (ten(BFloat16, (t, hidden)),
                ten(Uint8, (2 * inter, hidden // 2)), ten(Float8E4M3FN, (2 * inter, hidden // SF), 4),
                ten(Float32, (1,), 4),
                ten(Uint8, (hidden, inter // 2)), ten(Float8E4M3FN, (hidden, inter // SF), 4),
                ten(Float32, (1,), 4),
                ten(Float32, (1, t, 2 * inter)), ten(BFloat16, (t, inter)), ten(BFloat16, (t, inter)),
                ten(Float32, (KSPLIT, t, hidden)), ten(BFloat16, (t, hidden)))
        fn = cute.compile(_mlp, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
        _COMPILED[key] = fn
    return fn


def _ws(name, shape, dtype, device):
    key = (name, str(device), tuple(shape))
    t = _WS.get(key)
    if t is None:
        t = _WS[key] = torch.empty(shape, dtype=dtype, device=device)
    return t


def solve(x: torch.Tensor, gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor,
          gate_up_global_scale: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor,
          down_global_scale: torch.Tensor) -> torch.Tensor:
    ntok, hidden = x.shape
    inter = gate_up_packed.shape[0] // 2
    nout = down_packed.shape[0]
    out = torch.empty((ntok, nout), dtype=x.dtype, device=x.device)
    if ntok == 0:
        return out
    if hidden % KB or inter % KB or (2 * inter) % BMW or nout % BMW or nout != hidden:
        raise ValueError("hidden and intermediate sizes must be multiples of 64")
    dev = x.device
    h = _ws("h", (1, ntok, 2 * inter), torch.float32, dev)
    ah = _ws("ah", (ntok, inter), torch.bfloat16, dev)
    al = _ws("al", (ntok, inter), torch.bfloat16, dev)
    part = _ws("part", (KSPLIT, ntok, nout), torch.float32, dev)
    _compiled(hidden, inter)(
        x.contiguous(), gate_up_packed.contiguous(), gate_up_scale.contiguous(),
        gate_up_global_scale.reshape(1).float(), down_packed.contiguous(), down_scale.contiguous(),
        down_global_scale.reshape(1).float(), h, ah, al, part, out)
    return out
