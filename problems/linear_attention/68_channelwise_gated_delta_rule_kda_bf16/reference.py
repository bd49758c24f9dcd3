"""Kimi Delta Attention (KDA) forward: a delta-rule linear-attention state with its own data-dependent decay for every key channel."""

# Based on the public flash-linear-attention KDA recurrence (MIT) and its KDA head geometry (16 heads of 128):
# batch 8 x 1024 tokens, gates logsigmoid(N(0,1))/16 per channel as in its tests, all values drawn per draw.

import torch
import torch.nn.functional as F

NUM_HEADS = 16
HEAD_DIM = 128
CHUNK = 32                      # chunk length of the reference's chunked evaluation; the result is exact
NORM_EPS = 1e-12                # q / max(|q|, eps), as torch.nn.functional.normalize
GATE_LOGIT_NORMALIZER = 16.0
BATCH = {"full": 8, "smoke": 2}
SEQ_LEN = {"full": 1024, "smoke": 45}


def _chunked_kda(q, k, v, g, beta, state):
    """Exact chunked evaluation of S_t = D_t S_{t-1} + b_t k_t (v_t - (D_t S_{t-1})^T k_t)^T, o_t = S_t^T q_t,
    with D_t = diag(exp(g_t)) acting on the key axis.

    q, k, g: [N, T, K]; v: [N, T, V]; beta: [N, T]; state S: [N, K, V]; one floating dtype.
    """
    n, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    if pad:  # padded steps: no decay, no write, no read
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    c = (t + pad) // CHUNK
    q, k, v = q.view(n, c, CHUNK, dk), k.view(n, c, CHUNK, dk), v.view(n, c, CHUNK, dv)
    beta = beta.view(n, c, CHUNK, 1)
    cum = g.view(n, c, CHUNK, dk).cumsum(dim=2)                                  # per-channel log decay in chunk
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    s = state
    for i in range(c):
        qi, ki, vi, bi, ci = q[:, i], k[:, i], v[:, i], beta[:, i], cum[:, i]
        # pairwise per-channel decay exp(cum_t - cum_s) for s <= t, zero above the diagonal: [N, C(t), C(s), K]
        decay = (ci[:, :, None, :] - ci[:, None, :, :]).masked_fill(~lower[..., None], float("-inf")).exp()
        k_dec = decay * ki[:, None, :, :]                                          # k_s decayed to step t
        kk = torch.einsum("ntsk,ntk->nts", k_dec, ki)
        qk = torch.einsum("ntsk,ntk->nts", k_dec, qi)
        a = (bi * kk).tril(-1)
        rhs = torch.cat((bi * vi, bi * ki * ci.exp()), dim=-1)
        sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = sol[..., :dv] - sol[..., dv:] @ s                                      # corrected values written
        out[:, i] = (qi * ci.exp()) @ s + qk @ u
        last = ci[:, -1:, :]
        s = last.transpose(-1, -2).exp() * s + (ki * (last - ci).exp()).transpose(-1, -2) @ u
    return out.view(n, c * CHUNK, dv)[:, :t], s


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor) -> torch.Tensor:
    b, t, h, d = q.shape
    assert (h, d) == (NUM_HEADS, HEAD_DIM) and k.shape == q.shape == v.shape == g.shape
    wide = torch.promote_types(q.dtype, torch.float32)

    def heads(x):  # [B, T, H, ...] -> [B*H, T, ...]
        return x.to(wide).transpose(1, 2).reshape(b * h, t, *x.shape[3:])

    qn = F.normalize(q.to(wide), p=2.0, dim=-1, eps=NORM_EPS) * d ** -0.5
    kn = F.normalize(k.to(wide), p=2.0, dim=-1, eps=NORM_EPS)
    s0 = torch.zeros(b * h, d, d, dtype=wide, device=q.device)
    out, _ = _chunked_kda(heads(qn), heads(kn), heads(v), heads(g), heads(beta), s0)
    return out.view(b, h, t, d).transpose(1, 2).to(v.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, t = BATCH[size], SEQ_LEN[size]
    shape = (b, t, NUM_HEADS, HEAD_DIM)
    q = torch.randn(shape, device=device).to(torch.bfloat16)
    k = torch.randn(shape, device=device).to(torch.bfloat16)
    v = torch.randn(shape, device=device).to(torch.bfloat16)
    # per-channel log decay logsigmoid(N(0,1))/16: mean about -0.05 a step (memory of ~20 tokens), channels
    # range from almost no decay to -0.3 a step
    g = (F.logsigmoid(torch.randn(shape, device=device)) / GATE_LOGIT_NORMALIZER).to(torch.bfloat16)
    beta = torch.sigmoid(torch.randn(b, t, NUM_HEADS, device=device)).to(torch.bfloat16)
    return [q, k, v, g, beta]
