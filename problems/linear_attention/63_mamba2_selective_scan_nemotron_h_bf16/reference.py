"""Mamba-2 selective state-space scan (SSD) with softplus time steps, D skip and carried state for Nemotron-H 8B."""

# Designed for MetaKernelBench from the public Nemotron-H-8B config (Mamba-2 mixer: 128 heads of dim 64, state size 128,
# 8 B/C groups, chunk 128); a prefill batch of 2 sequences of 4096 tokens with Mamba-2 initialisation ranges.

import math

import torch
import torch.nn.functional as F

NUM_HEADS = 128
HEAD_DIM = 64
STATE_DIM = 128
NUM_GROUPS = 8
CHUNK = 128                     # chunk length of the reference's chunked (SSD) evaluation; the result is exact
BATCH = {"full": 2, "smoke": 1}
SEQ_LEN = {"full": 4096, "smoke": 200}
DT_MIN, DT_MAX = 1e-3, 1e-1     # Mamba-2 time-step initialisation range
A_MIN, A_MAX = 1.0, 16.0        # Mamba-2 A initialisation range (A = -exp(A_log))
DT_NOISE = 0.5


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """seg[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf above the diagonal (no cancellation)."""
    m = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, m)
    x = x.masked_fill(~torch.ones(m, m, dtype=torch.bool, device=a.device).tril(-1), 0.0)
    seg = x.cumsum(dim=-2)
    return seg.masked_fill(~torch.ones(m, m, dtype=torch.bool, device=a.device).tril(), float("-inf"))


@torch.no_grad()
def reference(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor, dt_bias: torch.Tensor,
              initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    assert (h, p, g, n) == (NUM_HEADS, HEAD_DIM, NUM_GROUPS, STATE_DIM) and C.shape == B.shape
    assert initial_state.shape == (b, h, p, n)
    wide = torch.promote_types(x.dtype, torch.float32)
    r = h // g                                                   # head h reads B/C group h // r
    delta = F.softplus(dt.to(wide) + dt_bias.to(wide))           # [b, l, h]
    a_rate = -A_log.to(wide).exp()
    pad = (-l) % CHUNK
    xw, bw, cw = x.to(wide), B.to(wide), C.to(wide)
    if pad:  # padded steps: delta = 0 (no decay, no input), outputs discarded
        xw, bw, cw = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (xw, bw, cw))
        delta = F.pad(delta, (0, 0, 0, pad))
    c = (l + pad) // CHUNK
    s = CHUNK
    xw = xw.view(b, c, s, g, r, p)
    bw, cw = bw.view(b, c, s, g, n), cw.view(b, c, s, g, n)
    delta = delta.view(b, c, s, g, r)
    cum = (delta * a_rate.view(g, r)).cumsum(dim=2).permute(0, 1, 3, 4, 2)          # [b, c, g, r, s]
    xdt = (xw * delta[..., None]).permute(0, 1, 3, 4, 2, 5)                         # [b, c, g, r, s, p]
    lower = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    # diagonal blocks: y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) delta_j x_j
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~lower, float("-inf")).exp_()
    cb = torch.einsum("bcign,bcjgn->bcgij", cw, bw)
    y = (decay.mul_(cb[:, :, :, None]) @ xdt)
    del decay
    # state contributed by each chunk alone, at the chunk's end: [b, c, g, r, p, n]
    to_end = (cum[..., -1:] - cum).exp()
    local = (xdt * to_end[..., None]).transpose(-1, -2) @ bw.permute(0, 1, 3, 2, 4)[:, :, :, None]
    # states entering chunk 0..c-1 and the final state: decayed sums over the initial state and earlier chunks
    z = torch.cat((initial_state.to(wide).view(b, 1, g, r, p, n), local), dim=1)        # [b, c+1, g, r, p, n]
    totals = F.pad(cum[..., -1], (0, 0, 0, 0, 1, 0)).permute(0, 2, 3, 1)       # [b, g, r, c+1], leading 0
    weights = _segsum(totals).exp()                                                  # [b, g, r, c+1, c+1]
    entering = (weights @ z.permute(0, 2, 3, 1, 4, 5).reshape(b, g, r, c + 1, p * n)).view(b, g, r, c + 1, p, n)
    final_state = entering[:, :, :, -1].reshape(b, h, p, n)
    # off-diagonal part: y_i += exp(cum_i) C_i . S_entering
    y += torch.einsum("bcsgn,bgrcpn->bcgrsp", cw, entering[:, :, :, :-1]) * cum.exp()[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, c * s, h, p)[:, :l]
    y = y + D.to(wide)[:, None] * x.to(wide)
    return y.to(x.dtype), final_state


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, l = BATCH[size], SEQ_LEN[size]
    x = torch.randn(b, l, NUM_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    # Mamba-2 ranges: per-head time step dt0 log-uniform in [1e-3, 1e-1] (dt_bias = softplus^-1(dt0)) and
    # A = -U(1, 16); per-step decay exp(dt*A) spans ~0.9999 to ~0.2, so memory ranges from a few tokens to the
    # whole sequence and the initial state stays visible on slow heads
    dt0 = torch.exp(math.log(DT_MIN) + (math.log(DT_MAX) - math.log(DT_MIN)) * torch.rand(NUM_HEADS, device=device))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    A_log = torch.log(A_MIN + (A_MAX - A_MIN) * torch.rand(NUM_HEADS, device=device))
    dt = (DT_NOISE * torch.randn(b, l, NUM_HEADS, device=device)).to(torch.bfloat16)
    B = torch.randn(b, l, NUM_GROUPS, STATE_DIM, device=device).to(torch.bfloat16)
    C = torch.randn(b, l, NUM_GROUPS, STATE_DIM, device=device).to(torch.bfloat16)
    D = 1.0 + 0.1 * torch.randn(NUM_HEADS, device=device)
    # initial state at each head's steady-state scale: var = dt0^2 / (1 - exp(-2 dt0 |A|))
    std = torch.sqrt(dt0.square() / -torch.expm1(-2.0 * dt0 * A_log.exp()))
    initial_state = std[:, None, None] * torch.randn(b, NUM_HEADS, HEAD_DIM, STATE_DIM, device=device)
    return [x, dt, A_log, B, C, D, dt_bias, initial_state]
