"""Backward pass of the post-LayerNorm residual GELU feed-forward block of Kokoro's PL-BERT (ALBERT) text encoder in fp32."""
# Designed for MetaKernelBench from the public Kokoro-82M config (plbert: hidden 768, intermediate 2048,
# max positions 512) and the ALBERT layer it instantiates (gelu_new = tanh GELU, LayerNorm eps 1e-12).

import math

import torch

HIDDEN = {"full": 768, "smoke": 96}
INTERMEDIATE = {"full": 2048, "smoke": 256}
# (sequences, phoneme positions each)
BATCH = {"full": (16, 512), "smoke": (2, 23)}
EPS = 1e-12
GELU_C = math.sqrt(2.0 / math.pi)


@torch.no_grad()
def reference(dy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
              b2: torch.Tensor, ln_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hidden = x.shape[-1]
    inter = w1.shape[0]
    assert dy.shape == x.shape and w1.shape == (inter, hidden) and w2.shape == (hidden, inter)
    assert b1.shape == (inter,) and b2.shape == (hidden,) and ln_weight.shape == (hidden,)
    wide = torch.promote_types(x.dtype, torch.float32)
    xs = x.reshape(-1, hidden).to(wide)
    g = dy.reshape(-1, hidden).to(wide)
    W1, W2, gamma = w1.to(wide), w2.to(wide), ln_weight.to(wide)
    # forward recomputation: h = x W1^T + b1, a = gelu_tanh(h), z = x + a W2^T + b2, y = LN(z)
    h = xs @ W1.t() + b1.to(wide)
    t = torch.tanh(GELU_C * (h + 0.044715 * h.pow(3)))
    a = 0.5 * h * (1 + t)
    z = xs + a @ W2.t() + b2.to(wide)
    mu = z.mean(dim=-1, keepdim=True)
    zc = z - mu
    rstd = torch.rsqrt(zc.square().mean(dim=-1, keepdim=True) + EPS)
    zhat = zc * rstd
    # LayerNorm backward
    d_ln_weight = (g * zhat).sum(dim=0)
    d_ln_bias = g.sum(dim=0)
    gg = g * gamma
    dz = rstd * (gg - gg.mean(dim=-1, keepdim=True) - zhat * (gg * zhat).mean(dim=-1, keepdim=True))
    # feed-forward backward; dz also flows straight to x through the residual
    db2 = dz.sum(dim=0)
    dw2 = dz.t() @ a
    da = dz @ W2
    dgelu = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * h * h)
    dh = da * dgelu
    db1 = dh.sum(dim=0)
    dw1 = dh.t() @ xs
    dx = dz + dh @ W1
    out = (dx.reshape(x.shape), dw1, db1, dw2, db2, d_ln_weight, d_ln_bias)
    return tuple(o.to(x.dtype) for o in out)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, inter = HIDDEN[size], INTERMEDIATE[size]
    batch, length = BATCH[size]
    f32 = torch.float32
    dy = torch.randn(batch, length, hidden, device=device, dtype=f32)
    # block input: the attention sub-layer's (layer-normalized) output
    x = torch.randn(batch, length, hidden, device=device, dtype=f32)
    w1 = torch.randn(inter, hidden, device=device, dtype=f32) / hidden ** 0.5
    b1 = 0.05 * torch.randn(inter, device=device, dtype=f32)
    w2 = torch.randn(hidden, inter, device=device, dtype=f32) / inter ** 0.5
    b2 = 0.05 * torch.randn(hidden, device=device, dtype=f32)
    ln_weight = 1 + 0.1 * torch.randn(hidden, device=device, dtype=f32)
    return [dy, x, w1, b1, w2, b2, ln_weight]
