from pathlib import Path

import pytest

from mkb_eval import problems as P

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
