"""DeepSeek-V3.1 MLA KV compression with FP8 re-quantization: kv_a projection of FP8 hidden states, latent RMSNorm, k_pe RoPE, FP8 cache entry with power-of-two scales."""

# Designed for MetaKernelBench from the public DeepSeek-V3.1 config (hidden 7168, kv_lora_rank 512, qk_rope_head_dim
# 64, FP8 e4m3 weights with 128x128 block scales, activations with UE8M0 (power-of-two) scales per 128 channels).

import math

import torch

BLOCK = 128
FP8_MAX = 448.0
KV_LORA_RANK = 512
ROPE_DIM = 64
EPS = 1e-6
ROPE_THETA = 10000.0
TOKENS = {"full": 8192, "smoke": 24}
HIDDEN = {"full": 7168, "smoke": 256}
MAX_POSITION = {"full": 32768, "smoke": 64}
# The cache scale of each 128-wide latent tile is 2^ceil(log2(amax / 448)). Rows where log2(amax / 448) of any tile
# lies within SCALE_MARGIN of an integer are redrawn, so the power-of-two choice is stable under numerical noise.
SCALE_MARGIN = 0.02
REDRAW_LIMIT = 32


def _dequant_weight(q: torch.Tensor, scale: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.to(wide).repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    return q.to(wide) * s


def _latent(hidden_fp8, hidden_scale, w_kv_a, w_kv_a_scale, kv_norm_weight, wide):
    """kv_a projection of the dequantized hidden state; returns the RMS-normalized latent (bf16) and the raw k_pe."""
    tokens, hidden = hidden_fp8.shape
    x = (hidden_fp8.to(wide).view(tokens, hidden // BLOCK, BLOCK) * hidden_scale.to(wide).unsqueeze(-1))
    kv = x.view(tokens, hidden) @ _dequant_weight(w_kv_a, w_kv_a_scale, wide).t()
    c, k_pe = kv.split([KV_LORA_RANK, ROPE_DIM], dim=1)
    c = c * torch.rsqrt(c.square().mean(dim=-1, keepdim=True) + EPS) * kv_norm_weight.to(wide)
    return c.to(torch.bfloat16), k_pe


@torch.no_grad()
def reference(hidden_fp8: torch.Tensor, hidden_scale: torch.Tensor, w_kv_a: torch.Tensor,
              w_kv_a_scale: torch.Tensor, kv_norm_weight: torch.Tensor, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor):
    tokens, hidden = hidden_fp8.shape
    assert w_kv_a.shape == (KV_LORA_RANK + ROPE_DIM, hidden) and hidden_scale.shape == (tokens, hidden // BLOCK)
    assert w_kv_a_scale.shape == (math.ceil((KV_LORA_RANK + ROPE_DIM) / BLOCK), hidden // BLOCK)
    wide = torch.promote_types(hidden_scale.dtype, torch.float32)
    kv_c_normed, k_pe = _latent(hidden_fp8, hidden_scale, w_kv_a, w_kv_a_scale, kv_norm_weight, wide)

    # RoPE on k_pe, interleaved pairs (x[2i], x[2i+1]) rotated by the angle of frequency i
    cos, sin = cos_sin_cache[positions].to(wide).chunk(2, dim=-1)       # [T, 32] each
    x1, x2 = k_pe[:, 0::2], k_pe[:, 1::2]
    k_pe = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(1)

    # FP8 cache entry from the bf16 latent: per 128-wide tile, scale = 2^ceil(log2(amax / 448)) and
    # value = e4m3(latent / scale) (exact division by a power of two, round to nearest even)
    tiles = kv_c_normed.to(wide).view(tokens, KV_LORA_RANK // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    kv_fp8 = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(tokens, KV_LORA_RANK)
    return kv_c_normed, k_pe.to(torch.bfloat16), kv_fp8, scale.squeeze(-1).to(torch.float32)


def _quantize_rows_ue8m0(x: torch.Tensor):
    """Per-(row, 128 channels) FP8 quantization with power-of-two scales."""
    groups = x.view(x.shape[0], -1, BLOCK)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(dim=-1).clamp(min=1e-30) / FP8_MAX)))
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view_as(x), scale


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, max_pos = TOKENS[size], HIDDEN[size], MAX_POSITION[size]
    rows = KV_LORA_RANK + ROPE_DIM
    w = torch.randn(rows, hidden, device=device) / math.sqrt(hidden)
    w_pad = torch.zeros(math.ceil(rows / BLOCK) * BLOCK, hidden, device=device)
    w_pad[:rows] = w
    blocks = w_pad.view(-1, BLOCK, hidden // BLOCK, BLOCK)
    w_kv_a_scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX          # last row block covers 64 rows
    w_kv_a = (blocks / w_kv_a_scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    w_kv_a = w_kv_a.view(-1, hidden)[:rows].contiguous()
    kv_norm_weight = (1 + 0.2 * torch.randn(KV_LORA_RANK, device=device)).to(torch.bfloat16)

    def draw(n):
        return torch.randn(n, hidden, device=device) * torch.exp(0.5 * torch.randn(n, 1, device=device))

    x = draw(tokens)
    for _ in range(REDRAW_LIMIT):
        hidden_fp8, hidden_scale = _quantize_rows_ue8m0(x)
        c, _ = _latent(hidden_fp8, hidden_scale, w_kv_a, w_kv_a_scale, kv_norm_weight, torch.float32)
        log_ratio = torch.log2(c.float().view(tokens, -1, BLOCK).abs().amax(dim=-1) / FP8_MAX)
        unstable = ((log_ratio - log_ratio.round()).abs() < SCALE_MARGIN).any(dim=1)
        count = int(unstable.sum())
        if count == 0:
            break
        x[unstable] = draw(count)
    else:
        raise RuntimeError("cache-scale margins stayed below SCALE_MARGIN after REDRAW_LIMIT redraws")

    positions = torch.randint(0, max_pos, (tokens,), device=device, dtype=torch.int64)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, ROPE_DIM, 2, device=device, dtype=torch.float32) / ROPE_DIM)
    angles = torch.arange(max_pos, device=device, dtype=torch.float32).unsqueeze(1) * inv_freq
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)       # [max_pos, 64]: 32 cos, then 32 sin
    return [hidden_fp8, hidden_scale, w_kv_a, w_kv_a_scale, kv_norm_weight, positions, cos_sin_cache]
