"""Gated linear attention (GLA) forward: a matrix state decayed per key channel by data-dependent gates and updated with k v^T each token."""

# Based on the public flash-linear-attention GLA recurrence (MIT) and the GLA 1.3B head geometry (4 heads, key dim 256,
# value dim 512): batch 8 x 1024 tokens, gates logsigmoid(N(0,1))/16 per channel as in its tests.

import torch
import torch.nn.functional as F

NUM_HEADS = 4
KEY_DIM = 256
VALUE_DIM = 512
CHUNK = 32                      # chunk length of the reference's chunked evaluation; the result is exact
GATE_LOGIT_NORMALIZER = 16.0
BATCH = {"full": 8, "smoke": 2}
SEQ_LEN = {"full": 1024, "smoke": 45}


def _chunked_gla(q, k, v, g, state):
    """Exact chunked evaluation of S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t.

    q, k, g: [N, T, K]; v: [N, T, V]; state S: [N, K, V]; one floating dtype.
    """
    n, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    if pad:  # padded steps: no decay, no write, no read
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    c = (t + pad) // CHUNK
    q, k, v = q.view(n, c, CHUNK, dk), k.view(n, c, CHUNK, dk), v.view(n, c, CHUNK, dv)
    cum = g.view(n, c, CHUNK, dk).cumsum(dim=2)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    s = state
    for i in range(c):
        qi, ki, vi, ci = q[:, i], k[:, i], v[:, i], cum[:, i]
        # pairwise per-channel decay exp(cum_t - cum_s) for s <= t, zero above the diagonal: [N, C(t), C(s), K]
        decay = (ci[:, :, None, :] - ci[:, None, :, :]).masked_fill(~lower[..., None], float("-inf")).exp()
        qk = torch.einsum("ntsk,ntk->nts", decay * ki[:, None, :, :], qi)
        out[:, i] = (qi * ci.exp()) @ s + qk @ vi
        last = ci[:, -1:, :]
        s = last.transpose(-1, -2).exp() * s + (ki * (last - ci).exp()).transpose(-1, -2) @ vi
    return out.view(n, c * CHUNK, dv)[:, :t], s


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor) -> torch.Tensor:
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    assert (h, dk, dv) == (NUM_HEADS, KEY_DIM, VALUE_DIM) and k.shape == q.shape == gk.shape
    wide = torch.promote_types(q.dtype, torch.float32)

    def heads(x):  # [B, T, H, D] -> [B*H, T, D]
        return x.to(wide).transpose(1, 2).reshape(b * h, t, x.shape[-1])

    s0 = torch.zeros(b * h, dk, dv, dtype=wide, device=q.device)
    out, _ = _chunked_gla(heads(q) * dk ** -0.5, heads(k), heads(v), heads(gk), s0)
    return out.view(b, h, t, dv).transpose(1, 2).to(q.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, t = BATCH[size], SEQ_LEN[size]
    q = torch.randn(b, t, NUM_HEADS, KEY_DIM, device=device).to(torch.bfloat16)
    k = torch.randn(b, t, NUM_HEADS, KEY_DIM, device=device).to(torch.bfloat16)
    v = torch.randn(b, t, NUM_HEADS, VALUE_DIM, device=device).to(torch.bfloat16)
    # per-channel log decay logsigmoid(N(0,1))/16: mean about -0.05 a step (memory of ~20 tokens, several chunks
    # for the slowest channels), so the state neither vanishes nor grows without bound
    gk = (F.logsigmoid(torch.randn(b, t, NUM_HEADS, KEY_DIM, device=device)) / GATE_LOGIT_NORMALIZER).to(torch.bfloat16)
    return [q, k, v, gk]
