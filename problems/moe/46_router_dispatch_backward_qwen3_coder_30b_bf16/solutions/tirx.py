# Backward of softmax top-8 routing + dispatch (permute) + weighted combine (unpermute) of a 128-expert MoE layer
# (hidden 2048, T = 8192, bf16 in/out, fp32 math) in TIRx: four kernels, the same decomposition as the CuTe DSL
# solution (which passed on the H200 at 0.387 ms device time).
#
# Row of pair (t, k) in the expert-major buffers: r(t, k) = off[e] + #{t' < t : e in ids[t']}, e = ids[t, k],
# built without sorting:
# K1 member: one warp per 32 tokens; each lane turns its 8 ids into a 128-bit expert mask, and 128 warp ballots
#    give the words M[e, w] (bit j: token 32w + j chose expert e).
# K2 prefix (1 CTA, 1024 threads): a warp per expert: popcounts of M[e, :] and a shuffle-up scan give
#    P[e, w] = #{chosen tokens of e in words < w}; warp 0 scans the 128 expert totals into off[0..128].
#    Then r(t, k) = off[e] + P[e, t/32] + popcount(M[e, t/32] & lanemask_lt(t % 32)).
# K3 token: one CTA per token, hidden/8 threads (256), thread i owns channels 8i..8i+7 (16-byte accesses).
#    Threads 0..7 compute the 8 rows into shared memory while every thread loads x, dy and the 8 router rows;
#    after the barrier the 8 expert_outputs rows. 16 dot products (chosen logits x.W[e_k], g_k = dy.EO[r_k])
#    in fp32: per thread -> warp reduce-scatter (16 shuffles for the 16 sums) -> shared partials -> every warp
#    combines the warp partials in the same order (identical totals in all threads). The 8 grad_expert_inputs
#    rows and a second read of the router rows (L2 hits) are issued after the reduction barrier (the CuTe
#    kernel needed 184-201 registers with every operand loaded up front; capped at 128 here as there, 2 CTAs
#    per SM). w = softmax over the 8 chosen logits (= p[chosen] / sum p[chosen]); dl_k = w_k (g_k - sum_j w_j g_j).
#    Stores: grad_expert_outputs[r_k] = bf16(w_k dy); grad_hidden = bf16(sum_k GEI[r_k] + sum_k dl_k W[e_k]);
#    thread k < 8 records (token, dl_k) of row r_k for K4.
# K4 router weight grad: CTA per (expert, 1024-column half), 128 threads: sums dl[r] * x[token(r)] in fp32 over
#    the expert's contiguous row range, 4 rows in flight per iteration (deterministic, no atomics).
#
# Differences from the CuTe DSL kernels: none in the algorithm; the ballot/popcount/shuffle primitives are the
# TIRx intrinsics, the exp in the 8-way softmax is the fast-math exp of the TVM build (the CuTe kernel's exp
# was ex2.approx-based as well, and passed).
# What limits it: DRAM bandwidth: K3 moves ~880 MB (3 x 268 MB expert-major rows + x, dy, grad_hidden),
# ~185 us at 4.8 TB/s; K4 re-reads x (~270 MB of gathered rows, partly L2 hits); K1/K2 are tiny.
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi launches them in order on torch's
# current stream. Workspaces (bit words, prefixes, offsets, per-row token / dl) are cached per (device, T).
#
# Registers (ptxas, sm_90a): token kernel 128 with the 2-CTA cap, no spills; the others 32.
#
# Verification: compile-checked on CPU (sm_90a); emulated on CPU (scripts/cuda_emu) at smoke size (2 seeds,
# <= 0.12x of the allowance) and at T = 1100, hidden 2048 (35 mask words: a scan chunk tail; <= 0.14x);
# H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

NUM_EXPERTS = 128
TOP_K = 8
VEC = 8
EWORDS = NUM_EXPERTS // 32      # 4 mask words per token
K1_THREADS = 128
K1_WARPS = K1_THREADS // 32
K2_THREADS = 1024
K2_WARPS = K2_THREADS // 32
K4_ROWS = 4                     # rows in flight per K4 iteration
NVAL = 2 * TOP_K                # dot products per token


