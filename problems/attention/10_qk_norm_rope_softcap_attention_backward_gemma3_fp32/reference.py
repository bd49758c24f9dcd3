"""Backward of the Gemma 3 4B attention core (QK RMSNorm, rotary embedding, logit softcap, causal GQA): dq, dk, dv and norm-weight gradients."""

# Designed for MetaKernelBench from the public Gemma 3 4B config: 8 query and 4 KV heads of dim 256, query scale
# 256^-0.5, RMSNorm eps 1e-6 with (1 + weight) gain, global-layer rotary theta 1e6 with linear scaling 8; softcap 50.

import math

import torch

QO_HEADS = 8
KV_HEADS = 4
HEAD_DIM = 256
EPS = 1e-6
SCALING = 256 ** -0.5             # query_pre_attn_scalar ** -0.5
SOFTCAP = 50.0                    # logits -> SOFTCAP * tanh(logits / SOFTCAP)
ROPE_THETA = 1_000_000.0
ROPE_LINEAR_FACTOR = 8.0          # positions are divided by this factor (linear rope scaling)
SHAPE = {"full": (2, 2048), "smoke": (1, 40)}      # (batch, sequence length)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.no_grad()
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor,
              k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    assert (heads, kv_heads, dim) == (QO_HEADS, KV_HEADS, HEAD_DIM) and cos.shape == sin.shape == (seq, dim)
    wide = torch.promote_types(q.dtype, torch.float32)
    group = heads // kv_heads
    c, s = cos.to(wide)[:, None, :], sin.to(wide)[:, None, :]

    def norm(x, weight):                                      # Gemma RMSNorm: x / rms(x) * (1 + weight)
        inv = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
        return x * inv * (1 + weight.to(wide)), x * inv, inv

    # forward, recomputed: layouts [B, KV, G, S, D] for queries and [B, KV, S, D] for keys and values
    qx, kx = q.to(wide), k.to(wide)
    qn, q_hat, q_inv = norm(qx, q_norm_weight)
    kn, k_hat, k_inv = norm(kx, k_norm_weight)
    qr = (qn * c + _rotate_half(qn) * s).permute(0, 2, 1, 3).reshape(batch, kv_heads, group, seq, dim)
    kr = (kn * c + _rotate_half(kn) * s).permute(0, 2, 1, 3)
    vv = v.to(wide).permute(0, 2, 1, 3)
    do = dout.to(wide).permute(0, 2, 1, 3).reshape(batch, kv_heads, group, seq, dim)

    tanh = torch.tanh(torch.einsum("bhgqd,bhkd->bhgqk", qr, kr) * (SCALING / SOFTCAP))
    logits = SOFTCAP * tanh
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    logits.masked_fill_(causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    del logits
    o = torch.einsum("bhgqk,bhkd->bhgqd", probs, vv)

    # backward
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, do)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do, vv)
    rowdot = (do * o).sum(dim=-1, keepdim=True)               # sum_k p * dp = dO . O
    dscore = probs * (dprobs - rowdot) * (1 - tanh.square()) * SCALING   # through softmax, softcap and scale
    del dprobs, probs, tanh
    dqr = torch.einsum("bhgqk,bhkd->bhgqd", dscore, kr).reshape(batch, heads, seq, dim).permute(0, 2, 1, 3)
    dkr = torch.einsum("bhgqk,bhgqd->bhkd", dscore, qr).permute(0, 2, 1, 3)
    del dscore

    def unrope(g):                                            # transpose of x -> x*cos + rotate_half(x)*sin
        return g * c - _rotate_half(g * s)

    def unnorm(g, x_hat, inv, weight):                        # RMSNorm backward: input and weight gradients
        u = g * (1 + weight.to(wide))
        dx = inv * (u - x_hat * (u * x_hat).mean(dim=-1, keepdim=True))
        return dx, (g * x_hat).reshape(-1, dim).sum(dim=0)

    dq, dwq = unnorm(unrope(dqr), q_hat, q_inv, q_norm_weight)
    dk, dwk = unnorm(unrope(dkr), k_hat, k_inv, k_norm_weight)
    dv = dv.permute(0, 2, 1, 3)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dwq.to(q_norm_weight.dtype),
            dwk.to(k_norm_weight.dtype))


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    batch, seq = SHAPE[size]
    # query/key projections: noise plus a shared per-KV-head direction with a random per-token strength, so some
    # keys attract many queries (peaked attention that drives the softcap), with a random per-token scale that the
    # RMSNorm removes; values and the upstream gradient are plain Gaussian
    direction = torch.randn(KV_HEADS, 1, HEAD_DIM, device=device).repeat_interleave(QO_HEADS // KV_HEADS, dim=0)
    q = torch.randn(batch, seq, QO_HEADS, HEAD_DIM, device=device)
    q = (q + 2 * torch.rand(batch, seq, QO_HEADS, 1, device=device) * direction[:, 0]) \
        * torch.exp(0.5 * torch.randn(batch, seq, QO_HEADS, 1, device=device))
    k = torch.randn(batch, seq, KV_HEADS, HEAD_DIM, device=device)
    k = (k + 2 * torch.rand(batch, seq, KV_HEADS, 1, device=device) * direction[::QO_HEADS // KV_HEADS, 0]) \
        * torch.exp(0.5 * torch.randn(batch, seq, KV_HEADS, 1, device=device))
    v = torch.randn(batch, seq, KV_HEADS, HEAD_DIM, device=device)
    # Gemma stores the norm gain as an offset from 1; trained gains sit near 1
    q_norm_weight = 0.2 * torch.randn(HEAD_DIM, device=device)
    k_norm_weight = 0.2 * torch.randn(HEAD_DIM, device=device)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32) / ROPE_LINEAR_FACTOR, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    dout = torch.randn(batch, seq, QO_HEADS, HEAD_DIM, device=device)
    return [q, k, v, q_norm_weight, k_norm_weight, angles.cos(), angles.sin(), dout]
