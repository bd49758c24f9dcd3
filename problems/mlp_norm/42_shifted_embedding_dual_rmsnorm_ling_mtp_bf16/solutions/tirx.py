# Ling MTP input: shifted-token embedding gather + two RMSNorms + concat (hidden 2048, bf16), one TIRx kernel.
#
# Same algorithm as the CuTe DSL solution (which passed on the H200 at 0.072 ms device time, 78% of the DRAM
# floor):
# - Grid: one CTA per token row t, threads = H / 8 (256 at H = 2048; at least one full warp for small H,
#   extra lanes predicated off; more than 256 chunks are spread over several chunks per thread). Thread i
#   owns the 16-byte chunk i (columns 8i..8i+7) of both halves: the hidden row, both norm weights, the
#   gathered embedding row and both output halves are 16-byte accesses.
# - The hidden row and both weights are loaded first; then the shifted token is resolved by every thread
#   with uniform loads: id = input_ids[t + 1], replaced by next_tokens[b] when t = cu_seqlens[b + 1] - 1
#   (scan over the sequences, the last match wins); then the embedding row of id is gathered.
# - Two fp32 sums of squares (e and h): per thread -> xor-shuffle butterfly -> per-warp partials in shared
#   memory -> one __syncthreads -> every thread adds the partials in the same order.
#   e' = (e * rsqrt(mean(e^2) + eps)) * enorm_w, h' likewise with hnorm_w, in fp32, rounded once to bf16,
#   16-byte stores to out[t, 0:H] and out[t, H:2H].
# Differences from the CuTe DSL version: the rows are viewed as [rows, H / 8, 8] so every 16-byte access is
#   visibly one aligned chunk; lanes without a chunk load nothing and contribute zero to the sums (the CuTe
#   version loads a clamped chunk and masks the sum). Same traffic and arithmetic.
# Limits: DRAM: 67 MB of embedding rows gathered (4 KB contiguous each), 67 MB of hidden rows read, 134 MB
#   written: 269 MB, 56 us at 4.8 TB/s. Expected ~70-75 us of device time like the CuTe DSL kernel; eager
#   PyTorch (1.30 ms) and torch.compile (1.80 ms) are far slower.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator of the generated CUDA; not yet
# run on the H200.
#
# Streams: the compiled function is called with torch tensors; tvm-ffi launches it on torch's current
# stream. Cached: the compiled module per hidden size (symbolic token, vocabulary and sequence counts);
# the output is allocated per call.

import torch
import tvm
from tvm.script import tirx as T

EPS = 1e-6
VEC = 8


