"""Gather paged 656-byte MLA cache entries (fp8 latent, per-128 fp32 scales, bf16 rope) of several requests into one contiguous bf16 buffer, upconverting the latent."""
# Designed for MetaKernelBench from vLLM's cp_gather_and_upconvert_fp8_kv_cache (Apache-2.0), as in the original
# MetaKernelBench problem 24; entry layout of the DeepSeek-V3.2 FP8 sparse-MLA cache: 512 fp8 + 4 fp32 scales + 64 bf16.

import torch

NOPE_DIM = 512
ROPE_DIM = 64
GROUP = 128                          # one fp32 scale per 128 latent values
GROUPS = NOPE_DIM // GROUP
ENTRY_BYTES = NOPE_DIM + 4 * GROUPS + 2 * ROPE_DIM    # 656
BLOCK_SIZE = 64
# (requests, total tokens gathered, cache blocks); the block table has TOTAL // BLOCK_SIZE columns
GEOMETRY = {"full": (8, 65536, 1536), "smoke": (3, 256, 12)}


@torch.no_grad()
def reference(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    assert cache.dtype == torch.uint8 and cache.shape[1:] == (BLOCK_SIZE, ENTRY_BYTES)
    lens = seq_lens.long()
    requests = lens.numel()
    total = int(lens.sum())
    req = torch.repeat_interleave(torch.arange(requests, device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - (torch.cumsum(lens, 0) - lens)[req]
    block = block_table[req, pos // BLOCK_SIZE].long()
    entries = cache[block, pos % BLOCK_SIZE]                               # [total, 656] bytes, request after request
    # little-endian byte fields: fp8 latent | fp32 group scales | bf16 rope
    latent = entries[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = entries[:, NOPE_DIM:NOPE_DIM + 4 * GROUPS].contiguous().view(torch.float32)
    rope = entries[:, NOPE_DIM + 4 * GROUPS:].contiguous().view(torch.bfloat16)
    nope = (latent.view(total, GROUPS, GROUP) * scales[:, :, None]).view(total, NOPE_DIM)
    return torch.cat((nope.to(torch.bfloat16), rope), dim=-1)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    requests, total, blocks = GEOMETRY[size]
    width = total // BLOCK_SIZE
    cuts = torch.randperm(total - 1)[:requests - 1].sort().values + 1
    lens = torch.diff(torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([total]))))
    nblk = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    assert int(nblk.sum()) <= blocks and int(nblk.max()) <= width
    phys = torch.randperm(blocks)[:int(nblk.sum())].to(torch.int32)
    block_table = torch.zeros(requests, width, dtype=torch.int32)
    for r, (start, n) in enumerate(zip((torch.cumsum(nblk, 0) - nblk).tolist(), nblk.tolist())):
        block_table[r, :n] = phys[start:start + n]

    # every slot holds a quantized entry: a latent with per-token-group magnitudes, quantized per 128-group
    # to +-448 with scale = absmax / 448, and a bf16 rope part of similar magnitude
    slots = blocks * BLOCK_SIZE
    latent = torch.randn(slots, GROUPS, GROUP, device=device) * (0.5 + 1.5 * torch.rand(slots, GROUPS, 1, device=device))
    scales = latent.abs().amax(dim=-1) / 448.0
    fp8 = (latent / scales[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(slots, NOPE_DIM)
    rope = (1.5 * torch.randn(slots, ROPE_DIM, device=device)).to(torch.bfloat16)
    cache = torch.cat((fp8.view(torch.uint8), scales.view(torch.uint8).view(slots, 4 * GROUPS),
                       rope.view(torch.uint8).view(slots, 2 * ROPE_DIM)), dim=-1)
    return [cache.view(blocks, BLOCK_SIZE, ENTRY_BYTES), block_table.to(device), lens.to(device=device, dtype=torch.int32)]
