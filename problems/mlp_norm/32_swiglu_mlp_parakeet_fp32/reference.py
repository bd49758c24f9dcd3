"""SwiGLU feed-forward (fused gate-up projection, SiLU gating, down projection) at Parakeet FastConformer geometry in fp32."""
# Designed for MetaKernelBench from the public Parakeet (FastConformer XL) encoder config: d_model 1024,
# feed-forward expansion 4 (4096), biased linears; the feed-forward is taken in its gated (SwiGLU) form.

import torch

HIDDEN = {"full": 1024, "smoke": 128}
INTERMEDIATE = {"full": 4096, "smoke": 384}
# (utterances, encoder frames each): 8 utterances of 60 s at 80 ms per frame after 8x subsampling
BATCH = {"full": (8, 750), "smoke": (2, 19)}


@torch.no_grad()
def reference(x: torch.Tensor, w_gate_up: torch.Tensor, b_gate_up: torch.Tensor, w_down: torch.Tensor,
              b_down: torch.Tensor) -> torch.Tensor:
    hidden = x.shape[-1]
    inter = w_down.shape[1]
    assert w_gate_up.shape == (2 * inter, hidden) and b_gate_up.shape == (2 * inter,)
    assert w_down.shape == (hidden, inter) and b_down.shape == (hidden,)
    wide = torch.promote_types(x.dtype, torch.float32)
    gate_up = x.to(wide) @ w_gate_up.to(wide).t() + b_gate_up.to(wide)      # [..., 2I]
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    act = torch.nn.functional.silu(gate) * up
    out = act @ w_down.to(wide).t() + b_down.to(wide)
    return out.to(x.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, inter = HIDDEN[size], INTERMEDIATE[size]
    batch, frames = BATCH[size]
    # the module input is layer-normalized, so unit-scale activations
    x = torch.randn(batch, frames, hidden, device=device, dtype=torch.float32)
    # trained-scale projections (std 1/sqrt(fan_in)) with small biases
    w_gate_up = torch.randn(2 * inter, hidden, device=device, dtype=torch.float32) / hidden ** 0.5
    b_gate_up = 0.05 * torch.randn(2 * inter, device=device, dtype=torch.float32)
    w_down = torch.randn(hidden, inter, device=device, dtype=torch.float32) / inter ** 0.5
    b_down = 0.05 * torch.randn(hidden, device=device, dtype=torch.float32)
    return [x, w_gate_up, b_gate_up, w_down, b_down]
