"""Grouped-query attention decode over a paged KV cache (page size 1) from Llama 4 Scout 17B-16E at TP=8."""

# Based on the public FlashInfer-Trace definition gqa_paged_decode_h5_kv1_d128_ps1 (Apache-2.0): 40 query and
# 8 KV heads of Llama 4 Scout split over 8 GPUs. The decode batch (64 requests) was designed for MetaKernelBench.

import math

import torch

QO_HEADS = 5
KV_HEADS = 1
HEAD_DIM = 128
PAGE_SIZE = 1
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
LOG2E = 1.0 / math.log(2.0)
# cached tokens per request: a long-context decode batch (64 requests, 151626 tokens in all)
KV_LENS = {
    "full": (1691, 830, 926, 122, 8467, 4396, 1011, 3035, 1855, 805, 3721, 1026, 1008, 634, 2207, 1268, 2415,
             763, 1589, 574, 3248, 1690, 1948, 2111, 510, 3064, 10948, 272, 248, 311, 3248, 1592, 4116, 2883,
             1728, 1860, 1181, 3337, 452, 918, 1785, 8482, 652, 476, 797, 3690, 1107, 5264, 215, 4328, 3941,
             339, 1632, 4722, 1529, 3804, 15050, 1841, 1058, 648, 2677, 1150, 1171, 1260),
    "smoke": (9, 40, 1, 23, 6),
}
# pages in the cache pool (each page holds one token); requests use distinct pages scattered over the pool
NUM_PAGES = {"full": 196608, "smoke": 128}


@torch.no_grad()
def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
              kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, qo_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert (qo_heads, kv_heads, head_dim, page_size) == (QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE)
    assert kv_indptr.numel() == batch + 1 and kv_indices.numel() == int(kv_indptr[-1])
    wide = torch.promote_types(q.dtype, torch.float32)
    group = qo_heads // kv_heads
    k_tok = k_cache.reshape(-1, kv_heads, head_dim)
    v_tok = v_cache.reshape(-1, kv_heads, head_dim)
    out = torch.empty((batch, qo_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, qo_heads), dtype=wide, device=q.device)
    bounds = kv_indptr.tolist()
    for b in range(batch):
        idx = kv_indices[bounds[b]:bounds[b + 1]].long()
        k = k_tok[idx].to(wide)                                    # [L, KV, D]
        v = v_tok[idx].to(wide)
        qb = q[b].to(wide).view(kv_heads, group, head_dim)         # query head h reads KV head h // group
        logits = torch.einsum("hgd,lhd->hgl", qb, k) * sm_scale
        lse[b] = (torch.logsumexp(logits, dim=-1) * LOG2E).reshape(qo_heads)   # base 2, as FlashInfer
        probs = torch.softmax(logits, dim=-1)
        out[b] = torch.einsum("hgl,lhd->hgd", probs, v).reshape(qo_heads, head_dim).to(q.dtype)
    return out, lse


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    lens = KV_LENS[size]
    pages = NUM_PAGES[size]
    q = torch.randn(len(lens), QO_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    kv_indptr = torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device,
                             dtype=torch.int32)
    # every request reads distinct pages scattered over the pool, in an order unrelated to page ids
    kv_indices = torch.randperm(pages, device=device)[:sum(lens)].to(torch.int32)
    return [q, k_cache, v_cache, kv_indptr, kv_indices, SM_SCALE]
