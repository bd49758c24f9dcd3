"""Qwen3-Next 80B A3B (TP=2) gated DeltaNet single-token decode for a batch of requests, updating each request's recurrent state."""

# Based on the public FlashInfer-Trace definition gdn_decode_qk8_v16_d128_k_last (Apache-2.0): batch size, scale and the
# per-head A_log / dt_bias of one captured workload record; projections and state re-drawn per draw at captured scales.

import torch
import torch.nn.functional as F

NUM_Q_HEADS = 8
NUM_K_HEADS = 8
NUM_V_HEADS = 16
HEAD_SIZE = 128
L2_EPS = 1e-6
BATCH = {"full": 64, "smoke": 3}
A_LOG = (-0.169921875, 2.34375, 1.3359375, 2.1875, -0.9375, -1.09375, 1.765625, -0.443359375, 0.91015625, -0.8125,
         2.328125, 0.205078125, 1.375, 2.796875, -0.88671875, -1.3046875)
DT_BIAS = (-2.078125, -5.625, -4.3125, -3.421875, -3.796875, -3.296875, -4.375, -6.25, -3.703125, -0.2890625,
           -5.21875, -6.1875, -3.046875, -5.0625, -4.875, -5.34375)
# scales of the captured projections and state
A_MEAN, A_STD = 1.33, 1.56
B_MEAN, B_STD = 0.4, 1.38
Q_STD, K_STD, V_STD = 0.18, 0.13, 0.073
STATE_STD = 0.009
SCALE = HEAD_SIZE ** -0.5


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + L2_EPS)


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, A_log: torch.Tensor,
              a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, t, hq, d = q.shape
    hk, hv = k.shape[2], v.shape[2]
    assert t == 1 and (hq, hk, hv, d) == (NUM_Q_HEADS, NUM_K_HEADS, NUM_V_HEADS, HEAD_SIZE)
    assert state.shape == (batch, hv, d, d)
    wide = torch.promote_types(q.dtype, torch.float32)
    alpha = torch.exp(-A_log.to(wide).exp() * F.softplus(a[:, 0].to(wide) + dt_bias.to(wide)))   # [B, HV]
    beta = torch.sigmoid(b[:, 0].to(wide))
    # per-head L2 normalization of query and key inside the kernel; value head h reads q/k head h // 2
    qn = _l2norm(q[:, 0].to(wide)).repeat_interleave(hv // hq, dim=1)                            # [B, HV, K]
    kn = _l2norm(k[:, 0].to(wide)).repeat_interleave(hv // hk, dim=1)
    s = alpha[..., None, None] * state.to(wide)                                                 # k-last [B, HV, V, K]
    predicted = (s @ kn[..., None])[..., 0]                                                     # S^T k: [B, HV, V]
    delta = beta[..., None] * (v[:, 0].to(wide) - predicted)
    s = s + delta[..., :, None] * kn[..., None, :]
    out = scale * (s @ qn[..., None])[..., 0]
    return out[:, None].to(q.dtype), s


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    n = BATCH[size]
    q = (Q_STD * torch.randn(n, 1, NUM_Q_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    k = (K_STD * torch.randn(n, 1, NUM_K_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    v = (V_STD * torch.randn(n, 1, NUM_V_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    state = STATE_STD * torch.randn(n, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, device=device)
    A_log = torch.tensor(A_LOG, device=device, dtype=torch.float32)
    a = (A_MEAN + A_STD * torch.randn(n, 1, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    dt_bias = torch.tensor(DT_BIAS, device=device, dtype=torch.float32)
    b = (B_MEAN + B_STD * torch.randn(n, 1, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    return [q, k, v, state, A_log, a, dt_bias, b, SCALE]
