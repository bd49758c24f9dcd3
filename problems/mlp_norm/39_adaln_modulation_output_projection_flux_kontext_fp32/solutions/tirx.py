# FLUX.1 Kontext final layer in fp32: AdaLN modulation GEMV, affine-free LayerNorm, (1 + scale) * xhat + shift
# and the 3072 -> 64 output projection; two TIRx kernels, fp32 FMA throughout (no tensor cores: the
# problem's allowance is 3x the fp32 reference's own error, which TF32 products exceed).
#
# Kernel 1 (modulation): grid 6144 / 8 CTAs of 256 threads, one warp per output row j of w_mod: float4 loads
#   of w_mod[j, :] (read once, 75 MB), dot products with silu(vec[b]) for both images (silu with an accurate
#   exp: Cody-Waite + degree-7 polynomial, and div.rn; TVM compiles with --use_fast_math), per-lane partial
#   sums over 96 values then an xor-shuffle tree. Writes s1[b, k] = 1 + scale (rounded as the reference) and
#   shift[b, k].
# Kernel 2 (norm + projection): grid ceil(B*T / 64) CTAs of 256 threads, 64 tokens x 64 outputs per CTA.
#   Phase 1: warp w computes mean and rstd of tokens 8w..8w+7 (float4 row loads, two passes: mean, then the
#   sum of squared deviations from a re-read of the row (L1/L2 hit); xor-shuffle trees; rstd =
#   1 / sqrt(var + 1e-6) with sqrt.rn / div.rn) into shared memory.
#   Phase 2: K = 3072 in chunks of 32. Each chunk: x (64 x 32) and w_out (64 x 32) are loaded as float4 into
#   registers one chunk ahead (software pipeline), transformed to y = s1 * ((x - mean) * rstd) + shift and
#   stored k-major into double-buffered shared memory; each thread accumulates 4 tokens x 4 outputs with
#   FMAs (two float4 shared loads per 16 FMAs). Two-level accumulation: a fresh partial per 32-wide chunk
#   is added to the running sum, so no single fp32 accumulator runs over the whole K (the problem statement
#   notes a single accumulator over a long reduction exceeds the allowance). out = sum + b_out.
#
# Limits: 6.4 GFLOP on fp32 FMA units (67 TFLOP/s peak) -> ~105 us at peak, expected ~140-170 us; x is read
#   twice (stats, then the projection: 402 MB, ~85 us of DRAM, overlapped with the FMA work of the other CTA
#   on the SM). Eager PyTorch: several elementwise/reduction kernels over the 201 MB x (fp32 temporaries)
#   plus the SGEMM: expected ~2x faster than eager.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Cached: compiled modules per hidden size; the small modulation buffer is allocated per call.

import torch
import tvm
from tvm.script import tirx as T

OUT = 64
EPS = 1e-6
THREADS = 256
TM = 64                    # tokens per CTA
KC = 32                    # K chunk
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


