"""MetaKernelBench evaluation toolkit: problems, GPU verifier, attempts, metrics, dataset."""

from mkb_eval.problems import Problem, ProblemError, find, load_all, load_problem

__version__ = "0.1.0"

__all__ = ["Problem", "ProblemError", "find", "load_all", "load_problem", "__version__"]
