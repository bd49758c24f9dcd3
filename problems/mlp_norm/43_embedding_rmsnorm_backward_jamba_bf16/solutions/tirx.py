# Backward of Jamba's token embedding + first-layer RMSNorm (hidden 4096, vocab 65536, bf16): the dense
# embedding gradient (scatter-add over repeated tokens) and the norm-weight gradient, three TIRx kernels.
#
# Math used (exact rearrangement of the reference): for vocab row v with positions P(v), e = E[v] and
# rstd = rsqrt(mean(e^2) + eps) are per row, and c_p = mean(g_p w ehat) is linear in g_p, so
#   d_embed[v] = R + rstd * (w * G - ehat * C),  G = sum_p g_p,  R = sum_p dr_p,  C = mean(G * w * ehat)
#   d_norm_weight = sum_v G_v * ehat_v.
# Only the column sums G, R of each row's positions are needed: every g / dr row is read exactly once.
#
# Kernel 1 (link): one thread per token position p: atomic exchange (atom.global.exch.b64) of
#   head[id] with (gen << 32 | p), the old value goes to next[p]: a linked list of the positions of
#   every vocab id. gen is a per-call generation number (host counter), so lists of earlier calls read
#   as empty and head never needs clearing (head / next are cached workspaces).
# Kernel 2 (rows): grid ceil(V / 64) CTAs of 256 threads, CTA c owns vocab rows 64c .. 64c+63; thread t
#   holds columns 8t..8t+7 and 2048+8t..+7 (16-byte bf16x8 accesses). Per row (head[v] is CTA-uniform):
#   - no position of this call: 16-byte stores of zeros;
#   - else walk the list (the next pointer is loaded together with the g / dr rows of the current
#     position), accumulating G and R in fp32 registers; one CTA reduction of the two sums
#     S1 = sum e^2 and S2 = sum G w e (xor shuffles, shared memory double-buffered by reduction count,
#     one __syncthreads); rstd = rsqrt(S1/H + eps), C = rstd * S2 / H; out = R + rstd (w G - e rstd C)
#     rounded once to bf16; the CTA's d_norm_weight partial += G * e * rstd (fp32, kept in shared
#     memory at thread-private columns to stay within __launch_bounds__(256, 3) = 80 registers).
#   The CTA writes its fp32 partial [4096] to a workspace row.
# Kernel 3 (dnw): grid 128 CTAs x 256 threads: CTA j sums the partial rows for columns 32j..32j+31
#   (warp w takes partial rows w, w+8, ...; lane = column, 128-byte coalesced loads), 8 warp sums
#   combined through shared memory, rounded to bf16.
# Accumulation is fp32 throughout (the output is bf16; the summation order of G depends on the atomic
# order, a ~1e-7 relative effect).
#
# Limits: the dense [65536, 4096] bf16 output (537 MB, mostly zeros) plus reading 16384 x (g, dr) rows
# and the e rows of the ~14k distinct ids (~370 MB): floor ~190 us at 4.8 TB/s. Expected ~230-260 us:
# the frequent ids (~50 positions each) are walked serially by one CTA (a pointer chase of L2-resident
# next entries plus 16 KB of loads per position), which costs a tail of ~15-30 us when one of them lands
# in the last wave; the 16 MB partial workspace adds ~7 us. Eager PyTorch runs many full-size fp32
# temporaries [16384, 4096] and a fp64 index_add over [65536, 4096] (2 GB of fp64 traffic): this should
# be several times faster.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on
# torch's current stream. Cached: compiled modules per hidden size; head / next / partial workspaces
# per (device, sizes) (their contents never carry results between calls: gen tags every list).

import torch
import tvm
from tvm.script import tirx as T

EPS = 1e-6
ROWS_PER_CTA = 64
LINK_THREADS = 256
RED_THREADS = 256
RED_COLS = 32