@T.prim_func
def member_kernel(ids_h: T.handle, m_h: T.handle):
    n_tok = T.int32()
    nw = T.int32()
    IDS = T.match_buffer(ids_h, (n_tok, TOP_K), "int32")
    M = T.match_buffer(m_h, (NUM_EXPERTS, nw), "int32")

    T.device_entry()
    cta = T.cta_id([T.ceildiv(nw, K1_WARPS)])
    tid = T.thread_id([K1_THREADS])
    warp = T.warp_id([K1_WARPS])
    lane = T.lane_id([32])
    words = T.alloc_local((EWORDS,), "uint32")
    mine = T.alloc_local((1,), "uint32")
    bal = T.alloc_local((1,), "uint32")

    w: T.let[T.int32] = cta * K1_WARPS + warp
    for q in T.unroll(EWORDS):
        words[q] = T.uint32(0)
    if w * 32 + lane < n_tok:
        for k in T.unroll(TOP_K):
            for q in T.unroll(EWORDS):
                if IDS[w * 32 + lane, k] // 32 == q:
                    words[q] = T.bitwise_or(words[q], T.shift_left(T.uint32(1), T.cast(IDS[w * 32 + lane, k] % 32, "uint32")))
    for q in T.unroll(EWORDS):
        mine[0] = T.uint32(0)
        for j in T.unroll(32):
            bal[0] = T.cuda.ballot_sync(T.uint32(0xFFFFFFFF),
                                        T.bitwise_and(T.shift_right(words[q], T.uint32(j)), T.uint32(1)) != T.uint32(0))
            if lane == j:
                mine[0] = bal[0]
        if w < nw:
            M[q * 32 + lane, w] = T.reinterpret("int32", mine[0])


