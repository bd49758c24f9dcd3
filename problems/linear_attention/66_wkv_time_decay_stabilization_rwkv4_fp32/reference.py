"""RWKV-4 WKV time-mixing recurrence in the numerically stable running-max form, with carried (num, den, max) state."""

# Designed for MetaKernelBench from the public RWKV-4 architecture (7B: 4096 channels) and its
# decay initialisation curve; 16 sequences processed as 512-token segments with carried state, sparse very large keys.

import math

import torch

CHANNELS = 4096
BATCH = {"full": 16, "smoke": 2}
SEQ_LEN = {"full": 512, "smoke": 48}
KEY_STD = 2.0
SPIKE_FRACTION = 2e-3           # share of keys replaced by very large values
SPIKE_MEAN, SPIKE_STD = 80.0, 10.0


@torch.no_grad()
def reference(time_decay: torch.Tensor, time_first: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, ch = k.shape
    assert ch == CHANNELS and v.shape == k.shape and state.shape == (b, 3, ch)
    wide = torch.promote_types(k.dtype, torch.float32)
    w = -time_decay.to(wide).exp()                       # per-step log decay (negative)
    u = time_first.to(wide)                              # bonus of the current token
    kw, vw = k.to(wide).transpose(0, 1), v.to(wide).transpose(0, 1)          # [T, B, C]
    # state after each step: (a, b) = numerator and denominator scaled by exp(-p), p = running max exponent;
    # the update mirrors the sequential stable kernel so the reference's rounding matches that of a plain scan
    ab_hist = torch.empty(t + 1, 2, b, ch, dtype=wide, device=k.device)
    p_hist = torch.empty(t + 1, b, ch, dtype=wide, device=k.device)
    ab_hist[0] = state[:, :2].to(wide).transpose(0, 1)
    p_hist[0] = state[:, 2].to(wide)
    v_one = torch.stack((vw, torch.ones_like(vw)), dim=1)                   # [T, 2, B, C]
    expo = torch.stack((torch.empty_like(kw), kw), dim=1)                   # [T, 2, B, C]: (p + w, k)
    for i in range(t):
        torch.add(p_hist[i], w, out=expo[i, 0])                              # decayed running max
        torch.amax(expo[i], dim=0, out=p_hist[i + 1])                        # new running max
        e = expo[i].sub_(p_hist[i + 1]).exp_()                               # (e_old, e_new)
        torch.addcmul(e[0] * ab_hist[i], e[1], v_one[i], out=ab_hist[i + 1])
    # outputs: the current token enters with bonus u and no decay, against the state before it
    ab, p = ab_hist[:-1], p_hist[:-1]
    bonus = u + kw
    q = torch.maximum(p, bonus)
    e_old = torch.exp(p - q)
    e_new = torch.exp(bonus - q)
    y = (e_old * ab[:, 0] + e_new * vw) / (e_old * ab[:, 1] + e_new)
    new_state = torch.cat((ab_hist[-1].transpose(0, 1), p_hist[-1][:, None]), dim=1)
    return y.transpose(0, 1).to(k.dtype), new_state.to(k.dtype)


def make_inputs(size: str = "full", device: str = "cuda") -> list:
    b, t = BATCH[size], SEQ_LEN[size]
    # RWKV-4 decay curve: time_decay_c = -5 + 8 (c/(C-1))^(0.7 + 1.3 r), r ~ U(0, 1) per draw, plus jitter; the
    # per-step decay exp(-exp(time_decay)) then spans ~0.993 (memory of ~150 tokens) to ~0 (no memory)
    ratio = torch.rand((), device=device)
    frac = torch.arange(CHANNELS, device=device, dtype=torch.float32) / (CHANNELS - 1)
    time_decay = -5.0 + 8.0 * frac.pow(0.7 + 1.3 * ratio) + 0.3 * torch.randn(CHANNELS, device=device)
    zigzag = ((torch.arange(CHANNELS, device=device) + 1) % 3 - 1).to(torch.float32) * 0.5
    time_first = math.log(0.3) + zigzag + 0.3 * torch.randn(CHANNELS, device=device)
    # keys: N(0, 2^2) with a sparse set of very large keys (about 80) so that exp(k) leaves the fp32 range and
    # only the running-max form stays finite
    k = KEY_STD * torch.randn(b, t, CHANNELS, device=device)
    spikes = torch.rand(b, t, CHANNELS, device=device) < SPIKE_FRACTION
    k = torch.where(spikes, SPIKE_MEAN + SPIKE_STD * torch.randn(b, t, CHANNELS, device=device), k)
    v = torch.randn(b, t, CHANNELS, device=device)
    # a reachable carried state: p = running max exponent, den = b >= 1 (the max term), num = a ~ den * mean(v)
    p0 = KEY_STD * torch.randn(b, CHANNELS, device=device) + 3.0
    memory = 1.0 / -torch.expm1(-time_decay.exp())                        # 1 / (1 - decay factor)
    den = 1.0 + torch.rand(b, CHANNELS, device=device) * (memory.clamp(max=200.0) - 1.0)
    num = den * 0.5 * torch.randn(b, CHANNELS, device=device)
    state = torch.stack((num, den, p0), dim=1)
    return [time_decay, time_first, k, v, state]
