"""RMS normalization of flattened per-head query/key rows (head dim 128) from Qwen3 30B A3B."""

import torch

HIDDEN = 128
EPS = 1e-6
ROWS = {"full": 520128, "smoke": 256}


@torch.no_grad()
def reference(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert hidden_states.shape[-1] == HIDDEN
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    x = hidden_states.to(wide)
    inv_rms = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
    return (x * inv_rms * weight.to(wide)).to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    n = ROWS[size]
    hidden_states = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=torch.float32)).to(torch.bfloat16)
    return [hidden_states, weight]
