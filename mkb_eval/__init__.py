"""MetaKernelBench evaluation toolkit: problems, GPU verifier, attempts, metrics, dataset.

    from mkb_eval import find, verify
    rec = verify(find(28), "tirx", "kernel.py")        # GPU tier on a GPU, CPU tier elsewhere
    print(rec.status, rec.timing.speedup)
"""

from mkb_eval.dataset import load_dataset
from mkb_eval.harness.verify import Limits, verify, verify_source
from mkb_eval.metrics import read_attempts, score
from mkb_eval.problems import Problem, ProblemError, find, load_all, load_problem
from mkb_eval.records import VerificationRecord, append_jsonl, read_jsonl

__version__ = "0.1.0"

__all__ = [
    "Limits",
    "Problem",
    "ProblemError",
    "VerificationRecord",
    "__version__",
    "append_jsonl",
    "find",
    "load_dataset",
    "load_all",
    "load_problem",
    "read_attempts",
    "read_jsonl",
    "score",
    "verify",
    "verify_source",
]
