"""Fused residual add and RMS normalization over the hidden state of Llama 3.1 8B (hidden 4096)."""

import torch

HIDDEN = 4096
EPS = 1e-5
TOKENS = {"full": 14509, "smoke": 64}


@torch.no_grad()
def reference(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert hidden_states.shape[-1] == HIDDEN and residual.shape == hidden_states.shape
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    x = hidden_states.to(wide) + residual.to(wide)
    inv_rms = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
    return (x * inv_rms * weight.to(wide)).to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    n = TOKENS[size]
    hidden_states = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
    residual = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
    # trained RMSNorm weights sit near 1
    weight = (1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=torch.float32)).to(torch.bfloat16)
    return [hidden_states, residual, weight]
