"""Residual add, RMS normalization and SwiGLU MLP of a Hermes 3 (Llama 3.1 8B) decoder layer over one prefill batch."""
# Designed for MetaKernelBench from the public Hermes-3-Llama-3.1-8B config (Llama 3.1 8B architecture):
# hidden 4096, intermediate 14336, RMSNorm eps 1e-5, bias-free SiLU-gated MLP.

import torch

HIDDEN = {"full": 4096, "smoke": 256}
INTERMEDIATE = {"full": 14336, "smoke": 512}
# tokens of one chunked-prefill step (prefill chunks plus decode tokens)
TOKENS = {"full": 4033, "smoke": 37}
EPS = 1e-5


@torch.no_grad()
def reference(hidden_states: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
              w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = hidden_states.shape[-1]
    inter = w_down.shape[1]
    assert residual.shape == hidden_states.shape and norm_weight.shape == (hidden,)
    assert w_gate_up.shape == (2 * inter, hidden) and w_down.shape == (hidden, inter)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    s = hidden_states.to(wide) + residual.to(wide)                     # new residual stream
    normed = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + EPS) * norm_weight.to(wide)
    gate_up = normed @ w_gate_up.to(wide).t()
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = act @ w_down.to(wide).t()
    return out.to(hidden_states.dtype), s.to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, inter, n = HIDDEN[size], INTERMEDIATE[size], TOKENS[size]
    f32, bf16 = torch.float32, torch.bfloat16
    # attention output, and a residual stream whose per-token magnitude varies (0.5x to 2x)
    hidden_states = (0.5 * torch.randn(n, hidden, device=device, dtype=f32)).to(bf16)
    row_scale = torch.exp(0.7 * (2 * torch.rand(n, 1, device=device, dtype=f32) - 1))
    residual = (torch.randn(n, hidden, device=device, dtype=f32) * row_scale).to(bf16)
    norm_weight = (1 + 0.1 * torch.randn(hidden, device=device, dtype=f32)).to(bf16)
    w_gate_up = (torch.randn(2 * inter, hidden, device=device, dtype=f32) / hidden ** 0.5).to(bf16)
    w_down = (torch.randn(hidden, inter, device=device, dtype=f32) / inter ** 0.5).to(bf16)
    return [hidden_states, residual, norm_weight, w_gate_up, w_down]
