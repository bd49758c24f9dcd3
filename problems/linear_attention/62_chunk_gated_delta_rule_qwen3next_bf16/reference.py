"""Chunked gated delta rule prefill with in-kernel query/key L2 normalization and carried state for Qwen3-Next 80B A3B."""

# Designed for MetaKernelBench from the public Qwen3-Next-80B-A3B config (gated DeltaNet layers: 16 query/key heads,
# 32 value heads, head dim 128, query/key L2-normalized inside the kernel); a batch of 4 sequences of 4096 tokens.

import torch
import torch.nn.functional as F

NUM_QK_HEADS = 16
NUM_V_HEADS = 32
HEAD_DIM = 128
CHUNK = 64                      # chunk length of the reference's chunked (WY) evaluation; the result is exact
L2_EPS = 1e-6
SCALE = HEAD_DIM ** -0.5
BATCH = {"full": 4, "smoke": 1}
SEQ_LEN = {"full": 4096, "smoke": 80}
# per-head mean decay rate -log(alpha) drawn log-uniformly in [RATE_MIN, RATE_MAX] per token
RATE_MIN, RATE_MAX = 1e-3, 0.5
STATE_STD = 0.25                # scale of a state that has absorbed a long prefix


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + L2_EPS)


def _chunked_gated_delta(q, k, v, g, beta, state):
    """Exact chunked evaluation of S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = S_t^T q_t.

    q, k: [N, T, K]; v: [N, T, V]; g = log a: [N, T]; beta: [N, T]; state: [N, K, V]; all one floating dtype.
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
    cum = g.view(n, c, CHUNK).cumsum(dim=-1)                                   # log decay since chunk start
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    # (I + A) U = beta (V - diag(e^cum) K S0) with A strictly lower: the WY form of the chunk's sequential writes
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
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, hqk, d = q.shape
    hv = v.shape[2]
    assert (hqk, hv, d) == (NUM_QK_HEADS, NUM_V_HEADS, HEAD_DIM) and k.shape == q.shape
    assert initial_state.shape == (b, hv, d, d)
    wide = torch.promote_types(q.dtype, torch.float32)
    rep = hv // hqk
    # value head h reads query/key head h // rep; fold (batch, value head) into one axis
    qn = (_l2norm(q.to(wide)) * scale).repeat_interleave(rep, dim=2).transpose(1, 2).reshape(b * hv, t, d)
    kn = _l2norm(k.to(wide)).repeat_interleave(rep, dim=2).transpose(1, 2).reshape(b * hv, t, d)
    vw = v.to(wide).transpose(1, 2).reshape(b * hv, t, d)
    gw = g.to(wide).transpose(1, 2).reshape(b * hv, t)
    bw = beta.to(wide).transpose(1, 2).reshape(b * hv, t)
    s0 = initial_state.to(wide).reshape(b * hv, d, d)
    out, s = _chunked_gated_delta(qn, kn, vw, gw, bw, s0)
    out = out.view(b, hv, t, d).transpose(1, 2).to(v.dtype)
    return out, s.view(b, hv, d, d)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, t = BATCH[size], SEQ_LEN[size]
    q = torch.randn(b, t, NUM_QK_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    k = torch.randn(b, t, NUM_QK_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    v = torch.randn(b, t, NUM_V_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    # decay: g = -rate_h * softplus(x) / ln 2 with x ~ N(0, 1), so per-head mean rates span 1e-3 (memory of
    # thousands of tokens: the initial state stays visible) to 0.5 (memory of a few tokens)
    lo, hi = torch.log(torch.tensor(RATE_MIN)), torch.log(torch.tensor(RATE_MAX))
    rate = torch.exp(lo + (hi - lo) * torch.rand(NUM_V_HEADS, device=device))
    g = -rate * F.softplus(torch.randn(b, t, NUM_V_HEADS, device=device)) / torch.log(torch.tensor(2.0))
    beta = torch.sigmoid(torch.randn(b, t, NUM_V_HEADS, device=device)).to(torch.bfloat16)
    initial_state = STATE_STD * torch.randn(b, NUM_V_HEADS, HEAD_DIM, HEAD_DIM, device=device)
    return [q, k, v, g, beta, initial_state, SCALE]
