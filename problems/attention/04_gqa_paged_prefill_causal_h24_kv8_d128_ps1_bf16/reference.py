"""Causal grouped-query attention prefill over a paged KV cache (page size 1) from Llama 3.2 3B."""

# Based on the public FlashInfer-Trace definition gqa_paged_prefill_causal_h24_kv8_d128_ps1 (Apache-2.0);
# query/KV lengths and the page pool of one captured workload record (27 requests, 16372 tokens, no prefix).

import math

import torch

QO_HEADS = 24
KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 1
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
LOG2E = 1.0 / math.log(2.0)
LOGIT_BUDGET = 1 << 25            # logits the reference materializes at once (memory bound for the fp64 anchor)
# per request: (new query tokens, KV tokens); KV includes the new tokens, so a query at i sees KV 0 .. i + kv - q
Q_LENS = {
    "full": (145, 166, 173, 402, 336, 346, 340, 342, 445, 354, 546, 447, 513, 538, 545, 775, 561, 715, 825, 596,
             940, 1081, 1150, 955, 963, 1250, 923),
    "smoke": (5, 17, 1, 30),
}
KV_LENS = Q_LENS
NUM_PAGES = {"full": 77646, "smoke": 96}


def _causal_attention(q, k, v, sm_scale):
    """q [Lq, H, D], k/v [Lkv, KV, D] (wide); bottom-right aligned causal mask; returns out and base-2 lse."""
    lq, heads, dim = q.shape
    lkv, kv_heads, _ = k.shape
    group = heads // kv_heads
    delta = lkv - lq
    out = torch.empty((lq, heads, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((lq, heads), dtype=q.dtype, device=q.device)
    rows = max(1, LOGIT_BUDGET // (heads * lkv))
    for s in range(0, lq, rows):
        e = min(s + rows, lq)
        visible = delta + e                                   # keys any query of this block may see
        qc = q[s:e].reshape(e - s, kv_heads, group, dim)
        logits = torch.einsum("qhgd,khd->hgqk", qc, k[:visible]) * sm_scale
        qpos = torch.arange(s, e, device=q.device) + delta
        kpos = torch.arange(visible, device=q.device)
        logits.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
        lse[s:e] = (torch.logsumexp(logits, dim=-1) * LOG2E).permute(2, 0, 1).reshape(e - s, heads)
        probs = torch.softmax(logits, dim=-1)
        out[s:e] = torch.einsum("hgqk,khd->qhgd", probs, v[:visible]).reshape(e - s, heads, -1)
    return out, lse


@torch.no_grad()
def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, qo_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert (qo_heads, kv_heads, head_dim, page_size) == (QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE)
    assert total_q == int(qo_indptr[-1]) and kv_indices.numel() == int(kv_indptr[-1])
    wide = torch.promote_types(q.dtype, torch.float32)
    k_tok = k_cache.reshape(-1, kv_heads, head_dim)
    v_tok = v_cache.reshape(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    lse = torch.empty((total_q, qo_heads), dtype=wide, device=q.device)
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qb) - 1):
        idx = kv_indices[kb[b]:kb[b + 1]].long()
        o, l = _causal_attention(q[qb[b]:qb[b + 1]].to(wide), k_tok[idx].to(wide), v_tok[idx].to(wide), sm_scale)
        out[qb[b]:qb[b + 1]] = o.to(q.dtype)
        lse[qb[b]:qb[b + 1]] = l
    return out, lse


def _indptr(lens, device):
    return torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    q_lens, kv_lens, pages = Q_LENS[size], KV_LENS[size], NUM_PAGES[size]
    q = torch.randn(sum(q_lens), QO_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    # every request reads distinct pages scattered over the pool
    kv_indices = torch.randperm(pages, device=device)[:sum(kv_lens)].to(torch.int32)
    return [q, k_cache, v_cache, _indptr(q_lens, device), _indptr(kv_lens, device), kv_indices, SM_SCALE]
