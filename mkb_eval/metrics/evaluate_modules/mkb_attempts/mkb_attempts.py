"""MetaKernelBench attempt-level scores as an HF `evaluate` Metric (a thin wrapper).

The arithmetic lives in ``mkb_eval.metrics``; this module only declares the inputs. No ``import a, b``
lines: `evaluate` parses this file's imports with a regex when it loads it.
"""

import os
from typing import Any

import datasets
import evaluate

from mkb_eval.metrics.inputs import DSLS, STATUSES, AttemptOutcome, InputError
from mkb_eval.metrics.ladder import score_attempts

_CITATION = """\
@article{metakernelbench2026,
  title   = {MetaKernelBench: Measuring GPU Kernel Knowledge Transfer Beyond Code},
  journal = {arXiv preprint arXiv:2610.05014},
  year    = {2026}
}
@article{ouyang2025kernelbench,
  title   = {KernelBench: Can LLMs Write Efficient GPU Kernels?},
  author  = {Ouyang, Anne and Guo, Simon and Arora, Simran and Zhang, Alex L. and Hu, William and
             R{\\'e}, Christopher and Mirhoseini, Azalia},
  journal = {arXiv preprint arXiv:2502.10517},
  year    = {2025}
}
"""

_DESCRIPTION = """\
Attempt-level scores of GPU kernel attempts (MetaKernelBench, CuTe DSL and TVM TIRx): pass rate,
the R@t ladder (share of attempts that passed with speedup >= t, t in 0, 0.5, 1, 2, 4), S = 100 x
mean R@t, KernelBench fast_p (passed and speedup > p, strict, p in 0, 1, 2) and the geometric mean
speedup of the passed attempts. passed means status "ok"; speedup = eager_ms / kernel_ms.
Attempts with status "skipped" are counted apart and left out of every rate; an empty input gives
None rates, never 0.

Config "verify" (GPU, opt-in) takes kernel sources instead of outcomes and runs the MetaKernelBench
verifier on each; it refuses to run unless MKB_ALLOW_KERNEL_EXEC=1 is set, because it executes
untrusted model-written code (the convention of HF code_eval).
"""

_KWARGS_DESCRIPTION = """
Args (default config):
    status (`list` of `str`): one per attempt, in "ok", "incorrect", "compile_error",
        "runtime_error", "timeout", "crashed", "policy_violation", "no_dsl_kernel", "implausible_time",
        "unverified", "skipped".
    speedup (`list` of `float` or `None`): eager_ms / kernel_ms; required for "ok", ignored otherwise.
Args (config "verify", needs a GPU and MKB_ALLOW_KERNEL_EXEC=1):
    problem_id (`list` of `int`): the problem of each kernel.
    dsl (`list` of `str`): "cutedsl" or "tirx".
    kernel_source (`list` of `str`): the kernel.py source of each attempt.
Returns:
    n_attempts, n_passed, n_skipped, n_errors (always 0 here), n_unverified (`int`),
    pass_rate, R@0, R@0.5, R@1, R@2, R@4 (`float` in [0, 1] or None), S (`float` in [0, 100] or None),
    fast_0, fast_1, fast_2 (`float` or None), geomean_speedup (`float` or None);
    config "verify" also returns `verdicts`, the verifier's dict per kernel.
Examples:

    >>> import evaluate
    >>> attempts = evaluate.load("mkb_eval/metrics/evaluate_modules/mkb_attempts")
    >>> r = attempts.compute(status=["ok", "ok", "incorrect", "timeout"], speedup=[2.0, 0.5, None, None])
    >>> r["pass_rate"], r["R@0.5"], r["R@1"], r["S"]
    (0.5, 0.5, 0.25, 30.0)
    >>> r["fast_0"], r["fast_1"], r["geomean_speedup"]
    (0.5, 0.25, 1.0)

    A skipped attempt is not an attempt; with nothing left, rates are None (n/a), not 0:

    >>> r = attempts.compute(status=["skipped"], speedup=[None])
    >>> r["n_attempts"], r["n_skipped"], r["pass_rate"], r["S"]
    (0, 1, None, None)

    The GPU mode refuses to execute kernels unless explicitly allowed:

    >>> verify = evaluate.load("mkb_eval/metrics/evaluate_modules/mkb_attempts", config_name="verify")
    >>> verify.compute(problem_id=[28], dsl=["tirx"], kernel_source=["def solve(*a): ..."])
    Traceback (most recent call last):
    ...
    ValueError: The "verify" mode of mkb_attempts executes untrusted model-written kernels ...
"""

