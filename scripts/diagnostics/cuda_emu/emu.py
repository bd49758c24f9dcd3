"""A CPU emulator for TVM-generated CUDA kernels (a development aid, not part of the verifier).

Compiles a kernel's CUDA source as C++ with g++ (shim.h maps threads to coroutines: __syncthreads,
warp shuffles and lockstep are real synchronisation points; ldmatrix, mma.m16n8k16 bf16, cp.async
and atomics are emulated, mma in double precision, so tensor-core rounding is NOT modelled) and
launches it on torch CPU tensors. Written while developing the TIRx solutions without a GPU; no
result of it counts as verification. Use: ``lib, sigs = build(cuda_source, tag)`` then
``launch(lib, sigs, kernel_name, grid, threads, {param: tensor_or_scalar})``.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
_CACHE = Path(tempfile.gettempdir()) / "mkb-cuda-emu"

EXTRA = r'''
typedef unsigned long long smaddr_t;
static inline void tvm_builtin_ptx_fma_rn_f32(float& d, float a, float b, float c) { d = fmaf(a, b, c); }
static inline void tvm_builtin_cuda_cta_sync() { __syncthreads(); }
static inline smaddr_t tvm_builtin_cuda_cvta_generic_to_shared(const void* p) { return (smaddr_t)p; }
static inline void tvm_builtin_ptx_cp_async_cg_async_cg_shared_global_16(smaddr_t d, const void* s) { memcpy((void*)d, s, 16); }
static inline void tvm_builtin_ptx_cp_async_ca_async_ca_shared_global_16(smaddr_t d, const void* s) { memcpy((void*)d, s, 16); }
static inline void tvm_builtin_ptx_cp_async_cg_src_size_async_cg_shared_global_16(smaddr_t d, const void* s, uint32_t n) {
  if (n > 16) n = 16; memcpy((void*)d, s, n); memset((char*)d + n, 0, 16 - n); }
static inline void tvm_builtin_ptx_cp_async_commit_group_async_commit_group() {}
static inline void tvm_builtin_ptx_cp_async_wait_all_async_wait_all() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_0() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_1() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_2() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_3() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_4() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_5() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_6() {}
static inline void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_7() {}
static uint64_t g_wx[1024][8];
static inline void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, smaddr_t p, bool trans) {
  int t = lin_tid(); g_wx[t][0] = p; yield_();
  int lane = t & 31, base = t & ~31; uint32_t out[4];
  for (int j = 0; j < 4; ++j) {
    if (!trans) {
      const uint16_t* row = (const uint16_t*)g_wx[base + j * 8 + lane / 4][0];
      out[j] = (uint32_t)row[(lane % 4) * 2] | ((uint32_t)row[(lane % 4) * 2 + 1] << 16);
    } else {
      const uint16_t* r0p = (const uint16_t*)g_wx[base + j * 8 + (lane % 4) * 2][0];
      const uint16_t* r1p = (const uint16_t*)g_wx[base + j * 8 + (lane % 4) * 2 + 1][0];
      out[j] = (uint32_t)r0p[lane / 4] | ((uint32_t)r1p[lane / 4] << 16);
    }
  }
  yield_(); r0 = out[0]; r1 = out[1]; r2 = out[2]; r3 = out[3];
}
static inline void tvm_builtin_ptx_ldmatrix_sync_aligned_m8n8_x4_shared_b16(uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d, smaddr_t p) { ldsm_x4(a, b, c, d, p, false); }
static inline void tvm_builtin_ptx_ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d, smaddr_t p) { ldsm_x4(a, b, c, d, p, true); }

static inline void ldsm_x2(uint32_t& r0, uint32_t& r1, smaddr_t p, bool trans) {
  int t = lin_tid(); g_wx[t][0] = p; yield_();
  int lane = t & 31, base = t & ~31; uint32_t out[2];
  for (int j = 0; j < 2; ++j) {
    if (!trans) {
      const uint16_t* row = (const uint16_t*)g_wx[base + j * 8 + lane / 4][0];
      out[j] = (uint32_t)row[(lane % 4) * 2] | ((uint32_t)row[(lane % 4) * 2 + 1] << 16);
    } else {
      const uint16_t* r0p = (const uint16_t*)g_wx[base + j * 8 + (lane % 4) * 2][0];
      const uint16_t* r1p = (const uint16_t*)g_wx[base + j * 8 + (lane % 4) * 2 + 1][0];
      out[j] = (uint32_t)r0p[lane / 4] | ((uint32_t)r1p[lane / 4] << 16);
    }
  }
  yield_(); r0 = out[0]; r1 = out[1];
}
static inline void tvm_builtin_ptx_ldmatrix_sync_aligned_m8n8_x2_shared_b16(uint32_t& a, uint32_t& b, smaddr_t p) { ldsm_x2(a, b, p, false); }
static inline void tvm_builtin_ptx_ldmatrix_sync_aligned_m8n8_x2_trans_shared_b16(uint32_t& a, uint32_t& b, smaddr_t p) { ldsm_x2(a, b, p, true); }
static inline float bf16lo(uint32_t v) { uint32_t u = v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float bf16hi(uint32_t v) { uint32_t u = v & 0xffff0000u; float f; memcpy(&f, &u, 4); return f; }
static inline float bfhalf(uint32_t v, int h) { return h ? bf16hi(v) : bf16lo(v); }

template <class TT> static inline TT tvm_builtin_cuda_atomic_add(TT* addr, TT value) { TT o = *addr; *addr = o + value; return o; }
static inline uint16_t f2bf(float f) { return nv_bfloat16(f).b; }
static inline void tvm_builtin_ptx_fma_half_rn_bf16x2(uint32_t& d, uint32_t a, uint32_t b, uint32_t c) {
  float lo = fmaf(bf16lo(a), bf16lo(b), bf16lo(c)), hi = fmaf(bf16hi(a), bf16hi(b), bf16hi(c));
  d = (uint32_t)f2bf(lo) | ((uint32_t)f2bf(hi) << 16); }
static inline void tvm_builtin_ptx_mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
    float& d0, float& d1, float& d2, float& d3, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
    uint32_t b0, uint32_t b1, float c0, float c1, float c2, float c3) {
  int t = lin_tid(); g_wx[t][0] = a0; g_wx[t][1] = a1; g_wx[t][2] = a2; g_wx[t][3] = a3; g_wx[t][4] = b0; g_wx[t][5] = b1;
  yield_();
  int lane = t & 31, base = t & ~31, g = lane >> 2, tq = lane & 3;
  float cin[4] = {c0, c1, c2, c3}; float out[4];
  for (int e = 0; e < 4; ++e) {
    int r = g + (e >= 2 ? 8 : 0), n = tq * 2 + (e & 1);
    double acc = cin[e];
    for (int k = 0; k < 16; ++k) {
      int la = base + (r % 8) * 4 + (k % 8) / 2, ra = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      int lb = base + n * 4 + (k % 8) / 2, rb = (k >= 8 ? 1 : 0);
      acc += (double)bfhalf((uint32_t)g_wx[la][ra], k & 1) * (double)bfhalf((uint32_t)g_wx[lb][4 + rb], k & 1);
    }
    out[e] = (float)acc;
  }
  yield_(); d0 = out[0]; d1 = out[1]; d2 = out[2]; d3 = out[3];
}
'''

def build(src: str, tag: str, extra: str = ""):
    cut = src.rfind("#define ushort unsigned short\n#endif\n")
    assert cut > 0
    body = src[cut + len("#define ushort unsigned short\n#endif\n"):]
    # drop helper definitions that use inline asm
    out, i = [], 0
    pat = re.compile(r'(__forceinline__ __device__|__device__ __forceinline__|static __device__|__device__)[^\n]*\{')
    while True:
        m = pat.search(body, i)
        if not m:
            out.append(body[i:]); break
        # find matching brace
        j = m.end(); depth = 1
        while depth:
            if body[j] == '{': depth += 1
            elif body[j] == '}': depth -= 1
            j += 1
        chunk = body[m.start():j]
        pre = body[i:m.start()]
        keep = "asm" not in chunk and "tvm_builtin_" not in chunk.split("(")[0]
        if not keep:
            pre = re.sub(r"template\s*<[^>]*>\s*$", "", pre)
        out.append(pre)
        if keep:
            out.append(chunk)
        i = j
    body = "".join(out)
    kernels = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\) \{', body)
    wrappers = []; sigs = {}
    for name, params in kernels:
        ps = [p.strip() for p in params.split(",")]
        names = [p.split()[-1] for p in ps]
        wrappers.append(f'extern "C" void launch_{name}(int gx, int gy, int gz, int nt, {params}) '
                        f'{{ run_grid(gx, gy, gz, nt, [&]() {{ {name}({", ".join(names)}); }}); }}')
        sigs[name] = ps
    body = re.sub(r"__shared__ alignas\((\d+)\)", r"alignas(\1) static", body)
    body = re.sub(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];", r"alignas(\1) static \2 \3[262144 / sizeof(\2)];", body)
    code = "#include \"shim.h\"\n" + EXTRA + extra + body + "\n" + "\n".join(wrappers) + "\n"
    h = hashlib.md5((code + (_HERE / "shim.h").read_text()).encode()).hexdigest()[:10]
    _CACHE.mkdir(exist_ok=True)
    cpp = str(_CACHE / f"{tag}_{h}.cpp"); so = cpp[:-4] + ".so"
    if not os.path.exists(so):
        open(cpp, "w").write(code)
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-w", f"-I{_HERE}", "-o", so, cpp], check=True)
    lib = ctypes.CDLL(so)
    return lib, sigs

def launch(lib, sigs, name, grid, nt, args: dict):
    ps = sigs[name]
    cargs = []
    for p in ps:
        nm = p.split()[-1]
        if nm not in args and nm.startswith('cse_v'):
            args[nm] = 0   # host-side CSE value the kernel body does not use (checked by the caller)
        v = args[nm]
        if "*" in p:
            assert isinstance(v, torch.Tensor) and v.is_contiguous(), nm
            cargs.append(ctypes.c_void_p(v.data_ptr()))
        elif p.startswith("float"):
            cargs.append(ctypes.c_float(v))
        elif p.startswith("double"):
            cargs.append(ctypes.c_double(v))
        elif p.startswith("int64_t") or p.startswith("long"):
            cargs.append(ctypes.c_longlong(int(v)))
        else:
            cargs.append(ctypes.c_int(int(v)))
    gx, gy, gz = (list(grid) + [1, 1])[:3]
    getattr(lib, "launch_" + name)(ctypes.c_int(gx), ctypes.c_int(gy), ctypes.c_int(gz), ctypes.c_int(nt), *cargs)
    assert lib.emu_errors() == 0, "lockstep violations"
