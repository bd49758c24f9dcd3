"""Backward pass of the SwiGLU MLP of a Hermes 3 (Llama 3.1 8B) layer: input gradient and both weight gradients."""
# Designed for MetaKernelBench from the public Hermes-3-Llama-3.1-8B config (Llama 3.1 8B architecture):
# hidden 4096, intermediate 14336, bias-free SiLU-gated MLP; one training micro-batch of 4096 tokens.

import torch

HIDDEN = {"full": 4096, "smoke": 256}
INTERMEDIATE = {"full": 14336, "smoke": 512}
TOKENS = {"full": 4096, "smoke": 48}


@torch.no_grad()
def reference(dout: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, hidden = x.shape
    inter = w_down.shape[1]
    assert dout.shape == x.shape and gate_up.shape == (tokens, 2 * inter)
    assert w_gate_up.shape == (2 * inter, hidden) and w_down.shape == (hidden, inter)
    wide = torch.promote_types(x.dtype, torch.float32)
    dy = dout.to(wide)
    g, u = gate_up[:, :inter].to(wide), gate_up[:, inter:].to(wide)
    sig = torch.sigmoid(g)
    silu = g * sig
    act = silu * u                                            # forward activation, recomputed from the saved gate_up
    d_act = dy @ w_down.to(wide)                              # [T, I]
    dw_down = dy.t() @ act                                    # [H, I]
    d_gate = d_act * u * sig * (1 + g * (1 - sig))            # silu'(g) = sig * (1 + g * (1 - sig))
    d_up = d_act * silu
    d_gate_up = torch.cat((d_gate, d_up), dim=1)              # [T, 2I]
    dw_gate_up = d_gate_up.t() @ x.to(wide)                   # [2I, H]
    dx = d_gate_up @ w_gate_up.to(wide)                       # [T, H]
    return dx.to(x.dtype), dw_gate_up.to(w_gate_up.dtype), dw_down.to(w_down.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, inter, n = HIDDEN[size], INTERMEDIATE[size], TOKENS[size]
    f32, bf16 = torch.float32, torch.bfloat16
    dout = (0.01 * torch.randn(n, hidden, device=device, dtype=f32)).to(bf16)
    # saved MLP input (post-RMSNorm activations)
    x = torch.randn(n, hidden, device=device, dtype=f32).to(bf16)
    # saved gate/up projections; drawn with the statistics of x @ w_gate_up^T (unit variance) rather than
    # recomputed, so the backward must use the saved tensor as given
    gate_up = torch.randn(n, 2 * inter, device=device, dtype=f32).to(bf16)
    w_gate_up = (torch.randn(2 * inter, hidden, device=device, dtype=f32) / hidden ** 0.5).to(bf16)
    w_down = (torch.randn(hidden, inter, device=device, dtype=f32) / inter ** 0.5).to(bf16)
    return [dout, x, gate_up, w_gate_up, w_down]
