"""The whole suite on every core (called by tests/conftest.py's ``pytest_cmdline_main``).

The suite mostly waits on one child process at a time (a worker importing torch and both
toolchains, a compile, a fault that must time out): run in one process it kept one of the CI
machine's two cores busy. When pytest-xdist is installed (the ``test`` extra) and the run names no
test paths, the suite is spread over ``min(4, cores)`` processes, a test file per process
(``--dist loadfile``: module fixtures such as the compile sweep and the local Ray instance are made
once). A run of chosen paths, of ``-m gpu`` (one GPU, and timing that must have the machine to
itself), with ``-n``/``--dist``/``--pdb``/``-p no:xdist`` of its own, or with
``MKB_TEST_PROCESSES=1`` stays as it was asked.
"""

from __future__ import annotations

import os

import pytest

# The longest files first (seconds, each file alone in one process on a 2-core machine, 2026-12-04; the compile
# checks with both cores): spread a file per process, the suite ends when its longest file does, so those start at
# once and the short ones fill in around them.
LONGEST_FIRST = (
    "tests/harness/test_solutions_compile.py",     # 301 (two compiles at a time)
    "tests/harness/test_faults.py",                # 106
    "tests/test_ray_executor.py",                  # 74
    "tests/agent/test_vllm_server.py",             # 59 (a vLLM-CPU server)
    "tests/agent/test_engine.py",                  # 58 (vLLM on CPU)
    "tests/harness/test_pool.py",                  # 52
    "tests/harness/test_forkserver.py",            # 44
)


def gpu_selected(markexpr: str) -> bool:
    return "gpu" in markexpr and not markexpr.strip().startswith("not")


def processes(config: pytest.Config, cores: int, env: dict[str, str]) -> int:
    """How many processes to spread this run over; 1: leave it as it is."""
    opt = config.option
    if (env.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist")
            or getattr(opt, "numprocesses", None) is not None or getattr(opt, "dist", "no") != "no"
            or opt.usepdb or opt.trace or opt.collectonly):
        return 1
    wanted = env.get("MKB_TEST_PROCESSES", "")
    if wanted.isdigit():
        return max(1, int(wanted))
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or gpu_selected(opt.markexpr or ""):
        return 1
    return max(1, min(4, cores))


def spread(config: pytest.Config) -> None:
    n = processes(config, len(os.sched_getaffinity(0)), dict(os.environ))
    if n > 1:
        config.option.numprocesses = n
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False      # xdist's default puts the files with most tests first


def longest_first(items: list[pytest.Item], root: str) -> None:
    """Reorder ``items`` (stably) so that the files of LONGEST_FIRST come first, in that order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        rel = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        return rank.get(rel, len(rank))

    items.sort(key=key)
