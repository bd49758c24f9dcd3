# GQA paged decode (32 q heads / 8 kv heads, head dim 128, page size 64, bf16) in TIRx: split-KV
# flash decoding with two kernels. Same design as the H200-verified page-size-1 solution of problem 01;
# only the KV addressing differs (page table with 64 tokens per page and a ragged last page).
#
# Kernel 1 (decode_partial): grid (16 splits, 8 kv heads, B requests), 128 threads = 4 warps.
# - Request b has npages = indptr[b+1] - indptr[b] pages and kv_len = (npages - 1) * 64 + last_page_len[b]
#   tokens; token t lives in page kv_indices[indptr[b] + t // 64], slot t % 64. The tokens are cut into
#   chunks of max(256, ceil(len/16)) tokens (never more than 16); CTA (s, h, b) handles chunk s and
#   exits at once if the chunk starts past the request's length.
# - A token is handled by a half-warp (16 lanes); lane l holds head-dim elements 8l .. 8l+7, so a K or V
#   row (256 bytes) is one 16-byte vector load per lane. The CTA's 8 half-warps each take 4 tokens per
#   iteration: 8 vector loads (4 K + 4 V rows) in flight per lane; the next iteration's page-table
#   lookups (one int32 per token; 64 consecutive tokens share it, so they are L1 hits) are prefetched
#   into registers.
# - Each lane keeps the 4 query heads of its kv group (32 fp32, pre-scaled by sm_scale*log2 e); the 4
#   partial dot products per token are summed over the 16 lanes with xor shuffles, then an online
#   softmax in base 2 per half-warp (running max, sum and a [4 heads x 8] fp32 accumulator, rescaled
#   once per 4-token group). Tokens past the chunk end get logit -inf and zero K/V (the unused slots of
#   the last page are never read).
# - The 8 half-warp states are merged through shared memory (16 KiB); the CTA writes its normalized
#   partial output [4 x 128] fp32 and partial base-2 lse to a cached workspace.
# - __launch_bounds__(128, 4): 4 CTAs (16 warps) per SM.
# Kernel 2 (decode_merge): grid (8 kv heads, B), 128 threads; merges the active chunks of a request
# (lse = max + log2(sum 2^(lse_s - max)), out = sum 2^(lse_s - lse) o_s) and writes the bf16 output and
# the base-2 lse. Zero-length requests: output 0 and lse -inf.
#
# What limits it / expected time: DRAM reads of the K/V pages (543 MB for 132601 tokens), ~113 us at
# 4.8 TB/s; problem 01's kernel ran at 0.08-0.09 ms for 242 MB on the H200, so ~0.15-0.2 ms here. The
# longest request (25869 tokens) is cut into 16 chunks of ~1617 tokens; those CTAs are latency bound
# (~50 us) but finish well inside the aggregate time. Far faster than the eager reference (a Python
# loop over requests with gathers and einsums).
#
# Streams: the compiled functions are called with torch tensors; tvm-ffi installs torch's current stream
# as TVM's environment stream for each call, so both kernels run in order on it. The workspace is cached
# per (device, batch) and fully rewritten (for every chunk kernel 2 reads) on each call.
#
# Verification: compile-checked on CPU (sm_90a); H200 results: results/h200/ (by kernel sha256).

import torch
import tvm
from tvm.script import tirx as T

QO_HEADS = 32
KV_HEADS = 8
GROUP = QO_HEADS // KV_HEADS          # 4 query heads per kv head
HEAD_DIM = 128
PAGE = 64                             # tokens per page
VEC = 8                               # bf16 per 16-byte access
LANES = HEAD_DIM // VEC               # 16 lanes per token
THREADS = 128
WARPS = THREADS // 32
TOKEN_LANES = THREADS // LANES        # 8 half-warps = tokens processed side by side
UNROLL = 4                            # tokens per half-warp per iteration
STEP = TOKEN_LANES * UNROLL           # 32 tokens per CTA iteration
CHUNK = 256                           # minimum tokens per split
MAX_SPLITS = 16                       # splits per (request, kv head)
OUT_VEC = 4                           # fp32 outputs per thread in the merges
LOG2E = 1.4426950408889634
M_INIT = -1.0e30                      # finite running-max start (avoids inf - inf)


