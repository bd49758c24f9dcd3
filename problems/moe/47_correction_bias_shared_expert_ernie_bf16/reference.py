"""ERNIE 4.5 MoE layer: fp32 softmax router whose top-6 choice uses a score-correction bias, 64 SwiGLU experts plus an always-on shared expert."""

# Designed for MetaKernelBench from the public ERNIE-4.5-21B-A3B config (hidden 2560, 64 routed experts, top-6,
# expert intermediate 1536, 2 shared experts fused into one SwiGLU of intermediate 3072, fp32 gate,
# e_score_correction_bias used for selection only).

import math

import torch

NUM_EXPERTS = 64
TOP_K = 6
NORM_MIN = 1e-12
TOKENS = {"full": 4096, "smoke": 32}
HIDDEN = {"full": 2560, "smoke": 128}
INTERMEDIATE = {"full": 1536, "smoke": 64}
SHARED_INTERMEDIATE = {"full": 3072, "smoke": 128}
# Rows whose 6th/7th gap of (softmax probability + bias) is below DECISION_MARGIN are redrawn. Probabilities average
# 1/64, so the margin is ~1e-3 of a typical score: far above fp32 rounding, so the choice is stable.
DECISION_MARGIN = 2e-5
REDRAW_LIMIT = 32


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    inter = down.shape[1]
    h = x @ gate_up.t()                                  # gate rows first, then up rows
    return (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down.t()


def _select(x32: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor):
    probs = torch.softmax(x32 @ gate_weight.t(), dim=-1)
    ranked = (probs + bias).topk(TOP_K + 1, dim=-1)
    return probs, ranked.indices[:, :TOP_K], ranked.values[:, TOP_K - 1] - ranked.values[:, TOP_K]


@torch.no_grad()
def reference(hidden_states: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
              experts_gate_up: torch.Tensor, experts_down: torch.Tensor, shared_gate_up: torch.Tensor,
              shared_down: torch.Tensor) -> torch.Tensor:
    tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = experts_gate_up.shape
    assert num_experts == NUM_EXPERTS and gate_weight.shape == (NUM_EXPERTS, hidden)
    assert experts_down.shape == (num_experts, hidden, two_inter // 2)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    x = hidden_states.to(wide)

    probs, topk_ids, _ = _select(x, gate_weight.to(wide), e_score_correction_bias.to(wide))
    chosen = probs.gather(1, topk_ids)                   # the bias picks experts; weights use the unbiased probs
    topk_weights = chosen / chosen.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN)

    out = _swiglu(x, shared_gate_up.to(wide), shared_down.to(wide))
    for e in range(num_experts):
        hit = topk_ids == e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        y = _swiglu(x[rows], experts_gate_up[e].to(wide), experts_down[e].to(wide))
        out[rows] += y * (topk_weights * hit).sum(dim=1)[rows].unsqueeze(1)   # unique rows per expert: deterministic
    return out.to(hidden_states.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden = TOKENS[size], HIDDEN[size]
    inter, shared_inter = INTERMEDIATE[size], SHARED_INTERMEDIATE[size]
    gate_weight = torch.randn(NUM_EXPERTS, hidden, device=device) / math.sqrt(hidden)          # fp32 router
    # aux-free balancing bias: small, comparable to the spread of the probabilities it corrects
    e_score_correction_bias = 0.004 * torch.randn(NUM_EXPERTS, device=device)

    def draw(n):
        return torch.randn(n, hidden, device=device).to(torch.bfloat16)

    hidden_states = draw(tokens)
    for _ in range(REDRAW_LIMIT):
        _, _, gap = _select(hidden_states.float(), gate_weight, e_score_correction_bias)
        unstable = gap < DECISION_MARGIN
        count = int(unstable.sum())
        if count == 0:
            break
        hidden_states[unstable] = draw(count)
    else:
        raise RuntimeError("routing margins stayed below DECISION_MARGIN after REDRAW_LIMIT redraws")

    std_in, std_mid, std_shared = 1 / math.sqrt(hidden), 1 / math.sqrt(inter), 1 / math.sqrt(shared_inter)
    experts_gate_up = (std_in * torch.randn(NUM_EXPERTS, 2 * inter, hidden, device=device)).to(torch.bfloat16)
    experts_down = (std_mid * torch.randn(NUM_EXPERTS, hidden, inter, device=device)).to(torch.bfloat16)
    shared_gate_up = (std_in * torch.randn(2 * shared_inter, hidden, device=device)).to(torch.bfloat16)
    shared_down = (std_shared * torch.randn(hidden, shared_inter, device=device)).to(torch.bfloat16)
    return [hidden_states, gate_weight, e_score_correction_bias, experts_gate_up, experts_down, shared_gate_up,
            shared_down]
