"""Backward through Jamba's token embedding and first-layer RMSNorm: the RMSNorm gradients, scatter-added into a dense embedding gradient."""
# Designed for MetaKernelBench from the public Jamba-v0.1 config: hidden 4096, vocab 65536, rms_norm_eps 1e-6;
# layer 0 normalizes the embedding output (input_layernorm) while the embedding also feeds the residual stream.

import torch

HIDDEN = {"full": 4096, "smoke": 128}
VOCAB = {"full": 65536, "smoke": 512}
BATCH = {"full": (4, 4096), "smoke": (2, 40)}    # (sequences, tokens each)
FREQUENT = {"full": 32, "smoke": 4}              # a few frequent tokens recur many times
FREQUENT_SHARE = 0.1
EPS = 1e-6


@torch.no_grad()
def reference(input_ids: torch.Tensor, embed_weight: torch.Tensor, norm_weight: torch.Tensor,
              d_normed: torch.Tensor, d_residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, hidden = embed_weight.shape
    assert d_normed.shape == input_ids.shape + (hidden,) and d_residual.shape == d_normed.shape
    assert norm_weight.shape == (hidden,)
    wide = torch.promote_types(embed_weight.dtype, torch.float32)
    ids = input_ids.reshape(-1).long()
    e = embed_weight[ids].to(wide)                                     # forward: e = E[ids], y = e * rstd * w
    rstd = torch.rsqrt(e.square().mean(dim=-1, keepdim=True) + EPS)
    ehat = e * rstd
    g = d_normed.reshape(-1, hidden).to(wide)
    d_norm_weight = (g * ehat).sum(dim=0)
    gw = g * norm_weight.to(wide)
    de = d_residual.reshape(-1, hidden).to(wide) + rstd * (gw - ehat * (gw * ehat).mean(dim=-1, keepdim=True))
    # duplicate tokens accumulate; float64 accumulation keeps the result independent of the summation order
    d_embed = torch.zeros(vocab, hidden, dtype=torch.float64, device=de.device).index_add_(0, ids, de.double())
    return d_embed.to(embed_weight.dtype), d_norm_weight.to(norm_weight.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, vocab = HIDDEN[size], VOCAB[size]
    batch, length = BATCH[size]
    n = batch * length
    f32, bf16 = torch.float32, torch.bfloat16
    # token ids: uniform over the vocabulary, except 10% of positions drawn from a few frequent tokens
    ids = torch.randint(0, vocab, (n,), device=device, dtype=torch.int64)
    frequent = torch.randint(0, vocab, (FREQUENT[size],), device=device, dtype=torch.int64)
    pick = frequent[torch.randint(0, FREQUENT[size], (n,), device=device)]
    ids = torch.where(torch.rand(n, device=device) < FREQUENT_SHARE, pick, ids).reshape(batch, length)
    embed_weight = (0.02 * torch.randn(vocab, hidden, device=device, dtype=f32)).to(bf16)
    norm_weight = (1 + 0.1 * torch.randn(hidden, device=device, dtype=f32)).to(bf16)
    # gradient scales chosen so the normalization path (amplified by rstd ~ 50) and the residual path into
    # the embedding gradient have comparable magnitude
    d_normed = (0.01 * torch.randn(batch, length, hidden, device=device, dtype=f32)).to(bf16)
    d_residual = (0.5 * torch.randn(batch, length, hidden, device=device, dtype=f32)).to(bf16)
    return [ids, embed_weight, norm_weight, d_normed, d_residual]
