"""Known-bad: a correct result in eager PyTorch, no DSL kernel at all (expect: no_dsl_kernel)."""

import torch


def solve(hidden_states, residual, weight):
    x = hidden_states.float() + residual.float()
    return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * weight.float()).to(torch.bfloat16)
