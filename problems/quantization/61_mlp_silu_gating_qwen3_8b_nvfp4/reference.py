"""Qwen3-8B SwiGLU MLP for a decode batch with NVFP4 weights: fused gate/up projection, silu(gate) * up, down projection."""

# Designed for MetaKernelBench from the public Qwen3-8B config (hidden 4096, MLP intermediate 12288, SiLU gating);
# weights are NVFP4 and activations bf16 (weight-only, as an H200 without FP4 tensor cores would serve it), for a
# decode step of 32 sequences, where streaming the 4-bit weights dominates.

import math

import torch

SF_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
TOKENS = {"full": 32, "smoke": 4}
HIDDEN = {"full": 4096, "smoke": 128}
INTERMEDIATE = {"full": 12288, "smoke": 192}


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """packed [N, K/2] uint8 (element 2i in the low nibble), block_scale [N, K/16] e4m3, global_scale [1] fp32."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])                     # code bit 3 is the sign
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = table[codes].unflatten(-1, (-1, SF_BLOCK))
    scale = block_scale.to(dtype).unsqueeze(-1) * global_scale.to(dtype)
    return (values * scale).flatten(-2)


@torch.no_grad()
def reference(x: torch.Tensor, gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor,
              gate_up_global_scale: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor,
              down_global_scale: torch.Tensor) -> torch.Tensor:
    tokens, hidden = x.shape
    inter = gate_up_packed.shape[0] // 2
    assert gate_up_packed.shape[1] * 2 == hidden and down_packed.shape == (hidden, inter // 2)
    wide = torch.promote_types(x.dtype, torch.float32)
    h = x.to(wide) @ _dequantize_nvfp4(gate_up_packed, gate_up_scale, gate_up_global_scale, wide).t()
    act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]                       # gate rows first, then up
    out = act @ _dequantize_nvfp4(down_packed, down_scale, down_global_scale, wide).t()
    return out.to(x.dtype)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code, saturating at 6); returns 4-bit codes, bit 3 = sign."""
    mag = v.abs()
    idx = ((mag > 0.25).long() + (mag >= 0.75).long() + (mag > 1.25).long() + (mag >= 1.75).long()
           + (mag > 2.5).long() + (mag >= 3.5).long() + (mag > 5.0).long())
    return idx | ((v < 0).long() << 3)


def _quantize_nvfp4(w: torch.Tensor):
    """NVFP4 encoder: fp32 global scale = amax / (448 * 6), e4m3 scale per 16 elements, E2M1 codes packed in pairs."""
    global_scale = (w.abs().amax() / (E4M3_MAX * E2M1_MAX)).reshape(1)
    blocks = w.unflatten(-1, (-1, SF_BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    denom = (block_scale.float() * global_scale).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / denom.clamp(min=1e-30), torch.zeros_like(blocks))
    codes = _e2m1_codes(scaled).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, block_scale, global_scale


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, inter = TOKENS[size], HIDDEN[size], INTERMEDIATE[size]
    gain = 1 + 0.2 * torch.randn(hidden, device=device)                 # post-RMSNorm activations
    x = (torch.randn(tokens, hidden, device=device) * gain).to(torch.bfloat16)
    # weights with per-row magnitude spread so block scales vary
    w13 = torch.randn(2 * inter, hidden, device=device) * torch.exp(0.3 * torch.randn(2 * inter, 1, device=device))
    w2 = torch.randn(hidden, inter, device=device) * torch.exp(0.3 * torch.randn(hidden, 1, device=device))
    return [x, *_quantize_nvfp4(w13 / math.sqrt(hidden)), *_quantize_nvfp4(w2 / math.sqrt(inter))]
