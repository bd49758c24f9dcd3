"""RetNet multi-scale retention in parallel form: causal query-key scores damped by a fixed exponential decay per head, applied to values."""

# Based on the public flash-linear-attention retention (MIT) and its RetNet head geometry (8 heads, key dim 256, value
# dim 512): batch 8 x 1024 tokens, per-head decay gamma_h = 1 - 2^(-5 - h), all values drawn per draw.

import torch

NUM_HEADS = 8
KEY_DIM = 256
VALUE_DIM = 512
BATCH = {"full": 8, "smoke": 2}
SEQ_LEN = {"full": 1024, "smoke": 96}


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    assert (h, dk, dv) == (NUM_HEADS, KEY_DIM, VALUE_DIM) and k.shape == q.shape
    wide = torch.promote_types(q.dtype, torch.float32)
    # decay matrix D[h, i, j] = gamma_h^(i - j) for j <= i, else 0
    log_gamma = torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(h, device=q.device, dtype=wide)))
    pos = torch.arange(t, device=q.device, dtype=wide)
    dist = pos[:, None] - pos[None, :]
    decay = (dist * log_gamma[:, None, None]).masked_fill(dist < 0, float("-inf")).exp()
    scores = (q.to(wide) * dk ** -0.5) @ k.to(wide).transpose(-1, -2) * decay
    return (scores @ v.to(wide)).to(q.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, t = BATCH[size], SEQ_LEN[size]
    q = torch.randn(b, NUM_HEADS, t, KEY_DIM, device=device).to(torch.bfloat16)
    k = torch.randn(b, NUM_HEADS, t, KEY_DIM, device=device).to(torch.bfloat16)
    v = torch.randn(b, NUM_HEADS, t, VALUE_DIM, device=device).to(torch.bfloat16)
    return [q, k, v]
