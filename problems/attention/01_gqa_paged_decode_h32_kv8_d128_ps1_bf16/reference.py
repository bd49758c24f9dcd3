"""Grouped-query attention decode over a paged KV cache (page size 1) from Llama 3.1 8B."""

import math

import torch

QO_HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 1
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
# per-request KV lengths of one captured decode batch (64 requests, 58966 tokens), and the page pool
KV_LENS = {
    "full": (542, 525, 570, 599, 778, 524, 525, 513, 558, 518, 516, 555, 511, 520, 527, 848, 578, 2570,
             3087, 1543, 2320, 2322, 1477, 1573, 1517, 527, 705, 521, 529, 523, 538, 516, 524, 532, 518,
             920, 641, 689, 517, 516, 522, 551, 532, 537, 2883, 3172, 822, 522, 900, 642, 512, 523, 551,
             2495, 531, 2123, 1589, 807, 557, 515, 848, 916, 509, 575),
    "smoke": (7, 33, 1, 20),
}
NUM_PAGES = {"full": 68237, "smoke": 96}


@torch.no_grad()
def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
              kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, qo_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert (qo_heads, kv_heads, head_dim, page_size) == (QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE)
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros((batch, qo_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, qo_heads), -math.inf, dtype=wide, device=q.device)
    group = qo_heads // kv_heads
    k_tok, v_tok = k_cache.squeeze(1), v_cache.squeeze(1)
    bounds = kv_indptr.tolist()
    for b in range(batch):
        idx = kv_indices[bounds[b]:bounds[b + 1]].long()
        if idx.numel() == 0:
            continue
        k = k_tok[idx].to(wide).permute(1, 0, 2).repeat_interleave(group, dim=0)   # [H, L, D]
        v = v_tok[idx].to(wide).permute(1, 0, 2).repeat_interleave(group, dim=0)
        logits = torch.einsum("hd,hld->hl", q[b].to(wide), k) * sm_scale
        lse[b] = torch.logsumexp(logits, dim=-1) / math.log(2.0)   # base-2 log-sum-exp, as FlashInfer
        out[b] = torch.einsum("hl,hld->hd", torch.softmax(logits, dim=-1), v).to(q.dtype)
    return out, lse


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    lens = KV_LENS[size]
    pages = NUM_PAGES[size]
    q = torch.randn(len(lens), QO_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    kv_indptr = torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device,
                             dtype=torch.int32)
    # every request reads distinct pages scattered over the pool
    kv_indices = torch.randperm(pages, device=device)[:sum(lens)].to(torch.int32)
    return [q, k_cache, v_cache, kv_indptr, kv_indices, SM_SCALE]
