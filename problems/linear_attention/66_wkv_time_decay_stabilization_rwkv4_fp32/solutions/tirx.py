# RWKV-4 WKV recurrence in the stable running-max form (4096 channels, 16 x 512 tokens, carried state),
# fp32, as one TIRx kernel. Same algorithm and launch geometry as the CuTe DSL solution of this problem
# (0.130 ms device on the H200).
#
# Algorithm
# - Every (sequence, channel) is an independent scalar recurrence over time: one thread per channel, the
#   state (a, b, p) in registers for the whole segment. Grid (4096 / 128 channel blocks, B); 128 threads;
#   at each step a warp reads 32 consecutive channels of k and v (128-byte coalesced rows) and writes y.
# - Per step, the reference's fp32 arithmetic in the reference's order:
#       q = max(p, u + k); y = (e^{p-q} a + e^{u+k-q} v) / (e^{p-q} b + e^{u+k-q})
#       p' = max(p + w, k); a' = e^{p+w-p'} a + e^{k-p'} v; b' = e^{p+w-p'} b + e^{k-p'}
#   with w = -exp(time_decay) (fp64, rounded once) and u = time_first.
# - Latency hiding: time in groups of 8 steps; the k/v loads of group g+1 are issued before the 8
#   sequential steps of group g (register double buffer); steps past T read a clamped row and are skipped.
# - new_state = (a, b, p) after the last step.
# Differences from the CuTe DSL version (which used the accurate library exp and IEEE division): TVM
# compiles device code with fast math, whose fp32 exp (~2 ulp, worse for large |x|) and division are
# approximate, and the e^{...} factors multiply the carried state on every step. So exp is an own routine
# (all arguments are <= 0 here: Cody-Waite reduction, degree-9 Taylor polynomial by FMAs, 2^n from the
# exponent bits, arguments clamped at -80 where e^x < 2e-35 against a partner term of 1), and the division
# is the approximate reciprocal refined by one Newton step and one residual correction of the quotient.
# What limits it: DRAM bandwidth (403 MB, SOL ~0.084 ms) and the dependent chain of 4 exps and a division
# per step (~80 instructions with the own exp); expected near the CuTe DSL kernel (~0.13 ms device).
#
# Host path: compiled once per process (batch and T symbolic); tvm-ffi runs the kernel on torch's current
# stream.
#
# Verification: compile-checked on CPU (sm_90a) and run in the CPU emulator; H200 results: results/h200/ (by kernel sha256).

import math

import torch
import tvm
from tvm.script import tirx as T

CHANNELS = 4096
THREADS = 128
U = 8                          # steps per group (loads of the next group in flight)
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125     # Cody-Waite split of ln 2
LN2_LO = 1.4286068203094172e-06
EXP_MIN = -80.0


@T.macro
def exp_neg(rb, ri, x, tmp):
    # rb[ri] = e^x for x <= 0 (~0.5 ulp): x = n ln2 + r, Taylor(r) by Horner, times 2^n via the exponent bits
    tmp[0] = T.max(x, T.float32(EXP_MIN))
    tmp[1] = T.floor(tmp[0] * T.float32(LOG2E) + T.float32(0.5))
    tmp[2] = (tmp[0] - tmp[1] * T.float32(LN2_HI)) - tmp[1] * T.float32(LN2_LO)
    tmp[3] = T.float32(1.0 / 362880.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0 / 40320.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0 / 5040.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0 / 720.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0 / 120.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0 / 24.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0 / 6.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(0.5)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0)
    tmp[3] = tmp[3] * tmp[2] + T.float32(1.0)
    rb[ri] = tmp[3] * T.reinterpret("float32", T.shift_left(T.cast(tmp[1], "int32") + 127, 23))


