"""MetaKernelBench evaluation toolkit: problems, GPU verifier, attempts, metrics, dataset.

    from mkb_eval import find, verify
    rec = verify(find(28), "tirx", "kernel.py")        # GPU tier on a GPU, CPU tier elsewhere
    print(rec.status, rec.timing.speedup)

The names below are loaded on first use (PEP 562), so ``import mkb_eval.harness.verify`` or the
``mkb`` CLI do not import the metrics, the dataset loader and their dependencies with it, and no
module of the package imports this one to reach another.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mkb_eval._version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "AttemptRecord": "mkb_eval.attempt_record",
    "load_dataset": "mkb_eval.dataset",
    "Limits": "mkb_eval.harness.verify",
    "verify": "mkb_eval.harness.verify",
    "verify_source": "mkb_eval.harness.verify",
    "read_attempts": "mkb_eval.metrics",
    "score": "mkb_eval.metrics",
    "Problem": "mkb_eval.problems",
    "ProblemError": "mkb_eval.problems",
    "find": "mkb_eval.problems",
    "load_all": "mkb_eval.problems",
    "load_problem": "mkb_eval.problems",
    "VerificationRecord": "mkb_eval.records",
    "append_jsonl": "mkb_eval.records",
    "read_jsonl": "mkb_eval.records",
}

__all__ = [                                     # _EXPORTS and the version (tests/test_architecture.py)
    "AttemptRecord",
    "Limits",
    "Problem",
    "ProblemError",
    "VerificationRecord",
    "__version__",
    "append_jsonl",
    "find",
    "load_all",
    "load_dataset",
    "load_problem",
    "read_attempts",
    "read_jsonl",
    "score",
    "verify",
    "verify_source",
]

if TYPE_CHECKING:
    from mkb_eval.attempt_record import AttemptRecord
    from mkb_eval.dataset import load_dataset
    from mkb_eval.harness.verify import Limits, verify, verify_source
    from mkb_eval.metrics import read_attempts, score
    from mkb_eval.problems import Problem, ProblemError, find, load_all, load_problem
    from mkb_eval.records import VerificationRecord, append_jsonl, read_jsonl


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mkb_eval' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value                     # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
