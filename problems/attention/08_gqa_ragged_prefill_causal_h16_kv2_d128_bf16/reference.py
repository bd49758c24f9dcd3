"""Causal grouped-query attention prefill over ragged (packed) query and KV tensors from Qwen3 32B at TP=4."""

# Based on the public FlashInfer-Trace definition gqa_ragged_prefill_causal_h16_kv2_d128 (Apache-2.0): 64 query and
# 8 KV heads split over 4 GPUs; query lengths of one captured workload record, cached prefixes designed here.

import math

import torch

QO_HEADS = 16
KV_HEADS = 2
HEAD_DIM = 128
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
LOG2E = 1.0 / math.log(2.0)
LOGIT_BUDGET = 1 << 25            # logits the reference materializes at once (memory bound for the fp64 anchor)
# per request: new query tokens, and extra KV tokens in front of them (KV length = prefix + query length)
Q_LENS = {
    "full": (133, 181, 9, 8, 14, 43, 24, 29, 2383, 2678, 314, 14, 420, 134, 4, 15, 43, 2024, 23, 1618, 1086, 300,
             49, 7, 340, 422, 1, 68, 18, 7, 74, 3, 20, 21, 12, 31, 3, 7, 21, 40, 14, 107, 11, 6, 30, 9, 26, 24, 301,
             266, 247, 75, 49, 23, 9, 4, 441, 15, 349, 27, 14, 17, 54, 6, 13, 8, 147, 8, 7, 9, 730),
    "smoke": (6, 1, 33, 12),
}
PREFIX_LENS = {
    "full": (0, 77, 30, 0, 733, 0, 646, 0, 0, 0, 552, 0, 130, 431, 0, 0, 0, 0, 0, 0, 0, 1417, 32, 0, 0, 0, 0, 127,
             87, 133, 79, 0, 718, 0, 256, 322, 90, 0, 571, 658, 0, 0, 0, 0, 1749, 0, 197, 0, 1182, 401, 0, 0, 0, 0,
             0, 38, 461, 0, 1849, 315, 434, 240, 0, 352, 323, 221, 0, 0, 65, 197, 0),
    "smoke": (0, 9, 20, 3),
}


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
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, qo_heads, head_dim = q.shape
    total_kv, kv_heads, _ = k.shape
    assert (qo_heads, kv_heads, head_dim) == (QO_HEADS, KV_HEADS, HEAD_DIM)
    assert total_q == int(qo_indptr[-1]) and total_kv == int(kv_indptr[-1])
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    lse = torch.empty((total_q, qo_heads), dtype=wide, device=q.device)
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qb) - 1):
        o, l = _causal_attention(q[qb[b]:qb[b + 1]].to(wide), k[kb[b]:kb[b + 1]].to(wide),
                                 v[kb[b]:kb[b + 1]].to(wide), sm_scale)
        out[qb[b]:qb[b + 1]] = o.to(q.dtype)
        lse[qb[b]:qb[b + 1]] = l
    return out, lse


def _indptr(lens, device):
    return torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    q_lens = Q_LENS[size]
    kv_lens = [p + n for p, n in zip(PREFIX_LENS[size], q_lens)]
    q = torch.randn(sum(q_lens), QO_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k = torch.randn(sum(kv_lens), KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn(sum(kv_lens), KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return [q, k, v, _indptr(q_lens, device), _indptr(kv_lens, device), SM_SCALE]
