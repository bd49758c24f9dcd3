"""Self-attention block with NVFP4 weights for a 64-head GQA decoder (hidden 8192): fused QKV projection, rotary embedding, causal attention, output projection."""

# Designed for MetaKernelBench for the Nova attention block named by the original benchmark, using a 70B-class
# dense-decoder geometry (hidden 8192, 64 query heads, 8 KV heads, head dim 128, rotary theta 500000); weights are
# NVFP4 (weight-only: activations stay bf16 on an H200, which has no FP4 tensor cores). Prefill of 4 x 1024 tokens.

import math

import torch

SF_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
HEAD_DIM = 128
GQA_GROUP = 8                 # query heads per KV head
ROPE_THETA = 500000.0
BATCH = {"full": 4, "smoke": 2}
SEQ_LEN = {"full": 1024, "smoke": 12}
HIDDEN = {"full": 8192, "smoke": 256}
KV_HEADS = {"full": 8, "smoke": 1}


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """packed [N, K/2] uint8 (element 2i in the low nibble), block_scale [N, K/16] e4m3, global_scale [1] fp32."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])                     # code bit 3 is the sign
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = table[codes].unflatten(-1, (-1, SF_BLOCK))
    scale = block_scale.to(dtype).unsqueeze(-1) * global_scale.to(dtype)
    return (values * scale).flatten(-2)


def _rope(x: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """Rotate-half rotary embedding over the full head dim; x [B, heads, S, D], positions 0..S-1."""
    seq = x.shape[2]
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=x.device, dtype=wide) / HEAD_DIM)
    angles = torch.arange(seq, device=x.device, dtype=wide).unsqueeze(1) * inv_freq
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)
    x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@torch.no_grad()
def reference(hidden_states: torch.Tensor, qkv_weight: torch.Tensor, qkv_weight_scale: torch.Tensor,
              qkv_weight_global_scale: torch.Tensor, o_weight: torch.Tensor, o_weight_scale: torch.Tensor,
              o_weight_global_scale: torch.Tensor) -> torch.Tensor:
    batch, seq, hidden = hidden_states.shape
    q_features = o_weight.shape[1] * 2
    kv_features = (qkv_weight.shape[0] - q_features) // 2
    heads, kv_heads = q_features // HEAD_DIM, kv_features // HEAD_DIM
    assert heads == GQA_GROUP * kv_heads and qkv_weight.shape[1] * 2 == hidden and o_weight.shape[0] == hidden
    wide = torch.promote_types(hidden_states.dtype, torch.float32)

    x = hidden_states.to(wide).view(batch * seq, hidden)
    qkv = x @ _dequantize_nvfp4(qkv_weight, qkv_weight_scale, qkv_weight_global_scale, wide).t()
    q, k, v = qkv.split([q_features, kv_features, kv_features], dim=1)
    q = _rope(q.view(batch, seq, heads, HEAD_DIM).transpose(1, 2), wide)
    k = _rope(k.view(batch, seq, kv_heads, HEAD_DIM).transpose(1, 2), wide)
    v = v.view(batch, seq, kv_heads, HEAD_DIM).transpose(1, 2)
    k = k.repeat_interleave(GQA_GROUP, dim=1)
    v = v.repeat_interleave(GQA_GROUP, dim=1)

    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
    attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v      # [B, heads, S, D]
    attn = attn.transpose(1, 2).reshape(batch * seq, q_features)
    out = attn @ _dequantize_nvfp4(o_weight, o_weight_scale, o_weight_global_scale, wide).t()
    return out.view(batch, seq, hidden).to(hidden_states.dtype)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code, saturating at 6); returns 4-bit codes, bit 3 = sign."""
    mag = v.abs()
    idx = ((mag > 0.25).long() + (mag >= 0.75).long() + (mag > 1.25).long() + (mag >= 1.75).long()
           + (mag > 2.5).long() + (mag >= 3.5).long() + (mag > 5.0).long())
    return idx | ((v < 0).long() << 3)


def _quantize_nvfp4(w: torch.Tensor):
    """NVFP4 encoder: fp32 global scale = amax / (448 * 6), e4m3 scale per 16 elements, E2M1 codes packed in pairs."""
    global_scale = (w.abs().amax() / (E4M3_MAX * E2M1_MAX)).reshape(1)
    blocks = w.unflatten(-1, (-1, SF_BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    denom = (block_scale.float() * global_scale).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / denom.clamp(min=1e-30), torch.zeros_like(blocks))
    codes = _e2m1_codes(scaled).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, block_scale, global_scale


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    batch, seq, hidden, kv_heads = BATCH[size], SEQ_LEN[size], HIDDEN[size], KV_HEADS[size]
    q_features = GQA_GROUP * kv_heads * HEAD_DIM
    kv_features = kv_heads * HEAD_DIM
    # post-RMSNorm hidden states with per-channel gain
    gain = 1 + 0.2 * torch.randn(hidden, device=device)
    hidden_states = (torch.randn(batch, seq, hidden, device=device) * gain).to(torch.bfloat16)
    # q/k rows scaled up a little so attention is peaked enough for positions to matter
    w_qkv = torch.randn(q_features + 2 * kv_features, hidden, device=device) / math.sqrt(hidden)
    w_qkv[:q_features + kv_features] *= 2.0
    qkv = _quantize_nvfp4(w_qkv)
    o = _quantize_nvfp4(torch.randn(hidden, q_features, device=device) / math.sqrt(q_features))
    return [hidden_states, *qkv, *o]