def _make_kernels(hidden):
    per_lane = hidden // 32             # modulation: values per lane
    n_chunks = hidden // KC
    row_iters = hidden // 128           # stats: float4 loads per lane per row

    @T.prim_func
    def modulation(vec_handle: T.handle, w_handle: T.handle, b_handle: T.handle, s1_handle: T.handle,
                   sh_handle: T.handle):
        n_img = T.int32()
        VEC = T.match_buffer(vec_handle, (n_img, hidden), "float32", align=16)
        WM = T.match_buffer(w_handle, (2 * hidden, hidden), "float32", align=16)
        BM_ = T.match_buffer(b_handle, (2 * hidden,), "float32")
        S1 = T.match_buffer(s1_handle, (n_img, hidden), "float32")
        SH = T.match_buffer(sh_handle, (n_img, hidden), "float32")

        T.device_entry()
        cta = T.cta_id([2 * hidden // 8])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])
        wv = T.alloc_local((4,), "float32")
        vv = T.alloc_local((4,), "float32")
        acc = T.alloc_local((1,), "float32")
        xr = T.alloc_local((4,), "float32")
        sv = T.alloc_local((1,), "float32")

        j: T.let[T.int32] = cta * 8 + warp
        for b in range(n_img):
            acc[0] = T.float32(0.0)
            for it in range(per_lane // 4):
                for i in T.vectorized(4):
                    wv[i] = WM[j, (it * 32 + lane) * 4 + i]
                for i in T.vectorized(4):
                    vv[i] = VEC[b, (it * 32 + lane) * 4 + i]
                for i in T.unroll(4):
                    # silu(v) = v / (1 + exp(-v)), accurate exp
                    xr[0] = T.min(T.max(T.float32(0.0) - vv[i], T.float32(-87.0)), T.float32(88.0))
                    xr[1] = T.floor(xr[0] * T.float32(LOG2E) + T.float32(0.5))
                    xr[2] = (xr[0] - xr[1] * T.float32(LN2_HI)) - xr[1] * T.float32(LN2_LO)
                    xr[3] = T.float32(1.0 / 5040.0)
                    xr[3] = xr[3] * xr[2] + T.float32(1.0 / 720.0)
                    xr[3] = xr[3] * xr[2] + T.float32(1.0 / 120.0)
                    xr[3] = xr[3] * xr[2] + T.float32(1.0 / 24.0)
                    xr[3] = xr[3] * xr[2] + T.float32(1.0 / 6.0)
                    xr[3] = xr[3] * xr[2] + T.float32(0.5)
                    xr[3] = xr[3] * xr[2] + T.float32(1.0)
                    xr[3] = xr[3] * xr[2] + T.float32(1.0)
                    xr[3] = xr[3] * T.reinterpret("float32", T.shift_left(T.cast(xr[1], "int32") + 127, 23))
                    T.ptx.div.rn.f32(sv[0], vv[i], T.float32(1.0) + xr[3])
                    acc[0] = acc[0] + sv[0] * wv[i]
            for s in T.unroll(5):
                acc[0] = acc[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, acc[0], 16 >> s, 32, 32)
            if lane == 0:
                if j < hidden:
                    SH[b, j] = acc[0] + BM_[j]
                else:
                    S1[b, j - hidden] = T.float32(1.0) + (acc[0] + BM_[j])

    @T.prim_func
    def norm_proj(x_handle: T.handle, s1_handle: T.handle, sh_handle: T.handle, w_handle: T.handle,
                  b_handle: T.handle, o_handle: T.handle, n_tok: T.int32):
        n_img = T.int32()
        n_all = T.int32()            # images * tokens per image (n_tok)
        X = T.match_buffer(x_handle, (n_all, hidden), "float32", align=16)
        S1 = T.match_buffer(s1_handle, (n_img, hidden), "float32", align=16)
        SH = T.match_buffer(sh_handle, (n_img, hidden), "float32", align=16)
        W = T.match_buffer(w_handle, (OUT, hidden), "float32", align=16)
        BO = T.match_buffer(b_handle, (OUT,), "float32")
        O = T.match_buffer(o_handle, (n_all, OUT), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        cta = T.cta_id([T.ceildiv(n_all, TM)])
        tid = T.thread_id([THREADS])
        warp = T.warp_id([8])
        lane = T.lane_id([32])

        ys = T.alloc_shared((2, KC, TM + 4), "float32")
        ws = T.alloc_shared((2, KC, OUT + 4), "float32")
        mu = T.alloc_shared((TM,), "float32")
        rs = T.alloc_shared((TM,), "float32")
        v4 = T.alloc_local((4,), "float32")
        st = T.alloc_local((3,), "float32")
        xa = T.alloc_local((8,), "float32")        # this thread's 2 float4 of the next x chunk
        wa = T.alloc_local((8,), "float32")        # and of the next w_out chunk
        ya = T.alloc_local((4,), "float32")
        yb = T.alloc_local((4,), "float32")
        part = T.alloc_local((16,), "float32")
        tot = T.alloc_local((16,), "float32")

        t0: T.let[T.int32] = cta * TM

        # ---- phase 1: mean / rstd of the CTA's tokens (warp w: tokens 8w .. 8w+7) ----
        for q in range(TM // 8):
            tl: T.let[T.int32] = warp * (TM // 8) + q
            tg: T.let[T.int32] = T.min(t0 + tl, n_all - 1)
            st[0] = T.float32(0.0)
            for it in range(row_iters):
                for i in T.vectorized(4):
                    v4[i] = X[tg, (it * 32 + lane) * 4 + i]
                st[0] = st[0] + ((v4[0] + v4[1]) + (v4[2] + v4[3]))
            for s in T.unroll(5):
                st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
            T.ptx.div.rn.f32(st[1], st[0], T.float32(hidden))
            st[0] = T.float32(0.0)
            for it in range(row_iters):
                for i in T.vectorized(4):
                    v4[i] = X[tg, (it * 32 + lane) * 4 + i]
                for i in T.unroll(4):
                    v4[i] = (v4[i] - st[1]) * (v4[i] - st[1])
                st[0] = st[0] + ((v4[0] + v4[1]) + (v4[2] + v4[3]))
            for s in T.unroll(5):
                st[0] = st[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, st[0], 16 >> s, 32, 32)
            T.ptx.div.rn.f32(st[2], st[0], T.float32(hidden))
            T.ptx.sqrt.rn.f32(st[0], st[2] + T.float32(EPS))
            T.ptx.div.rn.f32(st[2], T.float32(1.0), st[0])
            if lane == 0:
                mu[tl] = st[1]
                rs[tl] = st[2]
        T.cuda.cta_sync()

        # ---- phase 2: projection ----
        # loader mapping: float4 f = u*256 + tid (u = 0, 1) of a 64 x 32 tile: row f // 8, k 4 * (f % 8)
        # compute mapping: tokens 4ty .. 4ty+3, outputs 4tx .. 4tx+3
        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        for u in T.unroll(2):
            for i in T.vectorized(4):
                xa[u * 4 + i] = X[T.min(t0 + (u * THREADS + tid) // 8, n_all - 1), ((u * THREADS + tid) % 8) * 4 + i]
            for i in T.vectorized(4):
                wa[u * 4 + i] = W[(u * THREADS + tid) // 8, ((u * THREADS + tid) % 8) * 4 + i]
        for e in T.unroll(16):
            tot[e] = T.float32(0.0)

        for c in range(n_chunks):
            # transform + store chunk c into buffer c % 2
            for u in T.unroll(2):
                r: T.let[T.int32] = (u * THREADS + tid) // 8
                kb: T.let[T.int32] = ((u * THREADS + tid) % 8) * 4
                img: T.let[T.int32] = T.min(t0 + r, n_all - 1) // n_tok
                for i in T.vectorized(4):
                    ya[i] = S1[img, c * KC + kb + i]
                for i in T.vectorized(4):
                    yb[i] = SH[img, c * KC + kb + i]
                for i in T.unroll(4):
                    ys[c % 2, kb + i, r] = ya[i] * ((xa[u * 4 + i] - mu[r]) * rs[r]) + yb[i]
                    ws[c % 2, kb + i, r] = wa[u * 4 + i]
            T.cuda.cta_sync()
            # prefetch chunk c + 1 into registers
            if c + 1 < n_chunks:
                for u in T.unroll(2):
                    for i in T.vectorized(4):
                        xa[u * 4 + i] = X[T.min(t0 + (u * THREADS + tid) // 8, n_all - 1), (c + 1) * KC + ((u * THREADS + tid) % 8) * 4 + i]
                    for i in T.vectorized(4):
                        wa[u * 4 + i] = W[(u * THREADS + tid) // 8, (c + 1) * KC + ((u * THREADS + tid) % 8) * 4 + i]
            for e in T.unroll(16):
                part[e] = T.float32(0.0)
            for k in T.unroll(KC):
                for i in T.vectorized(4):
                    ya[i] = ys[c % 2, k, ty * 4 + i]
                for i in T.vectorized(4):
                    yb[i] = ws[c % 2, k, tx * 4 + i]
                for a in T.unroll(4):
                    for b in T.unroll(4):
                        part[a * 4 + b] = part[a * 4 + b] + ya[a] * yb[b]
            for e in T.unroll(16):
                tot[e] = tot[e] + part[e]

        for i in T.vectorized(4):
            yb[i] = BO[tx * 4 + i]
        for a in T.unroll(4):
            if t0 + ty * 4 + a < n_all:
                for b in T.unroll(4):
                    ya[b] = tot[a * 4 + b] + yb[b]
                for b in T.vectorized(4):
                    O[t0 + ty * 4 + a, tx * 4 + b] = ya[b]

    return modulation, norm_proj


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; for a module that is already runnable (llvm host + cuda
    # device code) jit() re-walks the import tree on every call (tens of us of Python). Caching the
    # result the way jit() itself does for exported modules makes the call path ~0.2 us.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled(hidden=3072):
    key = ("exes", hidden)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in _make_kernels(hidden))
        _CACHE[key] = exes
    return exes


def solve(x, vec, w_mod, b_mod, w_out, b_out):
    batch, tokens, hidden = x.shape
    assert hidden % 128 == 0
    _compiled()                                    # the full-size build, also when called at another size
    modulation, norm_proj = _compiled(hidden)
    dev = x.device
    s1 = torch.empty((batch, hidden), dtype=torch.float32, device=dev)
    sh = torch.empty((batch, hidden), dtype=torch.float32, device=dev)
    out = torch.empty((batch, tokens, OUT), dtype=torch.float32, device=dev)
    modulation(vec.contiguous(), w_mod.contiguous(), b_mod.contiguous(), s1, sh)
    if batch * tokens > 0:
        norm_proj(x.contiguous().view(batch * tokens, hidden), s1, sh, w_out.contiguous(), b_out.contiguous(),
                  out.view(batch * tokens, OUT), tokens)
    return out
