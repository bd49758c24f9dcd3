"""NVFP4 W4A4 attention output projection of Llama-3.3-Nemotron-Super-49B with the residual add: NVFP4 attention output times NVFP4 weight, plus the bf16 residual stream."""

# Designed for MetaKernelBench from the public Llama-3.3-Nemotron-Super-49B config (hidden 8192, 64 query heads x
# head dim 128 = 8192 attention channels); both operands are NVFP4 as in NVFP4 W4A4 checkpoints, the activation
# quantized by the attention kernel's epilogue. An H200 has no FP4 tensor cores, so both must be dequantized.

import math

import torch

SF_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
TOKENS = {"full": 4096, "smoke": 16}
IN_FEATURES = {"full": 8192, "smoke": 128}
OUT_FEATURES = {"full": 8192, "smoke": 96}


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """packed [N, K/2] uint8 (element 2i in the low nibble), block_scale [N, K/16] e4m3, global_scale [1] fp32."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])                     # code bit 3 is the sign
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = table[codes].unflatten(-1, (-1, SF_BLOCK))
    scale = block_scale.to(dtype).unsqueeze(-1) * global_scale.to(dtype)
    return (values * scale).flatten(-2)


@torch.no_grad()
def reference(attn_packed: torch.Tensor, attn_scale: torch.Tensor, attn_global_scale: torch.Tensor,
              weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
              residual: torch.Tensor) -> torch.Tensor:
    tokens, half_in = attn_packed.shape
    out_features = weight_packed.shape[0]
    assert weight_packed.shape == (out_features, half_in) and residual.shape == (tokens, out_features)
    wide = torch.promote_types(residual.dtype, torch.float32)
    a = _dequantize_nvfp4(attn_packed, attn_scale, attn_global_scale, wide)
    w = _dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, wide)
    return (residual.to(wide) + a @ w.t()).to(residual.dtype)


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
    tokens, in_features, out_features = TOKENS[size], IN_FEATURES[size], OUT_FEATURES[size]
    # attention outputs: per-head scale (heads of 128 channels) and per-token spread
    heads = max(in_features // 128, 1)
    head_gain = torch.exp(0.4 * torch.randn(heads, device=device)).repeat_interleave(in_features // heads)
    attn = torch.randn(tokens, in_features, device=device) * head_gain * torch.exp(
        0.3 * torch.randn(tokens, 1, device=device))
    weight = torch.randn(out_features, in_features, device=device) / math.sqrt(in_features)
    residual = (2.0 * torch.randn(tokens, out_features, device=device)).to(torch.bfloat16)
    return [*_quantize_nvfp4(attn), *_quantize_nvfp4(weight), residual]
