"""Per-head RMS normalization of the fused Q/K/V projection in the Gemma 3n E4B audio encoder (8 heads of 192), split into q, k, v in fp32."""
# Designed for MetaKernelBench from the public Gemma 3n E4B audio-encoder config: hidden 1536, 8 attention
# heads (head dim 192), ~25 encoder frames per second; Gemma 3n-style q/k norms with a learned scale and a
# scale-free v norm, eps 1e-6.

import torch

HEADS = 8
HEAD_DIM = {"full": 192, "smoke": 192}
# (clips, encoder frames each): 16 clips of 30 s at 40 ms per frame
BATCH = {"full": (16, 750), "smoke": (2, 13)}
EPS = 1e-6


@torch.no_grad()
def reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    batch, frames, width = qkv.shape
    head_dim = q_weight.shape[0]
    assert width == 3 * HEADS * head_dim and k_weight.shape == (head_dim,)
    wide = torch.promote_types(qkv.dtype, torch.float32)
    x = qkv.to(wide).reshape(batch, frames, 3, HEADS, head_dim)
    xhat = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
    q = xhat[:, :, 0] * q_weight.to(wide)
    k = xhat[:, :, 1] * k_weight.to(wide)
    v = xhat[:, :, 2]                                                   # no learned scale on v
    return tuple(t.contiguous().to(qkv.dtype) for t in (q, k, v))


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    head_dim = HEAD_DIM[size]
    batch, frames = BATCH[size]
    f32 = torch.float32
    # projection output with a per-(frame, q/k/v, head) magnitude, so each head's normalization is observable
    scale = torch.exp(0.5 * torch.randn(batch, frames, 3, HEADS, 1, device=device, dtype=f32))
    qkv = (torch.randn(batch, frames, 3, HEADS, head_dim, device=device, dtype=f32) * scale).reshape(
        batch, frames, 3 * HEADS * head_dim)
    q_weight = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=f32)
    k_weight = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=f32)
    return [qkv, q_weight, k_weight]
