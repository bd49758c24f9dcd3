"""Qwen3-Next 80B A3B (TP=2) gated DeltaNet check of several draft tokens per request from a state pool, returning every per-token state."""

# Based on the public FlashInfer-Trace definition gdn_mtp_qk8_v16_d128_k_last (Apache-2.0): batch, draft length, pool
# size, scale and the per-head A_log / dt_bias of one captured workload record; everything else re-drawn per draw.

import torch
import torch.nn.functional as F

NUM_Q_HEADS = 8
NUM_K_HEADS = 8
NUM_V_HEADS = 16
HEAD_SIZE = 128
L2_EPS = 1e-6
# (batch, draft tokens per request, state-pool slots)
GEOMETRY = {"full": (32, 4, 49), "smoke": (3, 3, 5)}
A_LOG = (-1.046875, -0.5234375, -1.828125, -1.15625, -0.0244140625, 0.28515625, -1.9921875, -2.0, 0.11962890625,
         0.3671875, -1.59375, -1.34375, 0.333984375, -1.640625, -0.5234375, -0.2890625)
DT_BIAS = (-5.25, -5.75, -2.015625, -3.3125, -6.25, -6.65625, -0.88671875, -0.6328125, -4.8125, -5.28125, -1.7578125,
           -3.484375, 2.3125, -6.40625, -6.34375, -6.75)
# scales of the captured projections and state pool
A_MEAN, A_STD = 0.82, 2.24
B_MEAN, B_STD = 0.45, 2.02
Q_STD, K_STD, V_STD = 0.63, 0.26, 0.13
STATE_STD = 0.0215
SCALE = HEAD_SIZE ** -0.5


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + L2_EPS)


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor,
              initial_state_indices: torch.Tensor, A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
              b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, t, hq, d = q.shape
    hk, hv = k.shape[2], v.shape[2]
    assert t > 1 and (hq, hk, hv, d) == (NUM_Q_HEADS, NUM_K_HEADS, NUM_V_HEADS, HEAD_SIZE)
    assert initial_state.shape[1:] == (hv, d, d) and initial_state_indices.shape == (batch,)
    wide = torch.promote_types(q.dtype, torch.float32)
    alpha = torch.exp(-A_log.to(wide).exp() * F.softplus(a.to(wide) + dt_bias.to(wide)))        # [B, T, HV]
    beta = torch.sigmoid(b.to(wide))
    qn = _l2norm(q.to(wide)).repeat_interleave(hv // hq, dim=2)                                 # [B, T, HV, K]
    kn = _l2norm(k.to(wide)).repeat_interleave(hv // hk, dim=2)
    vw = v.to(wide)
    s = initial_state[initial_state_indices.long()].to(wide)                                   # k-last [B, HV, V, K]
    output = torch.empty(batch, t, hv, d, dtype=q.dtype, device=q.device)
    states = torch.empty(batch, t, hv, d, d, dtype=wide, device=q.device)
    for i in range(t):
        s = alpha[:, i, :, None, None] * s
        predicted = (s @ kn[:, i, ..., None])[..., 0]                                          # S^T k: [B, HV, V]
        delta = beta[:, i, :, None] * (vw[:, i] - predicted)
        s = s + delta[..., :, None] * kn[:, i, :, None, :]
        output[:, i] = (scale * (s @ qn[:, i, ..., None])[..., 0]).to(q.dtype)
        states[:, i] = s
    return output, states


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    n, t, pool = GEOMETRY[size]
    q = (Q_STD * torch.randn(n, t, NUM_Q_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    k = (K_STD * torch.randn(n, t, NUM_K_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    v = (V_STD * torch.randn(n, t, NUM_V_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    initial_state = STATE_STD * torch.randn(pool, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, device=device)
    # each request owns a distinct pool slot, scattered over the pool
    initial_state_indices = torch.randperm(pool, device=device)[:n].to(torch.int32)
    A_log = torch.tensor(A_LOG, device=device, dtype=torch.float32)
    a = (A_MEAN + A_STD * torch.randn(n, t, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    dt_bias = torch.tensor(DT_BIAS, device=device, dtype=torch.float32)
    b = (B_MEAN + B_STD * torch.randn(n, t, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    return [q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, SCALE]
