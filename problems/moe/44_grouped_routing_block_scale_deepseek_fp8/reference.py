"""DeepSeek-V3 MoE layer on one expert-parallel rank: grouped top-8 sigmoid routing with a correction bias, FP8 block-scaled SwiGLU experts."""

# Designed for MetaKernelBench from the public DeepSeek-V3 architecture (256 routed experts in 8 groups, top-4 groups,
# top-8, routed scaling 2.5, hidden 7168, expert intermediate 2048, 128x128 FP8 blocks); the token count and the EP
# slice (32 local experts starting at expert 32) follow the FlashInfer-Trace workload used by the original problem.

import torch

NUM_EXPERTS = 256
NUM_GROUPS = 8
TOPK_GROUPS = 4
TOP_K = 8
BLOCK = 128
FP8_MAX = 448.0
ROUTED_SCALING_FACTOR = 2.5
# per size: tokens, hidden, expert intermediate, local experts, first local expert id
TOKENS = {"full": 14107, "smoke": 64}
HIDDEN = {"full": 7168, "smoke": 256}
INTERMEDIATE = {"full": 2048, "smoke": 128}
LOCAL_EXPERTS = {"full": 32, "smoke": 8}
LOCAL_EXPERT_OFFSET = {"full": 32, "smoke": 96}
# Routing is made stable under numerical noise: rows whose 4th/5th group-score gap or 8th/9th biased expert-score gap
# (within the kept groups) is below DECISION_MARGIN (biased scores are O(1), so this is ~1e-3 relative) are redrawn.
DECISION_MARGIN = 1e-3
REDRAW_LIMIT = 32