@T.prim_func
def wkv(td_h: T.handle, tf_h: T.handle, k_h: T.handle, v_h: T.handle, s_h: T.handle, y_h: T.handle,
        ns_h: T.handle):
    batch = T.int32()
    seqlen = T.int32()
    TD = T.match_buffer(td_h, (CHANNELS,), "float32")
    TF = T.match_buffer(tf_h, (CHANNELS,), "float32")
    K = T.match_buffer(k_h, (batch, seqlen, CHANNELS), "float32")
    V = T.match_buffer(v_h, (batch, seqlen, CHANNELS), "float32")
    S = T.match_buffer(s_h, (batch, 3, CHANNELS), "float32")
    Y = T.match_buffer(y_h, (batch, seqlen, CHANNELS), "float32")
    NS = T.match_buffer(ns_h, (batch, 3, CHANNELS), "float32")

    T.device_entry()
    cb, b = T.cta_id([CHANNELS // THREADS, batch])
    tid = T.thread_id([THREADS])

    st = T.alloc_local((3,), "float32")             # a, b, p
    kb = T.alloc_local((U,), "float32")
    vb = T.alloc_local((U,), "float32")
    kn = T.alloc_local((U,), "float32")
    vn = T.alloc_local((U,), "float32")
    wu = T.alloc_local((2,), "float32")             # w, u
    sv = T.alloc_local((8,), "float32")             # q, e_old, e_new, num, den, 1/den, y, p + w
    ex = T.alloc_local((4,), "float32")             # exp temporaries
    e2 = T.alloc_local((2,), "float32")             # e^{p+w-p'}, e^{k-p'}

    ch: T.let[T.int32] = cb * THREADS + tid
    wu[0] = T.cast(T.float64(0.0) - T.exp(T.cast(TD[ch], "float64")), "float32")
    wu[1] = TF[ch]
    st[0] = S[b, 0, ch]
    st[1] = S[b, 1, ch]
    st[2] = S[b, 2, ch]
    for s in T.unroll(U):
        kb[s] = K[b, T.min(s, seqlen - 1), ch]
        vb[s] = V[b, T.min(s, seqlen - 1), ch]

    for gi in range(T.ceildiv(seqlen, U)):
        # prefetch the next group (clamped rows; harmless past the end)
        for s in T.unroll(U):
            kn[s] = K[b, T.min(gi * U + U + s, seqlen - 1), ch]
            vn[s] = V[b, T.min(gi * U + U + s, seqlen - 1), ch]
        for s in T.unroll(U):
            if gi * U + s < seqlen:
                # output against the state before the token
                sv[0] = T.max(st[2], wu[1] + kb[s])
                exp_neg(sv, 1, st[2] - sv[0], ex)
                exp_neg(sv, 2, (wu[1] + kb[s]) - sv[0], ex)
                sv[3] = sv[1] * st[0] + sv[2] * vb[s]
                sv[4] = sv[1] * st[1] + sv[2]
                # num / den: approximate reciprocal, one Newton step, one residual correction
                sv[5] = T.float32(1.0) / sv[4]
                sv[5] = sv[5] + sv[5] * (T.float32(1.0) - sv[4] * sv[5])
                sv[6] = sv[3] * sv[5]
                sv[6] = sv[6] + (sv[3] - sv[4] * sv[6]) * sv[5]
                Y[b, gi * U + s, ch] = sv[6]
                # state update
                sv[7] = st[2] + wu[0]
                sv[0] = T.max(sv[7], kb[s])
                exp_neg(e2, 0, sv[7] - sv[0], ex)
                exp_neg(e2, 1, kb[s] - sv[0], ex)
                st[0] = e2[0] * st[0] + e2[1] * vb[s]
                st[1] = e2[0] * st[1] + e2[1]
                st[2] = sv[0]
        for s in T.unroll(U):
            kb[s] = kn[s]
            vb[s] = vn[s]

    NS[b, 0, ch] = st[0]
    NS[b, 1, ch] = st[1]
    NS[b, 2, ch] = st[2]


TARGET = {"kind": "cuda", "arch": "sm_90a"}
_CACHE = {}


def _prepare(exe):
    # Executable.__call__ is jit().main; caching jit() once keeps the host call path short.
    try:
        if getattr(exe, "_jitted_mod", 0) is None:
            exe._jitted_mod = exe.jit()
    except Exception:  # keep working if tvm.compile returns something else (e.g. a test double)
        pass
    return exe


def _compiled():
    exe = _CACHE.get("exe")
    if exe is None:
        exe = tvm.compile(tvm.IRModule({"main": wkv}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")
        _CACHE["exe"] = exe = _prepare(exe)
    return exe


def solve(time_decay, time_first, k, v, state):
    b, t, ch = k.shape
    assert ch == CHANNELS
    y = torch.empty_like(k)
    new_state = torch.empty_like(state)
    if b == 0:
        return y, new_state
    if t == 0:
        new_state.copy_(state)
        return y, new_state
    _compiled()(time_decay.contiguous(), time_first.contiguous(), k.contiguous(), v.contiguous(),
                state.contiguous(), y, new_state)
    return y, new_state
