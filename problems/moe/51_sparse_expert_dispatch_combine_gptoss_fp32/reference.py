"""gpt-oss-20b MoE layer in fp32: biased top-4 router with softmax over the chosen logits, sparse dispatch to 32 clamped-SwiGLU experts with biases, weighted combine."""

# Designed for MetaKernelBench from the public gpt-oss-20b architecture (hidden 2880, 32 experts, top-4, expert
# intermediate 2880, interleaved gate/up columns, SwiGLU with alpha 1.702 and clamp limit 7.0, biased projections).

import math

import torch

NUM_EXPERTS = 32
TOP_K = 4
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
TOKENS = {"full": 2048, "smoke": 24}
HIDDEN = {"full": 2880, "smoke": 64}
INTERMEDIATE = {"full": 2880, "smoke": 32}
# Rows whose 4th/5th router-logit gap is below DECISION_MARGIN (logits have std ~1, so ~1e-3 relative) are redrawn.
DECISION_MARGIN = 1e-3
REDRAW_LIMIT = 32


def _expert(x, gate_up, gate_up_bias, down, down_bias):
    h = x @ gate_up + gate_up_bias                      # [n, 2I], gate and up interleaved column by column
    gate = h[:, 0::2].clamp(max=SWIGLU_LIMIT)
    up = h[:, 1::2].clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    glu = gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    return ((up + 1) * glu) @ down + down_bias


@torch.no_grad()
def reference(hidden_states: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
              gate_up_proj: torch.Tensor, gate_up_proj_bias: torch.Tensor, down_proj: torch.Tensor,
              down_proj_bias: torch.Tensor) -> torch.Tensor:
    tokens, hidden = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    assert num_experts == NUM_EXPERTS and router_weight.shape == (NUM_EXPERTS, hidden)
    assert gate_up_proj.shape[1] == hidden and down_proj.shape == (num_experts, gate_up_proj.shape[2] // 2, hidden)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    x = hidden_states.to(wide)

    logits = x @ router_weight.to(wide).t() + router_bias.to(wide)
    top = logits.topk(TOP_K, dim=-1)
    weights = torch.softmax(top.values, dim=-1)         # softmax over the chosen logits only

    out = torch.zeros_like(x)
    for e in range(num_experts):
        hit = top.indices == e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        y = _expert(x[rows], gate_up_proj[e].to(wide), gate_up_proj_bias[e].to(wide), down_proj[e].to(wide),
                    down_proj_bias[e].to(wide))
        out[rows] += y * (weights * hit).sum(dim=1)[rows].unsqueeze(1)   # unique rows per expert: deterministic
    return out.to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, inter = TOKENS[size], HIDDEN[size], INTERMEDIATE[size]
    router_weight = torch.randn(NUM_EXPERTS, hidden, device=device) / math.sqrt(hidden)
    router_bias = 0.2 * torch.randn(NUM_EXPERTS, device=device)

    def draw(n):
        return torch.randn(n, hidden, device=device)

    hidden_states = draw(tokens)
    for _ in range(REDRAW_LIMIT):
        top = (hidden_states @ router_weight.t() + router_bias).topk(TOP_K + 1, dim=-1).values
        unstable = top[:, TOP_K - 1] - top[:, TOP_K] < DECISION_MARGIN
        count = int(unstable.sum())
        if count == 0:
            break
        hidden_states[unstable] = draw(count)
    else:
        raise RuntimeError("routing margins stayed below DECISION_MARGIN after REDRAW_LIMIT redraws")

    # expert weights scaled so that a visible share of gate/up pre-activations reaches the +-7 clamp
    gate_up_proj = 3.0 * torch.randn(NUM_EXPERTS, hidden, 2 * inter, device=device) / math.sqrt(hidden)
    gate_up_proj_bias = 0.5 * torch.randn(NUM_EXPERTS, 2 * inter, device=device)
    down_proj = torch.randn(NUM_EXPERTS, inter, hidden, device=device) / math.sqrt(inter)
    down_proj_bias = 0.5 * torch.randn(NUM_EXPERTS, hidden, device=device)
    return [hidden_states, router_weight, router_bias, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias]
