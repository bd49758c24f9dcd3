"""Qwen3-Next MoE layer: softmax top-10 routing over 512 SwiGLU experts plus a shared expert scaled by a sigmoid gate."""

# Designed for MetaKernelBench from the public Qwen3-Next-80B-A3B config (hidden 2048, 512 routed experts, top-10,
# norm_topk_prob, expert intermediate 512, one shared expert of intermediate 512 with a learned sigmoid gate).

import math

import torch

NUM_EXPERTS = 512
TOP_K = 10
EXPERT_CHUNK = 64            # experts per batched matmul in the reference (keeps the loop short)
TOKENS = {"full": 4096, "smoke": 16}
HIDDEN = {"full": 2048, "smoke": 32}
INTERMEDIATE = {"full": 512, "smoke": 16}
# Rows whose 10th/11th router-logit gap is below DECISION_MARGIN (logits have std ~1, so ~1e-3 relative) are redrawn.
DECISION_MARGIN = 1e-3
REDRAW_LIMIT = 32


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    inter = down.shape[-1]
    h = x @ gate_up.transpose(-1, -2)                    # gate rows first, then up rows
    return (torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]) @ down.transpose(-1, -2)


@torch.no_grad()
def reference(hidden_states: torch.Tensor, router_weight: torch.Tensor, experts_gate_up: torch.Tensor,
              experts_down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
              shared_expert_gate: torch.Tensor) -> torch.Tensor:
    tokens, hidden = hidden_states.shape
    num_experts = experts_gate_up.shape[0]
    assert num_experts == NUM_EXPERTS and router_weight.shape == (NUM_EXPERTS, hidden)
    assert shared_expert_gate.shape == (1, hidden)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    device = hidden_states.device
    x = hidden_states.to(wide)

    probs = torch.softmax(x @ router_weight.to(wide).t(), dim=-1)
    top = probs.topk(TOP_K, dim=-1)
    topk_weights = top.values / top.values.sum(dim=-1, keepdim=True)
    pairs = tokens * TOP_K

    # group the (token, k) pairs by expert into a padded [experts, capacity] table of pair ids (pad = `pairs`)
    flat = top.indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    sorted_experts = flat[order]
    slot = torch.arange(pairs, device=device) - starts[sorted_experts]
    table = torch.full((num_experts, int(counts.max())), pairs, dtype=torch.long, device=device)
    table[sorted_experts, slot] = order
    token_of = torch.where(table < pairs, table // TOP_K, torch.full_like(table, tokens))
    x_pad = torch.cat([x, x.new_zeros(1, hidden)])

    pair_out = x.new_zeros(pairs + 1, hidden)            # row `pairs` collects padding and is dropped
    for c in range(0, num_experts, EXPERT_CHUNK):
        y = _swiglu(x_pad[token_of[c:c + EXPERT_CHUNK]], experts_gate_up[c:c + EXPERT_CHUNK].to(wide),
                    experts_down[c:c + EXPERT_CHUNK].to(wide))
        pair_out[table[c:c + EXPERT_CHUNK]] = y
    routed = (pair_out[:pairs].view(tokens, TOP_K, hidden) * topk_weights.unsqueeze(-1)).sum(dim=1)

    shared = _swiglu(x, shared_gate_up.to(wide), shared_down.to(wide))
    gate = torch.sigmoid(x @ shared_expert_gate.to(wide).t())
    return (routed + gate * shared).to(hidden_states.dtype)


def _logit_gap(hidden_states: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    top = (hidden_states.float() @ router_weight.float().t()).topk(TOP_K + 1, dim=-1).values
    return top[:, TOP_K - 1] - top[:, TOP_K]


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, inter = TOKENS[size], HIDDEN[size], INTERMEDIATE[size]
    std_in, std_mid = 1 / math.sqrt(hidden), 1 / math.sqrt(inter)
    router_weight = (std_in * torch.randn(NUM_EXPERTS, hidden, device=device)).to(torch.bfloat16)

    def draw(n):
        return torch.randn(n, hidden, device=device).to(torch.bfloat16)

    hidden_states = draw(tokens)
    for _ in range(REDRAW_LIMIT):
        unstable = _logit_gap(hidden_states, router_weight) < DECISION_MARGIN
        count = int(unstable.sum())
        if count == 0:
            break
        hidden_states[unstable] = draw(count)
    else:
        raise RuntimeError("routing margins stayed below DECISION_MARGIN after REDRAW_LIMIT redraws")

    experts_gate_up = (std_in * torch.randn(NUM_EXPERTS, 2 * inter, hidden, device=device)).to(torch.bfloat16)
    experts_down = (std_mid * torch.randn(NUM_EXPERTS, hidden, inter, device=device)).to(torch.bfloat16)
    shared_gate_up = (std_in * torch.randn(2 * inter, hidden, device=device)).to(torch.bfloat16)
    shared_down = (std_mid * torch.randn(hidden, inter, device=device)).to(torch.bfloat16)
    shared_expert_gate = (std_in * torch.randn(1, hidden, device=device)).to(torch.bfloat16)
    return [hidden_states, router_weight, experts_gate_up, experts_down, shared_gate_up, shared_down,
            shared_expert_gate]
