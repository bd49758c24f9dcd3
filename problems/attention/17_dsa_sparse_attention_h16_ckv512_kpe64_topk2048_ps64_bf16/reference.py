"""DeepSeek sparse attention decode: latent attention over 2048 selected tokens of a paged KV cache, DeepSeek-V3.2 at TP=8."""

# Based on the public FlashInfer-Trace definition dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64 (Apache-2.0) and
# its sm_scale; the decode batch (64 requests, contexts 359 to 31066 tokens) was designed for MetaKernelBench.

import math

import torch

QO_HEADS = 16
CKV_DIM = 512                     # compressed latent KV (keys and values share it)
KPE_DIM = 64                      # decoupled rotary key part
PAGE_SIZE = 64
TOPK = 2048
SM_SCALE = 0.1352337788608801     # 1/sqrt(128 + 64) times the squared YaRN mscale
LOG2E = 1.0 / math.log(2.0)
# context length of each decode request; requests with more than TOPK tokens attend to TOPK of them
CONTEXT_LENS = {
    "full": (12321, 5746, 2387, 1162, 616, 4173, 1821, 1712, 3281, 3889, 420, 10331, 540, 26302, 7393, 2555, 15690,
             4182, 8174, 4560, 12262, 11839, 1653, 2220, 5773, 3320, 417, 31066, 465, 511, 1143, 7206, 24681, 3237,
             2770, 4874, 2838, 4448, 1310, 6349, 6065, 359, 3669, 4821, 7180, 1811, 1085, 1583, 7086, 1747, 1908,
             12856, 1866, 1668, 3739, 4996, 11561, 1700, 854, 3624, 7796, 931, 2516, 5563),
    "smoke": (3000, 700, 2048, 2113),
}
NUM_PAGES = {"full": 6144, "smoke": 160}


@torch.no_grad()
def reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
              sparse_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, heads, ckv_dim = q_nope.shape
    kpe_dim = q_pe.shape[-1]
    assert (heads, ckv_dim, kpe_dim, ckv_cache.shape[1]) == (QO_HEADS, CKV_DIM, KPE_DIM, PAGE_SIZE)
    assert sparse_indices.shape == (tokens, TOPK)
    wide = torch.promote_types(q_nope.dtype, torch.float32)
    # sparse_indices hold flat slot ids (page * PAGE_SIZE + offset); -1 marks an unused entry
    valid = sparse_indices >= 0
    slots = sparse_indices.clamp_min(0).long()
    c = ckv_cache.reshape(-1, ckv_dim)[slots].to(wide)                        # [T, K, 512]
    r = kpe_cache.reshape(-1, kpe_dim)[slots].to(wide)                        # [T, K, 64]
    logits = (torch.einsum("thc,tkc->thk", q_nope.to(wide), c)
              + torch.einsum("thr,tkr->thk", q_pe.to(wide), r)) * sm_scale
    logits.masked_fill_(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1) * LOG2E                             # base 2, as FlashInfer
    out = torch.einsum("thk,tkc->thc", torch.softmax(logits, dim=-1), c).to(q_nope.dtype)
    return out, lse


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    lens = CONTEXT_LENS[size]
    pool = NUM_PAGES[size]
    q_nope = torch.randn(len(lens), QO_HEADS, CKV_DIM, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(len(lens), QO_HEADS, KPE_DIM, device=device, dtype=torch.bfloat16)
    ckv_cache = torch.randn(pool, PAGE_SIZE, CKV_DIM, device=device, dtype=torch.bfloat16)
    kpe_cache = torch.randn(pool, PAGE_SIZE, KPE_DIM, device=device, dtype=torch.bfloat16)
    # each request owns distinct pages scattered over the pool; the selection is a random TOPK-subset of its
    # context (all of it when shorter), in ascending position order, mapped to slots through its page list
    npages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lens]
    perm = torch.randperm(pool, device=device)[:sum(npages)]
    sparse_indices = torch.full((len(lens), TOPK), -1, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(lens):
        pages = perm[start:start + npages[b]]
        start += npages[b]
        pos = torch.arange(n, device=device) if n <= TOPK else torch.randperm(n, device=device)[:TOPK].sort().values
        sparse_indices[b, :pos.numel()] = (pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).to(torch.int32)
    return [q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, SM_SCALE]
