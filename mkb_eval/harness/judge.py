"""The trusted side: regenerates inputs from the seeds, computes the reference and its fp64
anchor only after the candidate's outputs exist, compares, and times the PyTorch baselines.

Runs in the parent process (and a sweep's baselines in a timer process per GPU,
:mod:`mkb_eval.harness.reference_timer`), which never imports candidate code; the worker can
neither see the expected outputs nor influence how they are computed or compared.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mkb_eval.harness import attest, tensors, transport
from mkb_eval.harness.timing import Clock, TimingResult, time_draws
from mkb_eval.harness.tolerance import Mismatch, check_descriptor, compare, reference_numerics, run_reference
from mkb_eval.problems import Problem, load_module

if TYPE_CHECKING:
    from mkb_eval.baseline_record import BaselineEntry


# Seeding + input generation (the global RNG) and torch.compile (dynamo's global state) take
# turns across the judges of concurrent evaluations (sweep threads); otherwise they would
# regenerate each other's inputs. Reference runs and comparisons proceed side by side.
_TURN = threading.RLock()
_LINALG_READY: set[str] = set()


def _load_linalg(device: str) -> None:
    """torch loads its CUDA linear-algebra library on first use, and that load is not thread-safe
    ("lazy wrapper should be called at most once" when two judges' references reach it together)."""
    with _TURN:
        if device not in _LINALG_READY and torch.device(device).type == "cuda":
            _LINALG_READY.add(device)
            try:
                one = torch.ones(1, 1, device=device)
                torch.linalg.solve_triangular(one, one, upper=False)
            except Exception:  # noqa: BLE001 - a reference that needs the library will say what is wrong
                pass


class Judge:
    def __init__(self, problem: Problem, size: str, device: str) -> None:
        self.problem = problem
        self.module = load_module(problem)
        self.size = size
        self.device = device
        self.io_bytes: tuple[int, int] | None = None     # (input, reference output) bytes of one draw
        # seconds spent per part of ``check`` (inputs, input_digests, reference, read_output, compare, digest), summed over
        # its calls: where the parent's judging goes (the re-checks took 6 s an evaluation in a sweep)
        self.spent: dict[str, float] = {}
        _load_linalg(device)

    def _current(self) -> Any:
        """This judge's GPU as the thread's current device (a reference may say plain "cuda")."""
        dev = torch.device(self.device)
        return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()

    def inputs(self, seed: int) -> list[Any]:
        with _TURN, self._current():
            torch.manual_seed(seed)
            with reference_numerics():
                return self.module.make_inputs(self.size, self.device)

    def expected(self, inputs: list[Any]) -> tuple[Any, Any]:
        ref = run_reference(self.module.reference, inputs)
        anchor = run_reference(self.module.reference, inputs, anchored=True)
        return ref, anchor

    def check(self, seed: int, out_path: Path, worker_digests: list[Any] | None = None,
              commitment: list[list[int]] | None = None, key: int = 0) -> Mismatch | None:
        """Judge one saved output of the candidate against the reference for ``seed`` (and, for a timed
        window's output, against the digest committed at the window's end under ``key``)."""
        with self._current():
            return self._check(seed, out_path, worker_digests, commitment, key)

    @contextlib.contextmanager
    def _spend(self, part: str) -> Iterator[None]:
        """Add the block's seconds to ``spent[part]`` (the GPU's queue drained at its end, so each part
        carries its own work)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            if torch.device(self.device).type == "cuda":
                torch.cuda.synchronize(self.device)
            self.spent[part] = round(self.spent.get(part, 0.0) + time.perf_counter() - t, 4)

    def _check(self, seed: int, out_path: Path, worker_digests: list[Any] | None,
               commitment: list[list[int]] | None = None, key: int = 0) -> Mismatch | None:
        with self._spend("inputs"):
            inputs = self.inputs(seed)
        if worker_digests is not None:
            with self._spend("input_digests"):
                expected = tensors.digests(inputs)
            if len(worker_digests) != len(expected):     # the worker's report is untrusted: every input is checked
                return Mismatch("input", f"the worker reported {len(worker_digests)} input digests for {len(expected)} inputs")
            for pos, (after, before) in enumerate(zip(worker_digests, expected, strict=True)):
                if before is not None and after is not None and tuple(after) != tuple(before) \
                        and pos not in self.problem.mutates:
                    return Mismatch(f"input[{pos}]", "modified by solve; this problem's inputs are read-only")
        if not os.path.lexists(out_path):
            return Mismatch("output", "the worker saved no output for this draw")
        # the file is the untrusted worker's: parsed strictly, its structure checked against the
        # reference's before a byte of tensor data is read (see transport)
        try:
            with transport.open_output(out_path) as saved:
                with self._spend("reference"):
                    ref, anchor = self.expected(inputs)
                bad = check_descriptor(saved.root, ref)
                if bad:
                    return bad
                with self._spend("read_output"):
                    out = tensors.to_device(saved.values(), self.device)
        except transport.TransportError as e:
            return Mismatch("output", f"unreadable output file: {e}")
        if self.io_bytes is None:
            self.io_bytes = (sum(t.numel() * t.element_size() for t in tensors.walk(inputs)),
                             sum(t.numel() * t.element_size() for t in tensors.walk(ref)))
        with self._spend("compare"):
            bad = compare(out, ref, anchor, self.problem.tolerance_factor)
        if bad is None and commitment is not None:
            with self._spend("digest"):
                changed = attest.digest(out, key) != commitment
            if changed:
                return Mismatch("output", "changed after the timed window: it does not match the digest the worker "
                                          "committed to when the window ended")
        return bad

    def time_reference(self, warmup: list[int], timing: list[int], compiled: bool = False) -> tuple[TimingResult, float]:
        """Eager (or torch.compile) reference timed with the candidate's procedure; (result, setup s).

        The judge's GPU is made the thread's current device: CUDA events record on, and
        ``torch.cuda.synchronize()`` waits for, the current device only, so timing ``cuda:1``
        from a thread whose current device is ``cuda:0`` would measure host time alone.
        """
        with (_TURN if compiled else contextlib.nullcontext()), self._current():
            return self._time_reference(warmup, timing, compiled)

    def _time_reference(self, warmup: list[int], timing: list[int], compiled: bool) -> tuple[TimingResult, float]:
        fn = self.module.reference
        setup = 0.0
        if compiled:
            import torch._dynamo as dynamo

            dynamo.reset()
            t0 = time.perf_counter()
            fn = torch.compile(self.module.reference)
            with reference_numerics():
                fn(*self.inputs(warmup[0]))
            torch.cuda.synchronize()
            setup = time.perf_counter() - t0
        dev = torch.device(self.device)
        with reference_numerics(), torch.no_grad():
            res = time_draws(fn, self.inputs, warmup, timing, Clock(), dev)
        return res, setup


    def time_window(self, seeds: list[int], key: int) -> attest.WindowCalibration:
        """The eager reference's attested window on ``seeds`` (:func:`attest.calibrate_window`): the
        trusted make and commitment costs the worker's window is measured against."""
        with self._current():
            dev = torch.device(self.device)
            sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
            with reference_numerics(), torch.no_grad():
                cal = attest.calibrate_window(self.module.reference, self.inputs, seeds, key, sync)
            if dev.type == "cuda":
                torch.cuda.empty_cache()      # K input sets' blocks: a run's parent judges many problems
            return cal


def baseline_key(problem_hash: str, size: str, env: dict[str, Any]) -> str:
    return f"{problem_hash}|{size}|{env.get('gpu')}|{env.get('torch')}"


def read_baseline_cache(path: Path) -> dict[str, BaselineEntry]:
    """The cache's entries by key (:class:`mkb_eval.baseline_record.BaselineEntry`; the first valid one of
    a key wins; a malformed line is skipped with a warning naming it, and its key is a miss)."""
    from mkb_eval.baseline_record import read_baselines     # pydantic: imported where a cache is read

    return read_baselines(path)


def baseline_cached(problem: Problem, size: str, env: dict[str, Any], cache_dir: Path,
                    measure: Any | None, kind: str = "compile") -> tuple[float | None, bool, str | None]:
    """A reference's baseline time per (problem hash, size, GPU, torch): measured once, then reused.

    Compiling the reference takes tens of seconds; the kernel-independent number need not be
    paid again for every evaluation (``scripts/problem_report.py`` fills the cache for every
    problem at once, compiling in parallel). Sweeps may reuse the eager time the same way
    (``kind="eager"``, its own file): it is the largest share of a timing lane's work. ``measure=None``
    only looks up. Returns (ms, cached, error).
    """
    key = baseline_key(problem.hash, size, env)
    path = cache_dir / f"{kind}_baselines.jsonl"
    rec = read_baseline_cache(path).get(key)
    if rec is not None:
        return rec.ms, True, rec.error
    if measure is None:
        return None, False, None
    try:
        ms, err = float(measure()), None
    except Exception as e:            # torch.compile failing on a reference is a recorded fact
        if kind != "compile" or isinstance(e, (ChildProcessError, TimeoutError)):
            raise                 # (the timer process failing is no fact about the reference)
        ms, err = None, f"{type(e).__name__}: {str(e)[:300]}"
    store_baseline(cache_dir, kind, key, ms, err)
    return ms, False, err


def store_baseline(cache_dir: Path, kind: str, key: str, ms: float | None, err: str | None) -> None:
    """Append one entry to ``<cache_dir>/<kind>_baselines.jsonl`` (a time, or the error that stands for it),
    built as the typed entry (a bad key, a time that is not a positive number, both or neither of time and
    error fail here) and appended as one fsynced line."""
    from mkb_eval.baseline_record import BaselineEntry
    from mkb_eval.records import append_jsonl

    append_jsonl(cache_dir / f"{kind}_baselines.jsonl", BaselineEntry(key=key, ms=ms, error=err).to_json())
