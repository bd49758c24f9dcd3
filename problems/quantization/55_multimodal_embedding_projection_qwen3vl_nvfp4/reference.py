"""Qwen3-VL vision-to-language merger with NVFP4 weights: LayerNorm over vision patches, 2x2 spatial merge, fc1 + GELU + fc2 projection into the LLM embedding space."""

# Designed for MetaKernelBench from the public Qwen3-VL-8B config (vision hidden 1152, spatial merge 2x2 -> 4608,
# merger MLP 4608 -> 4608 -> 4096 with biases and exact GELU, LayerNorm eps 1e-6) with the merger weights stored
# in NVFP4 (weight-only: activations stay bf16, as an H200 without FP4 tensor cores would serve it).

import torch

SF_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MERGE = 4                    # 2x2 patches per merged token
LN_EPS = 1e-6
TOKENS = {"full": 4096, "smoke": 8}                  # merged (LLM) tokens; patches = 4 x tokens
VISION_HIDDEN = {"full": 1152, "smoke": 32}
OUT_HIDDEN = {"full": 4096, "smoke": 96}


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
def reference(patch_embeds: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
              fc1_weight: torch.Tensor, fc1_weight_scale: torch.Tensor, fc1_weight_global_scale: torch.Tensor,
              fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_weight_scale: torch.Tensor,
              fc2_weight_global_scale: torch.Tensor, fc2_bias: torch.Tensor) -> torch.Tensor:
    patches, vision_hidden = patch_embeds.shape
    merged = vision_hidden * MERGE
    assert patches % MERGE == 0 and fc1_weight.shape == (merged, merged // 2)
    assert fc2_weight.shape[1] == merged // 2
    wide = torch.promote_types(patch_embeds.dtype, torch.float32)
    x = torch.nn.functional.layer_norm(patch_embeds.to(wide), (vision_hidden,), ln_weight.to(wide),
                                       ln_bias.to(wide), LN_EPS)
    x = x.view(patches // MERGE, merged)                 # the 4 patches of a 2x2 window are consecutive rows
    w1 = _dequantize_nvfp4(fc1_weight, fc1_weight_scale, fc1_weight_global_scale, wide)
    h = torch.nn.functional.gelu(x @ w1.t() + fc1_bias.to(wide))
    w2 = _dequantize_nvfp4(fc2_weight, fc2_weight_scale, fc2_weight_global_scale, wide)
    return (h @ w2.t() + fc2_bias.to(wide)).to(patch_embeds.dtype)


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
    tokens, vision_hidden, out_hidden = TOKENS[size], VISION_HIDDEN[size], OUT_HIDDEN[size]
    merged = vision_hidden * MERGE
    patch_embeds = (torch.randn(tokens * MERGE, vision_hidden, device=device)
                    * (1 + torch.rand(tokens * MERGE, 1, device=device))
                    + 0.5 * torch.randn(vision_hidden, device=device)).to(torch.bfloat16)
    ln_weight = (1 + 0.1 * torch.randn(vision_hidden, device=device)).to(torch.bfloat16)
    ln_bias = (0.05 * torch.randn(vision_hidden, device=device)).to(torch.bfloat16)
    # weights with per-output-row magnitude spread, so block scales vary
    w1 = torch.randn(merged, merged, device=device) * torch.exp(0.3 * torch.randn(merged, 1, device=device))
    fc1 = _quantize_nvfp4(w1 / merged ** 0.5)
    fc1_bias = (0.1 * torch.randn(merged, device=device)).to(torch.bfloat16)
    w2 = torch.randn(out_hidden, merged, device=device) * torch.exp(0.3 * torch.randn(out_hidden, 1, device=device))
    fc2 = _quantize_nvfp4(w2 / merged ** 0.5)
    fc2_bias = (0.1 * torch.randn(out_hidden, device=device)).to(torch.bfloat16)
    return [patch_embeds, ln_weight, ln_bias, *fc1, fc1_bias, *fc2, fc2_bias]
