"""Qwen3-Omni vision patch merger: LayerNorm each vision patch, concatenate every 2x2 spatial group of patches, then a GELU MLP projects it to the language model width."""
# Designed for MetaKernelBench from the public Qwen3-Omni-30B-A3B vision config: hidden 1152, spatial_merge_size 2,
# out_hidden_size 2048; merger = LayerNorm(1152, eps 1e-6) -> view 4608 -> Linear 4608->4608 -> GELU(erf) -> Linear 4608->2048.

import torch
import torch.nn.functional as F

MERGE = 4                                            # spatial_merge_size ** 2 patches per merged token
VISION_HIDDEN = {"full": 1152, "smoke": 64}
OUT_HIDDEN = {"full": 2048, "smoke": 96}
# patches of a 32-frame 512x512 video: 16 temporal patches x 32 x 32 spatial patches
PATCHES = {"full": 16384, "smoke": 64}
EPS = 1e-6


@torch.no_grad()
def reference(hidden_states: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
              fc1_weight: torch.Tensor, fc1_bias: torch.Tensor, fc2_weight: torch.Tensor,
              fc2_bias: torch.Tensor) -> torch.Tensor:
    patches, hidden = hidden_states.shape
    assert patches % MERGE == 0 and fc1_weight.shape == (MERGE * hidden, MERGE * hidden)
    assert fc2_weight.shape[1] == MERGE * hidden
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    x = F.layer_norm(hidden_states.to(wide), (hidden,), norm_weight.to(wide), norm_bias.to(wide), EPS)
    # patches arrive in merge-window order: rows 4m..4m+3 are the 2x2 group of merged token m
    x = x.reshape(patches // MERGE, MERGE * hidden)
    h = F.gelu(x @ fc1_weight.to(wide).t() + fc1_bias.to(wide))
    out = h @ fc2_weight.to(wide).t() + fc2_bias.to(wide)
    return out.to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, out_hidden, patches = VISION_HIDDEN[size], OUT_HIDDEN[size], PATCHES[size]
    merged = MERGE * hidden
    # final ViT residual stream: channel-dependent offsets and scales, a few large-magnitude channels
    chan_scale = torch.exp(0.5 * torch.randn(hidden, device=device))
    chan_scale = torch.where(torch.rand(hidden, device=device) < 0.01, 10.0 * chan_scale, chan_scale)
    chan_mean = 0.5 * torch.randn(hidden, device=device)
    hidden_states = (torch.randn(patches, hidden, device=device) * chan_scale + chan_mean).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    norm_bias = (0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    fc1_weight = (torch.randn(merged, merged, device=device) / merged ** 0.5).to(torch.bfloat16)
    fc1_bias = (0.02 * torch.randn(merged, device=device)).to(torch.bfloat16)
    fc2_weight = (torch.randn(out_hidden, merged, device=device) / merged ** 0.5).to(torch.bfloat16)
    fc2_bias = (0.02 * torch.randn(out_hidden, device=device)).to(torch.bfloat16)
    return [hidden_states, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias]
