# Hybrid KV-cache block-table update (3 groups) + slot mapping, int32/int64, two TIRx kernels.
#
# Algorithm (same decomposition as the CuTe DSL solution)
# Kernel 1 (update_tables, apply the staged writes): one CTA per persistent-batch row, 128 threads.
# - The CTA builds the ordered list of the write records of its row (stable compaction): records
#   are tested 128 at a time (thread t tests record base + t), an inclusive warp scan of the hit
#   flags (5 shuffle-up steps; the CuTe version uses ballot + popc) gives each hit its rank in the
#   warp, a 4-entry shared array of warp totals gives the warp's offset, so the list in shared
#   memory keeps staging order (capacity MAX_RECORDS).
# - Per group g (expansion e = 1, 2, 1): n_k = staged_counts[g, w_k] * e and overwrite[w_k] of the
#   listed records go to shared memory; thread 0 walks the list in order (s = 0 on overwrite, else the
#   running count; start_k = s; s += n_k) and stores num_blocks[g, row] = s.
# - Writes: warp j takes records k = j, j+4, ..; lane l writes kernel-block columns start_k + l,
#   + 32, .. < start_k + n_k with id = staged_ids[g, w_k, l // e] * e + l % e. An entry is written
#   only by the last record of the list covering its column (each lane checks the later records), so
#   writes need no ordering and the result equals applying the records strictly in order.
# Kernel 2 (slot_mapping): one thread per token slot (256 per CTA): binary search of t in
# query_start_loc[1:] (searchsorted right, clamped to the last request; a fixed 17-step loop whose
# steps do nothing once the interval is empty), idx_mapping gives the row; per group
# slot = table_g[row, p // k_g] * k_g + p % k_g in int64; padding tokens (t >= qsl[-1]) get -1.
# Differs from the CuTe solution only in the host path: two compiled executables called back to back
# on torch's current stream (the CuTe version launches both kernels from one compiled host function).
#
# What limits it: latency, not bandwidth (~0.4 MB of traffic): two dependent launches, the per-row
# serial walk of the record list (x3 groups, with CTA barriers) and the binary-search load chain.
# The CuTe version measured 10.3 us of device time for the two kernels on the H200; the host call
# path dominates end-to-end.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator at smoke size; not yet
# run on the H200.

import torch
import tvm
from tvm.script import tirx as T

