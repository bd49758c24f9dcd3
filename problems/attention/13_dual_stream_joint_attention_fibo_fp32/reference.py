"""Dual-stream joint attention over text and image tokens with AdaLN modulation, QK RMSNorm, 3D rotary embeddings and gated residuals, from the FIBO transformer."""

# Designed for MetaKernelBench from the public FIBO (BriaFiboTransformer2DModel) config, a Flux-style MMDiT: 24 heads
# of dim 128 (hidden 3072), rotary axes (16, 56, 56) with theta 1e4, the attention half of a dual-stream block.

import math

import torch

HEAD_DIM = 128
HEADS = {"full": 24, "smoke": 2}  # the smoke size keeps the head dim and shrinks the width
AXES_DIM = (16, 56, 56)           # rotary dims per position axis (frame, row, column), summing to HEAD_DIM
ROPE_THETA = 10000.0
LN_EPS = 1e-6
RMS_EPS = 1e-6
# (batch, text tokens, latent rows, latent cols): a 1024x1024 image is a 64x64 latent grid (VAE stride 16, patch 1)
SHAPE = {"full": (1, 512, 64, 64), "smoke": (1, 7, 4, 6)}


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs (2i, 2i+1) of x [..., N, H, D] by per-pair angles (cos/sin [N, D/2])."""
    xe, xo = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((xe * c - xo * s, xo * c + xe * s), dim=-1).flatten(-2)


@torch.no_grad()
def reference(img: torch.Tensor, txt: torch.Tensor, img_mod: torch.Tensor, txt_mod: torch.Tensor,
              img_qkv_weight: torch.Tensor, img_qkv_bias: torch.Tensor, txt_qkv_weight: torch.Tensor,
              txt_qkv_bias: torch.Tensor, img_qk_norm_weight: torch.Tensor, txt_qk_norm_weight: torch.Tensor,
              img_out_weight: torch.Tensor, img_out_bias: torch.Tensor, txt_out_weight: torch.Tensor,
              txt_out_bias: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, n_img, width = img.shape
    n_txt = txt.shape[1]
    heads = width // HEAD_DIM
    assert width % HEAD_DIM == 0 and ids.shape == (n_txt + n_img, len(AXES_DIM))
    wide = torch.promote_types(img.dtype, torch.float32)

    def project(x, mod, w, bias, norm_w):
        # AdaLN: LayerNorm without affine, then (1 + scale) and shift; fused q|k|v projection; per-head RMSNorm
        shift, scale = mod[:, 0, None].to(wide), mod[:, 1, None].to(wide)
        x = torch.nn.functional.layer_norm(x.to(wide), (width,), eps=LN_EPS) * (1 + scale) + shift
        q, k, v = (x @ w.to(wide).T + bias.to(wide)).view(batch, -1, 3, heads, HEAD_DIM).unbind(dim=2)
        nw = norm_w.to(wide)
        q = q * torch.rsqrt(q.square().mean(dim=-1, keepdim=True) + RMS_EPS) * nw[0]
        k = k * torch.rsqrt(k.square().mean(dim=-1, keepdim=True) + RMS_EPS) * nw[1]
        return q, k, v

    tq, tk, tv = project(txt, txt_mod, txt_qkv_weight, txt_qkv_bias, txt_qk_norm_weight)
    iq, ik, iv = project(img, img_mod, img_qkv_weight, img_qkv_bias, img_qk_norm_weight)
    q, k, v = torch.cat((tq, iq), dim=1), torch.cat((tk, ik), dim=1), torch.cat((tv, iv), dim=1)   # text first

    # 3D rotary: axis a of the position ids turns AXES_DIM[a] / 2 channel pairs at frequencies theta^(-2i/dim_a)
    pos = ids.to(wide)
    angles = torch.cat([pos[:, a, None] * ROPE_THETA ** -(torch.arange(0, d, 2, device=img.device, dtype=wide) / d)
                        for a, d in enumerate(AXES_DIM)], dim=-1)
    cos, sin = torch.cos(angles), torch.sin(angles)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)

    attn = torch.empty_like(q)
    for h in range(heads):                                    # one head at a time bounds the score matrix
        logits = q[:, :, h] @ k[:, :, h].transpose(1, 2) / math.sqrt(HEAD_DIM)
        attn[:, :, h] = torch.softmax(logits, dim=-1) @ v[:, :, h]
    attn = attn.reshape(batch, n_txt + n_img, width)

    txt_out = txt.to(wide) + txt_mod[:, 2, None].to(wide) * (attn[:, :n_txt] @ txt_out_weight.to(wide).T
                                                            + txt_out_bias.to(wide))
    img_out = img.to(wide) + img_mod[:, 2, None].to(wide) * (attn[:, n_txt:] @ img_out_weight.to(wide).T
                                                            + img_out_bias.to(wide))
    return img_out.to(img.dtype), txt_out.to(txt.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    batch, n_txt, rows, cols = SHAPE[size]
    width = HEADS[size] * HEAD_DIM
    n_img = rows * cols

    def linear(out_features):                                 # weights scaled to keep activations near unit size
        return (torch.randn(out_features, width, device=device) * width ** -0.5,
                0.02 * torch.randn(out_features, device=device))

    img = torch.randn(batch, n_img, width, device=device)
    txt = torch.randn(batch, n_txt, width, device=device)
    # AdaLN-Zero outputs for the attention branch: (shift, scale, gate) per stream and sample
    img_mod = 0.5 * torch.randn(batch, 3, width, device=device)
    txt_mod = 0.5 * torch.randn(batch, 3, width, device=device)
    img_qkv_weight, img_qkv_bias = linear(3 * width)
    txt_qkv_weight, txt_qkv_bias = linear(3 * width)
    img_qk_norm_weight = 1 + 0.1 * torch.randn(2, HEAD_DIM, device=device)   # q and k RMSNorm gains near 1
    txt_qk_norm_weight = 1 + 0.1 * torch.randn(2, HEAD_DIM, device=device)
    img_out_weight, img_out_bias = linear(width)
    txt_out_weight, txt_out_bias = linear(width)
    # position ids (frame, row, col): zeros for text tokens, the latent grid for image tokens (Flux convention)
    grid = torch.stack(torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device),
                                      indexing="ij"), dim=-1).reshape(n_img, 2)
    ids = torch.zeros(n_txt + n_img, 3, dtype=torch.int32, device=device)
    ids[n_txt:, 1:] = grid.to(torch.int32)
    return [img, txt, img_mod, txt_mod, img_qkv_weight, img_qkv_bias, txt_qkv_weight, txt_qkv_bias,
            img_qk_norm_weight, txt_qk_norm_weight, img_out_weight, img_out_bias, txt_out_weight, txt_out_bias, ids]
