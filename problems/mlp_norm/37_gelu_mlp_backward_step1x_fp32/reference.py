"""Backward pass of the tanh-GELU MLP of a Step1X-Edit DiT image stream: input, weight and bias gradients in fp32."""
# Designed for MetaKernelBench from the public Step1X-Edit DiT parameters (FLUX-style MMDiT): hidden 3072,
# mlp_ratio 4 (12288), biased linears with tanh-approximated GELU; one 1024x1024 image = 4096 latent tokens.

import math

import torch

HIDDEN = {"full": 3072, "smoke": 128}
INTERMEDIATE = {"full": 12288, "smoke": 512}
TOKENS = {"full": 4096, "smoke": 40}
GELU_C = math.sqrt(2.0 / math.pi)


@torch.no_grad()
def reference(dout: torch.Tensor, x: torch.Tensor, h: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    tokens, hidden = x.shape
    inter = w1.shape[0]
    assert dout.shape == x.shape and h.shape == (tokens, inter)
    assert w1.shape == (inter, hidden) and w2.shape == (hidden, inter)
    wide = torch.promote_types(x.dtype, torch.float32)
    dy, xs, hs = dout.to(wide), x.to(wide), h.to(wide)
    t = torch.tanh(GELU_C * (hs + 0.044715 * hs.pow(3)))
    act = 0.5 * hs * (1 + t)                                   # gelu_tanh(h), recomputed from the saved h
    dw2 = dy.t() @ act                                         # [H, I]
    db2 = dy.sum(dim=0)
    d_act = dy @ w2.to(wide)                                   # [T, I]
    dgelu = 0.5 * (1 + t) + 0.5 * hs * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * hs * hs)
    dh = d_act * dgelu
    dw1 = dh.t() @ xs                                          # [I, H]
    db1 = dh.sum(dim=0)
    dx = dh @ w1.to(wide)                                      # [T, H]
    return tuple(o.to(x.dtype) for o in (dx, dw1, db1, dw2, db2))


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, inter, n = HIDDEN[size], INTERMEDIATE[size], TOKENS[size]
    f32 = torch.float32
    dout = 0.01 * torch.randn(n, hidden, device=device, dtype=f32)
    # saved MLP input: the modulated, layer-normalized image-stream hidden states
    x = torch.randn(n, hidden, device=device, dtype=f32)
    # saved pre-activation x @ w1^T + b1: drawn with its statistics (unit variance, small bias offset)
    # rather than recomputed, so the backward must use it as given
    h = torch.randn(n, inter, device=device, dtype=f32) + 0.05 * torch.randn(inter, device=device, dtype=f32)
    w1 = torch.randn(inter, hidden, device=device, dtype=f32) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, device=device, dtype=f32) / inter ** 0.5
    return [dout, x, h, w1, w2]
