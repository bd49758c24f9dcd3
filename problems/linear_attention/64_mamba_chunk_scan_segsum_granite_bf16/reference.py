"""Mamba-2 chunk scan: per-chunk outputs from segment-sum decays, given the state entering each chunk, for Granite 4.0 H Tiny."""

# Designed for MetaKernelBench from the public Granite-4.0-H-Tiny config (Mamba-2 mixer: 48 heads of dim 64, state size
# 128, one B/C group, chunk 256); a prefill batch of 2 sequences of 8192 tokens with Mamba-2 initialisation ranges.

import math

import torch
import torch.nn.functional as F

NUM_HEADS = 48
HEAD_DIM = 64
STATE_DIM = 128
NUM_GROUPS = 1
CHUNK = 256
BATCH = {"full": 2, "smoke": 1}
SEQ_LEN = {"full": 8192, "smoke": 300}
DT_MIN, DT_MAX = 1e-3, 1e-1     # Mamba-2 time-step initialisation range
A_MIN, A_MAX = 1.0, 16.0        # Mamba-2 A initialisation range
DT_NOISE = 0.5


@torch.no_grad()
def reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              chunk_states: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c = -(-l // CHUNK)
    assert (h, p, g, n) == (NUM_HEADS, HEAD_DIM, NUM_GROUPS, STATE_DIM) and C.shape == B.shape
    assert chunk_states.shape == (b, c, h, p, n)
    wide = torch.promote_types(x.dtype, torch.float32)
    r = h // g                                                   # head h reads B/C group h // r
    pad = c * CHUNK - l
    xw, bw, cw, delta = x.to(wide), B.to(wide), C.to(wide), dt.to(wide)
    if pad:  # padded steps: delta = 0, outputs discarded
        xw, bw, cw = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (xw, bw, cw))
        delta = F.pad(delta, (0, 0, 0, pad))
    s = CHUNK
    xw = xw.view(b, c, s, g, r, p)
    bw, cw = bw.view(b, c, s, g, n), cw.view(b, c, s, g, n)
    delta = delta.view(b, c, s, g, r)
    cum = (delta * A.to(wide).view(g, r)).cumsum(dim=2).permute(0, 1, 3, 4, 2)      # [b, c, g, r, s]
    xdt = (xw * delta[..., None]).permute(0, 1, 3, 4, 2, 5)                         # [b, c, g, r, s, p]
    # segment sums within a chunk: seg[i, j] = sum_{j < t <= i} dt_t A = cum_i - cum_j for j <= i
    lower = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~lower, float("-inf")).exp_()
    cb = torch.einsum("bcign,bcjgn->bcgij", cw, bw)
    y = decay.mul_(cb[:, :, :, None]) @ xdt                                         # [b, c, g, r, s, p]
    del decay
    # contribution of the state entering the chunk, decayed to each step
    states = chunk_states.to(wide).view(b, c, g, r, p, n)
    y += torch.einsum("bcsgn,bcgrpn->bcgrsp", cw, states) * cum.exp()[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, c * s, h, p)[:, :l]
    y = y + D.to(wide)[:, None] * x.to(wide)
    return y.to(x.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, l = BATCH[size], SEQ_LEN[size]
    c = -(-l // CHUNK)
    x = torch.randn(b, l, NUM_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    # Mamba-2 ranges: per-head dt0 log-uniform in [1e-3, 1e-1], A = -U(1, 16); dt = softplus(noise + softplus^-1(dt0))
    # already applied, so per-step decays exp(dt*A) span ~0.9999 to ~0.2 and the entering states stay visible
    dt0 = torch.exp(math.log(DT_MIN) + (math.log(DT_MAX) - math.log(DT_MIN)) * torch.rand(NUM_HEADS, device=device))
    A = -(A_MIN + (A_MAX - A_MIN) * torch.rand(NUM_HEADS, device=device))
    dt = F.softplus(DT_NOISE * torch.randn(b, l, NUM_HEADS, device=device) + dt0 + torch.log(-torch.expm1(-dt0)))
    B = torch.randn(b, l, NUM_GROUPS, STATE_DIM, device=device).to(torch.bfloat16)
    C = torch.randn(b, l, NUM_GROUPS, STATE_DIM, device=device).to(torch.bfloat16)
    # states entering each chunk at each head's steady-state scale: var = dt0^2 / (1 - exp(-2 dt0 |A|))
    std = torch.sqrt(dt0.square() / -torch.expm1(2.0 * dt0 * A))
    chunk_states = std[:, None, None] * torch.randn(b, c, NUM_HEADS, HEAD_DIM, STATE_DIM, device=device)
    D = 1.0 + 0.1 * torch.randn(NUM_HEADS, device=device)
    return [x, dt, A, B, C, chunk_states, D]
