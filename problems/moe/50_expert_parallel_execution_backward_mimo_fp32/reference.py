"""Backward of the grouped SwiGLU expert computation on one expert-parallel rank (8 local experts, ragged token groups, probability-weighted outputs) for MiMo-V2-Flash."""

# Designed for MetaKernelBench from the public MiMo-V2-Flash config (hidden 4096, 256 routed experts, top-8, expert
# intermediate 2048, SiLU-gated experts); one rank of 32-way expert parallelism holds 8 experts and receives the
# tokens routed to them, grouped by expert, after the dispatch all-to-all.

import math

import torch

# per size: hidden, expert intermediate, local experts, dispatched rows
HIDDEN = {"full": 4096, "smoke": 64}
INTERMEDIATE = {"full": 2048, "smoke": 32}
LOCAL_EXPERTS = {"full": 8, "smoke": 4}
ROWS = {"full": 8192, "smoke": 40}


@torch.no_grad()
def reference(expert_inputs: torch.Tensor, tokens_per_expert: torch.Tensor, routing_probs: torch.Tensor,
              w_gate_up: torch.Tensor, w_down: torch.Tensor, grad_outputs: torch.Tensor):
    rows, hidden = expert_inputs.shape
    local_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    assert w_down.shape == (local_experts, hidden, inter) and tokens_per_expert.shape == (local_experts,)
    assert routing_probs.shape == (rows,) and grad_outputs.shape == (rows, hidden)
    wide = torch.promote_types(expert_inputs.dtype, torch.float32)
    counts = tokens_per_expert.tolist()
    assert sum(counts) == rows

    grad_inputs = torch.empty(rows, hidden, dtype=wide, device=expert_inputs.device)
    grad_probs = torch.empty(rows, dtype=wide, device=expert_inputs.device)
    grad_w_gate_up = torch.zeros(local_experts, two_inter, hidden, dtype=wide, device=expert_inputs.device)
    grad_w_down = torch.zeros(local_experts, hidden, inter, dtype=wide, device=expert_inputs.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sl = slice(start, start + n)
        start += n
        x = expert_inputs[sl].to(wide)
        w1 = w_gate_up[e].to(wide)
        w2 = w_down[e].to(wide)
        p = routing_probs[sl].to(wide).unsqueeze(1)
        gy = grad_outputs[sl].to(wide)
        # forward recompute: y = p * (silu(g) * u) @ w2^T, with [g, u] = x @ w1^T (gate rows first)
        h = x @ w1.t()
        g, u = h[:, :inter], h[:, inter:]
        sg = torch.sigmoid(g)
        silu = g * sg
        a = silu * u
        o = a @ w2.t()
        # backward
        grad_probs[sl] = (gy * o).sum(dim=1)
        go = gy * p
        grad_w_down[e] = go.t() @ a
        ga = go @ w2
        gg = ga * u * (sg * (1 + g * (1 - sg)))
        gu = ga * silu
        gh = torch.cat([gg, gu], dim=1)
        grad_w_gate_up[e] = gh.t() @ x
        grad_inputs[sl] = gh @ w1
    return grad_inputs, grad_probs, grad_w_gate_up, grad_w_down


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    hidden, inter, local, rows = HIDDEN[size], INTERMEDIATE[size], LOCAL_EXPERTS[size], ROWS[size]
    # ragged groups: token counts per local expert drawn with uneven popularity (the smoke size also has an
    # expert that received no tokens)
    popularity = torch.softmax(0.6 * torch.randn(local, device=device), dim=0)
    if size == "smoke":
        popularity[1] = 0.0
    expert_of_row = torch.multinomial(popularity, rows, replacement=True)
    tokens_per_expert = torch.bincount(expert_of_row, minlength=local).to(torch.int64)
    expert_inputs = torch.randn(rows, hidden, device=device)
    # combine weights of the routed copies: renormalized top-8 sigmoid scores, roughly 1/8 each
    routing_probs = torch.distributions.Dirichlet(torch.full((8,), 2.0, device=device)).sample((rows,))[:, 0]
    w_gate_up = torch.randn(local, 2 * inter, hidden, device=device) / math.sqrt(hidden)
    w_down = torch.randn(local, hidden, inter, device=device) / math.sqrt(inter)
    grad_outputs = torch.randn(rows, hidden, device=device)
    return [expert_inputs, tokens_per_expert, routing_probs, w_gate_up, w_down, grad_outputs]
