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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a spread run (each process collects the same list), the longest files are handed out first."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.parallel import longest_first

        longest_first(items, str(config.rootpath))
