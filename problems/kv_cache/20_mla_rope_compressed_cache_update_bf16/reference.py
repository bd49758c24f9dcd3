"""MLA query up-projection and interleaved RoPE, with a paged write of the compressed KV latent and rotated key into the MLA cache (DeepSeek-V3, TP=8)."""
# Designed for MetaKernelBench from the public DeepSeek-V3 config (128 heads -> 16 per rank at TP=8, q_lora_rank 1536,
# kv_lora_rank 512, qk_nope 128, qk_rope 64, GPT-J style rotary); semantics as vLLM's MLA RoPE + concat_and_cache_mla fusion.

import torch

HEADS = 16
Q_LORA_RANK = 1536
KV_LORA_RANK = 512
NOPE_DIM = 128
ROPE_DIM = 64
QK_HEAD_DIM = NOPE_DIM + ROPE_DIM
ROPE_THETA = 10000.0
BLOCK_SIZE = 64
# (token slots in the batch, requests, cache blocks, max padding tokens, max tokens already cached per request)
GEOMETRY = {"full": (4096, 10, 1024, 64, 16384), "smoke": (24, 3, 8, 4, 70)}
MAX_POSITION = {"full": 32768, "smoke": 128}


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # GPT-J style: dims (2i, 2i+1) form a pair rotated by angle i; cos, sin broadcast to x[..., ::2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


@torch.no_grad()
def reference(qkv_lora: torch.Tensor, q_b_weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = qkv_lora.shape[0]
    assert qkv_lora.shape[1] == Q_LORA_RANK + KV_LORA_RANK + ROPE_DIM
    assert q_b_weight.shape == (HEADS * QK_HEAD_DIM, Q_LORA_RANK)
    assert kv_cache.shape[1:] == (BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM)
    wide = torch.promote_types(qkv_lora.dtype, torch.float32)
    x = qkv_lora.to(wide)
    q_c = x[:, :Q_LORA_RANK]
    kv_c = qkv_lora[:, Q_LORA_RANK:Q_LORA_RANK + KV_LORA_RANK]
    k_pe = x[:, Q_LORA_RANK + KV_LORA_RANK:]

    q = (q_c @ q_b_weight.to(wide).t()).view(tokens, HEADS, QK_HEAD_DIM)
    cos, sin = cos_sin_cache.to(wide)[positions.long()].chunk(2, dim=-1)          # [T, 32] each
    q_pe = _interleaved_rope(q[..., NOPE_DIM:], cos[:, None, :], sin[:, None, :])
    k_pe = _interleaved_rope(k_pe, cos, sin)
    q_out = torch.cat((q[..., :NOPE_DIM], q_pe), dim=-1).to(qkv_lora.dtype)

    # padding tokens (slot -1) get a q row but are not cached
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    kv_cache[block, offset, :KV_LORA_RANK] = kv_c[live].to(kv_cache.dtype)
    kv_cache[block, offset, KV_LORA_RANK:] = k_pe[live].to(kv_cache.dtype)
    return q_out, kv_cache


def _batch_layout(size: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and cache slots of a ragged chunked-prefill batch (drawn on the CPU generator)."""
    tokens, requests, blocks, max_pad, max_ctx = GEOMETRY[size]
    pad = int(torch.randint(1, max_pad + 1, (1,)))
    live = tokens - pad
    cuts = torch.randperm(live - 1)[:requests - 1].sort().values + 1
    lens = torch.diff(torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([live]))))
    ctx = torch.randint(0, max_ctx + 1, (requests,))
    req = torch.repeat_interleave(torch.arange(requests), lens)
    pos = ctx[req] + torch.arange(live) - (torch.cumsum(lens, 0) - lens)[req]
    first = ctx // BLOCK_SIZE
    nblk = (ctx + lens - 1) // BLOCK_SIZE - first + 1
    assert int(nblk.sum()) <= blocks
    phys = torch.randperm(blocks)[:int(nblk.sum())]
    slot = phys[(torch.cumsum(nblk, 0) - nblk)[req] + pos // BLOCK_SIZE - first[req]] * BLOCK_SIZE + pos % BLOCK_SIZE
    positions = torch.cat((pos, torch.zeros(pad, dtype=torch.long)))
    slot_mapping = torch.cat((slot, torch.full((pad,), -1, dtype=torch.long)))
    return positions, slot_mapping


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, _, blocks, _, _ = GEOMETRY[size]
    positions, slot_mapping = _batch_layout(size)
    # q latent and kv latent come out of RMSNorms (unit scale); k_pe is a raw projection slice
    qkv_lora = torch.randn(tokens, Q_LORA_RANK + KV_LORA_RANK + ROPE_DIM, device=device, dtype=torch.float32)
    qkv_lora[:, Q_LORA_RANK + KV_LORA_RANK:] *= 2.0
    qkv_lora = qkv_lora.to(torch.bfloat16)
    q_b_weight = (torch.randn(HEADS * QK_HEAD_DIM, Q_LORA_RANK, device=device) / Q_LORA_RANK ** 0.5).to(torch.bfloat16)
    inv_freq = ROPE_THETA ** (-torch.arange(0, ROPE_DIM, 2, device=device, dtype=torch.float32) / ROPE_DIM)
    angles = torch.outer(torch.arange(MAX_POSITION[size], device=device, dtype=torch.float32), inv_freq)
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)
    kv_cache = torch.randn(blocks, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM, device=device, dtype=torch.bfloat16)
    return [qkv_lora, q_b_weight, positions.to(device), cos_sin_cache, slot_mapping.to(device), kv_cache]