def _dequant_blocks(q: torch.Tensor, scale: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """q [R, C] with one scale per 128x128 block (scale [ceil(R/128), ceil(C/128)]) -> q * scale in `wide`."""
    rows, cols = q.shape
    s = scale.to(wide).repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    return q.to(wide) * s


def _route(logits: torch.Tensor, bias: torch.Tensor):
    """Grouped top-k on sigmoid(logits) + bias; returns (sigmoid scores, ids [T, K], group gap, expert gap)."""
    tokens = logits.shape[0]
    scores = torch.sigmoid(logits)
    biased = scores + bias
    group_scores = biased.view(tokens, NUM_GROUPS, -1).topk(2, dim=-1).values.sum(dim=-1)
    ranked_groups = group_scores.topk(TOPK_GROUPS + 1, dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, ranked_groups.indices[:, :TOPK_GROUPS], True)
    keep = keep.repeat_interleave(NUM_EXPERTS // NUM_GROUPS, dim=1)
    ranked = biased.masked_fill(~keep, float("-inf")).topk(TOP_K + 1, dim=-1)
    group_gap = ranked_groups.values[:, TOPK_GROUPS - 1] - ranked_groups.values[:, TOPK_GROUPS]
    expert_gap = ranked.values[:, TOP_K - 1] - ranked.values[:, TOP_K]
    return scores, ranked.indices[:, :TOP_K], group_gap, expert_gap


@torch.no_grad()
def reference(routing_logits: torch.Tensor, routing_bias: torch.Tensor, hidden_states: torch.Tensor,
              hidden_states_scale: torch.Tensor, gemm1_weights: torch.Tensor, gemm1_weights_scale: torch.Tensor,
              gemm2_weights: torch.Tensor, gemm2_weights_scale: torch.Tensor, local_expert_offset: int,
              routed_scaling_factor: float) -> torch.Tensor:
    tokens, num_experts = routing_logits.shape
    hidden = hidden_states.shape[1]
    local_experts, two_inter, _ = gemm1_weights.shape
    inter = two_inter // 2
    assert num_experts == NUM_EXPERTS and hidden % BLOCK == 0 and inter % BLOCK == 0
    assert hidden_states_scale.shape == (hidden // BLOCK, tokens)
    assert gemm2_weights.shape == (local_experts, hidden, inter)
    wide = torch.promote_types(routing_logits.dtype, torch.float32)

    scores, topk_ids, _, _ = _route(routing_logits.to(wide), routing_bias.to(wide))
    topk_scores = scores.gather(1, topk_ids)
    topk_weights = topk_scores / topk_scores.sum(dim=-1, keepdim=True) * routed_scaling_factor

    # activations: one scale per (128-channel block, token); the scale tensor is stored block-major [H/128, T]
    act_scale = hidden_states_scale.to(wide).t().unsqueeze(-1)
    act = (hidden_states.to(wide).view(tokens, hidden // BLOCK, BLOCK) * act_scale).view(tokens, hidden)

    out = torch.zeros(tokens, hidden, dtype=wide, device=hidden_states.device)
    for e in range(local_experts):
        hit = topk_ids == local_expert_offset + e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        w13 = _dequant_blocks(gemm1_weights[e], gemm1_weights_scale[e], wide)   # [2I, H]: gate rows, then up rows
        h = act[rows] @ w13.t()
        inner = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        w2 = _dequant_blocks(gemm2_weights[e], gemm2_weights_scale[e], wide)    # [H, I]
        weight = (topk_weights * hit).sum(dim=1)[rows].unsqueeze(1)
        out[rows] += (inner @ w2.t()) * weight    # each token appears once per expert: deterministic
    return out.to(torch.bfloat16)


def _quantize_rows_blocks(x: torch.Tensor):
    """Per-(row, 128-column block) FP8 quantization; returns e4m3 values and fp32 scales [R, C/128]."""
    blocks = x.view(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view_as(x), scale


def _quantize_weight_blocks(w: torch.Tensor):
    """128x128-block FP8 quantization of one weight matrix [R, C]; returns e4m3 values and fp32 scales."""
    rows, cols = w.shape
    blocks = w.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, cols), scale


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden, inter = TOKENS[size], HIDDEN[size], INTERMEDIATE[size]
    local, offset = LOCAL_EXPERTS[size], LOCAL_EXPERT_OFFSET[size]
    # correction bias: learned, small spread around a common offset; stored in bf16
    routing_bias = (0.9 + 0.02 * torch.randn(NUM_EXPERTS, device=device)).to(torch.bfloat16)
    # fp32 router logits with a per-expert popularity offset
    popularity = 0.3 * torch.randn(NUM_EXPERTS, device=device)

    def draw(n):
        return popularity - 1.5 + 0.75 * torch.randn(n, NUM_EXPERTS, device=device)

    routing_logits = draw(tokens)
    bias32 = routing_bias.float()
    for _ in range(REDRAW_LIMIT):
        _, _, group_gap, expert_gap = _route(routing_logits, bias32)
        unstable = (group_gap < DECISION_MARGIN) | (expert_gap < DECISION_MARGIN)
        count = int(unstable.sum())
        if count == 0:
            break
        routing_logits[unstable] = draw(count)
    else:
        raise RuntimeError("routing margins stayed below DECISION_MARGIN after REDRAW_LIMIT redraws")

    # activations with per-token magnitude spread, quantized per (token, 128 channels)
    x = torch.randn(tokens, hidden, device=device) * torch.exp(0.3 * torch.randn(tokens, 1, device=device))
    hidden_states, act_scale = _quantize_rows_blocks(x)
    hidden_states_scale = act_scale.t().contiguous()

    gemm1_weights = torch.empty(local, 2 * inter, hidden, device=device, dtype=torch.float8_e4m3fn)
    gemm2_weights = torch.empty(local, hidden, inter, device=device, dtype=torch.float8_e4m3fn)
    gemm1_weights_scale = torch.empty(local, 2 * inter // BLOCK, hidden // BLOCK, device=device)
    gemm2_weights_scale = torch.empty(local, hidden // BLOCK, inter // BLOCK, device=device)
    for e in range(local):
        gemm1_weights[e], gemm1_weights_scale[e] = _quantize_weight_blocks(
            0.02 * torch.randn(2 * inter, hidden, device=device))
        gemm2_weights[e], gemm2_weights_scale[e] = _quantize_weight_blocks(
            0.02 * torch.randn(hidden, inter, device=device))
    return [routing_logits, routing_bias, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
            gemm2_weights, gemm2_weights_scale, offset, ROUTED_SCALING_FACTOR]