def _geometry(hidden):
    vec = 8 if hidden >= 256 else hidden // 32          # bf16 per access
    threads = min(256, hidden // vec)
    chunks = hidden // (threads * vec)
    assert vec * threads * chunks == hidden and threads % 32 == 0
    return vec, threads, chunks


@T.prim_func
def link_positions(ids_handle: T.handle, head_handle: T.handle, next_handle: T.handle, gen: T.int64):
    n_pos = T.int32()
    vocab = T.int32()
    IDS = T.match_buffer(ids_handle, (n_pos,), "int64")
    HEAD = T.match_buffer(head_handle, (vocab,), "int64")
    NEXT = T.match_buffer(next_handle, (n_pos,), "int64")

    T.device_entry()
    cta = T.cta_id([T.ceildiv(n_pos, LINK_THREADS)])
    tid = T.thread_id([LINK_THREADS])
    old = T.alloc_local((1,), "int64")
    p: T.let[T.int32] = cta * LINK_THREADS + tid
    if p < n_pos:
        T.ptx.atom.global_.exch.b64(old[0], T.address_of(HEAD[T.cast(IDS[p], "int32")]),
                                    T.bitwise_or(T.shift_left(gen, T.int64(32)), T.cast(p, "int64")))
        NEXT[p] = old[0]


def _make_rows_kernel(hidden):
    vec, threads, chunks = _geometry(hidden)
    warps = threads // 32
    stride = threads * vec
    inv_h = 1.0 / hidden

    @T.prim_func
    def rows_kernel(e_handle: T.handle, w_handle: T.handle, g_handle: T.handle, r_handle: T.handle,
                    head_handle: T.handle, next_handle: T.handle, out_handle: T.handle, part_handle: T.handle,
                    gen: T.int64):
        vocab = T.int32()
        n_pos = T.int32()
        n_cta = T.int32()
        E = T.match_buffer(e_handle, (vocab, hidden), "bfloat16", align=16)
        W = T.match_buffer(w_handle, (hidden,), "bfloat16", align=16)
        G = T.match_buffer(g_handle, (n_pos, hidden), "bfloat16", align=16)
        R = T.match_buffer(r_handle, (n_pos, hidden), "bfloat16", align=16)
        HEAD = T.match_buffer(head_handle, (vocab,), "int64")
        NEXT = T.match_buffer(next_handle, (n_pos,), "int64")
        OUT = T.match_buffer(out_handle, (vocab, hidden), "bfloat16", align=16)
        PART = T.match_buffer(part_handle, (n_cta, hidden), "float32", align=16)

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 3})   # <= 80 registers: 768 threads per SM
        cta = T.cta_id([n_cta])
        tid = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([32])

        wb = T.alloc_local((chunks * vec,), "bfloat16")
        eb = T.alloc_local((chunks * vec,), "bfloat16")
        gs = T.alloc_local((chunks * vec,), "float32")
        rs = T.alloc_local((chunks * vec,), "float32")
        dnw = T.alloc_shared((hidden,), "float32")       # thread-private columns: no barrier needed
        bv = T.alloc_local((chunks * vec,), "bfloat16")
        gb = T.alloc_local((chunks * vec,), "bfloat16")
        rb = T.alloc_local((chunks * vec,), "bfloat16")
        hcur = T.alloc_local((1,), "int64")
        hnext = T.alloc_local((1,), "int64")
        s = T.alloc_local((2,), "float32")
        st = T.alloc_local((2,), "float32")      # rstd, C
        nred = T.alloc_local((1,), "int32")
        red = T.alloc_shared((2, 2, warps), "float32")

        for c in T.unroll(chunks):
            for i in T.vectorized(vec):
                wb[c * vec + i] = W[c * stride + tid * vec + i]
        for c in T.unroll(chunks):
            for i in T.unroll(vec):
                dnw[c * stride + tid * vec + i] = T.float32(0.0)
        nred[0] = 0

        for k in range(ROWS_PER_CTA):
            v: T.let[T.int32] = cta * ROWS_PER_CTA + k
            if v < vocab:
                hcur[0] = HEAD[v]
                if T.shift_right(hcur[0], T.int64(32)) != gen:
                    for e in T.unroll(chunks * vec):
                        bv[e] = T.bfloat16(0.0)
                    for c in T.unroll(chunks):
                        for i in T.vectorized(vec):
                            OUT[v, c * stride + tid * vec + i] = bv[c * vec + i]
                else:
                    for c in T.unroll(chunks):
                        for i in T.vectorized(vec):
                            eb[c * vec + i] = E[v, c * stride + tid * vec + i]
                    for e in T.unroll(chunks * vec):
                        gs[e] = T.float32(0.0)
                        rs[e] = T.float32(0.0)
                    while T.shift_right(hcur[0], T.int64(32)) == gen:
                        pos: T.let[T.int32] = T.cast(T.bitwise_and(hcur[0], T.int64(0xFFFFFFFF)), "int32")
                        hnext[0] = NEXT[pos]
                        for c in T.unroll(chunks):
                            for i in T.vectorized(vec):
                                gb[c * vec + i] = G[pos, c * stride + tid * vec + i]
                            for i in T.vectorized(vec):
                                rb[c * vec + i] = R[pos, c * stride + tid * vec + i]
                        for e in T.unroll(chunks * vec):
                            gs[e] = gs[e] + T.cast(gb[e], "float32")
                            rs[e] = rs[e] + T.cast(rb[e], "float32")
                        hcur[0] = hnext[0]
                    # CTA reduction of S1 = sum e^2, S2 = sum G w e
                    s[0] = T.float32(0.0)
                    s[1] = T.float32(0.0)
                    for e in T.unroll(chunks * vec):
                        s[0] = s[0] + T.cast(eb[e], "float32") * T.cast(eb[e], "float32")
                        s[1] = s[1] + gs[e] * T.cast(wb[e], "float32") * T.cast(eb[e], "float32")
                    for sh in T.unroll(5):
                        for j in T.unroll(2):
                            s[j] = s[j] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, s[j], 16 >> sh, 32, 32)
                    if lane == 0:
                        red[nred[0] % 2, 0, warp] = s[0]
                        red[nred[0] % 2, 1, warp] = s[1]
                    T.cuda.cta_sync()
                    for j in T.unroll(2):
                        s[j] = red[nred[0] % 2, j, 0]
                        for w in T.unroll(warps - 1):
                            s[j] = s[j] + red[nred[0] % 2, j, w + 1]
                    nred[0] = nred[0] + 1
                    st[0] = T.rsqrt(s[0] * T.float32(inv_h) + T.float32(EPS))
                    st[1] = st[0] * s[1] * T.float32(inv_h)
                    for e in T.unroll(chunks * vec):
                        bv[e] = T.cast(rs[e] + st[0] * (T.cast(wb[e], "float32") * gs[e]
                                                        - T.cast(eb[e], "float32") * st[0] * st[1]), "bfloat16")
                        dnw[(e // vec) * stride + tid * vec + e % vec] = (
                            dnw[(e // vec) * stride + tid * vec + e % vec] + gs[e] * (T.cast(eb[e], "float32") * st[0]))
                    for c in T.unroll(chunks):
                        for i in T.vectorized(vec):
                            OUT[v, c * stride + tid * vec + i] = bv[c * vec + i]

        for c in T.unroll(chunks):
            for q in T.unroll(vec // 4):
                for i in T.vectorized(4):
                    PART[cta, c * stride + tid * vec + q * 4 + i] = dnw[c * stride + tid * vec + q * 4 + i]

    return rows_kernel


def _make_dnw_kernel(hidden):
    warps = RED_THREADS // 32

    @T.prim_func
    def dnw_kernel(part_handle: T.handle, dnw_handle: T.handle):
        n_cta = T.int32()
        PART = T.match_buffer(part_handle, (n_cta, hidden), "float32")
        DNW = T.match_buffer(dnw_handle, (hidden,), "bfloat16")

        T.device_entry()
        cb = T.cta_id([hidden // RED_COLS])
        tid = T.thread_id([RED_THREADS])
        warp = T.warp_id([warps])
        lane = T.lane_id([32])
        acc = T.alloc_local((4,), "float32")
        tot = T.alloc_local((1,), "float32")
        red = T.alloc_shared((warps, RED_COLS), "float32")

        for j in T.unroll(4):
            acc[j] = T.float32(0.0)
        for r in range(T.ceildiv(n_cta, warps * 4)):
            for j in T.unroll(4):
                if (r * 4 + j) * warps + warp < n_cta:
                    acc[j] = acc[j] + PART[(r * 4 + j) * warps + warp, cb * RED_COLS + lane]
        red[warp, lane] = (acc[0] + acc[1]) + (acc[2] + acc[3])
        T.cuda.cta_sync()
        if warp == 0:
            tot[0] = red[0, lane]
            for w in T.unroll(warps - 1):
                tot[0] = tot[0] + red[w + 1, lane]
            DNW[cb * RED_COLS + lane] = T.cast(tot[0], "bfloat16")

    return dnw_kernel


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


def _compiled(hidden=4096):
    key = ("exes", hidden)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (link_positions, _make_rows_kernel(hidden), _make_dnw_kernel(hidden)))
        _CACHE[key] = exes
    return exes


def _workspace(device, vocab, n_pos, n_cta, hidden):
    key = ("ws", str(device), vocab, n_pos, n_cta, hidden)
    ws = _CACHE.get(key)
    if ws is None:
        head = torch.zeros(vocab, dtype=torch.int64, device=device)     # generation 0: empty lists
        nxt = torch.empty(n_pos, dtype=torch.int64, device=device)
        part = torch.empty((n_cta, hidden), dtype=torch.float32, device=device)
        ws = _CACHE[key] = (head, nxt, part)
    return ws


def solve(input_ids, embed_weight, norm_weight, d_normed, d_residual):
    vocab, hidden = embed_weight.shape
    _compiled(4096)                      # the full-size (Jamba) build, also when called at another size
    link, rows, dnw_k = _compiled(hidden)
    ids = input_ids.reshape(-1)
    ids = (ids if ids.dtype == torch.int64 else ids.to(torch.int64)).contiguous()
    n_pos = ids.numel()
    n_cta = (vocab + ROWS_PER_CTA - 1) // ROWS_PER_CTA
    d_embed = torch.empty((vocab, hidden), dtype=embed_weight.dtype, device=embed_weight.device)
    d_nw = torch.empty((hidden,), dtype=norm_weight.dtype, device=norm_weight.device)
    head, nxt, part = _workspace(embed_weight.device, vocab, max(n_pos, 1), n_cta, hidden)
    gen = _CACHE["gen"] = _CACHE.get("gen", 0) + 1                       # list generation of this call
    g = d_normed.reshape(n_pos, hidden).contiguous()
    r = d_residual.reshape(n_pos, hidden).contiguous()
    if n_pos > 0:
        link(ids, head, nxt[:n_pos], gen)
    rows(embed_weight.contiguous(), norm_weight.contiguous(), g, r, head, nxt[:n_pos], d_embed, part, gen)
    dnw_k(part, d_nw)
    return d_embed, d_nw
