"""Softmax top-8 routing over 160 experts with capacity-factor slot assignment, token dropping and the dispatched per-expert token buffer (Qwen3-Coder 480B)."""

# Designed for MetaKernelBench from the public Qwen3-Coder-480B-A35B config (hidden 6144, 160 routed experts, top-8,
# renormalized top-k probabilities); capacity factor 1.25 with position-priority dropping as in GShard/Megatron.

import math

import torch

NUM_EXPERTS = 160
TOP_K = 8
CAPACITY_FACTOR = 1.25
TOKENS = {"full": 8192, "smoke": 48}
HIDDEN = {"full": 6144, "smoke": 64}
# Rows whose 8th/9th router-logit gap is below DECISION_MARGIN (logits have std ~1, so ~1e-3 relative) are redrawn,
# so the expert choice is stable under numerical noise.
DECISION_MARGIN = 1e-3
REDRAW_LIMIT = 32


def capacity(tokens: int) -> int:
    return math.ceil(CAPACITY_FACTOR * tokens * TOP_K / NUM_EXPERTS)


@torch.no_grad()
def reference(hidden_states: torch.Tensor, router_weight: torch.Tensor):
    tokens, hidden = hidden_states.shape
    assert router_weight.shape == (NUM_EXPERTS, hidden)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    cap = capacity(tokens)

    logits = hidden_states.to(wide) @ router_weight.to(wide).t()
    probs = torch.softmax(logits, dim=-1)
    expert_ids = probs.topk(TOP_K, dim=-1).indices.sort(dim=-1).values       # [T, K], ascending expert id
    chosen = probs.gather(1, expert_ids)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)

    # slot of (t, e) = number of earlier tokens that chose e; slots >= capacity are dropped
    assigned = torch.zeros(tokens, NUM_EXPERTS, dtype=torch.int64, device=hidden_states.device)
    assigned.scatter_(1, expert_ids, 1)
    position = (assigned.cumsum(dim=0) - 1).gather(1, expert_ids)            # [T, K]
    kept = position < cap
    slots = torch.where(kept, position, torch.full_like(position, -1)).to(torch.int32)
    combine_weights = torch.where(kept, weights, torch.zeros_like(weights))

    dispatched = torch.zeros(NUM_EXPERTS, cap, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    tok = torch.arange(tokens, device=hidden_states.device).unsqueeze(1).expand(tokens, TOP_K)
    dispatched[expert_ids[kept], position[kept]] = hidden_states[tok[kept]]
    return dispatched, combine_weights, expert_ids.to(torch.int32), slots


def _logit_gap(hidden_states: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    top = (hidden_states.float() @ router_weight.float().t()).topk(TOP_K + 1, dim=-1).values
    return top[:, TOP_K - 1] - top[:, TOP_K]


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden = TOKENS[size], HIDDEN[size]
    # A shared direction u in the residual stream and a per-expert affinity to it make some experts popular,
    # so the busiest experts overflow their capacity as in real batches.
    u = torch.randn(hidden, device=device)
    u = u / u.norm()
    affinity = 0.1 * torch.randn(NUM_EXPERTS, 1, device=device)
    router_weight = (torch.randn(NUM_EXPERTS, hidden, device=device) / math.sqrt(hidden)
                     + affinity * u).to(torch.bfloat16)

    def draw(n):
        return (torch.randn(n, hidden, device=device) + 1.5 * u).to(torch.bfloat16)

    hidden_states = draw(tokens)
    for _ in range(REDRAW_LIMIT):
        unstable = _logit_gap(hidden_states, router_weight) < DECISION_MARGIN
        count = int(unstable.sum())
        if count == 0:
            break
        hidden_states[unstable] = draw(count)
    else:
        raise RuntimeError("routing margins stayed below DECISION_MARGIN after REDRAW_LIMIT redraws")
    return [hidden_states, router_weight]
