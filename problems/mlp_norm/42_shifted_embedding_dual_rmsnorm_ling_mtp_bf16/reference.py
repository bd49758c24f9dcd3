"""Ling 2.0 multi-token-prediction input: embed the next token of every position, RMS-normalize it and the previous hidden state, and concatenate."""
# Designed for MetaKernelBench from the public Ling-mini-2.0 config: hidden 2048, vocab 157184,
# rms_norm_eps 1e-6, one next-token-prediction (MTP) layer whose input is cat(enorm(embed), hnorm(hidden)).

import torch

HIDDEN = {"full": 2048, "smoke": 128}
VOCAB = {"full": 157184, "smoke": 1000}
# packed sequences of one batch (16384 tokens in all)
SEQ_LENS = {"full": (3071, 1, 2048, 517, 4096, 1900, 2751, 2000), "smoke": (5, 1, 17, 9)}
EPS = 1e-6


@torch.no_grad()
def reference(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, next_tokens: torch.Tensor,
              hidden_states: torch.Tensor, embed_weight: torch.Tensor, enorm_weight: torch.Tensor,
              hnorm_weight: torch.Tensor) -> torch.Tensor:
    tokens, hidden = hidden_states.shape
    assert input_ids.shape == (tokens,) and cu_seqlens.shape == (next_tokens.shape[0] + 1,)
    assert embed_weight.shape[1] == hidden and enorm_weight.shape == (hidden,) and hnorm_weight.shape == (hidden,)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    ids = input_ids.long()
    # position t of a sequence takes the token at t + 1; a sequence's last position takes its next token
    shifted = torch.empty_like(ids)
    shifted[:-1] = ids[1:]
    shifted[cu_seqlens[1:].long() - 1] = next_tokens.long()
    e = embed_weight[shifted].to(wide)
    h = hidden_states.to(wide)
    e = e * torch.rsqrt(e.square().mean(dim=-1, keepdim=True) + EPS) * enorm_weight.to(wide)
    h = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + EPS) * hnorm_weight.to(wide)
    return torch.cat((e, h), dim=-1).to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, vocab, lens = HIDDEN[size], VOCAB[size], SEQ_LENS[size]
    n = sum(lens)
    f32, bf16 = torch.float32, torch.bfloat16
    input_ids = torch.randint(0, vocab, (n,), device=device, dtype=torch.int64)
    cu_seqlens = torch.tensor((0,) + tuple(int(x) for x in torch.tensor(lens).cumsum(0)), device=device,
                              dtype=torch.int32)
    next_tokens = torch.randint(0, vocab, (len(lens),), device=device, dtype=torch.int64)
    # main-model final hidden states (before its final norm): large, per-token varying magnitude
    row_scale = torch.exp(1.0 + 0.5 * torch.randn(n, 1, device=device, dtype=f32))
    hidden_states = (torch.randn(n, hidden, device=device, dtype=f32) * row_scale).to(bf16)
    embed_weight = (0.02 * torch.randn(vocab, hidden, device=device, dtype=f32)).to(bf16)
    enorm_weight = (1 + 0.1 * torch.randn(hidden, device=device, dtype=f32)).to(bf16)
    hnorm_weight = (1 + 0.1 * torch.randn(hidden, device=device, dtype=f32)).to(bf16)
    return [input_ids, cu_seqlens, next_tokens, hidden_states, embed_weight, enorm_weight, hnorm_weight]
