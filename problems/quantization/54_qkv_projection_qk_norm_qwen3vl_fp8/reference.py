"""FP8 fused QKV projection of Qwen3-VL 8B (per-token-group activation scales, 128x128 block-scaled weights) followed by per-head RMS normalization of queries and keys."""

# Designed for MetaKernelBench from the public Qwen3-VL-8B text config (hidden 4096, 32 query heads, 8 KV heads,
# head dim 128, QK RMSNorm eps 1e-6) and its FP8 release format; the activations arrive quantized per (token,
# 128 channels) from the fused input-RMSNorm + quantization kernel.

import math

import torch

BLOCK = 128
FP8_MAX = 448.0
HEAD_DIM = 128
EPS = 1e-6
TOKENS = {"full": 8192, "smoke": 24}
HIDDEN = {"full": 4096, "smoke": 256}
KV_HEADS = {"full": 8, "smoke": 1}
GQA_GROUP = 4                                   # query heads per KV head (32 / 8)


def _dequant_weight(q: torch.Tensor, scale: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    s = scale.to(wide).repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.to(wide) * s


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS) * weight


@torch.no_grad()
def reference(x_fp8: torch.Tensor, x_scale: torch.Tensor, qkv_weight: torch.Tensor, qkv_weight_scale: torch.Tensor,
              q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor):
    tokens, hidden = x_fp8.shape
    out_features = qkv_weight.shape[0]
    assert x_scale.shape == (tokens, hidden // BLOCK) and qkv_weight.shape == (out_features, hidden)
    assert qkv_weight_scale.shape == (out_features // BLOCK, hidden // BLOCK)
    kv_heads = out_features // HEAD_DIM // (GQA_GROUP + 2)
    q_heads = GQA_GROUP * kv_heads
    assert (q_heads + 2 * kv_heads) * HEAD_DIM == out_features
    wide = torch.promote_types(x_scale.dtype, torch.float32)

    x = (x_fp8.to(wide).view(tokens, hidden // BLOCK, BLOCK) * x_scale.to(wide).unsqueeze(-1)).view(tokens, hidden)
    qkv = x @ _dequant_weight(qkv_weight, qkv_weight_scale, wide).t()
    q, k, v = qkv.split([q_heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=1)
    q = _rms_norm(q.view(tokens, q_heads, HEAD_DIM), q_norm_weight.to(wide))
    k = _rms_norm(k.view(tokens, kv_heads, HEAD_DIM), k_norm_weight.to(wide))
    v = v.reshape(tokens, kv_heads, HEAD_DIM)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, kv_heads = TOKENS[size], HIDDEN[size], KV_HEADS[size]
    out_features = (GQA_GROUP + 2) * kv_heads * HEAD_DIM
    channel_gain = 1 + 0.2 * torch.randn(hidden, device=device)
    channel_gain[torch.randperm(hidden, device=device)[:hidden // 256]] *= 8       # a few outlier channels
    x = (torch.randn(tokens, hidden, device=device) * channel_gain).view(tokens, hidden // BLOCK, BLOCK)
    x_scale = x.abs().amax(dim=-1) / FP8_MAX
    x_fp8 = (x / x_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(tokens, hidden)

    w = torch.randn(out_features, hidden, device=device) / math.sqrt(hidden)
    blocks = w.view(out_features // BLOCK, BLOCK, hidden // BLOCK, BLOCK)
    w_scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    qkv_weight = (blocks / w_scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q_norm_weight = (1 + 0.1 * torch.randn(HEAD_DIM, device=device)).to(torch.bfloat16)
    k_norm_weight = (1 + 0.1 * torch.randn(HEAD_DIM, device=device)).to(torch.bfloat16)
    return [x_fp8, x_scale, qkv_weight.view(out_features, hidden), w_scale, q_norm_weight, k_norm_weight]
