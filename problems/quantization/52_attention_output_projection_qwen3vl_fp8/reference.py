"""FP8 attention output projection of Qwen3-VL 32B: dynamic per-token-group (1x128) FP8 quantization of the attention output, then a GEMM with 128x128 block-scaled FP8 weights."""

# Designed for MetaKernelBench from the public Qwen3-VL-32B text config (64 heads x head dim 128 = 8192 attention
# channels, hidden 5120) and its FP8 release format (e4m3 weights with 128x128 block scales, dynamic activations).

import math

import torch

BLOCK = 128
FP8_MAX = 448.0
TOKENS = {"full": 8192, "smoke": 32}
IN_FEATURES = {"full": 8192, "smoke": 256}      # num_heads * head_dim
OUT_FEATURES = {"full": 5120, "smoke": 384}     # hidden size


def _dequant_weight(q: torch.Tensor, scale: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    s = scale.to(wide).repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.to(wide) * s


@torch.no_grad()
def reference(attn_output: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    tokens, in_features = attn_output.shape
    out_features = weight.shape[0]
    assert weight.shape == (out_features, in_features) and in_features % BLOCK == 0 and out_features % BLOCK == 0
    assert weight_scale.shape == (out_features // BLOCK, in_features // BLOCK)
    wide = torch.promote_types(attn_output.dtype, torch.float32)

    # dynamic activation quantization: one scale per (token, 128 channels) = group amax / 448, values rounded to
    # e4m3 (round to nearest even)
    groups = attn_output.to(wide).view(tokens, in_features // BLOCK, BLOCK)
    act_scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    act_q = (groups / act_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    act = (act_q.to(wide) * act_scale).view(tokens, in_features)

    out = act @ _dequant_weight(weight, weight_scale, wide).t()
    return out.to(attn_output.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, in_features, out_features = TOKENS[size], IN_FEATURES[size], OUT_FEATURES[size]
    # attention outputs: per-head magnitude differences and per-token spread
    head_scale = torch.exp(0.4 * torch.randn(in_features // 128, 1, device=device)).repeat_interleave(128, 0).t()
    attn_output = (torch.randn(tokens, in_features, device=device) * head_scale
                   * torch.exp(0.3 * torch.randn(tokens, 1, device=device))).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, device=device) / math.sqrt(in_features)
    blocks = w.view(out_features // BLOCK, BLOCK, in_features // BLOCK, BLOCK)
    weight_scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    weight = (blocks / weight_scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return [attn_output, weight.view(out_features, in_features), weight_scale]
