"""Causal GQA attention scores of Qwen3-14B computed from NVFP4-quantized queries and keys (chunked prefill over a padded batch), returned as scaled logits with -inf at masked positions."""

# Designed for MetaKernelBench from the public Qwen3-14B config (40 query heads, 8 KV heads, head dim 128, QK RMSNorm
# before the quantizer); queries and cached keys are NVFP4 with 16-element blocks along the head dimension.

import math

import torch

SF_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
HEAD_DIM = 128
GQA_GROUP = 5                 # query heads per KV head (40 / 8)
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
BATCH = {"full": 4, "smoke": 2}
KV_HEADS = {"full": 8, "smoke": 1}
QUERY_LEN = {"full": 512, "smoke": 4}        # new tokens per sequence (the chunk being prefilled)
KV_CAPACITY = {"full": 2048, "smoke": 12}    # padded key length; each sequence has its own kv length


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """packed [..., K/2] uint8 (element 2i in the low nibble), block_scale [..., K/16] e4m3, global_scale [1] fp32."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])                     # code bit 3 is the sign
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = table[codes].unflatten(-1, (-1, SF_BLOCK))
    scale = block_scale.to(dtype).unsqueeze(-1) * global_scale.to(dtype)
    return (values * scale).flatten(-2)


@torch.no_grad()
def reference(q_packed: torch.Tensor, q_scale: torch.Tensor, q_global_scale: torch.Tensor, k_packed: torch.Tensor,
              k_scale: torch.Tensor, k_global_scale: torch.Tensor, kv_lens: torch.Tensor,
              sm_scale: float) -> torch.Tensor:
    batch, heads, q_len, _ = q_packed.shape
    _, kv_heads, kv_cap, _ = k_packed.shape
    assert heads == GQA_GROUP * kv_heads and q_packed.shape[-1] * 2 == HEAD_DIM and kv_lens.shape == (batch,)
    wide = torch.promote_types(q_global_scale.dtype, torch.float32)
    q = _dequantize_nvfp4(q_packed, q_scale, q_global_scale, wide)                       # [B, H, Lq, D]
    k = _dequantize_nvfp4(k_packed, k_scale, k_global_scale, wide).repeat_interleave(GQA_GROUP, dim=1)
    scores = (q @ k.transpose(-1, -2)) * sm_scale                                        # [B, H, Lq, Lkv]
    # query i of sequence b sits at position kv_lens[b] - Lq + i and sees keys 0..that position
    q_pos = kv_lens.long().view(batch, 1, 1) - q_len + torch.arange(q_len, device=q.device).view(1, q_len, 1)
    visible = torch.arange(kv_cap, device=q.device).view(1, 1, kv_cap) <= q_pos          # [B, Lq, Lkv]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return scores.to(torch.bfloat16)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code, saturating at 6); returns 4-bit codes, bit 3 = sign."""
    mag = v.abs()
    idx = ((mag > 0.25).long() + (mag >= 0.75).long() + (mag > 1.25).long() + (mag >= 1.75).long()
           + (mag > 2.5).long() + (mag >= 3.5).long() + (mag > 5.0).long())
    return idx | ((v < 0).long() << 3)


def _quantize_nvfp4(x: torch.Tensor):
    """NVFP4 encoder: fp32 global scale = amax / (448 * 6), e4m3 scale per 16 elements, E2M1 codes packed in pairs."""
    global_scale = (x.abs().amax() / (E4M3_MAX * E2M1_MAX)).reshape(1)
    blocks = x.unflatten(-1, (-1, SF_BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    denom = (block_scale.float() * global_scale).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / denom.clamp(min=1e-30), torch.zeros_like(blocks))
    codes = _e2m1_codes(scaled).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, block_scale, global_scale


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    batch, kv_heads, q_len, kv_cap = BATCH[size], KV_HEADS[size], QUERY_LEN[size], KV_CAPACITY[size]
    heads = GQA_GROUP * kv_heads
    # kv lengths between half and all of the padded capacity (at least the chunk itself); one sequence is full
    kv_lens = torch.randint(max(q_len, kv_cap // 2), kv_cap + 1, (batch,), device=device, dtype=torch.int32)
    kv_lens[0] = kv_cap
    # RMS-normalized, rotated q/k: unit rms with a per-dimension gain (the norm weight); keys carry a shared bias
    # direction so that scores have structure across positions
    q = torch.randn(batch, heads, q_len, HEAD_DIM, device=device) * (1 + 0.5 * torch.rand(HEAD_DIM, device=device))
    k = (torch.randn(batch, kv_heads, kv_cap, HEAD_DIM, device=device)
         * (1 + 0.5 * torch.rand(HEAD_DIM, device=device)) + 0.5 * torch.randn(HEAD_DIM, device=device))
    return [*_quantize_nvfp4(q), *_quantize_nvfp4(k), kv_lens, SM_SCALE]
