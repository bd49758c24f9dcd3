"""Nemotron-H Mamba2 mixer output stage with NVFP4: gated group RMSNorm of the SSM output, dynamic NVFP4 quantization of the result, and the NVFP4 W4A4 out_proj GEMM."""

# Designed for MetaKernelBench from the public Nemotron-H-8B config (hidden 4096, Mamba2 d_inner 8192 = 128 heads x
# 64, 8 groups, gated RMSNorm eps 1e-5 over groups of 1024 channels, norm applied to y * silu(z)); out_proj in NVFP4
# W4A4 form with a static (calibrated) activation global scale and per-16 dynamic activation block scales.

import math

import torch

SF_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
N_GROUPS = 8
EPS = 1e-5
CALIBRATION_HEADROOM = 1.25
TOKENS = {"full": 8192, "smoke": 16}
D_INNER = {"full": 8192, "smoke": 256}
HIDDEN = {"full": 4096, "smoke": 64}


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """packed [N, K/2] uint8 (element 2i in the low nibble), block_scale [N, K/16] e4m3, global_scale [1] fp32."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])                     # code bit 3 is the sign
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = table[codes].unflatten(-1, (-1, SF_BLOCK))
    scale = block_scale.to(dtype).unsqueeze(-1) * global_scale.to(dtype)
    return (values * scale).flatten(-2)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code, saturating at 6); returns 4-bit codes, bit 3 = sign."""
    mag = v.abs()
    idx = ((mag > 0.25).long() + (mag >= 0.75).long() + (mag > 1.25).long() + (mag >= 1.75).long()
           + (mag > 2.5).long() + (mag >= 3.5).long() + (mag > 5.0).long())
    return idx | ((v < 0).long() << 3)


def _quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor):
    """NVFP4 encoder with a given global scale: block scale = e4m3(amax16 / (6 * global)) (saturating at 448),
    codes = E2M1(x / (block scale * global)), blocks whose scale rounds to zero encode zeros."""
    blocks = x.unflatten(-1, (-1, SF_BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    denom = (block_scale.to(x.dtype) * global_scale).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / denom.clamp(min=1e-30), torch.zeros_like(blocks))
    codes = _e2m1_codes(scaled).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, block_scale


def _gated_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    tokens, d_inner = y.shape
    x = (y.to(wide) * torch.nn.functional.silu(z.to(wide))).view(tokens, N_GROUPS, d_inner // N_GROUPS)
    x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
    return x.view(tokens, d_inner) * weight.to(wide)


@torch.no_grad()
def reference(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, act_global_scale: torch.Tensor,
              weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor):
    tokens, d_inner = y.shape
    assert z.shape == y.shape and weight_packed.shape[1] * 2 == d_inner and d_inner % N_GROUPS == 0
    wide = torch.promote_types(y.dtype, torch.float32)
    g = act_global_scale.to(wide)
    normed = _gated_norm(y, z, norm_weight, wide)
    act_packed, act_scale = _quantize_nvfp4(normed, g)
    a = _dequantize_nvfp4(act_packed, act_scale, g, wide)
    w = _dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, wide)
    return (a @ w.t()).to(y.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, d_inner, hidden = TOKENS[size], D_INNER[size], HIDDEN[size]
    # SSM outputs with per-head (64-channel) magnitude differences; gate pre-activations centred slightly positive
    head_gain = torch.exp(0.5 * torch.randn(d_inner // 64, device=device)).repeat_interleave(64)
    y = (torch.randn(tokens, d_inner, device=device) * head_gain).to(torch.bfloat16)
    z = (0.5 + torch.randn(tokens, d_inner, device=device)).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(d_inner, device=device)).to(torch.bfloat16)
    # static activation scale from calibration: amax / (448 * 6) with 25% headroom over this batch's amax
    amax = _gated_norm(y, z, norm_weight, torch.float32).abs().amax()
    act_global_scale = (CALIBRATION_HEADROOM * amax / (E4M3_MAX * E2M1_MAX)).reshape(1)
    w = torch.randn(hidden, d_inner, device=device) / math.sqrt(d_inner)
    w_global = (w.abs().amax() / (E4M3_MAX * E2M1_MAX)).reshape(1)
    weight_packed, weight_scale = _quantize_nvfp4(w, w_global)
    return [y, z, norm_weight, act_global_scale, weight_packed, weight_scale, w_global]
