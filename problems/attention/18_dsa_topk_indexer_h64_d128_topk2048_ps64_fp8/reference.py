"""DeepSeek sparse attention indexer: top-2048 token selection from FP8 index queries and a paged FP8 index-key cache, DeepSeek-V3.2."""

# Based on the public FlashInfer-Trace definition dsa_topk_indexer_fp8_h64_d128_topk2048_ps64 (Apache-2.0) and the
# public DeepSeek-V3.2 indexer (64 heads of dim 128); the decode batch (64 requests) was designed for MetaKernelBench.

import torch

INDEX_HEADS = 64
INDEX_DIM = 128
PAGE_SIZE = 64
TOPK = 2048
FP8_MAX = 448.0
# one page of the index-key cache is PAGE_SIZE * INDEX_DIM fp8 bytes (token-major) followed by PAGE_SIZE fp32 scales
PAGE_BYTES = PAGE_SIZE * (INDEX_DIM + 4)
# a row whose TOPK-th and (TOPK+1)-th scores differ by less than DECISION_MARGIN times its largest |score| has its
# query and head weights redrawn, so the selected set is stable under rounding noise; rows of ~32k tokens need a
# redraw about 80% of the time, so REDRAW_LIMIT rounds are never used up in practice (0.83^500 ~ 1e-40)
DECISION_MARGIN = 1e-4
REDRAW_LIMIT = 500
SEQ_LENS = {
    "full": (2658, 1323, 8035, 1353, 30690, 10320, 2860, 7247, 20524, 32768, 1627, 11883, 6874, 3097, 12209, 6799,
             12016, 2421, 4086, 6080, 4177, 4164, 1900, 4648, 4941, 3852, 4036, 8219, 2120, 8220, 3513, 4333, 3384,
             10066, 8763, 4121, 2642, 26217, 7022, 1302, 4078, 3661, 8431, 3266, 1956, 15615, 558, 996, 2428, 2449,
             3606, 4049, 11110, 896, 32768, 7549, 1891, 2313, 2527, 440, 6115, 1348, 2382, 1369),
    "smoke": (3000, 700, 2048, 2113),
}
NUM_PAGES = {"full": 8192, "smoke": 160}
MAX_PAGES = {"full": 512, "smoke": 48}           # block-table width (pages of the longest allowed context)


def _dequantize_pages(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Index keys of the given pages as [len(pages) * PAGE_SIZE, INDEX_DIM] in dtype."""
    raw = cache[pages].reshape(-1, PAGE_BYTES)
    values = raw[:, :PAGE_SIZE * INDEX_DIM].contiguous().view(torch.float8_e4m3fn).to(dtype)
    scales = raw[:, PAGE_SIZE * INDEX_DIM:].contiguous().view(torch.float32).to(dtype)
    return (values.view(-1, PAGE_SIZE, INDEX_DIM) * scales.view(-1, PAGE_SIZE, 1)).reshape(-1, INDEX_DIM)


def _scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Index score of every key: sum over heads of weight * relu(q_head . key)."""
    return weights @ torch.relu(q @ keys.T)


@torch.no_grad()
def reference(q_index_fp8: torch.Tensor, k_index_cache: torch.Tensor, weights: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor) -> torch.Tensor:
    batch, heads, dim = q_index_fp8.shape
    assert (heads, dim) == (INDEX_HEADS, INDEX_DIM) and k_index_cache.shape[1:] == (PAGE_SIZE, 1, INDEX_DIM + 4)
    wide = torch.promote_types(weights.dtype, torch.float32)
    q = q_index_fp8.to(wide)
    w = weights.to(wide)
    out = torch.full((batch, TOPK), -1, dtype=torch.int32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        pages = block_table[b, :(n + PAGE_SIZE - 1) // PAGE_SIZE].long()
        keys = _dequantize_pages(k_index_cache, pages, wide)[:n]
        k = min(TOPK, n)
        pos = torch.topk(_scores(q[b], keys, w[b]), k).indices.sort().values   # selected positions, ascending
        out[b, :k] = (pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).to(torch.int32)
    return out


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 e4m3 quantization over the last dim: (values, fp32 scale) with values * scale ~ x."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn), scale


def _ambiguous_rows(rows, q_fp8, cache, weights, lens, block_table) -> list[int]:
    """The rows among `rows` whose TOPK-th and (TOPK+1)-th scores are closer than the decision margin."""
    bad = []
    for b in rows:
        n = lens[b]
        pages = block_table[b, :(n + PAGE_SIZE - 1) // PAGE_SIZE].long()
        s = _scores(q_fp8[b].float(), _dequantize_pages(cache, pages, torch.float32)[:n], weights[b])
        top = torch.topk(s, TOPK + 1).values
        if float(top[TOPK - 1] - top[TOPK]) < DECISION_MARGIN * float(s.abs().max()):
            bad.append(b)
    return bad


def _draw_queries(rows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    # fp8 index queries with a per-head scale that DeepSeek-V3.2 folds, with n_heads^-0.5 and dim^-0.5, into weights
    q_fp8, q_scale = _quantize(torch.randn(rows, INDEX_HEADS, INDEX_DIM, device=device))
    weights = torch.randn(rows, INDEX_HEADS, device=device) * q_scale.squeeze(-1) * (INDEX_HEADS * INDEX_DIM) ** -0.5
    return q_fp8, weights


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    lens, pool, width = SEQ_LENS[size], NUM_PAGES[size], MAX_PAGES[size]
    npages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lens]
    # distinct pages per request scattered over the pool (page 0 is never handed out; unused entries are 0)
    perm = (torch.randperm(pool - 1, device=device) + 1)[:sum(npages)].to(torch.int32)
    block_table = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    start = 0
    for b, p in enumerate(npages):
        block_table[b, :p] = perm[start:start + p]
        start += p
    # index keys quantized per token to fp8 with an fp32 scale, packed page by page
    values, scales = _quantize(torch.randn(pool, PAGE_SIZE, INDEX_DIM, device=device))
    cache = torch.empty(pool, PAGE_BYTES, dtype=torch.uint8, device=device)
    cache[:, :PAGE_SIZE * INDEX_DIM] = values.view(torch.uint8).reshape(pool, -1)
    cache[:, PAGE_SIZE * INDEX_DIM:] = scales.reshape(pool, PAGE_SIZE).view(torch.uint8)
    k_index_cache = cache.view(pool, PAGE_SIZE, 1, INDEX_DIM + 4)
    q_fp8, weights = _draw_queries(len(lens), device)
    # only rows longer than TOPK make a decision; every other token set is taken whole
    check = [b for b, n in enumerate(lens) if n > TOPK]
    for _ in range(REDRAW_LIMIT):
        check = _ambiguous_rows(check, q_fp8, k_index_cache, weights, lens, block_table)
        if not check:
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            return [q_fp8, k_index_cache, weights, seq_lens, block_table]
        for b in check:
            q_row, w_row = _draw_queries(1, device)
            q_fp8[b], weights[b] = q_row[0], w_row[0]
    raise RuntimeError(f"top-{TOPK} decision margins under {DECISION_MARGIN} persist after {REDRAW_LIMIT} redraws")
