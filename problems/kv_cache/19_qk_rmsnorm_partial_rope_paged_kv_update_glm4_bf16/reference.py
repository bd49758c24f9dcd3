"""Per-head Q/K RMS normalization, partial NeoX rotary embedding and paged KV-cache write for one GLM-4.5-Air prefill chunk."""
# Designed for MetaKernelBench from the public GLM-4.5-Air config (96 query / 8 KV heads, head dim 128, QK-norm,
# partial_rotary_factor 0.5, rope_theta 1e6, rms eps 1e-5) at tensor parallel 2; semantics as vLLM's fused QK-norm/RoPE/KV-cache path.

import torch

Q_HEADS = 48            # per rank at TP=2
KV_HEADS = 4
HEAD_DIM = 128
ROTARY_DIM = 64         # partial_rotary_factor 0.5: only the first 64 dims of each head rotate
ROPE_THETA = 1.0e6
EPS = 1e-5
BLOCK_SIZE = 16
# (token slots in the batch, requests, cache blocks, max padding tokens, max tokens already cached per request)
GEOMETRY = {"full": (4096, 12, 2048, 64, 28672), "smoke": (40, 3, 16, 4, 40)}
MAX_POSITION = {"full": 131072, "smoke": 128}


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS) * weight.to(x.dtype)


def _partial_neox_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos, sin [T, ROTARY_DIM/2]. NeoX pairs dim i with dim i + ROTARY_DIM/2.
    half = ROTARY_DIM // 2
    lo, hi, rest = x[..., :half], x[..., half:ROTARY_DIM], x[..., ROTARY_DIM:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((lo * c - hi * s, hi * c + lo * s, rest), dim=-1)


@torch.no_grad()
def reference(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
              cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = qkv.shape[0]
    assert qkv.shape[1] == (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    assert kv_cache.shape[0] == 2 and kv_cache.shape[2:] == (BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    wide = torch.promote_types(qkv.dtype, torch.float32)
    x = qkv.to(wide)
    q = x[:, :Q_HEADS * HEAD_DIM].reshape(tokens, Q_HEADS, HEAD_DIM)
    k = x[:, Q_HEADS * HEAD_DIM:(Q_HEADS + KV_HEADS) * HEAD_DIM].reshape(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM:].reshape(tokens, KV_HEADS, HEAD_DIM)

    cos, sin = cos_sin_cache.to(wide)[positions.long()].chunk(2, dim=-1)
    q = _partial_neox_rope(_rms_norm_heads(q, q_norm_weight), cos, sin)
    k = _partial_neox_rope(_rms_norm_heads(k, k_norm_weight), cos, sin)

    # tokens whose slot is -1 are padding: their q is still produced, nothing is cached
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    kv_cache[0, block, offset] = k[live].to(kv_cache.dtype)
    kv_cache[1, block, offset] = v[live].to(kv_cache.dtype)
    return q.to(qkv.dtype), kv_cache


def _batch_layout(size: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and cache slots of a ragged chunked-prefill batch (drawn on the CPU generator)."""
    tokens, requests, blocks, max_pad, max_ctx = GEOMETRY[size]
    pad = int(torch.randint(1, max_pad + 1, (1,)))
    live = tokens - pad
    cuts = torch.randperm(live - 1)[:requests - 1].sort().values + 1
    lens = torch.diff(torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([live]))))
    ctx = torch.randint(0, max_ctx + 1, (requests,))                       # tokens cached before this chunk
    req = torch.repeat_interleave(torch.arange(requests), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = ctx[req] + torch.arange(live) - starts[req]
    first = ctx // BLOCK_SIZE
    nblk = (ctx + lens - 1) // BLOCK_SIZE - first + 1
    assert int(nblk.sum()) <= blocks
    # each request owns distinct physical blocks scattered over the pool
    phys = torch.randperm(blocks)[:int(nblk.sum())]
    base = torch.cumsum(nblk, 0) - nblk
    slot = phys[base[req] + pos // BLOCK_SIZE - first[req]] * BLOCK_SIZE + pos % BLOCK_SIZE
    positions = torch.cat((pos, torch.zeros(pad, dtype=torch.long)))
    slot_mapping = torch.cat((slot, torch.full((pad,), -1, dtype=torch.long)))
    return positions, slot_mapping


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, _, blocks, _, _ = GEOMETRY[size]
    positions, slot_mapping = _batch_layout(size)
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device, dtype=torch.float32)
    qkv = (qkv * (0.5 + torch.rand(tokens, 1, device=device))).to(torch.bfloat16)   # per-token scale varies
    # trained QK-norm weights: positive, spread around 1, channel dependent
    q_norm_weight = (1 + 0.25 * torch.randn(HEAD_DIM, device=device)).abs().to(torch.bfloat16)
    k_norm_weight = (1 + 0.25 * torch.randn(HEAD_DIM, device=device)).abs().to(torch.bfloat16)
    inv_freq = ROPE_THETA ** (-torch.arange(0, ROTARY_DIM, 2, device=device, dtype=torch.float32) / ROTARY_DIM)
    angles = torch.outer(torch.arange(MAX_POSITION[size], device=device, dtype=torch.float32), inv_freq)
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)
    # the cache already holds other requests' keys and values
    kv_cache = torch.randn(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return [qkv, positions.to(device), q_norm_weight, k_norm_weight, cos_sin_cache, slot_mapping.to(device), kv_cache]
