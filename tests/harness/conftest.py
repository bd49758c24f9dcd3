import dataclasses
from pathlib import Path

import pytest

from mkb_eval import problems as P
from mkb_eval.harness.job import Job

KERNELS = Path(__file__).parent / "kernels"
PRELUDE = (KERNELS / "cute_add_prelude.py").read_text()


@pytest.fixture(scope="session")
def p28() -> P.Problem:
    return P.find(28)


def compose(body: str, tmp: Path, name: str) -> Path:
    """Write prelude + body as a kernel file (the contract is one self-contained kernel.py)."""
    path = tmp / f"{name}.py"
    path.write_text(PRELUDE + "\n\n" + body)
    return path


def cpu_job(**over: object) -> Job:
    """A CPU-tier job of problem 28 as ``make_job`` builds it (for an evaluation folder ``eval`` that need
    not exist), with the fields in ``over`` replaced: for tests that hand a phase a job of their own."""
    from mkb_eval.harness.jobs import make_job

    return dataclasses.replace(make_job(P.find(28), "tirx", Path("eval"), "cpu", "smoke", "cpu"), **over)
