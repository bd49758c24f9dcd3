"""Variable-length bidirectional attention with 2D rotary embedding over packed image-patch sequences of the Qwen2.5-VL vision encoder in Qwen-Image-Edit-2509."""

# Designed for MetaKernelBench from the public Qwen2.5-VL vision config used by Qwen-Image-Edit-2509 (hidden 1280,
# 16 heads of dim 80, 14-px patches merged 2x2, rotary theta 1e4) and its ~384x384-pixel condition images.

import math

import torch

HEADS = 16
HEAD_DIM = 80
HIDDEN = HEADS * HEAD_DIM
ROPE_THETA = 10000.0
SCALE = 1.0 / math.sqrt(HEAD_DIM)
# patch grids (rows, cols) of the packed condition images: ~384x384-pixel images of several aspect ratios,
# resized to multiples of 28 px; every image is its own attention sequence (a full-attention encoder block)
GRIDS = {
    "full": ((28, 28), (22, 32), (32, 22), (20, 36), (28, 28), (36, 20), (22, 34), (26, 30), (28, 28), (30, 26),
             (18, 42), (22, 32), (28, 28), (34, 22), (20, 36), (18, 38), (28, 28), (32, 22), (26, 30), (22, 32),
             (28, 28), (42, 18), (20, 36), (28, 28), (22, 34), (38, 18), (30, 26), (28, 28), (22, 32), (36, 20),
             (28, 28), (32, 22)),
    "smoke": ((4, 6), (6, 4), (2, 2), (8, 4)),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.no_grad()
def reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    total, width = qkv.shape
    assert width == 3 * HIDDEN and cos.shape == sin.shape == (total, HEAD_DIM) and int(cu_seqlens[-1]) == total
    wide = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = qkv.to(wide).view(total, 3, HEADS, HEAD_DIM).unbind(dim=1)
    c, s = cos.to(wide)[:, None, :], sin.to(wide)[:, None, :]
    q = q * c + _rotate_half(q) * s                      # rotated queries and keys stay in full precision
    k = k * c + _rotate_half(k) * s
    out = torch.empty((total, HEADS, HEAD_DIM), dtype=wide, device=qkv.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):            # block-diagonal: tokens attend within their own image
        logits = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * SCALE
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v[a:b])
    return out.reshape(total, HIDDEN).to(qkv.dtype)


def _patch_positions(rows: int, cols: int) -> torch.Tensor:
    """(row, col) of every patch in encoder order: 2x2 merge groups are contiguous, groups in raster order."""
    r = torch.arange(rows).view(rows // 2, 2, 1, 1).expand(rows // 2, 2, cols // 2, 2)
    c = torch.arange(cols).view(1, 1, cols // 2, 2).expand(rows // 2, 2, cols // 2, 2)
    return torch.stack((r.permute(0, 2, 1, 3).reshape(-1), c.permute(0, 2, 1, 3).reshape(-1)), dim=-1)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    grids = GRIDS[size]
    lens = [r * c for r, c in grids]
    total = sum(lens)
    # output of the fused qkv projection: [tokens, (q | k | v) x 16 heads x 80]
    qkv = torch.randn(total, 3 * HIDDEN, device=device, dtype=torch.bfloat16)
    # 2D rotary: the first 20 frequencies turn with the patch row, the next 20 with the column (HF layout)
    pos = torch.cat([_patch_positions(r, c) for r, c in grids]).to(device=device, dtype=torch.float32)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM // 2, 2, device=device, dtype=torch.float32)
                                    / (HEAD_DIM // 2))
    angles = torch.cat((pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq), dim=-1)
    angles = torch.cat((angles, angles), dim=-1)
    cu_seqlens = torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device,
                              dtype=torch.int32)
    return [qkv, angles.cos(), angles.sin(), cu_seqlens]
