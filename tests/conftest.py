import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Before pytest-xdist reads its options: the whole suite spread over the cores (tests/parallel.py)."""
    from tests.parallel import spread

    spread(config)
