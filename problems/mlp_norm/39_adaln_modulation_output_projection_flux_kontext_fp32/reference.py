"""Final layer of FLUX.1 Kontext: AdaLN shift/scale from the conditioning vector, modulated LayerNorm and output projection to latent patches in fp32."""
# Designed for MetaKernelBench from the public FLUX.1 Kontext [dev] architecture: hidden 3072, final layer =
# SiLU + Linear(3072 -> 2*3072) modulation, affine-free LayerNorm (eps 1e-6), Linear(3072 -> 64) with bias.

import torch

HIDDEN = {"full": 3072, "smoke": 256}
OUT_CHANNELS = 64                       # 16 latent channels x 2x2 patch
# (images, image tokens each): target 64x64 tokens plus the same number of context-image tokens
BATCH = {"full": (2, 8192), "smoke": (2, 33)}
EPS = 1e-6


@torch.no_grad()
def reference(x: torch.Tensor, vec: torch.Tensor, w_mod: torch.Tensor, b_mod: torch.Tensor, w_out: torch.Tensor,
              b_out: torch.Tensor) -> torch.Tensor:
    batch, tokens, hidden = x.shape
    assert vec.shape == (batch, hidden) and w_mod.shape == (2 * hidden, hidden) and b_mod.shape == (2 * hidden,)
    assert w_out.shape == (OUT_CHANNELS, hidden) and b_out.shape == (OUT_CHANNELS,)
    wide = torch.promote_types(x.dtype, torch.float32)
    mod = torch.nn.functional.silu(vec.to(wide)) @ w_mod.to(wide).t() + b_mod.to(wide)   # [B, 2H]
    shift, scale = mod[:, None, :hidden], mod[:, None, hidden:]
    xs = x.to(wide)
    mu = xs.mean(dim=-1, keepdim=True)
    xc = xs - mu
    xhat = xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + EPS)
    y = (1 + scale) * xhat + shift
    out = y @ w_out.to(wide).t() + b_out.to(wide)
    return out.to(x.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden = HIDDEN[size]
    batch, tokens = BATCH[size]
    f32 = torch.float32
    # last-block hidden states: large, per-token varying magnitude and per-channel offsets (DiT outlier channels)
    token_scale = 4 * torch.exp(0.3 * torch.randn(batch, tokens, 1, device=device, dtype=f32))
    channel_offset = 2 * torch.randn(batch, 1, hidden, device=device, dtype=f32)
    x = torch.randn(batch, tokens, hidden, device=device, dtype=f32) * token_scale + channel_offset
    # conditioning vector (timestep + guidance + pooled text embedding), one per image
    vec = torch.randn(batch, hidden, device=device, dtype=f32)
    w_mod = 0.5 * torch.randn(2 * hidden, hidden, device=device, dtype=f32) / hidden ** 0.5
    b_mod = 0.05 * torch.randn(2 * hidden, device=device, dtype=f32)
    w_out = torch.randn(OUT_CHANNELS, hidden, device=device, dtype=f32) / hidden ** 0.5
    b_out = 0.02 * torch.randn(OUT_CHANNELS, device=device, dtype=f32)
    return [x, vec, w_mod, b_mod, w_out, b_out]
