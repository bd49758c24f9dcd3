"""Shared test helpers."""

from mkb_eval import problems as P


def loadable() -> list[P.Problem]:
    """Every problem folder that validates (tests/test_problem_set.py reports the ones that do not)."""
    out = []
    for folder in P.discover():
        try:
            out.append(P.load_problem(folder))
        except P.ProblemError:
            continue
    return out
