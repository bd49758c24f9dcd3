"""Backward pass of the fused residual add and RMS normalization of a Qwen3 4B decoder layer (hidden 2560)."""
# Designed for MetaKernelBench from the public Qwen3-4B config: hidden 2560, rms_norm_eps 1e-6, pre-norm
# residual layout; one training micro-batch of 16384 tokens.

import torch

HIDDEN = {"full": 2560, "smoke": 2560}
TOKENS = {"full": 16384, "smoke": 24}
EPS = 1e-6


@torch.no_grad()
def reference(dy: torch.Tensor, d_residual: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    assert dy.shape == x.shape and d_residual.shape == x.shape and residual.shape == x.shape
    assert weight.shape == (hidden,)
    wide = torch.promote_types(x.dtype, torch.float32)
    s = x.to(wide) + residual.to(wide)                         # forward: s = x + residual, y = s * rstd * w
    rstd = torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + EPS)
    shat = s * rstd
    g = dy.to(wide)
    d_weight = (g * shat).sum(dim=0)
    gw = g * weight.to(wide)
    ds = d_residual.to(wide) + rstd * (gw - shat * (gw * shat).mean(dim=-1, keepdim=True))
    return ds.to(x.dtype), d_weight.to(weight.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, n = HIDDEN[size], TOKENS[size]
    f32, bf16 = torch.float32, torch.bfloat16
    dy = torch.randn(n, hidden, device=device, dtype=f32).to(bf16)
    d_residual = torch.randn(n, hidden, device=device, dtype=f32).to(bf16)
    # sub-layer output and a residual stream whose per-token magnitude varies (0.5x to 2x)
    x = (0.5 * torch.randn(n, hidden, device=device, dtype=f32)).to(bf16)
    row_scale = torch.exp(0.7 * (2 * torch.rand(n, 1, device=device, dtype=f32) - 1))
    residual = (torch.randn(n, hidden, device=device, dtype=f32) * row_scale).to(bf16)
    weight = (1 + 0.1 * torch.randn(hidden, device=device, dtype=f32)).to(bf16)
    return [dy, d_residual, x, residual, weight]
