"""Causal grouped-query attention prefill over a paged KV cache (page size 64) from Llama 3.2 3B."""

# Based on the public FlashInfer-Trace definition gqa_paged_prefill_causal_h24_kv8_d128_ps64 (Apache-2.0); the
# batch (15 requests of chunked prefill over cached prefixes, ragged last pages) was designed for MetaKernelBench.

import math

import torch

QO_HEADS = 24
KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 64
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
LOG2E = 1.0 / math.log(2.0)
LOGIT_BUDGET = 1 << 25            # logits the reference materializes at once (memory bound for the fp64 anchor)
# per request: new query tokens and cached prefix tokens; the KV pages hold prefix + new tokens
Q_LENS = {
    "full": (1463, 2048, 117, 636, 1423, 1804, 1106, 1996, 858, 1030, 793, 330, 387, 913, 466),
    "smoke": (3, 40, 1, 70),
}
PREFIX_LENS = {
    "full": (0, 10541, 7563, 0, 2668, 696, 3321, 6573, 0, 2954, 2212, 1641, 1450, 0, 1254),
    "smoke": (0, 90, 63, 0),
}
NUM_PAGES = {"full": 1280, "smoke": 16}


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
              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, qo_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert (qo_heads, kv_heads, head_dim, page_size) == (QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE)
    assert total_q == int(qo_indptr[-1]) and kv_indices.numel() == int(kv_indptr[-1])
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    lse = torch.empty((total_q, qo_heads), dtype=wide, device=q.device)
    qb, kb, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(len(qb) - 1):
        pages = kv_indices[kb[b]:kb[b + 1]].long()
        length = (pages.numel() - 1) * page_size + last[b]      # all slots but the unused tail of the last page
        k = k_cache[pages].reshape(-1, kv_heads, head_dim)[:length].to(wide)
        v = v_cache[pages].reshape(-1, kv_heads, head_dim)[:length].to(wide)
        o, l = _causal_attention(q[qb[b]:qb[b + 1]].to(wide), k, v, sm_scale)
        out[qb[b]:qb[b + 1]] = o.to(q.dtype)
        lse[qb[b]:qb[b + 1]] = l
    return out, lse


def _indptr(lens, device):
    return torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    q_lens, pool = Q_LENS[size], NUM_PAGES[size]
    kv_lens = [p + n for p, n in zip(PREFIX_LENS[size], q_lens)]
    npages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in kv_lens]
    q = torch.randn(sum(q_lens), QO_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(pool, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(pool, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    # distinct pages scattered over the pool; the unused slots of each last page hold data that must be ignored
    kv_indices = torch.randperm(pool, device=device)[:sum(npages)].to(torch.int32)
    kv_last_page_len = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(kv_lens, npages)], device=device,
                                    dtype=torch.int32)
    return [q, k_cache, v_cache, _indptr(q_lens, device), _indptr(npages, device), kv_indices, kv_last_page_len,
            SM_SCALE]
