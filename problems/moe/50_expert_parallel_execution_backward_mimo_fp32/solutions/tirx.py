"""Backward of the grouped SwiGLU experts on one EP rank (MiMo-V2-Flash: 8 local experts, hidden 4096,
intermediate 2048, N = 8192 rows grouped by expert, fp32 throughout) in TIRx: one SIMT fp32 GEMM template
instantiated six times plus a schedule kernel and a row-sum kernel (eight launches per call).

Same algorithm as the CuTe DSL solution (the problem requires fp32 arithmetic, no TF32, so every product is an
fp32 FMA on the CUDA cores):
  G1  h  = x @ W13[e]^T                       per expert row tile, A and B k-major            -> h [N, 2I]
  G2  partial <dy, o>, o = a @ W2[e]^T        A = swiglu(h) built while loading, B k-major   -> part [N, H/128]
  G3  da = (p dy) @ W2[e]; dh = [da u silu'(g) | da silu(g)]
                                              A = p * dy built while loading, B n-major      -> dh [N, 2I]
  G4  dW2[e]  = (p dy)^T @ a                  per (expert, m tile), K = the expert's rows, both operands m/n-major
  G5  dW13[e] = dh^T @ x                      same
  G6  dx = dh @ W13[e]                        A k-major, B n-major
  grad_routing_probs = sum of the H/128 partials of each row, fixed order (deterministic).
Experts without rows get zero weight gradients (empty K range, zero accumulators are stored).
GEMM: CTA tile 128 x 128 x 16, 256 threads, 8 x 8 outputs per thread (rows 4 ty + {0..3} and 64 + ..., columns
4 tx + {0..3} and 64 + ...), two shared buffers, the next k tile is loaded global -> registers during the FMAs,
one barrier per k tile, two-level accumulation (a fresh partial per 64 k values added to the running sum).
Differences from the CuTe DSL solution, none of them algorithmic:
- operand loads are 16-byte (4 floats) per access, two per thread and operand (k-major: rows tid/4 and tid/4 + 64,
  k offset 4 (tid % 4); m/n-major: k rows tid/32 and tid/32 + 8, columns 4 (tid % 32)); the CuTe version moves 8
  floats per thread in one piece;
- the schedule kernel writes the expert row offsets and the prefix of 128-row tiles per expert; each row-tile CTA
  finds its expert by scanning that prefix (8 entries) instead of reading an explicit tile list;
- TVM builds device code with fast math, so sigmoid uses its own range-reduced exp (Cody-Waite, degree-7
  polynomial) and a correctly rounded division instead of the hardware approximations.
Expected to be slower than eager PyTorch and torch.compile: both run the 1.24 TFLOP through cuBLAS fp32 SGEMMs
(eager 40.0 ms, torch.compile 29.4 ms on the H200); this simple SIMT GEMM (no multi-stage cp.async ring, one CTA
per SM-quarter of registers) is expected around 35-45 TFLOP/s, i.e. ~28-35 ms against the 18.5 ms fp32 floor.
Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).
Streams: tvm-ffi launches the compiled functions in order on torch's current stream. Cached: compiled modules and
the per-(device, N) workspaces.
"""

import torch
import tvm
from tvm.script import tirx as T

BM, BN, BK = 128, 128, 16
THREADS = 256
PAD = BM + 4
FLUSH = 4                # k tiles per partial sum (64 k values)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06


@T.macro
def sigmoid_acc(dst, di, x, e):
    # dst[di] = 1 / (1 + exp(-x)); exp(-x) = 2^k p(r), r = -x - k ln2, degree-7 Taylor, argument clamped to
    # [-87, 88]; correctly rounded division (the build uses fast math)
    e[0] = T.min(T.max(T.float32(0.0) - x, T.float32(-87.0)), T.float32(88.0))
    e[1] = T.floor(e[0] * T.float32(LOG2E) + T.float32(0.5))
    e[2] = (e[0] - e[1] * T.float32(LN2_HI)) - e[1] * T.float32(LN2_LO)
    e[3] = T.float32(1.0 / 5040.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 720.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 120.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 24.0)
    e[3] = e[3] * e[2] + T.float32(1.0 / 6.0)
    e[3] = e[3] * e[2] + T.float32(0.5)
    e[3] = e[3] * e[2] + T.float32(1.0)
    e[3] = e[3] * e[2] + T.float32(1.0)
    e[3] = e[3] * T.reinterpret("float32", T.shift_left(T.cast(e[1], "int32") + 127, 23))
    T.ptx.div.rn.f32(dst[di], T.float32(1.0), T.float32(1.0) + e[3])


