"""Causal multi-head latent attention prefill over a paged compressed KV cache (page size 1) from DeepSeek-V3 at TP=8."""

# Based on the public FlashInfer-Trace definition mla_paged_prefill_causal_h16_ckv512_kpe64_ps1 (Apache-2.0); query
# and KV lengths and sm_scale of one captured workload record (28 requests, 1954 query tokens, 2044 KV tokens).

import math

import torch

QO_HEADS = 16
CKV_DIM = 512                     # compressed latent KV (keys and values share it)
KPE_DIM = 64                      # decoupled rotary key part
PAGE_SIZE = 1
SM_SCALE = 0.1352337747812271     # 1/sqrt(128 + 64) times the squared YaRN mscale of DeepSeek-V3
LOG2E = 1.0 / math.log(2.0)
# per request: new query tokens and KV tokens (KV includes them; query i sees KV 0 .. i + kv - q)
Q_LENS = {
    "full": (20, 11, 83, 14, 36, 9, 17, 137, 96, 33, 4, 39, 21, 82, 1, 10, 420, 28, 20, 61, 390, 49, 176, 66, 9, 32,
             79, 11),
    "smoke": (3, 12, 1, 20),
}
KV_LENS = {
    "full": (23, 15, 85, 18, 39, 11, 21, 141, 99, 36, 6, 44, 23, 90, 4, 14, 423, 30, 23, 64, 393, 53, 180, 70, 12, 34,
             81, 12),
    "smoke": (5, 12, 4, 26),
}
NUM_PAGES = {"full": 131072, "smoke": 96}


@torch.no_grad()
def reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
              qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, heads, ckv_dim = q_nope.shape
    kpe_dim = q_pe.shape[-1]
    assert (heads, ckv_dim, kpe_dim, ckv_cache.shape[1]) == (QO_HEADS, CKV_DIM, KPE_DIM, PAGE_SIZE)
    assert total_q == int(qo_indptr[-1]) and kv_indices.numel() == int(kv_indptr[-1])
    wide = torch.promote_types(q_nope.dtype, torch.float32)
    ckv = ckv_cache.reshape(-1, ckv_dim)
    kpe = kpe_cache.reshape(-1, kpe_dim)
    out = torch.empty_like(q_nope)
    lse = torch.empty((total_q, heads), dtype=wide, device=q_nope.device)
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qb) - 1):
        idx = kv_indices[kb[b]:kb[b + 1]].long()
        c, r = ckv[idx].to(wide), kpe[idx].to(wide)                     # [L, 512], [L, 64]
        qn, qp = q_nope[qb[b]:qb[b + 1]].to(wide), q_pe[qb[b]:qb[b + 1]].to(wide)
        lq, lkv = qn.shape[0], c.shape[0]
        logits = (torch.einsum("qhc,kc->hqk", qn, c) + torch.einsum("qhr,kr->hqk", qp, r)) * sm_scale
        qpos = torch.arange(lq, device=c.device) + (lkv - lq)
        logits.masked_fill_(torch.arange(lkv, device=c.device)[None, :] > qpos[:, None], float("-inf"))
        lse[qb[b]:qb[b + 1]] = (torch.logsumexp(logits, dim=-1) * LOG2E).T
        out[qb[b]:qb[b + 1]] = torch.einsum("hqk,kc->qhc", torch.softmax(logits, dim=-1), c).to(q_nope.dtype)
    return out, lse


def _indptr(lens, device):
    return torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    q_lens, kv_lens, pages = Q_LENS[size], KV_LENS[size], NUM_PAGES[size]
    q_nope = torch.randn(sum(q_lens), QO_HEADS, CKV_DIM, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(sum(q_lens), QO_HEADS, KPE_DIM, device=device, dtype=torch.bfloat16)
    ckv_cache = torch.randn(pages, PAGE_SIZE, CKV_DIM, device=device, dtype=torch.bfloat16)
    kpe_cache = torch.randn(pages, PAGE_SIZE, KPE_DIM, device=device, dtype=torch.bfloat16)
    # every request reads distinct pages scattered over the pool
    kv_indices = torch.randperm(pages, device=device)[:sum(kv_lens)].to(torch.int32)
    return [q_nope, q_pe, ckv_cache, kpe_cache, _indptr(q_lens, device), _indptr(kv_lens, device), kv_indices,
            SM_SCALE]
