"""Grouped-query attention decode over a paged KV cache (page size 64) from Llama 3.1 8B."""

# Based on the public FlashInfer-Trace definition gqa_paged_decode_h32_kv8_d128_ps64 (Apache-2.0); the decode
# batch (64 requests, 102 to 25869 cached tokens, ragged last pages) was designed for MetaKernelBench.

import math

import torch

QO_HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 64
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
LOG2E = 1.0 / math.log(2.0)
# cached tokens per request (64 requests, 132601 tokens in all, 2104 pages)
KV_LENS = {
    "full": (8160, 130, 1894, 780, 865, 1071, 211, 1055, 597, 25869, 1593, 946, 1009, 713, 503, 915, 2006, 1049,
             3078, 1086, 1329, 5226, 2123, 825, 1103, 2115, 7418, 1020, 1044, 3204, 585, 1024, 2877, 2192, 1412,
             2376, 102, 3259, 548, 290, 1667, 2442, 871, 493, 1331, 1240, 4606, 2547, 1548, 3535, 1080, 565, 2199,
             2196, 1071, 643, 1598, 138, 2419, 2023, 297, 1374, 546, 2570),
    "smoke": (1, 64, 65, 150, 7),
}
NUM_PAGES = {"full": 3072, "smoke": 16}


@torch.no_grad()
def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
              kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, qo_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert (qo_heads, kv_heads, head_dim, page_size) == (QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE)
    assert kv_indptr.numel() == batch + 1 and kv_indices.numel() == int(kv_indptr[-1])
    wide = torch.promote_types(q.dtype, torch.float32)
    group = qo_heads // kv_heads
    out = torch.empty((batch, qo_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, qo_heads), dtype=wide, device=q.device)
    bounds = kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    for b in range(batch):
        pages = kv_indices[bounds[b]:bounds[b + 1]].long()
        # tokens of the request in order: all slots of every page but the last, then last[b] slots of it
        length = (pages.numel() - 1) * page_size + last[b]
        k = k_cache[pages].reshape(-1, kv_heads, head_dim)[:length].to(wide)    # [L, KV, D]
        v = v_cache[pages].reshape(-1, kv_heads, head_dim)[:length].to(wide)
        qb = q[b].to(wide).view(kv_heads, group, head_dim)                       # head h reads KV head h // group
        logits = torch.einsum("hgd,lhd->hgl", qb, k) * sm_scale
        lse[b] = (torch.logsumexp(logits, dim=-1) * LOG2E).reshape(qo_heads)     # base 2, as FlashInfer
        probs = torch.softmax(logits, dim=-1)
        out[b] = torch.einsum("hgl,lhd->hgd", probs, v).reshape(qo_heads, head_dim).to(q.dtype)
    return out, lse


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    lens = KV_LENS[size]
    pool = NUM_PAGES[size]
    npages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lens]
    q = torch.randn(len(lens), QO_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(pool, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(pool, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    kv_indptr = torch.tensor((0,) + tuple(int(x) for x in torch.tensor(npages).cumsum(0)), device=device,
                             dtype=torch.int32)
    # distinct pages scattered over the pool; the unused slots of each last page hold data that must be ignored
    kv_indices = torch.randperm(pool, device=device)[:sum(npages)].to(torch.int32)
    kv_last_page_len = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(lens, npages)], device=device,
                                    dtype=torch.int32)
    return [q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, SM_SCALE]