@T.prim_func
def sched_kernel(cnt_handle: T.handle, off_handle: T.handle, toff_handle: T.handle):
    ne = T.int32()
    ne1 = T.int32()
    CNT = T.match_buffer(cnt_handle, (ne,), "int64")
    OFF = T.match_buffer(off_handle, (ne1,), "int32")
    TOFF = T.match_buffer(toff_handle, (ne1,), "int32")
    T.device_entry()
    cta = T.cta_id([1])
    tid = T.thread_id([32])
    a = T.alloc_local((3,), "int32")
    if tid == 0:
        a[0] = 0
        a[1] = 0
        for q in range(ne):
            OFF[q] = a[0]
            TOFF[q] = a[1]
            a[2] = T.cast(CNT[q], "int32")
            a[0] = a[0] + a[2]
            a[1] = a[1] + T.ceildiv(a[2], BM)
        OFF[ne] = a[0]
        TOFF[ne] = a[1]


@T.prim_func
def probs_kernel(part_handle: T.handle, out_handle: T.handle):
    rows = T.int32()
    nparts = T.int32()
    PART = T.match_buffer(part_handle, (rows, nparts), "float32")
    OUT = T.match_buffer(out_handle, (rows,), "float32")
    T.device_entry()
    cta = T.cta_id([T.ceildiv(rows, THREADS)])
    tid = T.thread_id([THREADS])
    s = T.alloc_local((1,), "float32")
    r: T.let[T.int32] = cta * THREADS + tid
    if r < rows:
        s[0] = PART[r, 0]
        for j in range(1, nparts):
            s[0] = s[0] + PART[r, j]
        OUT[r] = s[0]


