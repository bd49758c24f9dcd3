"""FP8 fused gate/up projection of the Qwen3-VL 8B MLP with SiLU gating: per-token-scaled FP8 activations times 128x128 block-scaled FP8 weights, output silu(gate) * up."""

# Designed for MetaKernelBench from the public Qwen3-VL-8B text config (hidden 4096, MLP intermediate 12288) and its
# FP8 release format (e4m3 weights with 128x128 block scales); the activations arrive already quantized with one
# scale per token by the preceding fused RMSNorm + quantization kernel.

import math

import torch

BLOCK = 128
FP8_MAX = 448.0
TOKENS = {"full": 4096, "smoke": 24}
HIDDEN = {"full": 4096, "smoke": 256}
INTERMEDIATE = {"full": 12288, "smoke": 256}


def _dequant_weight(q: torch.Tensor, scale: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    s = scale.to(wide).repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.to(wide) * s


@torch.no_grad()
def reference(x_fp8: torch.Tensor, x_scale: torch.Tensor, gate_up_weight: torch.Tensor,
              gate_up_weight_scale: torch.Tensor) -> torch.Tensor:
    tokens, hidden = x_fp8.shape
    two_inter = gate_up_weight.shape[0]
    inter = two_inter // 2
    assert x_scale.shape == (tokens, 1) and gate_up_weight.shape == (two_inter, hidden)
    assert gate_up_weight_scale.shape == (two_inter // BLOCK, hidden // BLOCK)
    wide = torch.promote_types(x_scale.dtype, torch.float32)
    x = x_fp8.to(wide) * x_scale.to(wide)
    h = x @ _dequant_weight(gate_up_weight, gate_up_weight_scale, wide).t()     # gate rows first, then up rows
    return (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, inter = TOKENS[size], HIDDEN[size], INTERMEDIATE[size]
    # post-RMSNorm activations: unit scale with a few outlier channels (the weight of the norm)
    channel_gain = 1 + 0.2 * torch.randn(hidden, device=device)
    channel_gain[torch.randperm(hidden, device=device)[:hidden // 256]] *= 8
    x = torch.randn(tokens, hidden, device=device) * channel_gain
    x_scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    x_fp8 = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    w = torch.randn(2 * inter, hidden, device=device) / math.sqrt(hidden)
    blocks = w.view(2 * inter // BLOCK, BLOCK, hidden // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    weight = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return [x_fp8, x_scale, weight.view(2 * inter, hidden), scale]