_WARNING = """The "verify" mode of mkb_attempts executes untrusted model-written kernels on this machine's \
GPU. The verifier isolates each kernel in a child process, but it is not a security sandbox. Run it only in \
a disposable, network-isolated environment, and opt in by setting the environment variable \
MKB_ALLOW_KERNEL_EXEC=1, e.g. os.environ["MKB_ALLOW_KERNEL_EXEC"] = "1"."""

_SCORE_FEATURES = datasets.Features(
    {
        "status": datasets.Value("string"),
        "speedup": datasets.Value("float64"),
    }
)
_VERIFY_FEATURES = datasets.Features(
    {
        "problem_id": datasets.Value("int64"),
        "dsl": datasets.Value("string"),
        "kernel_source": datasets.Value("string"),
    }
)


def _outcome(i: int, status: Any, speedup: float | None) -> AttemptOutcome:
    """One AttemptOutcome from the inputs; the arm is irrelevant at attempt level."""
    if status not in STATUSES:
        raise ValueError(f"status[{i}]: unknown status {status!r}; expected one of {', '.join(STATUSES)}")
    try:
        return AttemptOutcome(
            problem_id=0,
            arm="solo_cutedsl",
            status=status,
            speedup=speedup if status == "ok" else None,
            skipped=status == "skipped",
        )
    except InputError as e:
        raise ValueError(f"attempt {i}: {e}") from None


def _verify(
    problem_id: list[int], dsl: list[str], kernel_source: list[str]
) -> tuple[list[AttemptOutcome], list[dict[str, Any]]]:
    """Run the verifier on each kernel (GPU); returns (outcomes, verdicts)."""
    if os.environ.get("MKB_ALLOW_KERNEL_EXEC") != "1":
        raise ValueError(_WARNING)
    try:
        from mkb_eval.harness.verify import verify_source
    except ImportError as e:
        raise RuntimeError(
            "the verify mode needs mkb_eval.harness.verify.verify_source, which this installation of mkb_eval "
            f"lacks ({e}); install a version of mkb_eval with the GPU harness"
        ) from e
    outcomes: list[AttemptOutcome] = []
    verdicts: list[dict[str, Any]] = []
    for i, (pid, d, src) in enumerate(zip(problem_id, dsl, kernel_source, strict=True)):
        if d not in DSLS:
            raise ValueError(f"dsl[{i}]: expected {' or '.join(map(repr, DSLS))}, got {d!r}")
        verdict = dict(verify_source(int(pid), d, src))
        timing = verdict.get("timing") or {}
        speedup = timing.get("speedup")
        if speedup is None and timing.get("kernel_ms") and timing.get("eager_ms"):
            speedup = timing["eager_ms"] / timing["kernel_ms"]
        outcomes.append(_outcome(i, verdict.get("status"), speedup))
        verdicts.append(verdict)
    return outcomes, verdicts


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MkbAttempts(evaluate.Metric):
    """Pass rate, R@t ladder, S, fast_p and geomean speedup of kernel attempts."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in ("default", "verify"):
            raise KeyError(f"unknown config {self.config_name!r}; use the default config or 'verify'")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=_VERIFY_FEATURES if self.config_name == "verify" else _SCORE_FEATURES,
            homepage="https://arxiv.org/abs/2610.05014",
            reference_urls=["https://arxiv.org/abs/2502.10517"],
        )

    def _compute(
        self,
        status: list[str] | None = None,
        speedup: list[float | None] | None = None,
        problem_id: list[int] | None = None,
        dsl: list[str] | None = None,
        kernel_source: list[str] | None = None,
    ) -> dict[str, Any]:
        if self.config_name == "verify":
            assert problem_id is not None and dsl is not None and kernel_source is not None
            outcomes, verdicts = _verify(problem_id, dsl, kernel_source)
            return {**score_attempts(outcomes), "verdicts": verdicts}
        assert status is not None and speedup is not None
        return dict(score_attempts([_outcome(i, s, x) for i, (s, x) in enumerate(zip(status, speedup, strict=True))]))
