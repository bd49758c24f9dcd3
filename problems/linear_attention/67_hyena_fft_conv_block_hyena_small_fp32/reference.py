"""Hyena order-2 operator block: causal short depthwise convolution, gating, FFT long convolution with a given implicit filter, and output gating."""

# Designed for MetaKernelBench from the public HyenaDNA-small-32k architecture (d_model 256, Hyena order 2, short filter
# 3, sequence 32768); the implicit long filter is already evaluated and passed in; batch 4.

import math

import torch

D_MODEL = 256
ORDER = 2
SHORT_FILTER = 3
BATCH = {"full": 4, "smoke": 2}
SEQ_LEN = {"full": 32768, "smoke": 300}
# ExponentialModulation of the implicit filter: decay rates from log(target)/fast to log(target)/slow (Hyena)
FAST_DECAY_PCT, SLOW_DECAY_PCT, DECAY_TARGET = 0.3, 1.5, 1e-2
NUM_TONES = 8


@torch.no_grad()
def reference(u: torch.Tensor, short_weight: torch.Tensor, short_bias: torch.Tensor, long_filter: torch.Tensor,
              filter_bias: torch.Tensor) -> torch.Tensor:
    b, l, width = u.shape
    d = width // (ORDER + 1)
    assert d == D_MODEL and short_weight.shape == (width, SHORT_FILTER) and long_filter.shape == (d, l)
    wide = torch.promote_types(u.dtype, torch.float32)
    x = u.to(wide).transpose(1, 2)                                         # [B, 3D, L]
    w = short_weight.to(wide)
    # causal depthwise short convolution: tap SHORT_FILTER - 1 multiplies the current step
    xp = torch.nn.functional.pad(x, (SHORT_FILTER - 1, 0))
    uc = short_bias.to(wide)[:, None] + sum(w[:, j, None] * xp[..., j:j + l] for j in range(SHORT_FILTER))
    x0, x1, v = uc.split(d, dim=1)
    z = x1 * v                                                              # first gate
    # causal long convolution conv[t] = sum_{s <= t} h[t - s] z[s], by FFT of length 2L (no wrap-around)
    n = 2 * l
    conv = torch.fft.irfft(torch.fft.rfft(z, n=n) * torch.fft.rfft(long_filter.to(wide), n=n), n=n)[..., :l]
    y = x0 * (conv + filter_bias.to(wide)[:, None] * z)                     # skip term, then output gate
    return y.transpose(1, 2).to(u.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, l = BATCH[size], SEQ_LEN[size]
    width = (ORDER + 1) * D_MODEL
    u = torch.randn(b, l, width, device=device)
    short_weight = torch.randn(width, SHORT_FILTER, device=device) / math.sqrt(SHORT_FILTER)
    short_bias = 0.1 * torch.randn(width, device=device)
    # implicit filter as Hyena evaluates it: a smooth random signal (sum of sinusoids) times an exponential window
    # whose rate runs from fast (1% left after 30% of the sequence) to slow (after 150%) across channels, so some
    # channels mix the whole sequence; each channel scaled to unit L2 norm
    t = torch.linspace(0.0, 1.0, l, device=device)
    rates = torch.linspace(math.log(DECAY_TARGET) / SLOW_DECAY_PCT, math.log(DECAY_TARGET) / FAST_DECAY_PCT,
                           D_MODEL, device=device).abs()
    freqs = torch.exp(torch.empty(D_MODEL, NUM_TONES, 1, device=device).uniform_(0.0, math.log(l / 4)))
    phases = 2 * math.pi * torch.rand(D_MODEL, NUM_TONES, 1, device=device)
    amps = torch.randn(D_MODEL, NUM_TONES, 1, device=device)
    signal = (amps * torch.sin(2 * math.pi * freqs * t + phases)).sum(dim=1)
    long_filter = signal * torch.exp(-rates[:, None] * t)
    long_filter = long_filter / long_filter.norm(dim=-1, keepdim=True)
    filter_bias = torch.randn(D_MODEL, device=device)
    return [u, short_weight, short_bias, long_filter, filter_bias]
