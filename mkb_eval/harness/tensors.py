"""Tensor helpers shared by the worker and the judge: digests, snapshots, poisoning, transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def walk(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in walk(v)]
    return []


_PERIOD = 65521                  # the digest's weights are (i mod _PERIOD) + 1
_WEIGHTS: dict[str, torch.Tensor] = {}


def _period_weights(device: torch.device) -> torch.Tensor:
    """1 .. 65521 as int64 on ``device``, made once per device (half a megabyte each)."""
    w = _WEIGHTS.get(str(device))
    if w is None:
        w = _WEIGHTS[str(device)] = torch.arange(1, _PERIOD + 1, device=device, dtype=torch.int64)
    return w


def digest(t: torch.Tensor) -> tuple[int, int]:
    """An exact, order-independent fingerprint of a tensor's bytes, computed on its own device.

    Integer sums wrap modulo 2**64, so the result does not depend on reduction order and the
    worker and the judge compute the same number for the same bytes. The weighted sum
    ``sum(w[i] * (i % 65521 + 1))`` is taken as column sums of the words laid out in rows of 65521
    (the same number modulo 2**64): no int64 copy of the words and no index vector as long as the
    tensor (on a problem with 1.4 GB of fp8 weights those were ~8 GB of temporaries per check).
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = b.view(torch.int32) if b.numel() % 4 == 0 else b
    n = words.numel()
    rows = n // _PERIOD
    i64 = torch.int64
    body = words[:rows * _PERIOD].view(rows, _PERIOD).sum(0, dtype=i64) if rows else words.new_zeros(0, dtype=i64)
    tail = words[rows * _PERIOD:].to(i64)
    w = _period_weights(words.device)
    weighted = (body * w[:body.numel()]).sum() + (tail * w[:tail.numel()]).sum()
    plain = body.sum() + tail.sum()
    pair = torch.stack([weighted, plain]).tolist()
    return int(pair[0]), int(pair[1])


def digests(inputs: list[Any]) -> list[tuple[int, int] | None]:
    return [digest(v) if isinstance(v, torch.Tensor) else None for v in inputs]


def snapshot(value: Any) -> Any:
    """Copy outputs on the caller's current stream, without any synchronization first.

    Work a kernel left unfinished on another stream is not waited for, so a submission that
    returns before its results are ready on the caller's stream is caught. What is not an output
    (a tensor subclass, a sparse tensor, a dict...) is kept as a refusal with its reason
    (:func:`mkb_eval.harness.transport.capture`).
    """
    from mkb_eval.harness import transport

    return transport.capture(value)


def to_device(value: Any, device: str | torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def save(value: Any, path: Path) -> None:
    """The worker's side of the output transport (no pickle: the judge never unpickles candidate data)."""
    from mkb_eval.harness import transport

    transport.write(value, path)


def load(path: Path) -> Any:
    """A worker's output file as values (CPU); ``transport.TransportError`` for a bad file or a refusal."""
    from mkb_eval.harness import transport

    with transport.open_output(path) as out:
        return out.values()


def refill_(dst: list[Any], src: list[Any]) -> list[Any]:
    """Copy a new draw's values into the previous draw's buffers (same addresses, new content)."""
    out = []
    for d, s in zip(dst, src, strict=True):       # the same problem's draws: one value per input
        if isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor) and d.shape == s.shape and d.dtype == s.dtype:
            d.copy_(s)
            out.append(d)
        else:
            out.append(s)
    return out


def poison_free_memory(device: torch.device, max_bytes: int = 8 << 30) -> int:
    """Fill the caching allocator's free blocks with 0xFF (NaN for floats) and give them back.

    A later ``torch.empty`` that lands on a stale block then reads garbage instead of an old
    result. Stops at the first allocation that needs fresh device memory. Returns bytes poisoned.
    """
    held: list[torch.Tensor] = []
    poisoned = 0
    chunk = 256 << 20
    while chunk >= (1 << 20) and poisoned < max_bytes:
        before = torch.cuda.memory_reserved(device)
        try:
            t = torch.empty(chunk, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            chunk //= 4
            continue
        if torch.cuda.memory_reserved(device) > before:
            del t
            chunk //= 4
            continue
        t.fill_(0xFF)
        held.append(t)
        poisoned += chunk
    torch.cuda.synchronize(device)
    del held
    return poisoned
