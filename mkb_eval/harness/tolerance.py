"""Correctness arithmetic: structure checks and the fp64-anchored tolerance.

An output passes iff ``max|out - anchor| <= factor * max(max|ref - anchor|, eps(dtype) * max|anchor|)``,
where ``ref`` is the reference in its own precision and ``anchor`` the same reference run on
inputs promoted to float64. Integer and bool outputs must match exactly. Non-finite values
fail unless the anchor holds the same non-finite value at that position.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Mismatch:
    """Why an output does not match: the path (``output[1]``) and a one-line reason."""

    path: str
    reason: str
    max_error: float | None = None
    allowance: float | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


_NUMERICS = threading.Lock()
_numerics_users = 0
_numerics_saved: tuple[Any, ...] = ()


@contextlib.contextmanager
def reference_numerics() -> Iterator[None]:
    """Full-precision matmuls and reductions while the reference runs (no TF32, no reduced-precision).

    The flags are process-wide, so the context is counted: judges in concurrent threads share one
    strict setting and the last to leave restores what was there before.
    """
    global _numerics_users, _numerics_saved  # noqa: PLW0603 - process-wide flags: counted under _NUMERICS
    m = torch.backends.cuda.matmul
    with _NUMERICS:
        if _numerics_users == 0:
            _numerics_saved = (m.allow_tf32, torch.backends.cudnn.allow_tf32, m.allow_bf16_reduced_precision_reduction,
                               m.allow_fp16_reduced_precision_reduction, torch.get_float32_matmul_precision())
            m.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            m.allow_bf16_reduced_precision_reduction = False
            m.allow_fp16_reduced_precision_reduction = False
            torch.set_float32_matmul_precision("highest")
        _numerics_users += 1
    try:
        yield
    finally:
        with _NUMERICS:
            _numerics_users -= 1
            if _numerics_users == 0:
                saved = _numerics_saved
                (m.allow_tf32, torch.backends.cudnn.allow_tf32, m.allow_bf16_reduced_precision_reduction,
                 m.allow_fp16_reduced_precision_reduction) = saved[:4]
                torch.set_float32_matmul_precision(saved[4])


def promote(value: Any) -> Any:
    """Floating tensors (and floats) to float64; everything else unchanged (deep)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).clone() if value.is_floating_point() else value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(promote(v) for v in value)
    return copy.deepcopy(value)


