"""Backward of softmax top-8 routing, token dispatch (permute) and weighted combine (unpermute) around the experts of a 128-expert MoE layer (Qwen3-Coder 30B-A3B)."""

# Designed for MetaKernelBench from the public Qwen3-Coder-30B-A3B config (hidden 2048, 128 routed experts, top-8,
# norm_topk_prob): the router/dispatch part of one MoE layer's backward pass for an 8k-token micro-batch.

import math

import torch

NUM_EXPERTS = 128
TOP_K = 8
HIDDEN = {"full": 2048, "smoke": 256}
TOKENS = {"full": 8192, "smoke": 32}


def _permutation(topk_ids: torch.Tensor) -> torch.Tensor:
    """Row of each (token, k) pair in the expert-major buffers: pairs sorted by expert id, then by token index."""
    order = torch.sort(topk_ids.reshape(-1).long(), stable=True).indices
    row = torch.empty_like(order)
    row[order] = torch.arange(order.numel(), device=order.device)
    return row.view(topk_ids.shape)


@torch.no_grad()
def reference(hidden_states: torch.Tensor, router_weight: torch.Tensor, topk_ids: torch.Tensor,
              expert_outputs: torch.Tensor, grad_output: torch.Tensor, grad_expert_inputs: torch.Tensor):
    tokens, hidden = hidden_states.shape
    assert hidden in HIDDEN.values() and router_weight.shape == (NUM_EXPERTS, hidden)
    assert topk_ids.shape == (tokens, TOP_K)
    assert expert_outputs.shape == grad_expert_inputs.shape == (tokens * TOP_K, hidden)
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    ids = topk_ids.long()
    row = _permutation(topk_ids)

    # forward recompute of the routing weights: w = softmax(logits)[ids] / sum, i.e. a softmax over the chosen logits
    x = hidden_states.to(wide)
    w_r = router_weight.to(wide)
    probs = torch.softmax(x @ w_r.t(), dim=-1)
    chosen = probs.gather(1, ids)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)                                  # [T, K]

    # combine backward: y_t = sum_k weights[t,k] * expert_outputs[row[t,k]]
    out_k = expert_outputs.to(wide)[row]                                                  # [T, K, H]
    grad_weights = torch.einsum("th,tkh->tk", grad_output.to(wide), out_k)
    grad_expert_outputs = torch.empty(tokens * TOP_K, hidden, dtype=wide, device=hidden_states.device)
    grad_expert_outputs[row.view(-1)] = (grad_output.to(wide).unsqueeze(1) * weights.unsqueeze(-1)).view(-1, hidden)
    # renormalization + softmax backward (the softmax-normalization terms cancel for a renormalized top-k):
    # d logits[t, ids[t,k]] = weights * (grad_weights - sum_k weights * grad_weights); zero for unchosen experts
    grad_chosen = weights * (grad_weights - (weights * grad_weights).sum(dim=-1, keepdim=True))
    grad_logits = torch.zeros_like(probs).scatter_(1, ids, grad_chosen)

    # dispatch backward (un-permute and sum the K copies) + router input gradient
    grad_hidden = grad_expert_inputs.to(wide)[row].sum(dim=1) + grad_logits @ w_r
    grad_router_weight = grad_logits.t() @ x
    return (grad_hidden.to(hidden_states.dtype), grad_router_weight.to(router_weight.dtype),
            grad_expert_outputs.to(expert_outputs.dtype))


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    tokens, hidden = TOKENS[size], HIDDEN[size]
    hidden_states = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    router_weight = (torch.randn(NUM_EXPERTS, hidden, device=device) / math.sqrt(hidden)).to(torch.bfloat16)
    # the forward pass's choice (ascending expert ids per token); the backward does not re-decide it
    logits = hidden_states.float() @ router_weight.float().t()
    topk_ids = logits.topk(TOP_K, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    # saved expert outputs and incoming gradients in the expert-major (permuted) layout, with a per-expert scale
    # so that wrong rows are visible; gradient scales chosen so the router and dispatch terms of grad_hidden are
    # of comparable size
    expert_scale = torch.exp(0.5 * torch.randn(NUM_EXPERTS, device=device))
    sorted_experts = topk_ids.reshape(-1).long().sort().values
    row_scale = expert_scale[sorted_experts].unsqueeze(1)
    expert_outputs = (torch.randn(tokens * TOP_K, hidden, device=device) * row_scale).to(torch.bfloat16)
    grad_output = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    grad_expert_inputs = (0.1 * torch.randn(tokens * TOP_K, hidden, device=device) * row_scale).to(torch.bfloat16)
    return [hidden_states, router_weight, topk_ids, expert_outputs, grad_output, grad_expert_inputs]
