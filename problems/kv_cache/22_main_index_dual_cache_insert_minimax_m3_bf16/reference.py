"""MiniMax-M3 style per-head RMS norm and partial RoPE of main and indexer queries/keys, inserted into a paged KV cache and a paged indexer-key cache."""
# Based on the head layout of vLLM's fused MiniMax-M3 QK-norm/RoPE/KV-insert kernel test (Apache-2.0), as in the original
# MetaKernelBench problem 22 (16 q, 4 kv, 4 index-q, 1 index-k heads of dim 128; 64 rotary dims; theta 5e6; (1 + w) norm).

import torch

Q_HEADS = 16
KV_HEADS = 4
INDEX_Q_HEADS = 4
HEAD_DIM = 128
ROTARY_DIM = 64
ROPE_THETA = 5.0e6
EPS = 1e-6
BLOCK_SIZE = 64
# (token slots, requests, main-cache blocks, indexer-cache blocks, max padding tokens, max tokens already cached)
GEOMETRY = {"full": (8192, 16, 512, 512, 128, 24576), "smoke": (40, 3, 6, 6, 4, 100)}
MAX_POSITION = {"full": 65536, "smoke": 256}
# column layout of the fused projection, in heads of HEAD_DIM: q, k, v, index q, index k
SPLITS = (Q_HEADS, KV_HEADS, KV_HEADS, INDEX_Q_HEADS, 1)


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D] in the wide dtype: RMS norm with a zero-centred weight (scale 1 + w), then NeoX RoPE on dims < 64
    x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS) * (1.0 + weight.to(x.dtype))
    half = ROTARY_DIM // 2
    lo, hi, rest = x[..., :half], x[..., half:ROTARY_DIM], x[..., ROTARY_DIM:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((lo * c - hi * s, hi * c + lo * s, rest), dim=-1)


@torch.no_grad()
def reference(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
              index_q_norm_weight: torch.Tensor, index_k_norm_weight: torch.Tensor, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor, index_slot_mapping: torch.Tensor,
              kv_cache: torch.Tensor, index_cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = qkv.shape[0]
    assert qkv.shape[1] == sum(SPLITS) * HEAD_DIM
    assert kv_cache.shape[1:] == (KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    assert index_cache.shape[1:] == (BLOCK_SIZE, HEAD_DIM)
    wide = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v, iq, ik = qkv.view(tokens, sum(SPLITS), HEAD_DIM).split(SPLITS, dim=1)
    cos, sin = cos_sin_cache.to(wide)[positions.long()].chunk(2, dim=-1)
    q = _norm_rope(q.to(wide), q_norm_weight, cos, sin)
    k = _norm_rope(k.to(wide), k_norm_weight, cos, sin)
    iq = _norm_rope(iq.to(wide), index_q_norm_weight, cos, sin)
    ik = _norm_rope(ik.to(wide), index_k_norm_weight, cos, sin)[:, 0]

    # main cache block layout: [head, offset, K dims 0..127 | V dims 128..255]; slot -1 = padding, skipped
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    block, offset = (slots // BLOCK_SIZE)[:, None], (slots % BLOCK_SIZE)[:, None]
    heads = torch.arange(KV_HEADS, device=qkv.device)[None, :]
    kv_cache[block, heads, offset] = torch.cat((k[live], v[live].to(wide)), dim=-1).to(kv_cache.dtype)

    ilive = index_slot_mapping >= 0
    islots = index_slot_mapping[ilive].long()
    index_cache[islots // BLOCK_SIZE, islots % BLOCK_SIZE] = ik[ilive].to(index_cache.dtype)
    return q.to(qkv.dtype), iq.to(qkv.dtype), kv_cache, index_cache


def _batch_layout(size: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions and slots in both caches for a ragged chunked-prefill batch (CPU generator).

    The two caches have their own block pools and block tables, so a token's two slots are unrelated.
    """
    tokens, requests, blocks, index_blocks, max_pad, max_ctx = GEOMETRY[size]
    pad = int(torch.randint(1, max_pad + 1, (1,)))
    live = tokens - pad
    cuts = torch.randperm(live - 1)[:requests - 1].sort().values + 1
    lens = torch.diff(torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([live]))))
    ctx = torch.randint(0, max_ctx + 1, (requests,))
    req = torch.repeat_interleave(torch.arange(requests), lens)
    pos = ctx[req] + torch.arange(live) - (torch.cumsum(lens, 0) - lens)[req]
    first = ctx // BLOCK_SIZE
    nblk = (ctx + lens - 1) // BLOCK_SIZE - first + 1
    local = (torch.cumsum(nblk, 0) - nblk)[req] + pos // BLOCK_SIZE - first[req]
    slot_maps = []
    for pool in (blocks, index_blocks):
        assert int(nblk.sum()) <= pool
        phys = torch.randperm(pool)[:int(nblk.sum())]
        slot = phys[local] * BLOCK_SIZE + pos % BLOCK_SIZE
        slot_maps.append(torch.cat((slot, torch.full((pad,), -1, dtype=torch.long))))
    positions = torch.cat((pos, torch.zeros(pad, dtype=torch.long)))
    return positions, slot_maps[0], slot_maps[1]


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, _, blocks, index_blocks, _, _ = GEOMETRY[size]
    positions, slot_mapping, index_slot_mapping = _batch_layout(size)
    qkv = torch.randn(tokens, sum(SPLITS) * HEAD_DIM, device=device)
    qkv = (qkv * (0.5 + torch.rand(tokens, 1, device=device))).to(torch.bfloat16)
    # zero-centred norm weights (the norm scales by 1 + w)
    weights = [(0.2 * torch.randn(HEAD_DIM, device=device)).to(torch.bfloat16) for _ in range(4)]
    inv_freq = ROPE_THETA ** (-torch.arange(0, ROTARY_DIM, 2, device=device, dtype=torch.float32) / ROTARY_DIM)
    angles = torch.outer(torch.arange(MAX_POSITION[size], device=device, dtype=torch.float32), inv_freq)
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)
    kv_cache = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, device=device, dtype=torch.bfloat16)
    index_cache = torch.randn(index_blocks, BLOCK_SIZE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return [qkv, *weights, positions.to(device), cos_sin_cache, slot_mapping.to(device), index_slot_mapping.to(device),
            kv_cache, index_cache]