def _make(hidden):
    nch = hidden // VEC                       # 16-byte chunks per half row
    threads = min(256, max(32, ((nch + 31) // 32) * 32))
    per = (nch + threads - 1) // threads      # chunks per thread
    nwarps = threads // 32
    inv_h = 1.0 / hidden

    @T.prim_func
    def mtp_input(ids_handle: T.handle, cu_handle: T.handle, next_handle: T.handle, h_handle: T.handle,
                  e_handle: T.handle, we_handle: T.handle, wh_handle: T.handle, o_handle: T.handle):
        ntok = T.int32()
        ncu = T.int32()
        nseq = T.int32()
        vocab = T.int32()
        IDS = T.match_buffer(ids_handle, (ntok,), "int64")
        CU = T.match_buffer(cu_handle, (ncu,), "int32")
        NEXT = T.match_buffer(next_handle, (nseq,), "int64")
        H = T.match_buffer(h_handle, (ntok, nch, VEC), "bfloat16", align=16)
        E = T.match_buffer(e_handle, (vocab, nch, VEC), "bfloat16", align=16)
        WE = T.match_buffer(we_handle, (nch, VEC), "bfloat16", align=16)
        WH = T.match_buffer(wh_handle, (nch, VEC), "bfloat16", align=16)
        O = T.match_buffer(o_handle, (ntok, 2 * nch, VEC), "bfloat16", align=16)

        T.device_entry()
        t = T.cta_id([ntok])
        tid = T.thread_id([threads])
        warp = T.warp_id([nwarps])
        lane = T.lane_id([32])

        hb = T.alloc_local((per * VEC,), "bfloat16")
        eb = T.alloc_local((per * VEC,), "bfloat16")
        web = T.alloc_local((per * VEC,), "bfloat16")
        whb = T.alloc_local((per * VEC,), "bfloat16")
        ob = T.alloc_local((VEC,), "bfloat16")
        tok = T.alloc_local((1,), "int64")
        s = T.alloc_local((2,), "float32")
        red = T.alloc_shared((nwarps, 2), "float32")

        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.vectorized(VEC):
                    hb[k * VEC + i] = H[t, tid + k * threads, i]
                for i in T.vectorized(VEC):
                    web[k * VEC + i] = WE[tid + k * threads, i]
                for i in T.vectorized(VEC):
                    whb[k * VEC + i] = WH[tid + k * threads, i]

        # shifted token of row t
        tok[0] = T.int64(0)
        if t + 1 < ntok:
            tok[0] = IDS[t + 1]
        for b in range(nseq):
            if CU[b + 1] - 1 == t:
                tok[0] = NEXT[b]
        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.vectorized(VEC):
                    eb[k * VEC + i] = E[T.cast(tok[0], "int32"), tid + k * threads, i]

        s[0] = T.float32(0.0)
        s[1] = T.float32(0.0)
        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.unroll(VEC):
                    s[0] = s[0] + T.cast(eb[k * VEC + i], "float32") * T.cast(eb[k * VEC + i], "float32")
                    s[1] = s[1] + T.cast(hb[k * VEC + i], "float32") * T.cast(hb[k * VEC + i], "float32")
        for sh in T.unroll(5):
            for j in T.unroll(2):
                s[j] = s[j] + T.tvm_warp_shuffle_xor(0xFFFFFFFF, s[j], 16 >> sh, 32, 32)
        if lane == 0:
            red[warp, 0] = s[0]
            red[warp, 1] = s[1]
        T.cuda.cta_sync()
        for j in T.unroll(2):
            s[j] = red[0, j]
            for w in T.unroll(nwarps - 1):
                s[j] = s[j] + red[w + 1, j]
            s[j] = T.rsqrt(s[j] * T.float32(inv_h) + T.float32(EPS))

        for k in T.unroll(per):
            if tid + k * threads < nch:
                for i in T.unroll(VEC):
                    ob[i] = T.cast((T.cast(eb[k * VEC + i], "float32") * s[0]) * T.cast(web[k * VEC + i], "float32"),
                                   "bfloat16")
                for i in T.vectorized(VEC):
                    O[t, tid + k * threads, i] = ob[i]
                for i in T.unroll(VEC):
                    ob[i] = T.cast((T.cast(hb[k * VEC + i], "float32") * s[1]) * T.cast(whb[k * VEC + i], "float32"),
                                   "bfloat16")
                for i in T.vectorized(VEC):
                    O[t, nch + tid + k * threads, i] = ob[i]

    return mtp_input, threads


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


def _compiled(hidden=2048):
    key = ("exe", hidden)
    exe = _CACHE.get(key)
    if exe is None:
        assert hidden % VEC == 0
        exe = tvm.compile(tvm.IRModule({"main": _make(hidden)[0]}), target=tvm.target.Target(TARGET),
                          tir_pipeline="tirx")
        _CACHE[key] = exe = _prepare(exe)
    return exe


def solve(input_ids, cu_seqlens, next_tokens, hidden_states, embed_weight, enorm_weight, hnorm_weight):
    tokens, hidden = hidden_states.shape
    vocab = embed_weight.shape[0]
    _compiled()                                    # the full-size build, also when called at another size
    exe = _compiled(hidden)
    nch = hidden // VEC
    out = torch.empty((tokens, 2 * hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    if tokens > 0:
        exe(input_ids.to(torch.int64).contiguous(), cu_seqlens.to(torch.int32).contiguous(),
            next_tokens.to(torch.int64).contiguous(), hidden_states.contiguous().view(tokens, nch, VEC),
            embed_weight.contiguous().view(vocab, nch, VEC), enorm_weight.contiguous().view(nch, VEC),
            hnorm_weight.contiguous().view(nch, VEC), out.view(tokens, 2 * nch, VEC))
    return out
