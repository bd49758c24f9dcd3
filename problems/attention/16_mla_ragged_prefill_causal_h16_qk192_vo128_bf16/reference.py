"""Causal multi-head latent attention prefill in expanded form (qk 192, vo 128) over ragged tensors from DeepSeek-V3 at TP=8."""

# Based on the public FlashInfer-Trace definition mla_ragged_prefill_causal_h16_qk192_vo128 (Apache-2.0); query
# lengths and the 256-token prefixes of one captured workload record (63 requests). sm_scale is DeepSeek-V3's.

import math

import torch

QO_HEADS = 16
KV_HEADS = 16
QK_DIM = 192                      # 128 no-rope + 64 rope dims per head, after up-projecting the latent
VO_DIM = 128
SM_SCALE = 0.1352337747812271     # 1/sqrt(192) times the squared YaRN mscale of DeepSeek-V3
LOG2E = 1.0 / math.log(2.0)
# per request: new query tokens, and extra KV tokens in front of them (KV length = prefix + query length)
Q_LENS = {
    "full": (39, 38, 39, 39, 39, 40, 40, 40, 41, 40, 40, 42, 42, 41, 42, 42, 43, 42, 43, 42, 43, 43, 44, 44, 44, 46,
             45, 44, 45, 45, 46, 46, 46, 46, 46, 47, 47, 47, 47, 48, 49, 48, 47, 48, 49, 50, 49, 49, 50, 50, 51, 51,
             50, 51, 51, 52, 50, 52, 53, 53, 54, 53, 52),
    "smoke": (6, 1, 33, 12),
}
PREFIX_LENS = {"full": (256,) * 63, "smoke": (0, 9, 20, 3)}


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, heads, qk_dim = q.shape
    total_kv, kv_heads, vo_dim = v.shape
    assert (heads, kv_heads, qk_dim, vo_dim, k.shape[-1]) == (QO_HEADS, KV_HEADS, QK_DIM, VO_DIM, QK_DIM)
    assert total_q == int(qo_indptr[-1]) and total_kv == int(kv_indptr[-1]) == k.shape[0]
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty((total_q, heads, vo_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, heads), dtype=wide, device=q.device)
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qb) - 1):
        qs, ks, vs = q[qb[b]:qb[b + 1]].to(wide), k[kb[b]:kb[b + 1]].to(wide), v[kb[b]:kb[b + 1]].to(wide)
        lq, lkv = qs.shape[0], ks.shape[0]
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * sm_scale
        qpos = torch.arange(lq, device=q.device) + (lkv - lq)     # bottom-right aligned causal mask
        logits.masked_fill_(torch.arange(lkv, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        lse[qb[b]:qb[b + 1]] = (torch.logsumexp(logits, dim=-1) * LOG2E).T
        out[qb[b]:qb[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), vs).to(q.dtype)
    return out, lse


def _indptr(lens, device):
    return torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    q_lens = Q_LENS[size]
    kv_lens = [p + n for p, n in zip(PREFIX_LENS[size], q_lens)]
    q = torch.randn(sum(q_lens), QO_HEADS, QK_DIM, device=device, dtype=torch.bfloat16)
    k = torch.randn(sum(kv_lens), KV_HEADS, QK_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn(sum(kv_lens), KV_HEADS, VO_DIM, device=device, dtype=torch.bfloat16)
    return [q, k, v, _indptr(q_lens, device), _indptr(kv_lens, device), SM_SCALE]
