"""Causal local (13-frame window) attention with sinusoidal relative position bias, per-dimension query scale and logit softcap, from the Gemma 3n E2B audio encoder."""

# Designed for MetaKernelBench from the public Gemma 3n audio config (hidden 1536, 8 heads of dim 192, chunk 12,
# left context 13, right context 0, logit cap 50) and the attention it describes; 25 encoder frames per second.

import math

import torch

HEADS = 8
HEAD_DIM = 192
HIDDEN = HEADS * HEAD_DIM         # width of the sinusoidal timing signal fed to the position projection
MAX_BACKWARD = 12                 # a frame sees itself and the 12 frames before it (context_left - 1)
SOFTCAP = 50.0
MIN_TIMESCALE, MAX_TIMESCALE = 1.0, 1.0e4
# the query scale: head_dim^-0.5 / softplus(0), times softplus(per_dim_scale) per channel
Q_SCALE = HEAD_DIM ** -0.5 / math.log(2.0)
# (clips, frames) and the valid frames of each clip; frames past a clip's length are padding
SHAPE = {"full": (16, 750), "smoke": (2, 30)}
CLIP_LENS = {
    "full": (750, 612, 488, 750, 233, 371, 705, 150, 540, 750, 96, 420, 675, 310, 580, 265),
    "smoke": (30, 17),
}


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_dim_scale: torch.Tensor,
              pos_proj_weight: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    batch, frames, heads, dim = q.shape
    assert (heads, dim) == (HEADS, HEAD_DIM) and pos_proj_weight.shape == (HIDDEN, HIDDEN)
    wide = torch.promote_types(q.dtype, torch.float32)
    valid = ~padding_mask                                           # [B, T], True for real frames
    qs = q.to(wide) * (Q_SCALE * torch.nn.functional.softplus(per_dim_scale.to(wide)))

    # relative position embedding of distance d = 0 .. 12: pos_proj(cat(sin(d * inv_ts), cos(d * inv_ts)))
    half = HIDDEN // 2
    inv_ts = MIN_TIMESCALE * torch.exp(torch.arange(half, device=q.device, dtype=wide)
                                       * -(math.log(MAX_TIMESCALE / MIN_TIMESCALE) / (half - 1)))
    dist = torch.arange(MAX_BACKWARD + 1, device=q.device, dtype=wide)
    timing = torch.cat((torch.sin(dist[:, None] * inv_ts), torch.cos(dist[:, None] * inv_ts)), dim=-1)
    rel = (timing @ pos_proj_weight.to(wide).T).view(MAX_BACKWARD + 1, heads, dim)      # [13, H, D]

    # window slot j holds the frame at t - 12 + j (distance 12 - j); slots before the clip start are masked
    pad = MAX_BACKWARD
    kp = torch.nn.functional.pad(k.to(wide), (0, 0, 0, 0, pad, 0))
    vp = torch.nn.functional.pad(v.to(wide), (0, 0, 0, 0, pad, 0))
    vmask = torch.nn.functional.pad(valid, (pad, 0), value=False)
    logits = torch.empty((batch, frames, heads, pad + 1), dtype=wide, device=q.device)
    keep = torch.empty((batch, frames, 1, pad + 1), dtype=torch.bool, device=q.device)
    for j in range(pad + 1):
        logits[..., j] = (qs * (kp[:, j:j + frames] + rel[pad - j])).sum(dim=-1)
        keep[..., 0, j] = vmask[:, j:j + frames]
    logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
    logits.masked_fill_(~keep, float("-inf"))                   # every real frame keeps at least itself
    probs = torch.softmax(logits, dim=-1)
    out = torch.zeros((batch, frames, heads, dim), dtype=wide, device=q.device)
    for j in range(pad + 1):
        out += probs[..., j:j + 1] * vp[:, j:j + frames]
    out *= valid[:, :, None, None]                              # padded frames produce zeros
    return torch.nan_to_num(out, nan=0.0).to(q.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    batch, frames = SHAPE[size]
    shape = (batch, frames, HEADS, HEAD_DIM)
    # projected queries/keys with a larger spread than unit Gaussians, so the softcap bends the largest logits
    q = 1.5 * torch.randn(shape, device=device)
    k = 1.5 * torch.randn(shape, device=device)
    v = torch.randn(shape, device=device)
    per_dim_scale = 0.5 * torch.randn(HEAD_DIM, device=device)                 # trained offsets around 0
    pos_proj_weight = torch.randn(HIDDEN, HIDDEN, device=device) * HIDDEN ** -0.5
    lens = torch.tensor(CLIP_LENS[size], device=device)
    padding_mask = torch.arange(frames, device=device)[None, :] >= lens[:, None]   # True on padding frames
    # padded frames carry garbage, as after the encoder's earlier layers; it must not leak into real frames
    return [q, k, v, per_dim_scale, pos_proj_weight, padding_mask]