@T.prim_func
def decode_partial(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle, indptr_handle: T.handle,
                   indices_handle: T.handle, last_handle: T.handle, po_handle: T.handle, pl_handle: T.handle,
                   scale_log2: T.float32):
    batch = T.int32()
    pages = T.int32()
    n_idx = T.int32()
    Q = T.match_buffer(q_handle, (batch, QO_HEADS, HEAD_DIM), "bfloat16", align=16)
    K = T.match_buffer(k_handle, (pages, PAGE, KV_HEADS, HEAD_DIM), "bfloat16", align=16)
    V = T.match_buffer(v_handle, (pages, PAGE, KV_HEADS, HEAD_DIM), "bfloat16", align=16)
    IP = T.match_buffer(indptr_handle, (batch + 1,), "int32")
    IDX = T.match_buffer(indices_handle, (n_idx,), "int32")
    LAST = T.match_buffer(last_handle, (batch,), "int32")
    PO = T.match_buffer(po_handle, (batch, KV_HEADS, MAX_SPLITS, GROUP, HEAD_DIM), "float32", align=16)
    PL = T.match_buffer(pl_handle, (batch, KV_HEADS, MAX_SPLITS, GROUP), "float32")

    T.device_entry()
    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 4})   # <= 128 registers (no spills): 16 warps per SM
    split, kvh, b = T.cta_id([MAX_SPLITS, KV_HEADS, batch])
    tid = T.thread_id([THREADS])
    warp = T.warp_id([WARPS])
    lane = T.lane_id([32])

    qv = T.alloc_local((VEC,), "bfloat16")
    qf = T.alloc_local((GROUP * VEC,), "float32")
    kb = T.alloc_local((UNROLL * VEC,), "bfloat16")
    vb = T.alloc_local((UNROLL * VEC,), "bfloat16")
    pid = T.alloc_local((UNROLL,), "int32")
    s = T.alloc_local((UNROLL * GROUP,), "float32")
    p = T.alloc_local((UNROLL,), "float32")
    m = T.alloc_local((GROUP,), "float32")
    lsum = T.alloc_local((GROUP,), "float32")
    acc = T.alloc_local((GROUP * VEC,), "float32")
    mx = T.alloc_local((1,), "float32")
    sc = T.alloc_local((1,), "float32")
    o = T.alloc_local((OUT_VEC,), "float32")
    ov = T.alloc_local((OUT_VEC,), "float32")
    sm_acc = T.alloc_shared((TOKEN_LANES * GROUP * HEAD_DIM,), "float32")
    sm_m = T.alloc_shared((TOKEN_LANES * GROUP,), "float32")
    sm_l = T.alloc_shared((TOKEN_LANES * GROUP,), "float32")

    g: T.let[T.int32] = warp * 2 + lane // LANES        # half-warp (token lane) id, 0..7
    d0: T.let[T.int32] = (lane % LANES) * VEC           # first head-dim element of this lane
    kv_start: T.let[T.int32] = IP[b]                  # first page-table entry of the request
    kv_len: T.let[T.int32] = T.max(IP[b + 1] - kv_start - 1, 0) * PAGE + T.if_then_else(IP[b + 1] > kv_start, LAST[b], 0)
    chunk: T.let[T.int32] = T.max(CHUNK, T.ceildiv(kv_len, MAX_SPLITS))
    c0: T.let[T.int32] = split * chunk

    if c0 < kv_len:
        c1: T.let[T.int32] = T.min(c0 + chunk, kv_len)
        n_iter: T.let[T.int32] = T.ceildiv(c1 - c0, STEP)

        # query heads kvh*4 .. kvh*4+3, this lane's 8 elements, pre-scaled for base-2 softmax
        for h in T.unroll(GROUP):
            for i in T.vectorized(VEC):
                qv[i] = Q[b, kvh * GROUP + h, d0 + i]
            for i in T.unroll(VEC):
                qf[h * VEC + i] = T.cast(qv[i], "float32") * scale_log2
        for h in T.unroll(GROUP):
            m[h] = T.float32(M_INIT)
            lsum[h] = T.float32(0.0)
            for i in T.unroll(VEC):
                acc[h * VEC + i] = T.float32(0.0)
        # pid = page * 64 + slot of the token
        for u in T.unroll(UNROLL):
            pid[u] = 0
            if c0 + u * TOKEN_LANES + g < c1:
                pid[u] = IDX[kv_start + (c0 + u * TOKEN_LANES + g) // PAGE] * PAGE + (c0 + u * TOKEN_LANES + g) % PAGE

        for it in range(n_iter):
            # K and V rows of this half-warp's 4 tokens (zeros past the chunk end)
            for u in T.unroll(UNROLL):
                if c0 + it * STEP + u * TOKEN_LANES + g < c1:
                    for i in T.vectorized(VEC):
                        kb[u * VEC + i] = K[pid[u] // PAGE, pid[u] % PAGE, kvh, d0 + i]
                    for i in T.vectorized(VEC):
                        vb[u * VEC + i] = V[pid[u] // PAGE, pid[u] % PAGE, kvh, d0 + i]
                else:
                    for i in T.unroll(VEC):
                        kb[u * VEC + i] = T.bfloat16(0.0)
                        vb[u * VEC + i] = T.bfloat16(0.0)
            # prefetch the page ids of the next iteration
            for u in T.unroll(UNROLL):
                if c0 + (it + 1) * STEP + u * TOKEN_LANES + g < c1:
                    pid[u] = (IDX[kv_start + (c0 + (it + 1) * STEP + u * TOKEN_LANES + g) // PAGE] * PAGE
                              + (c0 + (it + 1) * STEP + u * TOKEN_LANES + g) % PAGE)
            # partial logits (this lane's 8 elements), then sum over the 16 lanes of the half-warp
            for u in T.unroll(UNROLL):
                for h in T.unroll(GROUP):
                    s[u * GROUP + h] = T.float32(0.0)
                    for i in T.unroll(VEC):
                        s[u * GROUP + h] = s[u * GROUP + h] + qf[h * VEC + i] * T.cast(kb[u * VEC + i], "float32")
            for r in T.unroll(4):
                for e in T.unroll(UNROLL * GROUP):
                    s[e] = s[e] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, s[e], 8 >> r, 32, 32)
            for u in T.unroll(UNROLL):
                if c0 + it * STEP + u * TOKEN_LANES + g >= c1:
                    for h in T.unroll(GROUP):
                        s[u * GROUP + h] = T.float32("-inf")
            # online softmax update, once per 4-token group
            for h in T.unroll(GROUP):
                mx[0] = T.max(T.max(m[h], T.max(s[h], s[GROUP + h])), T.max(s[2 * GROUP + h], s[3 * GROUP + h]))
                sc[0] = T.exp2(m[h] - mx[0])
                for u in T.unroll(UNROLL):
                    p[u] = T.exp2(s[u * GROUP + h] - mx[0])
                lsum[h] = lsum[h] * sc[0] + ((p[0] + p[1]) + (p[2] + p[3]))
                for i in T.unroll(VEC):
                    acc[h * VEC + i] = (acc[h * VEC + i] * sc[0]
                                        + p[0] * T.cast(vb[i], "float32")
                                        + p[1] * T.cast(vb[VEC + i], "float32")
                                        + p[2] * T.cast(vb[2 * VEC + i], "float32")
                                        + p[3] * T.cast(vb[3 * VEC + i], "float32"))
                m[h] = mx[0]

        # merge the 8 half-warp states of the CTA through shared memory
        for h in T.unroll(GROUP):
            for half in T.unroll(2):
                for i in T.vectorized(VEC // 2):
                    sm_acc[(g * GROUP + h) * HEAD_DIM + d0 + half * (VEC // 2) + i] = acc[h * VEC + half * (VEC // 2) + i]
        if lane % LANES == 0:
            for h in T.unroll(GROUP):
                sm_m[g * GROUP + h] = m[h]
                sm_l[g * GROUP + h] = lsum[h]
        T.cuda.cta_sync()

        hh: T.let[T.int32] = tid // 32                  # query head within the group
        dd: T.let[T.int32] = (tid % 32) * OUT_VEC        # first output element
        mx[0] = sm_m[hh]
        for t in T.unroll(TOKEN_LANES - 1):
            mx[0] = T.max(mx[0], sm_m[(t + 1) * GROUP + hh])
        sc[0] = T.float32(0.0)
        for i in T.unroll(OUT_VEC):
            o[i] = T.float32(0.0)
        for t in T.unroll(TOKEN_LANES):
            p[0] = T.exp2(sm_m[t * GROUP + hh] - mx[0])
            sc[0] = sc[0] + sm_l[t * GROUP + hh] * p[0]
            for i in T.vectorized(OUT_VEC):
                ov[i] = sm_acc[(t * GROUP + hh) * HEAD_DIM + dd + i]
            for i in T.unroll(OUT_VEC):
                o[i] = o[i] + ov[i] * p[0]
        p[1] = T.float32(1.0) / sc[0]
        for i in T.unroll(OUT_VEC):
            o[i] = o[i] * p[1]
        for i in T.vectorized(OUT_VEC):
            PO[b, kvh, split, hh, dd + i] = o[i]
        if tid % 32 == 0:
            PL[b, kvh, split, hh] = mx[0] + T.log2(sc[0])


@T.prim_func
def decode_merge(indptr_handle: T.handle, last_handle: T.handle, po_handle: T.handle, pl_handle: T.handle,
                 out_handle: T.handle, lse_handle: T.handle):
    batch = T.int32()
    IP = T.match_buffer(indptr_handle, (batch + 1,), "int32")
    LAST = T.match_buffer(last_handle, (batch,), "int32")
    PO = T.match_buffer(po_handle, (batch, KV_HEADS, MAX_SPLITS, GROUP, HEAD_DIM), "float32", align=16)
    PL = T.match_buffer(pl_handle, (batch, KV_HEADS, MAX_SPLITS, GROUP), "float32")
    OUT = T.match_buffer(out_handle, (batch, QO_HEADS, HEAD_DIM), "bfloat16", align=16)
    LSE = T.match_buffer(lse_handle, (batch, QO_HEADS), "float32")

    T.device_entry()
    kvh, b = T.cta_id([KV_HEADS, batch])
    tid = T.thread_id([THREADS])

    o = T.alloc_local((OUT_VEC,), "float32")
    ob = T.alloc_local((OUT_VEC,), "bfloat16")
    pv = T.alloc_local((OUT_VEC,), "float32")
    mx = T.alloc_local((1,), "float32")
    w = T.alloc_local((1,), "float32")
    wsum = T.alloc_local((1,), "float32")

    hh: T.let[T.int32] = tid // 32
    dd: T.let[T.int32] = (tid % 32) * OUT_VEC
    kv_len: T.let[T.int32] = T.max(IP[b + 1] - IP[b] - 1, 0) * PAGE + T.if_then_else(IP[b + 1] > IP[b], LAST[b], 0)
    chunk: T.let[T.int32] = T.max(CHUNK, T.ceildiv(kv_len, MAX_SPLITS))
    n_act: T.let[T.int32] = T.ceildiv(kv_len, chunk)    # chunks kernel 1 wrote (0 if empty)

    if n_act > 0:
        mx[0] = PL[b, kvh, 0, hh]
        for sp in range(n_act - 1):
            mx[0] = T.max(mx[0], PL[b, kvh, sp + 1, hh])
        wsum[0] = T.float32(0.0)
        for i in T.unroll(OUT_VEC):
            o[i] = T.float32(0.0)
        for sp in range(n_act):
            w[0] = T.exp2(PL[b, kvh, sp, hh] - mx[0])
            wsum[0] = wsum[0] + w[0]
            for i in T.vectorized(OUT_VEC):
                pv[i] = PO[b, kvh, sp, hh, dd + i]
            for i in T.unroll(OUT_VEC):
                o[i] = o[i] + w[0] * pv[i]
        w[0] = T.float32(1.0) / wsum[0]
        for i in T.unroll(OUT_VEC):
            ob[i] = T.cast(o[i] * w[0], "bfloat16")
        for i in T.vectorized(OUT_VEC):
            OUT[b, kvh * GROUP + hh, dd + i] = ob[i]
        if tid % 32 == 0:
            LSE[b, kvh * GROUP + hh] = mx[0] + T.log2(wsum[0])
    else:
        for i in T.unroll(OUT_VEC):
            ob[i] = T.bfloat16(0.0)
        for i in T.vectorized(OUT_VEC):
            OUT[b, kvh * GROUP + hh, dd + i] = ob[i]
        if tid % 32 == 0:
            LSE[b, kvh * GROUP + hh] = T.float32("-inf")


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


def _compiled():
    exes = _CACHE.get("exes")
    if exes is None:
        target = tvm.target.Target(TARGET)
        exes = tuple(_prepare(tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx"))
                     for f in (decode_partial, decode_merge))
        _CACHE["exes"] = exes
    return exes


def _workspace(device: torch.device, batch: int):
    key = ("ws", str(device), batch)
    ws = _CACHE.get(key)
    if ws is None:
        po = torch.empty((batch, KV_HEADS, MAX_SPLITS, GROUP, HEAD_DIM), dtype=torch.float32, device=device)
        pl = torch.empty((batch, KV_HEADS, MAX_SPLITS, GROUP), dtype=torch.float32, device=device)
        ws = (po, pl)
        _CACHE[key] = ws
    return ws


def solve(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
          kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
          sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    partial, merge = _compiled()
    batch = q.shape[0]
    out = torch.empty((batch, QO_HEADS, HEAD_DIM), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, QO_HEADS), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    po, pl = _workspace(q.device, batch)
    indptr = kv_indptr if kv_indptr.dtype == torch.int32 else kv_indptr.to(torch.int32)
    indices = kv_indices if kv_indices.dtype == torch.int32 else kv_indices.to(torch.int32)
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=q.device)
    last = kv_last_page_len if kv_last_page_len.dtype == torch.int32 else kv_last_page_len.to(torch.int32)
    partial(q, k_cache, v_cache, indptr, indices.contiguous(), last.contiguous(), po, pl, float(sm_scale) * LOG2E)
    merge(indptr, last.contiguous(), po, pl, out, lse)
    return out, lse
