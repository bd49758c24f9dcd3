"""Bodies of the misbehaving test kernels for problem 28; each is appended to cute_add_prelude.py.

Keys are the test ids; values are (body, expected CPU-tier status).
"""

CPU_CASES = {
    "good": ("def solve(h, r, w):\n    return rmsnorm_rest(add_fp32(h, r), w)\n", "unverified"),
    "raises": ("def solve(h, r, w):\n    raise ValueError('boom: the candidate gave up')\n", "runtime_error"),
    "hangs": ("def solve(h, r, w):\n    while True:\n        pass\n", "timeout"),
    "aborts": ("import os\n\n\ndef solve(h, r, w):\n    os.abort()\n", "crashed"),
    "prints_10mb": ("import sys\nsys.stdout.write('x' * (10 << 20))\nsys.stdout.flush()\n\n\n"
                    "def solve(h, r, w):\n    return rmsnorm_rest(add_fp32(h, r), w)\n", "unverified"),
    "wrong_structure": ("def solve(h, r, w):\n    y = rmsnorm_rest(add_fp32(h, r), w)\n    return (y, y)\n",
                        "incorrect"),
    "wrong_dtype": ("def solve(h, r, w):\n    return add_fp32(h, r)\n", "incorrect"),
    "dsl_type_error": ("@cute.jit\ndef _bad(mX: cute.Tensor):\n    undefined_name_in_dsl(mX)\n\n\n"
                       "def solve(h, r, w):\n    from cutlass.cute.runtime import from_dlpack\n"
                       "    cute.compile(_bad, from_dlpack(h))\n    return h\n", "compile_error"),
    "no_solve": ("def not_solve(h, r, w):\n    return h\n", "compile_error"),
    "import_error": ("import a_module_that_does_not_exist\n\n\ndef solve(h, r, w):\n    return h\n", "compile_error"),
}

# GPU-only: an out-of-bounds store far outside any allocation
ILLEGAL_ACCESS = '''
@cute.kernel
def _oob_kernel(mS: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    # a pointer into unmapped device memory: the store faults with an illegal address
    bad = cute.make_tensor(cute.make_ptr(Float32, 1 << 44, cute.AddressSpace.gmem, assumed_align=4),
                           cute.make_layout((32,)))
    bad[tidx] = mS[tidx]


@cute.jit
def _oob(mS: cute.Tensor, stream: cuda.CUstream):
    _oob_kernel(mS).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


_OOB = []


def solve(h, r, w):
    from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream
    s = add_fp32(h, r)
    if not _OOB:
        fake = make_fake_compact_tensor(Float32, (cute.sym_int32(),), assumed_align=16)
        _OOB.append(cute.compile(_oob, fake, make_fake_stream(use_tvm_ffi_env_stream=True),
                                 options="--enable-tvm-ffi"))
    _OOB[0](s.view(-1))
    return rmsnorm_rest(s, w)
'''
