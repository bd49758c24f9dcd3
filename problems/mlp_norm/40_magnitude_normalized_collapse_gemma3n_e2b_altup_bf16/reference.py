"""Gemma 3n E2B AltUp collapse: unembed the three alternate streams, rescale each to the main stream's RMS and average all four."""
# Designed for MetaKernelBench from the public Gemma 3n E2B text config: hidden 2048, altup_num_inputs 4
# (one main stream plus three alternate streams, each with a bias-free 2048x2048 unembedding projection).

import torch

HIDDEN = {"full": 2048, "smoke": 192}
STREAMS = 4
TOKENS = {"full": 8192, "smoke": 29}
EPS = 1e-5              # floor on the mean square of a projected stream


@torch.no_grad()
def reference(hidden_states: torch.Tensor, unembed_weights: torch.Tensor) -> torch.Tensor:
    streams, tokens, hidden = hidden_states.shape
    assert streams == STREAMS and unembed_weights.shape == (STREAMS - 1, hidden, hidden)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    main = hidden_states[0].to(wide)
    target = main.square().mean(dim=-1, keepdim=True).sqrt()                          # [T, 1]
    proj = torch.matmul(hidden_states[1:].to(wide), unembed_weights.to(wide).transpose(1, 2))   # [3, T, H]
    mag = proj.square().mean(dim=-1, keepdim=True).clamp_min(EPS).sqrt()
    out = (main + (proj * (target / mag)).sum(dim=0)) / STREAMS
    return out.to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, n = HIDDEN[size], TOKENS[size]
    f32, bf16 = torch.float32, torch.bfloat16
    # every stream has its own per-token magnitude (log-normal), so the rescaling is observable
    scale = torch.exp(0.5 * torch.randn(STREAMS, n, 1, device=device, dtype=f32))
    hidden_states = (torch.randn(STREAMS, n, hidden, device=device, dtype=f32) * scale).to(bf16)
    unembed_weights = (torch.randn(STREAMS - 1, hidden, hidden, device=device, dtype=f32) / hidden ** 0.5).to(bf16)
    return [hidden_states, unembed_weights]
