"""DeltaNet forward: per-token rank-one delta-rule corrections of a linear-attention state without decay, starting from a given state."""

# Based on the public flash-linear-attention delta rule (MIT) and its DeltaNet head geometry (16 heads of 128):
# batch 8 x 1024 tokens, query/key L2-normalized inside the kernel, values and initial state drawn per draw.

import torch
import torch.nn.functional as F

NUM_HEADS = 16
KEY_DIM = 128
VALUE_DIM = 128
CHUNK = 64                      # chunk length of the reference's chunked (WY) evaluation; the result is exact
NORM_EPS = 1e-12                # q / max(|q|, eps), as torch.nn.functional.normalize
BATCH = {"full": 8, "smoke": 2}
SEQ_LEN = {"full": 1024, "smoke": 100}


def _chunked_delta(q, k, v, beta, state):
    """Exact chunked evaluation of S_t = S_{t-1} + b_t k_t (v_t - S_{t-1}^T k_t)^T, o_t = S_t^T q_t.

    q, k: [N, T, K]; v: [N, T, V]; beta: [N, T]; state S: [N, K, V]; one floating dtype.
    """
    n, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    if pad:  # padded steps write nothing and are not read
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, pad))
    c = (t + pad) // CHUNK
    q, k, v = q.view(n, c, CHUNK, dk), k.view(n, c, CHUNK, dk), v.view(n, c, CHUNK, dv)
    beta = beta.view(n, c, CHUNK, 1)
    # (I + A) U = beta (V - K S0) with A = strictly-lower(beta K K^T): the WY form of the chunk's sequential writes
    a = (beta * (k @ k.transpose(-1, -2))).tril(-1)
    sol = torch.linalg.solve_triangular(a, torch.cat((beta * v, beta * k), dim=-1), upper=False, unitriangular=True)
    u_free, w = sol[..., :dv], sol[..., dv:]
    qk = (q @ k.transpose(-1, -2)).tril()
    out = torch.empty_like(v)
    s = state
    for i in range(c):
        u = u_free[:, i] - w[:, i] @ s
        out[:, i] = q[:, i] @ s + qk[:, i] @ u
        s = s + k[:, i].transpose(-1, -2) @ u
    return out.view(n, c * CHUNK, dv)[:, :t], s


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    assert (h, dk, dv) == (NUM_HEADS, KEY_DIM, VALUE_DIM) and initial_state.shape == (b, h, dk, dv)
    wide = torch.promote_types(q.dtype, torch.float32)
    qn = F.normalize(q.to(wide), p=2.0, dim=-1, eps=NORM_EPS) * dk ** -0.5
    kn = F.normalize(k.to(wide), p=2.0, dim=-1, eps=NORM_EPS)
    out, s = _chunked_delta(qn.reshape(b * h, t, dk), kn.reshape(b * h, t, dk), v.to(wide).reshape(b * h, t, dv),
                            beta.to(wide).reshape(b * h, t), initial_state.to(wide).reshape(b * h, dk, dv))
    return out.view(b, h, t, dv).to(q.dtype), s.view(b, h, dk, dv)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, t = BATCH[size], SEQ_LEN[size]
    q = torch.randn(b, NUM_HEADS, t, KEY_DIM, device=device).to(torch.bfloat16)
    k = torch.randn(b, NUM_HEADS, t, KEY_DIM, device=device).to(torch.bfloat16)
    v = torch.randn(b, NUM_HEADS, t, VALUE_DIM, device=device).to(torch.bfloat16)
    beta = torch.sigmoid(torch.randn(b, NUM_HEADS, t, device=device)).to(torch.bfloat16)
    initial_state = torch.randn(b, NUM_HEADS, KEY_DIM, VALUE_DIM, device=device)
    return [q, k, v, beta, initial_state]