def make_gemm(mode, a_major, a_x, b_major, b_x, epi):
    """C = A @ B^T over 128 x 128 tiles. mode 'rows': one CTA per (n tile, row tile of an expert), B is the
    expert's weight ([E * rows_of_B, cols / 4, 4] view); mode 'wgrad': one CTA per (n tile, m tile, expert), K runs
    over the expert's rows. *_major 'k' (source [m or n, k]) or 'mn' (source [k, m or n]); *_x 'none' | 'swiglu'
    (silu(h_g) * h_u from H) | 'pgy' (P[row] * GY[row, :]); epi 'store' | 'dot' | 'dh'."""
    assert mode in ("rows", "wgrad") and epi in ("store", "dot", "dh")
    assert mode == "rows" or (a_major == "mn" and b_major == "mn" and epi == "store")
    assert mode == "wgrad" or a_major == "k"

    @T.prim_func
    def gemm(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle, h_handle: T.handle, p_handle: T.handle,
             gy_handle: T.handle, off_handle: T.handle, toff_handle: T.handle, part_handle: T.handle,
             M: T.int32, N: T.int32, K: T.int32, n_by: T.int32, n_bz: T.int32):
        ar = T.int32()
        ac4 = T.int32()
        br = T.int32()
        bc4 = T.int32()
        cr = T.int32()
        cc4 = T.int32()
        hr = T.int32()
        hc4 = T.int32()
        pr = T.int32()
        gyr = T.int32()
        gyc4 = T.int32()
        ne1 = T.int32()
        qr = T.int32()
        qc = T.int32()
        A = T.match_buffer(a_handle, (ar, ac4, 4), "float32", align=16)
        B = T.match_buffer(b_handle, (br, bc4, 4), "float32", align=16)
        C = T.match_buffer(c_handle, (cr, cc4, 4), "float32", align=16)
        H = T.match_buffer(h_handle, (hr, hc4, 4), "float32", align=16)
        P = T.match_buffer(p_handle, (pr,), "float32")
        GY = T.match_buffer(gy_handle, (gyr, gyc4, 4), "float32", align=16)
        OFF = T.match_buffer(off_handle, (ne1,), "int32")
        TOFF = T.match_buffer(toff_handle, (ne1,), "int32")
        PART = T.match_buffer(part_handle, (qr, qc), "float32")

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx, by, bz = T.cta_id([T.ceildiv(N, BN), n_by, n_bz])
        tid = T.thread_id([THREADS])

        As = T.alloc_shared((2, BK, PAD), "float32")
        Bs = T.alloc_shared((2, BK, PAD), "float32")
        acc = T.alloc_local((64,), "float32")
        tot = T.alloc_local((64,), "float32")
        ra = T.alloc_local((8,), "float32")
        rb = T.alloc_local((8,), "float32")
        av = T.alloc_local((8,), "float32")
        bv = T.alloc_local((8,), "float32")
        hg = T.alloc_local((4,), "float32")
        hu = T.alloc_local((4,), "float32")
        sg = T.alloc_local((4,), "float32")
        o = T.alloc_local((8,), "float32")
        d = T.alloc_local((1,), "float32")
        ew = T.alloc_local((4,), "float32")
        info = T.alloc_local((5,), "int32")        # expert, m0, m_end, k0, k_end

        tx: T.let[T.int32] = tid % 16
        ty: T.let[T.int32] = tid // 16
        n0: T.let[T.int32] = bx * BN
        kr_: T.let[T.int32] = tid // 4               # k-major loads: tile rows kr_, kr_ + 64
        kk_: T.let[T.int32] = (tid % 4) * 4          #                k offset
        mk_: T.let[T.int32] = tid // 32              # m/n-major loads: k rows mk_, mk_ + 8
        mc_: T.let[T.int32] = (tid % 32) * 4         #                  tile column
        i4: T.let[T.int32] = hc4 // 2                # I / 4 (the up half of h starts at column 4 * i4)

        if mode == "rows":
            info[0] = 0
            for q in range(ne1 - 1):
                if TOFF[q + 1] <= by:
                    info[0] = q + 1
            if info[0] < ne1 - 1:
                info[1] = OFF[info[0]] + (by - TOFF[info[0]]) * BM
                info[2] = OFF[info[0] + 1]
            else:
                info[1] = 0
                info[2] = 0
            info[3] = 0
            info[4] = K
        else:
            info[0] = bz
            info[1] = by * BM
            info[2] = M
            info[3] = OFF[bz]
            info[4] = OFF[bz + 1]

        if info[1] < info[2]:
            e: T.let[T.int32] = info[0]
            m0: T.let[T.int32] = info[1]
            m_end: T.let[T.int32] = info[2]
            k0: T.let[T.int32] = info[3]
            k_end: T.let[T.int32] = info[4]
            nk: T.let[T.int32] = T.ceildiv(k_end - k0, BK)
            for i in T.unroll(64):
                acc[i] = T.float32(0.0)
                tot[i] = T.float32(0.0)

            for kt in range(nk + 1):
                if kt < nk:
                    kb: T.let[T.int32] = k0 + kt * BK
                    # ---------------- A tile kt -> registers ----------------
                    for u in T.unroll(2):
                        if a_major == "k":
                            ok_a: T.let[T.bool] = m0 + kr_ + u * 64 < m_end and kb + kk_ < k_end
                            r_a: T.let[T.int32] = T.min(m0 + kr_ + u * 64, m_end - 1)
                            c_a: T.let[T.int32] = (kb + kk_) // 4
                        else:
                            ok_a: T.let[T.bool] = kb + mk_ + u * 8 < k_end and m0 + mc_ < m_end
                            r_a: T.let[T.int32] = T.min(kb + mk_ + u * 8, k_end - 1)
                            c_a: T.let[T.int32] = (m0 + mc_) // 4
                        if a_x == "none":
                            for i in T.vectorized(4):
                                ra[u * 4 + i] = A[r_a, T.min(c_a, ac4 - 1), i]
                        elif a_x == "pgy":
                            for i in T.vectorized(4):
                                ra[u * 4 + i] = GY[r_a, T.min(c_a, gyc4 - 1), i]
                            for i in T.unroll(4):
                                ra[u * 4 + i] = ra[u * 4 + i] * P[r_a]
                        else:
                            for i in T.vectorized(4):
                                hg[i] = H[r_a, T.min(c_a, i4 - 1), i]
                            for i in T.vectorized(4):
                                hu[i] = H[r_a, i4 + T.min(c_a, i4 - 1), i]
                            for i in T.unroll(4):
                                sigmoid_acc(sg, i, hg[i], ew)
                                ra[u * 4 + i] = hg[i] * sg[i] * hu[i]
                        for i in T.unroll(4):
                            ra[u * 4 + i] = T.if_then_else(ok_a, ra[u * 4 + i], T.float32(0.0))
                    # ---------------- B tile kt -> registers ----------------
                    for u in T.unroll(2):
                        if b_major == "k":
                            ok_b: T.let[T.bool] = n0 + kr_ + u * 64 < N and kb + kk_ < k_end
                            r_b: T.let[T.int32] = e * N + T.min(n0 + kr_ + u * 64, N - 1)
                            c_b: T.let[T.int32] = (kb + kk_) // 4
                        else:
                            ok_b: T.let[T.bool] = kb + mk_ + u * 8 < k_end and n0 + mc_ < N
                            if mode == "rows":
                                r_b: T.let[T.int32] = e * K + T.min(kb + mk_ + u * 8, K - 1)
                            else:
                                r_b: T.let[T.int32] = T.min(kb + mk_ + u * 8, k_end - 1)
                            c_b: T.let[T.int32] = (n0 + mc_) // 4
                        if b_x == "none":
                            for i in T.vectorized(4):
                                rb[u * 4 + i] = B[r_b, T.min(c_b, bc4 - 1), i]
                        else:
                            for i in T.vectorized(4):
                                hg[i] = H[r_b, T.min(c_b, i4 - 1), i]
                            for i in T.vectorized(4):
                                hu[i] = H[r_b, i4 + T.min(c_b, i4 - 1), i]
                            for i in T.unroll(4):
                                sigmoid_acc(sg, i, hg[i], ew)
                                rb[u * 4 + i] = hg[i] * sg[i] * hu[i]
                        for i in T.unroll(4):
                            rb[u * 4 + i] = T.if_then_else(ok_b, rb[u * 4 + i], T.float32(0.0))
                # ---------------- FMAs on tile kt - 1 ----------------
                if kt > 0:
                    cur: T.let[T.int32] = (kt - 1) % 2
                    for k in T.unroll(BK):
                        for hh in T.unroll(2):
                            for i in T.vectorized(4):
                                av[hh * 4 + i] = As[cur, k, hh * 64 + ty * 4 + i]
                            for i in T.vectorized(4):
                                bv[hh * 4 + i] = Bs[cur, k, hh * 64 + tx * 4 + i]
                        for a in T.unroll(8):
                            for b in T.unroll(8):
                                acc[a * 8 + b] = acc[a * 8 + b] + av[a] * bv[b]
                    if (kt - 1) % FLUSH == FLUSH - 1:
                        for i in T.unroll(64):
                            tot[i] = tot[i] + acc[i]
                            acc[i] = T.float32(0.0)
                # ---------------- registers -> shared buffer kt % 2 ----------------
                if kt < nk:
                    for u in T.unroll(2):
                        if a_major == "k":
                            for i in T.unroll(4):
                                As[kt % 2, kk_ + i, kr_ + u * 64] = ra[u * 4 + i]
                        else:
                            for i in T.vectorized(4):
                                As[kt % 2, mk_ + u * 8, mc_ + i] = ra[u * 4 + i]
                        if b_major == "k":
                            for i in T.unroll(4):
                                Bs[kt % 2, kk_ + i, kr_ + u * 64] = rb[u * 4 + i]
                        else:
                            for i in T.vectorized(4):
                                Bs[kt % 2, mk_ + u * 8, mc_ + i] = rb[u * 4 + i]
                T.cuda.cta_sync()

            for i in T.unroll(64):
                tot[i] = tot[i] + acc[i]

            # ---------------- epilogue: rows m0 + (a // 4) 64 + 4 ty + a % 4, columns n0 + hb 64 + 4 tx + j -----
            if epi == "dot":
                for a in T.unroll(8):
                    row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                    d[0] = T.float32(0.0)
                    for hb in T.unroll(2):
                        col: T.let[T.int32] = n0 + hb * 64 + tx * 4
                        for j in T.vectorized(4):
                            o[j] = GY[T.min(row, m_end - 1), T.min(col // 4, gyc4 - 1), j]
                        for j in T.unroll(4):
                            d[0] = d[0] + T.if_then_else(col < N, tot[a * 8 + hb * 4 + j] * o[j], T.float32(0.0))
                    for s in T.unroll(4):
                        d[0] = d[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, d[0], 1 << s, 32, 32)
                    if tx == 0 and row < m_end:
                        PART[row, bx] = d[0]
            else:
                for a in T.unroll(8):
                    row: T.let[T.int32] = m0 + (a // 4) * 64 + ty * 4 + a % 4
                    for hb in T.unroll(2):
                        col: T.let[T.int32] = n0 + hb * 64 + tx * 4
                        if row < m_end and col < N:
                            if epi == "dh":
                                for j in T.vectorized(4):
                                    hg[j] = H[row, col // 4, j]
                                for j in T.vectorized(4):
                                    hu[j] = H[row, i4 + col // 4, j]
                                for j in T.unroll(4):
                                    sigmoid_acc(sg, j, hg[j], ew)
                                    o[j] = tot[a * 8 + hb * 4 + j] * hu[j] * (sg[j] * (T.float32(1.0) + hg[j] * (T.float32(1.0) - sg[j])))
                                    o[4 + j] = tot[a * 8 + hb * 4 + j] * (hg[j] * sg[j])
                                for j in T.vectorized(4):
                                    C[row, col // 4, j] = o[j]
                                for j in T.vectorized(4):
                                    C[row, i4 + col // 4, j] = o[4 + j]
                            elif mode == "wgrad":
                                for j in T.vectorized(4):
                                    C[e * M + row, col // 4, j] = tot[a * 8 + hb * 4 + j]
                            else:
                                for j in T.vectorized(4):
                                    C[row, col // 4, j] = tot[a * 8 + hb * 4 + j]

    return gemm


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}
_WORKSPACE = {}

# (mode, A major, A transform, B major, B transform, epilogue) of G1 .. G6
GEMMS = (("rows", "k", "none", "k", "none", "store"),
         ("rows", "k", "swiglu", "k", "none", "dot"),
         ("rows", "k", "pgy", "mn", "none", "dh"),
         ("wgrad", "mn", "pgy", "mn", "swiglu", "store"),
         ("wgrad", "mn", "none", "mn", "none", "store"),
         ("rows", "k", "none", "mn", "none", "store"))


def _prepare(exe):
    # cache the runnable module the way jit() does for exported modules (keeps the per-call Python path short)
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else
        pass
    return exe


def _compiled():
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (sched_kernel,) + tuple(make_gemm(*g) for g in GEMMS) + (probs_kernel,)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE["exes"] = exes
    return exes


def solve(expert_inputs, tokens_per_expert, routing_probs, w_gate_up, w_down, grad_outputs):
    sched, g1, g2, g3, g4, g5, g6, probs = _compiled()
    rows, hidden = expert_inputs.shape
    experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    assert hidden % 4 == 0 and inter % 4 == 0 and rows > 0
    dev = expert_inputs.device
    f32 = torch.float32
    x = expert_inputs.contiguous()
    p = routing_probs.contiguous()           # make_inputs passes a strided column (stride 8)
    gy = grad_outputs.contiguous()
    w13 = w_gate_up.contiguous()
    w2 = w_down.contiguous()
    cnt = tokens_per_expert.to(torch.int64).contiguous()
    gx = torch.empty((rows, hidden), dtype=f32, device=dev)
    gp = torch.empty((rows,), dtype=f32, device=dev)
    gw13 = torch.empty((experts, two_inter, hidden), dtype=f32, device=dev)
    gw2 = torch.empty((experts, hidden, inter), dtype=f32, device=dev)
    nparts = (hidden + BN - 1) // BN
    key = (str(dev), rows, hidden, inter, experts)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.empty((rows, two_inter), dtype=f32, device=dev),
              torch.empty((rows, two_inter), dtype=f32, device=dev),
              torch.empty((rows, nparts), dtype=f32, device=dev),
              torch.empty((experts + 1,), dtype=torch.int32, device=dev),
              torch.empty((experts + 1,), dtype=torch.int32, device=dev))
        _WORKSPACE[key] = ws
    h, dh, part, off, toff = ws
    tiles = (rows + BM - 1) // BM + experts              # upper bound on the row tiles (idle CTAs exit)
    xv = x.view(rows, hidden // 4, 4)
    gyv = gy.view(rows, hidden // 4, 4)
    hv = h.view(rows, two_inter // 4, 4)
    dhv = dh.view(rows, two_inter // 4, 4)
    w13v = w13.view(experts * two_inter, hidden // 4, 4)
    w2v = w2.view(experts * hidden, inter // 4, 4)
    sched(cnt, off, toff)
    # (A, B, C, H, P, GY, OFF, TOFF, PART, M, N, K, n_by, n_bz)
    g1(xv, w13v, hv, hv, p, gyv, off, toff, part, rows, two_inter, hidden, tiles, 1)
    g2(hv, w2v, hv, hv, p, gyv, off, toff, part, rows, hidden, inter, tiles, 1)
    g3(gyv, w2v, dhv, hv, p, gyv, off, toff, part, rows, inter, hidden, tiles, 1)
    g4(gyv, hv, gw2.view(experts * hidden, inter // 4, 4), hv, p, gyv, off, toff, part,
       hidden, inter, rows, (hidden + BM - 1) // BM, experts)
    g5(dhv, xv, gw13.view(experts * two_inter, hidden // 4, 4), hv, p, gyv, off, toff, part,
       two_inter, hidden, rows, (two_inter + BM - 1) // BM, experts)
    g6(dhv, w13v, gx.view(rows, hidden // 4, 4), hv, p, gyv, off, toff, part, rows, hidden, two_inter, tiles, 1)
    probs(part, gp)
    return gx, gp, gw13, gw2
