"""ConvNeXt V2 block MLP on channels-last features: pointwise linear C->4C, GELU, global response normalization over the spatial dims, pointwise linear 4C->C, in fp32."""
# Designed for MetaKernelBench from the public ConvNeXt V2-Base architecture: stage 3 (dim 512, 14x14 at 224x224 input),
# block MLP pwconv1 512->2048, GELU (erf), GRN (L2 norm over H, W; divided by its channel mean + 1e-6), pwconv2 2048->512.

import torch
import torch.nn.functional as F

DIM = {"full": 512, "smoke": 32}
EXPANSION = 4
# (images, height, width) of the stage-3 feature map
SHAPE = {"full": (64, 14, 14), "smoke": (2, 5, 5)}
GRN_EPS = 1e-6


@torch.no_grad()
def reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, grn_gamma: torch.Tensor, grn_beta: torch.Tensor,
              w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    assert x.dim() == 4 and w1.shape == (EXPANSION * dim, dim) and w2.shape == (dim, EXPANSION * dim)
    wide = torch.promote_types(x.dtype, torch.float32)
    h = F.gelu(x.to(wide) @ w1.to(wide).t() + b1.to(wide))                 # [N, H, W, 4C]
    # global response normalization: per image and channel, the L2 norm over all spatial positions,
    # relative to that image's mean norm across channels
    gx = torch.linalg.vector_norm(h, ord=2, dim=(1, 2), keepdim=True)      # [N, 1, 1, 4C]
    nx = gx / (gx.mean(dim=-1, keepdim=True) + GRN_EPS)
    h = grn_gamma.to(wide) * (h * nx) + grn_beta.to(wide) + h
    out = h @ w2.to(wide).t() + b2.to(wide)
    return out.to(x.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    dim = DIM[size]
    inner = EXPANSION * dim
    n, height, width = SHAPE[size]
    # the MLP input is the block's LayerNorm output: unit-scale channels after a per-channel affine
    x = torch.randn(n, height, width, dim, device=device) * (1 + 0.2 * torch.randn(dim, device=device)) \
        + 0.1 * torch.randn(dim, device=device)
    w1 = torch.randn(inner, dim, device=device) / dim ** 0.5
    b1 = 0.1 * torch.randn(inner, device=device)
    # trained GRN parameters (initialised at zero, learned to O(0.1..1))
    grn_gamma = 0.5 * torch.randn(inner, device=device)
    grn_beta = 0.1 * torch.randn(inner, device=device)
    w2 = torch.randn(dim, inner, device=device) / inner ** 0.5
    b2 = 0.05 * torch.randn(dim, device=device)
    return [x, w1, b1, grn_gamma, grn_beta, w2, b2]
