"""Shared test helpers."""

import time

from mkb_eval import problems as P


def until(cond, timeout: float = 10.0) -> bool:
    """Whether ``cond()`` came true within ``timeout`` s (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def loadable() -> list[P.Problem]:
    """Every problem folder that validates (tests/test_problem_set.py reports the ones that do not)."""
    out = []
    for folder in P.discover():
        try:
            out.append(P.load_problem(folder))
        except P.ProblemError:
            continue
    return out
