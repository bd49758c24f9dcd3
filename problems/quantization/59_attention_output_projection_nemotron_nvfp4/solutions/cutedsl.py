"""NVFP4 W4A4 attention output projection with residual add (Llama-3.3-Nemotron-Super-49B: T = 4096,
8192 -> 8192) in CuTe DSL: the TIRx solution's decomposition, three launches.

1. _dequant_kernel (activation, then weight): one thread per 16-element block: 8 packed bytes (low nibble
   first) and one e4m3 scale -> 16 bf16 values code * scale, exact in bf16 (at most 6 significant bits).
2. _gemm_kernel: out = residual + (A @ W^T) * (gs_a * gs_w), A [T, K] and W [N, K] bf16 K-contiguous, fp32
   accumulation on Hopper warpgroup MMA (m64n128k16): CTA tile 128 x 128 = 2 warpgroups x 64 rows, K tiles
   of 64 through a 3-stage cp.async ring into 128-byte-swizzled K-major shared layouts (96 KiB, 2 CTAs per
   SM). Grouped raster as in TIRx: the 1-D grid walks groups of 8 M tiles, M fastest inside a group, so
   the co-resident CTAs share a few weight panels and 8 activation row blocks in L2 (the 67 MB bf16
   activation and 134 MB bf16 weight do not fit the 50 MB L2). Epilogue per accumulator pair (coordinates
   from the per-thread MMA slice): residual pair + acc * scale -> bf16x2 store; rows / columns past
   T / N zero-filled on load and not stored.
Difference from the TIRx solution: warpgroup MMA instead of warp-level mma.sync. Its skill notes that the
warpgroup GEMM of problem 60 (same 550 GFLOP, but M-fastest raster over an activation larger than L2) was
no faster than this problem's warp-level GEMM with grouped raster, while on problem 27 (operands in L2)
the warpgroup GEMM was 1.75x faster; this version combines the warpgroup MMA with the grouped raster.

Expected time: 550 GFLOP; at problem 27's ~470 TFLOP/s about 1.2 ms, plus ~60 us of dequantization traffic
(260 MB), vs 1.73 ms device for TIRx, 11.6 ms torch.compile and 12.7 ms eager (fp32 GEMMs).
Host path: one tvm-ffi compiled function per (K, N) (token count symbolic) launches the three kernels on
the caller's current torch stream; bf16 workspaces cached per (device, shape), fully rewritten per call.

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
VEC = 8
BM, BN, BK = 128, 128, 64
STAGES = 3
THREADS = 256
GROUP_M = 8
DQ_THREADS = 256


@cute.jit
def _e2m1(code: Int32) -> Float32:
    """4-bit E2M1 code (bit 3 = sign) -> value: magnitudes 0, .5, 1, 1.5 (= m / 2), 2, 3, 4, 6."""
    m = code & 7
    small = Float32(m) * Float32(0.5)
    big = Float32(cutlass.select_(m < 6, Float32(2.0), Float32(4.0))) * (Float32(1.0) + Float32(m & 1) * Float32(0.5))
    mag = Float32(cutlass.select_(m < 4, small, big))
    return Float32(cutlass.select_((code & 8) != 0, -mag, mag))


@cute.kernel
def _dequant_kernel(mP: cute.Tensor, mS: cute.Tensor, mD: cute.Tensor):
    """mP [N, K/2] uint8 (element 2i low nibble), mS [N, K/16] e4m3 -> mD [N, K] bf16 = code * block scale."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nb = mS.shape[1]
    b = bidx * DQ_THREADS + tidx
    if b < mP.shape[0] * nb:
        r = b // nb
        q = b % nb
        s = Float32(mS[r, q])
        pk = cute.make_rmem_tensor((SF // 2,), Uint8)
        cute.autovec_copy(cute.zipped_divide(mP[r, None], (SF // 2,))[(None, q)], pk)
        f = cute.make_rmem_tensor((SF,), Float32)
        for i in cutlass.range_constexpr(SF // 2):
            byte = Int32(pk[i])
            f[2 * i] = _e2m1(byte & 15) * s
            f[2 * i + 1] = _e2m1(byte >> 4) * s
        o = cute.make_rmem_tensor((SF,), BFloat16)
        o.store(f.load().to(BFloat16))
        cute.autovec_copy(o, cute.zipped_divide(mD[r, None], (SF,))[(None, q)])


@cute.jit
def _load_tile(atom: cute.CopyAtom, mA: cute.Tensor, mB: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
               m0: Int32, n0: Int32, kt: Int32, st: Int32, tidx: Int32):
    """cp.async of K tile kt of A rows m0.. and B rows n0.. (128 x 64 each) into stage st; rows out of range -> 0."""
    M = mA.shape[0]
    N = mB.shape[0]
    pieces = BK // VEC
    for it in cutlass.range_constexpr(BM * pieces // THREADS):
        idx = tidx + it * THREADS
        r = idx // pieces
        c = idx % pieces
        dst_a = cute.zipped_divide(sA[r, None, st], (VEC,))[(None, c)]
        if m0 + r < M:
            cute.copy(atom, cute.zipped_divide(mA[m0 + r, None], (VEC,))[(None, kt * pieces + c)], dst_a)
        else:
            dst_a.fill(0.0)
        dst_b = cute.zipped_divide(sB[r, None, st], (VEC,))[(None, c)]
        if n0 + r < N:
            cute.copy(atom, cute.zipped_divide(mB[n0 + r, None], (VEC,))[(None, kt * pieces + c)], dst_b)
        else:
            dst_b.fill(0.0)


@cute.kernel
def _gemm_kernel(mA: cute.Tensor, mB: cute.Tensor, mGa: cute.Tensor, mGw: cute.Tensor, mRes: cute.Tensor,
                 mC: cute.Tensor,
                 sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    pid, _, _ = cute.arch.block_idx()
    M = mA.shape[0]
    N = mB.shape[0]
    nk = mA.shape[1] // BK
    # grouped raster over (M tiles, N tiles)
    n_mt = (M + BM - 1) // BM
    n_nt = (N + BN - 1) // BN
    per_group = GROUP_M * n_nt
    first_mt = (pid // per_group) * GROUP_M
    gsize = cutlass.min(n_mt - first_mt, GROUP_M)
    mt = first_mt + (pid % per_group) % gsize
    nt = (pid % per_group) // gsize
    m0 = mt * BM
    n0 = nt * BN
    smem = cutlass.utils.SmemAllocator()
    sA = smem.allocate_tensor(BFloat16, sA_layout.outer, byte_alignment=1024, swizzle=sA_layout.inner)
    sB = smem.allocate_tensor(BFloat16, sB_layout.outer, byte_alignment=1024, swizzle=sB_layout.inner)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                               num_bits_per_copy=128)
    thr = tiled_mma.get_slice(tidx)
    fA = tiled_mma.make_fragment_A(thr.partition_A(sA))
    fB = tiled_mma.make_fragment_B(thr.partition_B(sB))
    acc = cute.make_rmem_tensor(thr.partition_shape_C((BM, BN)), Float32)
    acc.fill(0.0)
    tiled_mma.set(Field.ACCUMULATE, True)

    for p in cutlass.range_constexpr(STAGES - 1):
        if p < nk:
            _load_tile(atom, mA, mB, sA, sB, m0, n0, Int32(p), Int32(p), tidx)
        cute.arch.cp_async_commit_group()
    for kt in cutlass.range(nk):
        ahead = kt + STAGES - 1
        if ahead < nk:
            _load_tile(atom, mA, mB, sA, sB, m0, n0, ahead, ahead % STAGES, tidx)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(STAGES - 1)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()
        st = kt % STAGES
        cute.nvgpu.warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(fA, mode=[2])):
            cute.gemm(tiled_mma, acc, fA[None, None, k, st], fB[None, None, k, st], acc)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.barrier()
    cute.arch.cp_async_wait_group(0)

    gs = mGa[0] * mGw[0]
    coord = thr.partition_C(cute.make_identity_tensor((BM, BN)))
    for p in cutlass.range_constexpr(cute.size(acc) // 2):
        row = m0 + coord[2 * p][0]
        col = n0 + coord[2 * p][1]
        if row < M:
            if col < N:
                res = cute.make_rmem_tensor((2,), BFloat16)
                cute.autovec_copy(cute.zipped_divide(mRes[row, None], (2,))[(None, col // 2)], res)
                pair = cute.make_rmem_tensor((2,), BFloat16)
                for e in cutlass.range_constexpr(2):
                    pair[e] = (Float32(res[e]) + acc[2 * p + e] * gs).to(BFloat16)
                cute.autovec_copy(pair, cute.zipped_divide(mC[row, None], (2,))[(None, col // 2)])


@cute.jit
def _dequant(mP: cute.Tensor, mS: cute.Tensor, mD: cute.Tensor, stream: cuda.CUstream):
    nb = mS.shape[0] * mS.shape[1]
    _dequant_kernel(mP, mS, mD).launch(grid=[(nb + DQ_THREADS - 1) // DQ_THREADS, 1, 1], block=[DQ_THREADS, 1, 1],
                                       stream=stream)


@cute.jit
def _oproj(mAp: cute.Tensor, mAs: cute.Tensor, mGa: cute.Tensor, mWp: cute.Tensor, mWs: cute.Tensor,
           mGw: cute.Tensor, mRes: cute.Tensor, mA: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor,
           stream: cuda.CUstream):
    _dequant(mAp, mAs, mA, stream)
    _dequant(mWp, mWs, mW, stream)
    tiled_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                                  Float32, (2, 1, 1), tiler_mn=(64, BN))
    sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BM, BN, BK), BFloat16, STAGES)
    sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BM, BN, BK), BFloat16, STAGES)
    n_tiles = ((mA.shape[0] + BM - 1) // BM) * ((mW.shape[0] + BN - 1) // BN)
    _gemm_kernel(mA, mW, mGa, mGw, mRes, mOut, sA_layout, sB_layout, tiled_mma).launch(
        grid=[n_tiles, 1, 1], block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}
_WS = {}


def _compiled(k, nout):
    fn = _COMPILED.get((k, nout))
    if fn is None:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        t = cute.sym_int32()

        def mat(dt, shape, align=16):
            return make_fake_compact_tensor(dt, shape, stride_order=(1, 0), assumed_align=align)

        g = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
        args = (mat(Uint8, (t, k // 2)), mat(Float8E4M3FN, (t, k // SF), 8), g,
                mat(Uint8, (nout, k // 2)), mat(Float8E4M3FN, (nout, k // SF), 8),
                make_fake_compact_tensor(Float32, (1,), assumed_align=4),
                mat(BFloat16, (t, nout), 4), mat(BFloat16, (t, k)), mat(BFloat16, (nout, k)),
                mat(BFloat16, (t, nout), 4))
        fn = cute.compile(_oproj, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
        _COMPILED[(k, nout)] = fn
    return fn


def _ws(name, shape, device):
    key = (name, str(device), tuple(shape))
    t = _WS.get(key)
    if t is None:
        t = _WS[key] = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return t


def solve(attn_packed: torch.Tensor, attn_scale: torch.Tensor, attn_global_scale: torch.Tensor,
          weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
          residual: torch.Tensor) -> torch.Tensor:
    tokens, half_in = attn_packed.shape
    k = half_in * 2
    nout = weight_packed.shape[0]
    dev = residual.device
    out = torch.empty((tokens, nout), dtype=residual.dtype, device=dev)
    if tokens == 0:
        return out
    if k % BK or nout % 2:
        raise ValueError("in_features must be a multiple of 64 and out_features even")
    a = _ws("a", (tokens, k), dev)
    w = _ws("w", (nout, k), dev)
    _compiled(k, nout)(attn_packed.contiguous(), attn_scale.contiguous(), attn_global_scale.reshape(1).float(),
                       weight_packed.contiguous(), weight_scale.contiguous(), weight_global_scale.reshape(1).float(),
                       residual.contiguous(), a, w, out)
    return out
