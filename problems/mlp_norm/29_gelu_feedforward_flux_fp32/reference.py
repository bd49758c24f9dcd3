"""FLUX.1 transformer-block feed-forward over the image tokens of a 1024x1024 generation: linear 3072->12288, tanh-approximate GELU, linear 12288->3072, in fp32."""
# Designed for MetaKernelBench from the public FLUX.1 [dev] transformer config: inner dim 3072 (24 heads x 128), mlp_ratio 4,
# feed-forward = Linear(3072, 12288) -> GELU(approximate="tanh") -> Linear(12288, 3072), both with bias; 4096 image tokens.

import torch
import torch.nn.functional as F

HIDDEN = {"full": 3072, "smoke": 128}
MLP_RATIO = 4
# (batch, tokens): a 1024x1024 image is a 128x128 latent, packed into 2x2 patches -> 64 x 64 = 4096 tokens
SHAPE = {"full": (1, 4096), "smoke": (1, 40)}


@torch.no_grad()
def reference(hidden_states: torch.Tensor, w_in: torch.Tensor, b_in: torch.Tensor, w_out: torch.Tensor,
              b_out: torch.Tensor) -> torch.Tensor:
    hidden = hidden_states.shape[-1]
    assert w_in.shape == (MLP_RATIO * hidden, hidden) and w_out.shape == (hidden, MLP_RATIO * hidden)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    h = F.gelu(hidden_states.to(wide) @ w_in.to(wide).t() + b_in.to(wide), approximate="tanh")
    out = h @ w_out.to(wide).t() + b_out.to(wide)
    return out.to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden = HIDDEN[size]
    inner = MLP_RATIO * hidden
    batch, tokens = SHAPE[size]
    # the block feeds its feed-forward a LayerNorm output modulated by AdaLN: (1 + scale) * norm(x) + shift,
    # with per-channel scale and shift from the timestep/text conditioning
    scale = 0.5 * torch.randn(hidden, device=device)
    shift = 0.3 * torch.randn(hidden, device=device)
    hidden_states = torch.randn(batch, tokens, hidden, device=device) * (1 + scale) + shift
    w_in = torch.randn(inner, hidden, device=device) / hidden ** 0.5
    b_in = 0.05 * torch.randn(inner, device=device)
    w_out = torch.randn(hidden, inner, device=device) / inner ** 0.5
    b_out = 0.05 * torch.randn(hidden, device=device)
    return [hidden_states, w_in, b_in, w_out, b_out]
