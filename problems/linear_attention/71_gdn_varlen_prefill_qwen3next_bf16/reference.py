"""Qwen3-Next 80B A3B (TP=2) gated DeltaNet prefill over packed ragged sequences, each continuing from its own recurrent state."""

# Based on the public FlashInfer-Trace definition gdn_prefill_qk8_v16_d128_k_last (Apache-2.0): sequence boundaries,
# scale and the per-head A_log / dt_bias of one captured workload record; everything else re-drawn per draw.

import torch
import torch.nn.functional as F

NUM_Q_HEADS = 8
NUM_K_HEADS = 8
NUM_V_HEADS = 16
HEAD_SIZE = 128
CHUNK = 64                      # chunk length of the reference's chunked (WY) evaluation; the result is exact
CU_SEQLENS = {"full": (0, 19, 50, 940, 959), "smoke": (0, 5, 75, 90)}
# captured per-head decay parameters (16 value heads)
A_LOG = (1.3984375, 1.203125, 2.203125, 0.1474609375, 1.46875, -0.6171875, 1.8125, -1.359375, 0.50390625, 1.03125,
         2.953125, 1.2890625, 1.3203125, 2.109375, 3.34375, 1.78125)
DT_BIAS = (-2.34375, -3.421875, -4.03125, -1.65625, -3.25, 2.046875, -5.625, -2.65625, -2.375, -2.984375, -2.328125,
           -4.09375, -4.25, -3.71875, -4.96875, -3.578125)
# scales of the captured projections
A_MEAN, A_STD = -0.12, 1.26
B_MEAN, B_STD = 1.47, 2.01
V_STD = 0.041
STATE_STD = HEAD_SIZE ** -0.5
SCALE = HEAD_SIZE ** -0.5


def _chunked_gated_delta(q, k, v, g, beta, state):
    """Exact chunked evaluation of S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = S_t^T q_t.

    q, k: [N, T, K]; v: [N, T, V]; g = log a: [N, T]; beta: [N, T]; state S: [N, K, V]; one floating dtype.
    """
    n, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    if pad:  # padded steps: no decay, no write, no read
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    c = (t + pad) // CHUNK
    q, k, v = q.view(n, c, CHUNK, dk), k.view(n, c, CHUNK, dk), v.view(n, c, CHUNK, dv)
    beta = beta.view(n, c, CHUNK, 1)
    cum = g.view(n, c, CHUNK).cumsum(dim=-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = (beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat((beta * v, beta * cum.exp()[..., None] * k), dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u_free, w = sol[..., :dv], sol[..., dv:]
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    s = state
    for i in range(c):
        u = u_free[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + qk[:, i] @ u
        s = chunk_decay[:, i] * s + k_dec[:, i].transpose(-1, -2) @ u
    return out.view(n, c * CHUNK, dv)[:, :t], s


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, A_log: torch.Tensor,
              a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor, cu_seqlens: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    total, hq, d = q.shape
    hk, hv = k.shape[1], v.shape[1]
    assert (hq, hk, hv, d) == (NUM_Q_HEADS, NUM_K_HEADS, NUM_V_HEADS, HEAD_SIZE)
    num_seqs = cu_seqlens.numel() - 1
    assert state.shape == (num_seqs, hv, d, d)
    wide = torch.promote_types(q.dtype, torch.float32)
    # alpha = exp(-exp(A_log) * softplus(a + dt_bias)) is kept in log form; beta = sigmoid(b)
    g = -A_log.to(wide).exp() * F.softplus(a.to(wide) + dt_bias.to(wide))            # [T, HV]
    beta = torch.sigmoid(b.to(wide))
    rep = hv // hq
    qw = q.to(wide).repeat_interleave(rep, dim=1).transpose(0, 1) * scale            # [HV, T, K]
    kw = k.to(wide).repeat_interleave(hv // hk, dim=1).transpose(0, 1)
    vw = v.to(wide).transpose(0, 1)
    gw, bw = g.transpose(0, 1), beta.transpose(0, 1)
    output = torch.empty(total, hv, d, dtype=q.dtype, device=q.device)
    new_state = torch.empty(num_seqs, hv, d, d, dtype=wide, device=q.device)
    bounds = cu_seqlens.tolist()
    assert bounds[-1] == total
    for i in range(num_seqs):
        lo, hi = bounds[i], bounds[i + 1]
        s0 = state[i].to(wide).transpose(-1, -2)                                     # k-last [V, K] -> [K, V]
        out, s = _chunked_gated_delta(qw[:, lo:hi], kw[:, lo:hi], vw[:, lo:hi], gw[:, lo:hi], bw[:, lo:hi], s0)
        output[lo:hi] = out.transpose(0, 1).to(q.dtype)
        new_state[i] = s.transpose(-1, -2)
    return output, new_state


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    bounds = CU_SEQLENS[size]
    total, n = bounds[-1], len(bounds) - 1
    # query and key arrive L2-normalized (the captured prefill inputs are unit vectors per head)
    q = F.normalize(torch.randn(total, NUM_Q_HEADS, HEAD_SIZE, device=device), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(total, NUM_K_HEADS, HEAD_SIZE, device=device), dim=-1).to(torch.bfloat16)
    v = (V_STD * torch.randn(total, NUM_V_HEADS, HEAD_SIZE, device=device)).to(torch.bfloat16)
    # a non-zero carried state (k-last layout [seq, head, V, K]) so that the state path is observable
    state = STATE_STD * torch.randn(n, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, device=device)
    A_log = torch.tensor(A_LOG, device=device, dtype=torch.float32)
    a = (A_MEAN + A_STD * torch.randn(total, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    dt_bias = torch.tensor(DT_BIAS, device=device, dtype=torch.float32)
    b = (B_MEAN + B_STD * torch.randn(total, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    cu_seqlens = torch.tensor(bounds, device=device, dtype=torch.int64)
    return [q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, SCALE]
