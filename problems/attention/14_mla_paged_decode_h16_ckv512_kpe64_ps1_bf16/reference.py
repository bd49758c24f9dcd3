"""Multi-head latent attention decode over a paged compressed KV cache (page size 1) from DeepSeek-V3 at TP=8."""

# Based on the public FlashInfer-Trace definition mla_paged_decode_h16_ckv512_kpe64_ps1 (Apache-2.0): 128 heads over
# 8 GPUs in the absorbed form; KV lengths and sm_scale of one captured workload record (64 requests, 75145 tokens).

import math

import torch

QO_HEADS = 16
CKV_DIM = 512                     # compressed latent KV (keys and values share it)
KPE_DIM = 64                      # decoupled rotary key part
PAGE_SIZE = 1
SM_SCALE = 0.1352337747812271     # 1/sqrt(128 + 64) times the squared YaRN mscale of DeepSeek-V3
LOG2E = 1.0 / math.log(2.0)
KV_LENS = {
    "full": (537, 514, 638, 510, 1572, 1540, 1593, 1590, 2661, 2103, 2418, 9197, 554, 519, 1879, 692, 814, 679, 670,
             540, 516, 518, 612, 512, 3299, 633, 536, 1050, 519, 568, 658, 514, 534, 728, 642, 916, 1444, 1582, 1633,
             1537, 1511, 629, 1096, 1501, 1486, 1512, 519, 550, 940, 568, 520, 3013, 555, 523, 1426, 579, 644, 524,
             517, 533, 1428, 1316, 1394, 1690),
    "smoke": (9, 40, 1, 23),
}
NUM_PAGES = {"full": 131072, "smoke": 96}


@torch.no_grad()
def reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, ckv_dim = q_nope.shape
    kpe_dim = q_pe.shape[-1]
    assert (heads, ckv_dim, kpe_dim, ckv_cache.shape[1]) == (QO_HEADS, CKV_DIM, KPE_DIM, PAGE_SIZE)
    assert kv_indptr.numel() == batch + 1 and kv_indices.numel() == int(kv_indptr[-1])
    wide = torch.promote_types(q_nope.dtype, torch.float32)
    ckv = ckv_cache.reshape(-1, ckv_dim)
    kpe = kpe_cache.reshape(-1, kpe_dim)
    out = torch.empty_like(q_nope)
    lse = torch.empty((batch, heads), dtype=wide, device=q_nope.device)
    bounds = kv_indptr.tolist()
    for b in range(batch):
        idx = kv_indices[bounds[b]:bounds[b + 1]].long()
        c = ckv[idx].to(wide)                                           # [L, 512]
        logits = (q_nope[b].to(wide) @ c.T + q_pe[b].to(wide) @ kpe[idx].to(wide).T) * sm_scale
        lse[b] = torch.logsumexp(logits, dim=-1) * LOG2E                 # base 2, as FlashInfer
        out[b] = (torch.softmax(logits, dim=-1) @ c).to(q_nope.dtype)   # values are the latent vectors
    return out, lse


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    lens = KV_LENS[size]
    pages = NUM_PAGES[size]
    q_nope = torch.randn(len(lens), QO_HEADS, CKV_DIM, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(len(lens), QO_HEADS, KPE_DIM, device=device, dtype=torch.bfloat16)
    ckv_cache = torch.randn(pages, PAGE_SIZE, CKV_DIM, device=device, dtype=torch.bfloat16)
    kpe_cache = torch.randn(pages, PAGE_SIZE, KPE_DIM, device=device, dtype=torch.bfloat16)
    kv_indptr = torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device,
                             dtype=torch.int32)
    # every request reads distinct pages scattered over the pool
    kv_indices = torch.randperm(pages, device=device)[:sum(lens)].to(torch.int32)
    return [q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, SM_SCALE]