@T.prim_func
def prefix_kernel(m_h: T.handle, p_h: T.handle, off_h: T.handle):
    nw = T.int32()
    M = T.match_buffer(m_h, (NUM_EXPERTS, nw), "int32")
    P = T.match_buffer(p_h, (NUM_EXPERTS, nw), "int32")
    OFF = T.match_buffer(off_h, (NUM_EXPERTS + 1,), "int32")

    T.device_entry()
    cta = T.cta_id([1])
    tid = T.thread_id([K2_THREADS])
    warp = T.warp_id([K2_WARPS])
    lane = T.lane_id([32])
    scnt = T.alloc_shared((NUM_EXPERTS,), "int32")
    a = T.alloc_local((4,), "int32")            # count, inclusive scan, carry, shuffled value
    c4 = T.alloc_local((4,), "int32")

    for eb in T.unroll(NUM_EXPERTS // K2_WARPS):
        a[2] = 0
        for c in range(T.ceildiv(nw, 32)):
            a[0] = 0
            if c * 32 + lane < nw:
                a[0] = T.cast(T.popcount(T.reinterpret("uint32", M[eb * K2_WARPS + warp, c * 32 + lane])), "int32")
            a[1] = a[0]
            for s in T.unroll(5):
                a[3] = T.tvm_warp_shuffle_up(0xFFFFFFFF, a[1], 1 << s, 32, 32)
                if lane >= (1 << s):
                    a[1] = a[1] + a[3]
            if c * 32 + lane < nw:
                P[eb * K2_WARPS + warp, c * 32 + lane] = a[2] + a[1] - a[0]
            a[2] = a[2] + T.tvm_warp_shuffle(0xFFFFFFFF, a[1], 31, 32, 32)
        if lane == 0:
            scnt[eb * K2_WARPS + warp] = a[2]
    T.cuda.cta_sync()
    if warp == 0:
        # exclusive scan of the 128 counts: lane j holds experts 4j..4j+3
        for i in T.unroll(4):
            c4[i] = scnt[4 * lane + i]
        a[0] = c4[0] + c4[1] + c4[2] + c4[3]
        a[1] = a[0]
        for s in T.unroll(5):
            a[3] = T.tvm_warp_shuffle_up(0xFFFFFFFF, a[1], 1 << s, 32, 32)
            if lane >= (1 << s):
                a[1] = a[1] + a[3]
        a[2] = a[1] - a[0]
        OFF[4 * lane] = a[2]
        OFF[4 * lane + 1] = a[2] + c4[0]
        OFF[4 * lane + 2] = a[2] + c4[0] + c4[1]
        OFF[4 * lane + 3] = a[2] + c4[0] + c4[1] + c4[2]
        if lane == 31:
            OFF[NUM_EXPERTS] = a[1]


def make_token_kernel(hidden):
    nch = hidden // VEC
    assert nch % 32 == 0, "hidden must be a multiple of 256"
    nwarp = nch // 32

    @T.prim_func
    def token_kernel(x_h: T.handle, w_h: T.handle, ids_h: T.handle, eo_h: T.handle, dy_h: T.handle, gei_h: T.handle,
                     m_h: T.handle, p_h: T.handle, off_h: T.handle, gh_h: T.handle, geo_h: T.handle,
                     tokrow_h: T.handle, dlrow_h: T.handle):
        n_tok = T.int32()
        npair = T.int32()
        nw = T.int32()
        X = T.match_buffer(x_h, (n_tok, nch, VEC), "bfloat16", align=16)
        W = T.match_buffer(w_h, (NUM_EXPERTS, nch, VEC), "bfloat16", align=16)
        IDS = T.match_buffer(ids_h, (n_tok, TOP_K), "int32")
        EO = T.match_buffer(eo_h, (npair, nch, VEC), "bfloat16", align=16)
        DY = T.match_buffer(dy_h, (n_tok, nch, VEC), "bfloat16", align=16)
        GEI = T.match_buffer(gei_h, (npair, nch, VEC), "bfloat16", align=16)
        M = T.match_buffer(m_h, (NUM_EXPERTS, nw), "int32")
        P = T.match_buffer(p_h, (NUM_EXPERTS, nw), "int32")
        OFF = T.match_buffer(off_h, (NUM_EXPERTS + 1,), "int32")
        GH = T.match_buffer(gh_h, (n_tok, nch, VEC), "bfloat16", align=16)
        GEO = T.match_buffer(geo_h, (npair, nch, VEC), "bfloat16", align=16)
        TOKROW = T.match_buffer(tokrow_h, (npair,), "int32")
        DLROW = T.match_buffer(dlrow_h, (npair,), "float32")

        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 2})
        t = T.cta_id([n_tok])
        tid = T.thread_id([nch])
        warp = T.warp_id([nwarp])
        lane = T.lane_id([32])

        srow = T.alloc_shared((TOP_K,), "int32")
        sred = T.alloc_shared((nwarp, NVAL), "float32")
        xb = T.alloc_local((VEC,), "bfloat16")
        dyb = T.alloc_local((VEC,), "bfloat16")
        rb = T.alloc_local((TOP_K * VEC,), "bfloat16")     # router rows, then input-gradient rows
        eb = T.alloc_local((TOP_K * VEC,), "bfloat16")     # expert-output rows, then router rows again
        rows = T.alloc_local((TOP_K,), "int32")
        vals = T.alloc_local((NVAL,), "float32")
        tot = T.alloc_local((NVAL,), "float32")
        sc = T.alloc_local((4,), "float32")                # send, keep, partial, total
        sm = T.alloc_local((4,), "float32")                # max, sum, inverse sum, sum w g
        ws = T.alloc_local((TOP_K,), "float32")
        dls = T.alloc_local((TOP_K,), "float32")
        gh = T.alloc_local((VEC,), "float32")
        ob = T.alloc_local((VEC,), "bfloat16")

        if tid < TOP_K:
            srow[tid] = OFF[IDS[t, tid]] + P[IDS[t, tid], t // 32] + T.cast(T.popcount(T.bitwise_and(
                T.reinterpret("uint32", M[IDS[t, tid], t // 32]),
                T.shift_left(T.uint32(1), T.cast(t % 32, "uint32")) - T.uint32(1))), "int32")
        for j in T.vectorized(VEC):
            xb[j] = X[t, tid, j]
        for j in T.vectorized(VEC):
            dyb[j] = DY[t, tid, j]
        for k in T.unroll(TOP_K):
            for j in T.vectorized(VEC):
                rb[k * VEC + j] = W[IDS[t, k], tid, j]
        T.cuda.cta_sync()
        for k in T.unroll(TOP_K):
            rows[k] = srow[k]
        for k in T.unroll(TOP_K):
            for j in T.vectorized(VEC):
                eb[k * VEC + j] = EO[rows[k], tid, j]
        for k in T.unroll(TOP_K):
            vals[k] = T.float32(0.0)
            vals[TOP_K + k] = T.float32(0.0)
            for j in T.unroll(VEC):
                vals[k] = vals[k] + T.cast(xb[j], "float32") * T.cast(rb[k * VEC + j], "float32")
            for j in T.unroll(VEC):
                vals[TOP_K + k] = vals[TOP_K + k] + T.cast(dyb[j], "float32") * T.cast(eb[k * VEC + j], "float32")
        # warp reduce-scatter: at offset o the lanes with bit o set keep the upper half of the list and send
        # the lower half; lane l ends with the warp sum of value l >> 1 (after the final xor-1 step)
        for st in T.unroll(4):
            for k in T.unroll(NVAL // 2):
                if k < (NVAL >> (st + 1)):              # constant after unrolling
                    if T.bitwise_and(lane, 16 >> st) != 0:
                        sc[0] = vals[k]
                        sc[1] = vals[k + (NVAL >> (st + 1))]
                    else:
                        sc[0] = vals[k + (NVAL >> (st + 1))]
                        sc[1] = vals[k]
                    vals[k] = sc[1] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[0], 16 >> st, 32, 32)
        sc[2] = vals[0] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, vals[0], 1, 32, 32)
        if lane % 2 == 0:
            sred[warp, lane // 2] = sc[2]
        T.cuda.cta_sync()
        # issued after the barrier: input-gradient rows and the router rows again (L2 hits)
        for k in T.unroll(TOP_K):
            for j in T.vectorized(VEC):
                rb[k * VEC + j] = GEI[rows[k], tid, j]
        for k in T.unroll(TOP_K):
            for j in T.vectorized(VEC):
                eb[k * VEC + j] = W[IDS[t, k], tid, j]
        # every warp combines the warp partials: lane l sums value l % 16 over the warps of parity l / 16, one
        # xor-16 shuffle completes it, lane v broadcasts value v (same order everywhere: identical totals)
        sc[2] = T.float32(0.0)
        for j in T.unroll((nwarp + 1) // 2):
            if 2 * j + lane // NVAL < nwarp:
                sc[2] = sc[2] + sred[T.min(2 * j + lane // NVAL, nwarp - 1), lane % NVAL]
        sc[3] = sc[2] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, sc[2], NVAL, 32, 32)
        for v in T.unroll(NVAL):
            tot[v] = T.tvm_warp_shuffle(0xFFFFFFFF, sc[3], v, 32, 32)

        # softmax over the 8 chosen logits, then the routing-weight gradient
        sm[0] = tot[0]
        for k in T.unroll(TOP_K - 1):
            sm[0] = T.max(sm[0], tot[k + 1])
        sm[1] = T.float32(0.0)
        for k in T.unroll(TOP_K):
            ws[k] = T.exp(tot[k] - sm[0])
            sm[1] = sm[1] + ws[k]
        sm[2] = T.float32(1.0) / sm[1]
        sm[3] = T.float32(0.0)
        for k in T.unroll(TOP_K):
            ws[k] = ws[k] * sm[2]
            sm[3] = sm[3] + ws[k] * tot[TOP_K + k]
        for k in T.unroll(TOP_K):
            dls[k] = ws[k] * (tot[TOP_K + k] - sm[3])

        for k in T.unroll(TOP_K):
            for j in T.unroll(VEC):
                ob[j] = T.cast(T.cast(dyb[j], "float32") * ws[k], "bfloat16")
            for j in T.vectorized(VEC):
                GEO[rows[k], tid, j] = ob[j]
        for j in T.unroll(VEC):
            gh[j] = T.cast(rb[j], "float32")
        for k in T.unroll(TOP_K - 1):
            for j in T.unroll(VEC):
                gh[j] = gh[j] + T.cast(rb[(k + 1) * VEC + j], "float32")
        for k in T.unroll(TOP_K):
            for j in T.unroll(VEC):
                gh[j] = gh[j] + T.cast(eb[k * VEC + j], "float32") * dls[k]
        for j in T.unroll(VEC):
            ob[j] = T.cast(gh[j], "bfloat16")
        for j in T.vectorized(VEC):
            GH[t, tid, j] = ob[j]
        for k in T.unroll(TOP_K):
            if tid == k:
                TOKROW[rows[k]] = t
                DLROW[rows[k]] = dls[k]

    return token_kernel


def make_wgrad_kernel(hidden):
    nch = hidden // VEC
    k4_threads = min(128, nch)
    k4_split = nch // k4_threads

    @T.prim_func
    def wgrad_kernel(x_h: T.handle, off_h: T.handle, tokrow_h: T.handle, dlrow_h: T.handle, gw_h: T.handle):
        n_tok = T.int32()
        npair = T.int32()
        X = T.match_buffer(x_h, (n_tok, nch, VEC), "bfloat16", align=16)
        OFF = T.match_buffer(off_h, (NUM_EXPERTS + 1,), "int32")
        TOKROW = T.match_buffer(tokrow_h, (npair,), "int32")
        DLROW = T.match_buffer(dlrow_h, (npair,), "float32")
        GW = T.match_buffer(gw_h, (NUM_EXPERTS, nch, VEC), "bfloat16", align=16)

        T.device_entry()
        e, half = T.cta_id([NUM_EXPERTS, k4_split])
        tid = T.thread_id([k4_threads])
        acc = T.alloc_local((VEC,), "float32")
        xs = T.alloc_local((K4_ROWS * VEC,), "bfloat16")
        ds = T.alloc_local((K4_ROWS,), "float32")
        ob = T.alloc_local((VEC,), "bfloat16")

        for j in T.unroll(VEC):
            acc[j] = T.float32(0.0)
        for rb in range(T.ceildiv(OFF[e + 1] - OFF[e], K4_ROWS)):
            for q in T.unroll(K4_ROWS):
                ds[q] = T.if_then_else(OFF[e] + rb * K4_ROWS + q < OFF[e + 1],
                                       DLROW[T.min(OFF[e] + rb * K4_ROWS + q, OFF[e + 1] - 1)], T.float32(0.0))
                for j in T.vectorized(VEC):
                    xs[q * VEC + j] = X[TOKROW[T.min(OFF[e] + rb * K4_ROWS + q, OFF[e + 1] - 1)], half * k4_threads + tid, j]
            for q in T.unroll(K4_ROWS):
                for j in T.unroll(VEC):
                    acc[j] = acc[j] + T.cast(xs[q * VEC + j], "float32") * ds[q]
        for j in T.unroll(VEC):
            ob[j] = T.cast(acc[j], "bfloat16")
        for j in T.vectorized(VEC):
            GW[e, half * k4_threads + tid, j] = ob[j]

    return wgrad_kernel


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; caching jit() once makes the host call path ~0.2 us.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled(hidden=2048):
    key = ("exes", hidden)
    exes = _CACHE.get(key)
    if exes is None:
        target = tvm.target.Target(TARGET)
        funcs = (member_kernel, prefix_kernel, make_token_kernel(hidden), make_wgrad_kernel(hidden))
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in funcs)
        _CACHE[key] = exes
    return exes


def _workspace(device, ntok):
    key = ("ws", str(device), ntok)
    ws = _CACHE.get(key)
    if ws is None:
        nw = (ntok + 31) // 32
        ws = (torch.empty((NUM_EXPERTS, nw), dtype=torch.int32, device=device),     # membership bit words
              torch.empty((NUM_EXPERTS, nw), dtype=torch.int32, device=device),     # word prefixes
              torch.empty((NUM_EXPERTS + 1,), dtype=torch.int32, device=device),
              torch.empty((ntok * TOP_K,), dtype=torch.int32, device=device),
              torch.empty((ntok * TOP_K,), dtype=torch.float32, device=device))
        _CACHE[key] = ws
    return ws


def solve(hidden_states, router_weight, topk_ids, expert_outputs, grad_output, grad_expert_inputs):
    ntok, hidden = hidden_states.shape
    assert topk_ids.shape == (ntok, TOP_K) and router_weight.shape == (NUM_EXPERTS, hidden)
    dev = hidden_states.device
    gh = torch.empty_like(hidden_states)
    gw = torch.empty_like(router_weight)
    geo = torch.empty_like(expert_outputs)
    if ntok == 0:
        return gh, gw, geo
    _compiled()                                   # the full-size build, also when called at another size
    member, prefix, token, wgrad = _compiled(hidden)
    m, p, off, tok_row, dl_row = _workspace(dev, ntok)
    nch = hidden // VEC
    x = hidden_states.contiguous().view(ntok, nch, VEC)
    ids = topk_ids.to(torch.int32).contiguous()
    member(ids, m)
    prefix(m, p, off)
    token(x, router_weight.contiguous().view(NUM_EXPERTS, nch, VEC), ids,
          expert_outputs.contiguous().view(-1, nch, VEC), grad_output.contiguous().view(ntok, nch, VEC),
          grad_expert_inputs.contiguous().view(-1, nch, VEC), m, p, off, gh.view(ntok, nch, VEC),
          geo.view(-1, nch, VEC), tok_row, dl_row)
    wgrad(x, off, tok_row, dl_row, gw.view(NUM_EXPERTS, nch, VEC))
    return gh, gw, geo
