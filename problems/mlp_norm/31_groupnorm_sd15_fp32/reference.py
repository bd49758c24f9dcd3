"""Stable Diffusion 1.5 UNet GroupNorm (32 groups, eps 1e-5) with per-channel affine over NCHW activations, in fp32."""
# Designed for MetaKernelBench from the public Stable Diffusion 1.5 UNet config: norm_num_groups 32, norm_eps 1e-5,
# first-level block width 320 on the 64x64 latent of a 512x512 image; batch of 8 prompts with classifier-free guidance.

import torch
import torch.nn.functional as F

GROUPS = 32
EPS = 1e-5
CHANNELS = 320
# (batch, height, width): 8 images x 2 (conditional and unconditional) on the 64x64 latent grid
SHAPE = {"full": (16, 64, 64), "smoke": (2, 6, 5)}


@torch.no_grad()
def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 4 and x.shape[1] == CHANNELS and weight.shape == bias.shape == (CHANNELS,)
    wide = torch.promote_types(x.dtype, torch.float32)
    # per sample and group of 10 channels: mean and biased variance over the channels and all pixels
    out = F.group_norm(x.to(wide), GROUPS, weight.to(wide), bias.to(wide), EPS)
    return out.to(x.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    batch, height, width = SHAPE[size]
    # conv-block activations: channel-dependent offsets and log-normal scales, plus a per-sample gain
    chan_scale = torch.exp(0.5 * torch.randn(CHANNELS, 1, 1, device=device))
    chan_mean = 0.5 * torch.randn(CHANNELS, 1, 1, device=device) * chan_scale
    gain = 0.5 + torch.rand(batch, 1, 1, 1, device=device)
    x = (torch.randn(batch, CHANNELS, height, width, device=device) * chan_scale + chan_mean) * gain
    weight = 1 + 0.2 * torch.randn(CHANNELS, device=device)
    bias = 0.1 * torch.randn(CHANNELS, device=device)
    return [x, weight, bias]
