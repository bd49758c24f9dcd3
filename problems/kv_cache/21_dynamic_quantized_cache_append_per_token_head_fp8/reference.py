"""Dynamic per-(token, head) FP8 e4m3 quantization of new keys and values and their append into paged FP8 caches with per-slot scales."""
# Designed for MetaKernelBench from vLLM's per-token-head FP8 KV-cache write (Apache-2.0), as in the original
# MetaKernelBench problem 21; KV geometry of Llama 3.1 8B (8 KV heads, head dim 128), block size 16.

import torch

KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
FP8_MAX = 448.0          # largest finite float8_e4m3fn
MIN_SCALE = 1e-8         # guards an all-zero (token, head) row
# (token slots in the batch, requests, cache blocks, max padding tokens, max tokens already cached per request)
GEOMETRY = {"full": (8192, 24, 1024, 128, 8192), "smoke": (40, 3, 12, 4, 40)}


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of each [HEAD_DIM] row: returns (float8_e4m3fn bit patterns as uint8, scales)."""
    # Tensor-by-tensor divisions are IEEE round-to-nearest on every device (PyTorch on CUDA turns a division by a
    # Python scalar into a multiply by its reciprocal, which would change the bits).
    absmax = x.abs().amax(dim=-1)
    scale = (absmax / torch.full_like(absmax, FP8_MAX)).clamp(min=MIN_SCALE)
    inv = torch.ones_like(scale) / scale                # one reciprocal per row, then a multiply per element
    q = (x * inv[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale


@torch.no_grad()
def reference(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert key.shape[1:] == (KV_HEADS, HEAD_DIM) and value.shape == key.shape
    assert key_cache.dtype == torch.uint8 and key_cache.shape[1:] == (BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert k_scale_cache.shape == key_cache.shape[:3]
    wide = torch.promote_types(key.dtype, torch.float32)
    live = slot_mapping >= 0                      # slot -1 marks padding tokens, which are skipped
    slots = slot_mapping[live].long()
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    # the caches hold float8_e4m3fn bit patterns in uint8 storage, as vLLM allocates fp8 caches
    qk, sk = _quantize(key[live].to(wide))
    qv, sv = _quantize(value[live].to(wide))
    key_cache[block, offset] = qk
    value_cache[block, offset] = qv
    k_scale_cache[block, offset] = sk.to(k_scale_cache.dtype)
    v_scale_cache[block, offset] = sv.to(v_scale_cache.dtype)
    return key_cache, value_cache, k_scale_cache, v_scale_cache


def _slot_mapping(size: str) -> torch.Tensor:
    """Cache slots of a ragged batch: each request appends its new tokens after its cached ones (CPU generator)."""
    tokens, requests, blocks, max_pad, max_ctx = GEOMETRY[size]
    pad = int(torch.randint(1, max_pad + 1, (1,)))
    live = tokens - pad
    cuts = torch.randperm(live - 1)[:requests - 1].sort().values + 1
    lens = torch.diff(torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([live]))))
    ctx = torch.randint(0, max_ctx + 1, (requests,))
    req = torch.repeat_interleave(torch.arange(requests), lens)
    pos = ctx[req] + torch.arange(live) - (torch.cumsum(lens, 0) - lens)[req]
    first = ctx // BLOCK_SIZE
    nblk = (ctx + lens - 1) // BLOCK_SIZE - first + 1
    assert int(nblk.sum()) <= blocks
    phys = torch.randperm(blocks)[:int(nblk.sum())]
    slot = phys[(torch.cumsum(nblk, 0) - nblk)[req] + pos // BLOCK_SIZE - first[req]] * BLOCK_SIZE + pos % BLOCK_SIZE
    return torch.cat((slot, torch.full((pad,), -1, dtype=torch.long)))


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, _, blocks, _, _ = GEOMETRY[size]
    slot_mapping = _slot_mapping(size).to(device)
    # keys carry channel outliers (log-normal per-(head, dim) magnitudes, a few channels 8x larger),
    # values a per-token magnitude, so the per-row absmax and hence the scale varies a lot
    chan = torch.exp(0.5 * torch.randn(KV_HEADS, HEAD_DIM, device=device))
    chan = torch.where(torch.rand(KV_HEADS, HEAD_DIM, device=device) < 0.03, 8.0 * chan, chan)
    key = (torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device) * chan).to(torch.bfloat16)
    value = (torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device)
             * torch.exp(0.5 * torch.randn(tokens, KV_HEADS, 1, device=device))).to(torch.bfloat16)
    # the caches already hold other tokens: fp8 payloads over the full range and their scales
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = (150.0 * torch.randn(shape, device=device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    value_cache = (150.0 * torch.randn(shape, device=device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    k_scale_cache = 0.002 + 0.02 * torch.rand(shape[:3], device=device)
    v_scale_cache = 0.002 + 0.02 * torch.rand(shape[:3], device=device)
    return [key, value, slot_mapping, key_cache, value_cache, k_scale_cache, v_scale_cache]