BLOCK_SIZES = (16, 32, 8)
KERNEL_BLOCK_SIZES = (16, 16, 8)
EXPAND = tuple(b // k for b, k in zip(BLOCK_SIZES, KERNEL_BLOCK_SIZES))
PAD_SLOT_ID = -1
THREADS1 = 128
NWARPS1 = THREADS1 // 32
MAX_RECORDS = 2048            # capacity of the per-row record list (shared memory, 3 x 8 KiB)
THREADS2 = 256
SEARCH_STEPS = 17             # enough for up to 65535 scheduled requests


@T.macro
def apply_group(TB, NB, OW, IDS, CNT, s_list, s_n, s_s, win, run, g, e, nm, row, tid, warp, lane):
    # per-record kernel-block count and overwrite flag, in list order
    for it in range(T.ceildiv(nm, THREADS1)):
        k0: T.let[T.int32] = it * THREADS1 + tid
        if k0 < nm:
            s_n[k0] = CNT[g, s_list[k0]] * e
            s_s[k0] = T.cast(OW[s_list[k0]], "int32")
    T.cuda.cta_sync()
    if tid == 0:
        run[0] = NB[g, row]
        for k1 in range(nm):
            if s_s[k1] != 0:
                run[0] = 0
            s_s[k1] = run[0]
            run[0] = run[0] + s_n[k1]
        NB[g, row] = run[0]
    T.cuda.cta_sync()
    for it2 in range(T.ceildiv(nm, NWARPS1)):
        k: T.let[T.int32] = it2 * NWARPS1 + warp
        if k < nm:
            wk: T.let[T.int32] = s_list[k]
            nk: T.let[T.int32] = s_n[k]
            st: T.let[T.int32] = s_s[k]
            for jt in range(T.ceildiv(nk, 32)):
                j: T.let[T.int32] = jt * 32 + lane
                if j < nk:
                    win[0] = 1
                    for k2 in range(nm - k - 1):
                        s2: T.let[T.int32] = s_s[k + 1 + k2]
                        if st + j >= s2 and st + j < s2 + s_n[k + 1 + k2]:
                            win[0] = 0
                    if win[0] != 0:
                        TB[row, st + j] = IDS[g, wk, j // e] * e + j % e
    T.cuda.cta_sync()             # s_n / s_s are reused by the next group


@T.prim_func
def update_tables(t0_h: T.handle, t1_h: T.handle, t2_h: T.handle, nb_h: T.handle, req_h: T.handle,
                  ow_h: T.handle, ids_h: T.handle, cnt_h: T.handle):
    rows = T.int32()
    w0 = T.int32()
    w1 = T.int32()
    w2 = T.int32()
    nrec = T.int32()
    stage = T.int32()
    T0 = T.match_buffer(t0_h, (rows, w0), "int32")
    T1 = T.match_buffer(t1_h, (rows, w1), "int32")
    T2 = T.match_buffer(t2_h, (rows, w2), "int32")
    NB = T.match_buffer(nb_h, (3, rows), "int32")
    REQ = T.match_buffer(req_h, (nrec,), "int32")
    OW = T.match_buffer(ow_h, (nrec,), "uint8")
    IDS = T.match_buffer(ids_h, (3, nrec, stage), "int32")
    CNT = T.match_buffer(cnt_h, (3, nrec), "int32")

    T.device_entry()
    row = T.cta_id([rows])
    tid = T.thread_id([THREADS1])

    s_list = T.alloc_shared((MAX_RECORDS,), "int32")
    s_n = T.alloc_shared((MAX_RECORDS,), "int32")
    s_s = T.alloc_shared((MAX_RECORDS,), "int32")
    s_warp = T.alloc_shared((NWARPS1,), "int32")
    hit = T.alloc_local((1,), "int32")
    scan = T.alloc_local((1,), "int32")
    nmatch = T.alloc_local((1,), "int32")
    before = T.alloc_local((1,), "int32")
    win = T.alloc_local((1,), "int32")
    run = T.alloc_local((1,), "int32")

    warp: T.let[T.int32] = tid // 32
    lane: T.let[T.int32] = tid % 32

    # stable compaction of this row's records (staging order)
    nmatch[0] = 0
    for base in range(T.ceildiv(nrec, THREADS1)):
        w: T.let[T.int32] = base * THREADS1 + tid
        hit[0] = 0
        if w < nrec:
            if REQ[w] == row:
                hit[0] = 1
        scan[0] = hit[0]
        for sh in T.unroll(5):
            up: T.let[T.int32] = T.tvm_warp_shuffle_up(0xFFFFFFFF, scan[0], 1 << sh, 32, 32)
            if lane >= (1 << sh):
                scan[0] = scan[0] + up
        if lane == 31:
            s_warp[warp] = scan[0]
        T.cuda.cta_sync()
        before[0] = nmatch[0]
        for i in T.unroll(NWARPS1):
            if i < warp:
                before[0] = before[0] + s_warp[i]
            nmatch[0] = nmatch[0] + s_warp[i]
        if hit[0] != 0:
            s_list[before[0] + scan[0] - 1] = w
        T.cuda.cta_sync()         # s_warp is rewritten by the next chunk; s_list complete after the last

    nm: T.let[T.int32] = nmatch[0]
    apply_group(T0, NB, OW, IDS, CNT, s_list, s_n, s_s, win, run, 0, EXPAND[0], nm, row, tid, warp, lane)
    apply_group(T1, NB, OW, IDS, CNT, s_list, s_n, s_s, win, run, 1, EXPAND[1], nm, row, tid, warp, lane)
    apply_group(T2, NB, OW, IDS, CNT, s_list, s_n, s_s, win, run, 2, EXPAND[2], nm, row, tid, warp, lane)


@T.prim_func
def slot_mapping(t0_h: T.handle, t1_h: T.handle, t2_h: T.handle, map_h: T.handle, qsl_h: T.handle,
                 pos_h: T.handle, out_h: T.handle):
    rows = T.int32()
    w0 = T.int32()
    w1 = T.int32()
    w2 = T.int32()
    nreq = T.int32()
    ntok = T.int32()
    T0 = T.match_buffer(t0_h, (rows, w0), "int32")
    T1 = T.match_buffer(t1_h, (rows, w1), "int32")
    T2 = T.match_buffer(t2_h, (rows, w2), "int32")
    MAP = T.match_buffer(map_h, (nreq,), "int32")
    QSL = T.match_buffer(qsl_h, (nreq + 1,), "int32")
    POS = T.match_buffer(pos_h, (ntok,), "int64")
    OUT = T.match_buffer(out_h, (3, ntok), "int64")

    T.device_entry()
    bx = T.cta_id([T.ceildiv(ntok, THREADS2)])
    tid = T.thread_id([THREADS2])

    lo = T.alloc_local((1,), "int32")
    hi = T.alloc_local((1,), "int32")

    t: T.let[T.int32] = bx * THREADS2 + tid
    if t < ntok:
        if t < QSL[nreq]:
            # entry = #{i in 1..nreq : qsl[i] <= t}, clamped to nreq - 1
            lo[0] = 0
            hi[0] = nreq
            for it in range(SEARCH_STEPS):
                if lo[0] < hi[0]:
                    mid: T.let[T.int32] = (lo[0] + hi[0]) // 2
                    if QSL[mid + 1] <= t:
                        lo[0] = mid + 1
                    else:
                        hi[0] = mid
            r: T.let[T.int32] = MAP[T.min(lo[0], nreq - 1)]
            p: T.let[T.int64] = POS[t]
            OUT[0, t] = T.cast(T0[r, T.cast(p // KERNEL_BLOCK_SIZES[0], "int32")], "int64") * KERNEL_BLOCK_SIZES[0] \
                + p % KERNEL_BLOCK_SIZES[0]
            OUT[1, t] = T.cast(T1[r, T.cast(p // KERNEL_BLOCK_SIZES[1], "int32")], "int64") * KERNEL_BLOCK_SIZES[1] \
                + p % KERNEL_BLOCK_SIZES[1]
            OUT[2, t] = T.cast(T2[r, T.cast(p // KERNEL_BLOCK_SIZES[2], "int32")], "int64") * KERNEL_BLOCK_SIZES[2] \
                + p % KERNEL_BLOCK_SIZES[2]
        else:
            OUT[0, t] = T.int64(PAD_SLOT_ID)
            OUT[1, t] = T.int64(PAD_SLOT_ID)
            OUT[2, t] = T.int64(PAD_SLOT_ID)


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
                     for f in (update_tables, slot_mapping))
        _CACHE["exes"] = exes
    return exes


def _i32(x: torch.Tensor) -> torch.Tensor:
    return (x if x.dtype == torch.int32 else x.to(torch.int32)).contiguous()


def solve(block_table_0, block_table_1, block_table_2, num_blocks, write_requests, overwrite, staged_ids,
          staged_counts, idx_mapping, query_start_loc, positions):
    update, slots = _compiled()
    assert write_requests.numel() <= MAX_RECORDS and idx_mapping.numel() < (1 << (SEARCH_STEPS - 1))
    assert block_table_0.dtype == torch.int32 and num_blocks.dtype == torch.int32
    ntok = positions.numel()
    slot_out = torch.empty((3, ntok), dtype=torch.int64, device=positions.device)
    ow = overwrite.view(torch.uint8) if overwrite.dtype == torch.bool else overwrite.to(torch.uint8)
    if block_table_0.shape[0] > 0 and write_requests.numel() > 0:
        update(block_table_0, block_table_1, block_table_2, num_blocks, _i32(write_requests), ow.contiguous(),
               _i32(staged_ids), _i32(staged_counts))
    if ntok > 0:
        slots(block_table_0, block_table_1, block_table_2, _i32(idx_mapping), _i32(query_start_loc),
              positions.to(torch.int64).contiguous(), slot_out)
    return block_table_0, block_table_1, block_table_2, num_blocks, slot_out
