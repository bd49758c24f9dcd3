"""Apply one step's staged block-table writes for three hybrid KV-cache groups, then translate every scheduled token's position into a cache slot per group."""
# Designed for MetaKernelBench from vLLM's v1 GPU BlockTables (staged writes fused across KV-cache groups, then slot
# mapping; Apache-2.0), as in the original MetaKernelBench problem 26: group block sizes 16/32/8, kernel block sizes 16/16/8.

import torch

BLOCK_SIZES = (16, 32, 8)            # allocation block size of each KV-cache group
KERNEL_BLOCK_SIZES = (16, 16, 8)     # block size the attention kernels address: group 1 splits each block into 2
PAD_SLOT_ID = -1
GEOMETRY = {
    # rows of the persistent batch, token slots per step, max model length, scheduled requests
    # (new / chunked-prefill / decode), staged write records, block ids per record and group
    "full": dict(rows=256, tokens=8192, max_len=16384, batch=224, new=6, chunked=4, writes=192, stage=16,
                 new_len=(256, 896), chunk_len=(128, 640)),
    "smoke": dict(rows=12, tokens=96, max_len=256, batch=8, new=2, chunked=2, writes=24, stage=2,
                  new_len=(5, 20), chunk_len=(3, 12)),
}


@torch.no_grad()
def reference(block_table_0: torch.Tensor, block_table_1: torch.Tensor, block_table_2: torch.Tensor,
              num_blocks: torch.Tensor, write_requests: torch.Tensor, overwrite: torch.Tensor,
              staged_ids: torch.Tensor, staged_counts: torch.Tensor, idx_mapping: torch.Tensor,
              query_start_loc: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tables = (block_table_0, block_table_1, block_table_2)
    dev = positions.device
    writes = write_requests.numel()
    rec = torch.arange(writes, device=dev)
    row = write_requests.long()

    # Staged writes act in order. Record w appends (or, if overwrite[w], writes from column 0) its kernel-block ids to
    # its row, and the row's count becomes start + written. Vectorized: sort records by (row, order); within a row,
    # the start of a record is the count left by the last record at or before it that starts from a known count
    # (an overwrite starts from 0, the row's first record from num_blocks) plus everything appended in between.
    order = torch.argsort(row * writes + rec)
    row_s, ow_s = row[order], overwrite[order]
    first = torch.ones(writes, dtype=torch.bool, device=dev)
    first[1:] = row_s[1:] != row_s[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    anchor = torch.cummax(torch.where(ow_s | first, rec, -1), 0).values
    for g, table in enumerate(tables):
        expand = BLOCK_SIZES[g] // KERNEL_BLOCK_SIZES[g]
        n = staged_counts[g].long() * expand                        # kernel blocks written by each record
        n_s = n[order]
        incl = torch.cumsum(n_s, 0)
        base = torch.where(ow_s[anchor], 0, num_blocks[g, row_s].long())
        end_s = base + incl - (incl[anchor] - n_s[anchor])
        start = torch.empty_like(end_s)
        start[order] = end_s - n_s
        num_blocks[g, row_s[last]] = end_s[last].to(num_blocks.dtype)

        # allocation block b expands to kernel blocks b*expand .. b*expand+expand-1; where records overlap, the later wins
        width = table.shape[1]
        col = torch.arange(staged_ids.shape[2] * expand, device=dev)
        vals = staged_ids[g][:, col // expand].long() * expand + col % expand
        used = col[None, :] < n[:, None]
        target = (row[:, None] * width + start[:, None] + col[None, :])[used]
        writer = rec[:, None].expand_as(used)[used]
        winner = torch.full((table.numel(),), -1, dtype=torch.long, device=dev).scatter_reduce(0, target, writer, "amax")
        keep = winner[target] == writer
        table.view(-1)[target[keep]] = vals[used][keep].to(table.dtype)

    # slot of each scheduled token in each group: kernel block of its position times the kernel block size plus offset
    qsl = query_start_loc.long()
    t = torch.arange(positions.numel(), device=dev)
    entry = torch.searchsorted(qsl[1:], t, right=True).clamp(max=idx_mapping.numel() - 1)
    live = t < qsl[-1]
    req_row = idx_mapping.long()[entry]
    pos = positions.long()
    slots = []
    for g, table in enumerate(tables):
        kb = KERNEL_BLOCK_SIZES[g]
        block = table[req_row, torch.where(live, pos // kb, 0)].long()
        slots.append(torch.where(live, block * kb + pos % kb, PAD_SLOT_ID))
    return block_table_0, block_table_1, block_table_2, num_blocks, torch.stack(slots)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    geo = GEOMETRY[size]
    rows, tokens, max_len, batch, stage, writes = (geo[k] for k in ("rows", "tokens", "max_len", "batch", "stage", "writes"))
    expand = [b // k for b, k in zip(BLOCK_SIZES, KERNEL_BLOCK_SIZES)]
    widths = [max_len // k for k in KERNEL_BLOCK_SIZES]
    pools = [rows * max_len // b for b in BLOCK_SIZES]               # allocation blocks per group
    # the scheduler's view (drawn on the CPU generator): which rows run, how much each had and adds this step
    batch_rows = torch.randperm(rows)[:batch]
    kind = torch.zeros(batch, dtype=torch.long)                      # 0 decode, 1 new request, 2 chunked prefill
    kind[:geo["new"]] = 1
    kind[geo["new"]:geo["new"] + geo["chunked"]] = 2
    kind = kind[torch.randperm(batch)]
    lo, hi = geo["new_len"]
    clo, chi = geo["chunk_len"]
    prev = torch.where(kind == 1, 0, torch.randint(1, max_len // 2, (batch,)))
    prev = torch.where(kind == 0, torch.randint(1, max_len - 1, (batch,)), prev)
    new = torch.where(kind == 1, torch.randint(lo, hi + 1, (batch,)),
                      torch.where(kind == 2, torch.randint(clo, chi + 1, (batch,)), torch.ones(batch, dtype=torch.long)))
    assert int(new.sum()) < tokens and int((prev + new).max()) <= max_len

    # persistent tables: stale ids everywhere, valid ids for the blocks running requests already hold
    tables = [torch.randint(0, p * e, (rows, w), dtype=torch.int32) for p, e, w in zip(pools, expand, widths)]
    counts = torch.stack([torch.randint(0, w - stage * e + 1, (rows,), dtype=torch.int32) for w, e in zip(widths, expand)])
    fresh = [torch.randperm(p) for p in pools]                        # distinct allocation blocks per group
    taken = [0, 0, 0]

    def take(g: int, n: int) -> torch.Tensor:
        taken[g] += n
        return fresh[g][taken[g] - n:taken[g]]

    records = []                                                     # (row, overwrite, [ids per group]) per request
    for i in range(batch):
        r, p0, p1 = int(batch_rows[i]), int(prev[i]), int(prev[i] + new[i])
        ids = []
        for g in range(3):
            held = _ceil_div(p0, BLOCK_SIZES[g])
            if kind[i] != 1:
                old = take(g, held)
                tables[g][r, :held * expand[g]] = (old[:, None] * expand[g] + torch.arange(expand[g])).flatten()
                counts[g, r] = held * expand[g]
            ids.append(take(g, _ceil_div(p1, BLOCK_SIZES[g]) - held))
        mine = []
        if kind[i] == 1 and bool(torch.rand(()) < 0.5):
            # the row was freed and reassigned within the step: a stale append was staged before the overwrite
            mine.append((r, False, [torch.randint(0, p, (int(torch.randint(1, stage + 1, ())),)) for p in pools]))
        for k in range(max(_ceil_div(x.numel(), stage) for x in ids)):
            mine.append((r, bool(kind[i] == 1 and k == 0), [x[k * stage:(k + 1) * stage] for x in ids]))
        records.append(mine)
    # no-op padding records (append nothing) fill the fixed-size staging buffer
    used = sum(len(m) for m in records)
    assert used <= writes
    nothing = torch.zeros(0, dtype=torch.long)
    records += [[(int(torch.randint(0, rows, ())), False, [nothing] * 3)] for _ in range(writes - used)]
    # interleave the requests' record lists at random, keeping each list's own order
    owners = torch.repeat_interleave(torch.arange(len(records)), torch.tensor([len(m) for m in records]))
    cursor = [0] * len(records)
    write_requests = torch.empty(writes, dtype=torch.int32)
    overwrite = torch.zeros(writes, dtype=torch.bool)
    staged_ids = torch.full((3, writes, stage), -1, dtype=torch.int32)
    staged_counts = torch.zeros(3, writes, dtype=torch.int32)
    for w, o in enumerate(owners[torch.randperm(writes)].tolist()):
        r, ow, ids = records[o][cursor[o]]
        cursor[o] += 1
        write_requests[w], overwrite[w] = r, ow
        for g in range(3):
            staged_counts[g, w] = ids[g].numel()
            staged_ids[g, w, :ids[g].numel()] = ids[g]

    # this step's tokens: each scheduled request continues at its previous length; the tail is padding
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(new, 0))).to(torch.int32)
    positions = torch.zeros(tokens, dtype=torch.long)
    positions[:int(new.sum())] = torch.cat([torch.arange(int(a), int(a + b)) for a, b in zip(prev, new)])
    out = [*tables, counts, write_requests, overwrite, staged_ids, staged_counts, batch_rows.to(torch.int32),
           query_start_loc, positions]
    return [x.to(device) for x in out]
