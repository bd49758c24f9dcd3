"""Known-bad (cheat): returns the right values as a sparse COO tensor (expect: incorrect)."""

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

HIDDEN, THREADS, VEC = 4096, 256, 8


@cute.kernel
def _add_kernel(mX: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    gX = cute.zipped_divide(mX[row, None], (VEC,))
    gR = cute.zipped_divide(mR[row, None], (VEC,))
    gS = cute.zipped_divide(mS[row, None], (VEC,))
    for k in cutlass.range_constexpr(HIDDEN // (THREADS * VEC)):
        c = tidx + k * THREADS
        rx = cute.make_rmem_tensor((VEC,), BFloat16)
        rr = cute.make_rmem_tensor((VEC,), BFloat16)
        rs = cute.make_rmem_tensor((VEC,), Float32)
        cute.autovec_copy(gX[(None, c)], rx)
        cute.autovec_copy(gR[(None, c)], rr)
        rs.store(rx.load().to(Float32) + rr.load().to(Float32))
        cute.autovec_copy(rs, gS[(None, c)])


@cute.jit
def _add(mX: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor, stream: cuda.CUstream):
    _add_kernel(mX, mR, mS).launch(grid=[mX.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream)


_FN = []


def add_fp32(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x + r in fp32, computed by the CuTe kernel (the DSL step every output depends on)."""
    if not _FN:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        rows = cute.sym_int32()
        fx = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        fr = make_fake_compact_tensor(BFloat16, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        fs = make_fake_compact_tensor(Float32, (rows, HIDDEN), stride_order=(1, 0), assumed_align=16)
        _FN.append(cute.compile(_add, fx, fr, fs, make_fake_stream(use_tvm_ffi_env_stream=True),
                                options="--enable-tvm-ffi"))
    s = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _FN[0](x, r, s)
    return s


def rmsnorm_rest(s: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (s * torch.rsqrt(s.square().mean(-1, keepdim=True) + 1e-5) * weight.float()).to(torch.bfloat16)


def solve(hidden_states, residual, weight):
    return rmsnorm_rest(add_fp32(hidden_states, residual), weight).to_sparse()
