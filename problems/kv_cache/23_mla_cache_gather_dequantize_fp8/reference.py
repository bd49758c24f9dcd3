"""Gather the paged FP8 MLA cache entries of several requests into one contiguous buffer, dequantized with a per-tensor scale to bf16."""
# Designed for MetaKernelBench from vLLM's gather_and_maybe_dequant_cache for MLA (Apache-2.0), as in the original
# MetaKernelBench problem 23; DeepSeek-V3 MLA entry (512 latent + 64 rope = 576 values), block size 64.

import torch

ENTRY = 576              # kv_lora_rank 512 + qk_rope_head_dim 64
BLOCK_SIZE = 64
# (requests, total tokens gathered, cache blocks); the block table has TOTAL // BLOCK_SIZE columns
GEOMETRY = {"full": (8, 65536, 1536), "smoke": (3, 256, 12)}


@torch.no_grad()
def reference(src_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    assert src_cache.shape[1:] == (BLOCK_SIZE, ENTRY)
    wide = torch.promote_types(scale.dtype, torch.float32)     # fp8 has no type promotion; the scale sets the precision
    # the output contract is bf16 for an fp8 cache; the harness's float64 anchor stays unrounded
    out_dtype = torch.bfloat16 if src_cache.dtype == torch.float8_e4m3fn else wide
    lens = seq_lens.long()
    requests = lens.numel()
    total = int(lens.sum())
    req = torch.repeat_interleave(torch.arange(requests, device=lens.device), lens, output_size=total)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=lens.device) - starts[req]        # position within its request
    block = block_table[req, pos // BLOCK_SIZE].long()
    entries = src_cache[block, pos % BLOCK_SIZE].to(wide)               # [total, 576], request after request
    return (entries * scale.to(wide)).to(out_dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    requests, total, blocks = GEOMETRY[size]
    width = total // BLOCK_SIZE
    # ragged lengths summing to the fixed total (CPU generator), each request owning distinct scattered blocks
    cuts = torch.randperm(total - 1)[:requests - 1].sort().values + 1
    lens = torch.diff(torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([total]))))
    nblk = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    assert int(nblk.sum()) <= blocks and int(nblk.max()) <= width
    phys = torch.randperm(blocks)[:int(nblk.sum())].to(torch.int32)
    block_table = torch.zeros(requests, width, dtype=torch.int32)      # unused entries are 0, as in vLLM
    for r, (start, n) in enumerate(zip((torch.cumsum(nblk, 0) - nblk).tolist(), nblk.tolist())):
        block_table[r, :n] = phys[start:start + n]
    # a per-tensor kv-cache scale and a latent of unit scale, so cached fp8 values use most of the range
    scale = 2.0 ** (-6 + 0.5 * torch.rand(1, device=device))
    latent = torch.randn(blocks, BLOCK_SIZE, ENTRY, device=device) * torch.exp(0.3 * torch.randn(blocks, BLOCK_SIZE, 1, device=device))
    src_cache = (latent / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return [src_cache, block_table.to(device), lens.to(device=device, dtype=torch.int32), scale]
