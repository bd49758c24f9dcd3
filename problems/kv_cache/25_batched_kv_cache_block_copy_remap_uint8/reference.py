"""Batched K/V cache-page copy under a shared source-to-destination block remap (uint8 pages)."""

import torch

# (blocks in the cache, mapped blocks); a block is [BLOCK_SIZE, HEADS, HEAD_DIM] bytes
GEOMETRY = {"full": (1024, 256), "smoke": (16, 4)}
BLOCK_SIZE = 32
HEADS = 8
HEAD_DIM = 256


@torch.no_grad()
def reference(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
              block_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    dst_k[dst] = src_k[src]
    dst_v[dst] = src_v[src]
    return dst_k, dst_v


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    blocks, mapped = GEOMETRY[size]
    shape = (blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    src_k, src_v, dst_k, dst_v = (torch.randint(0, 256, shape, device=device, dtype=torch.uint8) for _ in range(4))
    # distinct source and destination blocks, so the copy order cannot matter
    perm = torch.randperm(blocks, device=device)
    block_mapping = torch.stack((perm[:mapped], perm[mapped:2 * mapped]), dim=1).to(torch.int64)
    return [src_k, src_v, dst_k, dst_v, block_mapping]