def clone_inputs(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(clone_inputs(v) for v in value)
    return copy.deepcopy(value)


def run_reference(reference: Any, inputs: list[Any], anchored: bool = False) -> Any:
    """Run the reference on a private copy of the inputs (references may mutate them)."""
    args = promote(inputs) if anchored else clone_inputs(inputs)
    with reference_numerics(), torch.no_grad():
        return reference(*args)


def _kind(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return "tensor"
    return type(v).__name__


def check_structure(out: Any, ref: Any, path: str = "output") -> Mismatch | None:
    """Same container type, length and nesting; tensors with the same shape, dtype and device."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            return Mismatch(path, f"expected a tensor, got {_kind(out)}")
        if tuple(out.shape) != tuple(ref.shape):
            return Mismatch(path, f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}")
        if out.dtype != ref.dtype:
            return Mismatch(path, f"dtype {out.dtype} != expected {ref.dtype}")
        if out.device.type != ref.device.type:
            return Mismatch(path, f"device {out.device} != expected {ref.device}")
        return None
    if isinstance(ref, (list, tuple)):
        if type(out) is not type(ref):
            return Mismatch(path, f"expected a {type(ref).__name__}, got {_kind(out)}")
        if len(out) != len(ref):
            return Mismatch(path, f"length {len(out)} != expected {len(ref)}")
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            bad = check_structure(o, r, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(ref, bool) or isinstance(out, bool):
        return None if type(out) is type(ref) else Mismatch(path, f"expected {type(ref).__name__}, got {_kind(out)}")
    if isinstance(ref, (int, float)):
        return None if isinstance(out, (int, float)) else Mismatch(path, f"expected a number, got {_kind(out)}")
    return None if type(out) is type(ref) else Mismatch(path, f"expected {type(ref).__name__}, got {_kind(out)}")


def check_descriptor(node: Any, ref: Any, path: str = "output") -> Mismatch | None:
    """``check_structure`` on a worker's output descriptor (:mod:`~mkb_eval.harness.transport`), before any
    of its bytes are read: a refusal, a wrong container, length, shape, dtype or device is a mismatch."""
    from mkb_eval.harness import transport as T

    if isinstance(node, T.Refused):
        return Mismatch(path, node.reason)
    if isinstance(ref, torch.Tensor):
        if not isinstance(node, T.TensorDesc):
            return Mismatch(path, f"expected a tensor, got {_desc_kind(node)}")
        if node.shape != tuple(ref.shape):
            return Mismatch(path, f"shape {node.shape} != expected {tuple(ref.shape)}")
        if T.DTYPES[node.dtype] != ref.dtype:
            return Mismatch(path, f"dtype torch.{node.dtype} != expected {ref.dtype}")
        if node.device != ref.device.type:
            return Mismatch(path, f"device {node.device} != expected {ref.device.type}")
        return None
    if isinstance(ref, (list, tuple)):
        if not isinstance(node, T.SeqDesc) or node.kind != type(ref).__name__:
            return Mismatch(path, f"expected a {type(ref).__name__}, got {_desc_kind(node)}")
        if len(node.items) != len(ref):
            return Mismatch(path, f"length {len(node.items)} != expected {len(ref)}")
        for i, (o, r) in enumerate(zip(node.items, ref, strict=True)):
            bad = check_descriptor(o, r, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if not isinstance(node, T.Scalar):
        return Mismatch(path, f"expected {type(ref).__name__}, got {_desc_kind(node)}")
    return check_structure(node.value, ref, path)


def _desc_kind(node: Any) -> str:
    from mkb_eval.harness import transport as T

    if isinstance(node, T.TensorDesc):
        return "tensor"
    if isinstance(node, T.SeqDesc):
        return node.kind
    return type(getattr(node, "value", None)).__name__


def _compare_tensor(out: torch.Tensor, ref: torch.Tensor, anchor: torch.Tensor, factor: float,
                    path: str) -> Mismatch | None:
    if not ref.is_floating_point() and not ref.is_complex():
        diff = (out != ref.to(out.device))
        n = int(diff.sum())
        if n:
            first = tuple(int(i) for i in diff.nonzero()[0].tolist())
            return Mismatch(path, f"{n} of {ref.numel()} elements differ (exact match required; first at {first}: "
                                  f"got {out[first].item()}, expected {ref[first].item()})")
        return None
    o = out.detach().to(torch.float64)
    a = anchor.detach().to(device=o.device, dtype=torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    # the common case in one read back: an all-finite anchor and output need no masks (amax propagates
    # nan and inf, so a non-finite value anywhere shows in these three numbers and takes the masked path)
    err, ref_err, scale = torch.stack([(o - a).abs().amax(), (r - a).abs().amax(), a.abs().amax()]).tolist() \
        if a.numel() else (0.0, 0.0, 0.0)
    if not (math.isfinite(err) and math.isfinite(scale)):
        return _compare_nonfinite(o, r, a, out.dtype, factor, path)
    if not math.isfinite(ref_err):
        ref_err = _reference_error(r, a, None)
    return _within(o, a, err, ref_err, scale, out.dtype, factor, path)


def _reference_error(r: torch.Tensor, a: torch.Tensor, a_fin: torch.Tensor | None) -> float:
    """The reference's largest error against the anchor where it is finite. Where the reference itself
    is nan or inf and the anchor is finite, its error says nothing of the allowance: counted, a nan made
    the allowance nan and an inf made it infinite, and either let any output pass."""
    d = (r - a).abs()
    ok = torch.isfinite(d) if a_fin is None else torch.isfinite(d) & a_fin
    return float(d[ok].max()) if bool(ok.any()) else 0.0


def _within(o: torch.Tensor, a: torch.Tensor, err: float, ref_err: float, scale: float, dtype: torch.dtype,
            factor: float, path: str, a_fin: torch.Tensor | None = None) -> Mismatch | None:
    """The tolerance rule on the finite positions' numbers (``a_fin`` None: every position)."""
    allowance = factor * max(ref_err, torch.finfo(dtype).eps * scale)
    if err > allowance:
        over_all = (o - a).abs() > allowance
        over = int(over_all.sum() if a_fin is None else over_all[a_fin].sum())
        n = a.numel() if a_fin is None else int(a_fin.sum())
        ratio = err / allowance if allowance > 0 else float("inf")
        return Mismatch(path, f"max abs error {err:.4g} exceeds the allowance {allowance:.4g} ({ratio:.3g}x over), "
                              f"{over} of {n} elements over", err, allowance)
    return None


def _compare_nonfinite(o: torch.Tensor, r: torch.Tensor, a: torch.Tensor, dtype: torch.dtype, factor: float,
                       path: str) -> Mismatch | None:
    """An anchor or output with inf/nan somewhere: the rule on the anchor's finite positions."""
    a_fin = torch.isfinite(a)
    if not bool(a_fin.all()):
        special = ~a_fin
        same = (o[special] == a[special]) | (torch.isnan(o[special]) & torch.isnan(a[special]))
        if not bool(same.all()):
            return Mismatch(path, "non-finite reference values (inf/nan) not reproduced")
    o_bad = ~torch.isfinite(o) & a_fin
    if bool(o_bad.any()):
        return Mismatch(path, f"contains {int(o_bad.sum())} non-finite values where the reference is finite")
    if not bool(a_fin.any()):
        return None
    err = float((o - a)[a_fin].abs().max())
    ref_err = _reference_error(r, a, a_fin)
    scale = float(a[a_fin].abs().max())
    return _within(o, a, err, ref_err, scale, dtype, factor, path, a_fin)


def compare(out: Any, ref: Any, anchor: Any, factor: float = 3.0, path: str = "output") -> Mismatch | None:
    """Structure first, then values; returns the first mismatch or None."""
    bad = check_structure(out, ref, path)
    if bad:
        return bad
    if isinstance(ref, torch.Tensor):
        return _compare_tensor(out, ref, anchor, factor, path)
    if isinstance(ref, (list, tuple)):
        for i, (o, r, a) in enumerate(zip(out, ref, anchor, strict=True)):
            bad = compare(o, r, a, factor, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(ref, float):
        t = torch.tensor([float(out)], dtype=torch.float64)
        return _compare_tensor(t, torch.tensor([ref], dtype=torch.float32), torch.tensor([float(anchor)],
                               dtype=torch.float64), factor, path)
    return None if out == ref else Mismatch(path, f"got {out!r}, expected {ref!r}")


def zeros_like_output(value: Any) -> Any:
    """The "return zeros" answer of the same structure (used to prove a problem is not degenerate)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, (list, tuple)):
        return type(value)(zeros_like_output(v) for v in value)
    return type(value)(0) if isinstance(value, (int, float)) else value
