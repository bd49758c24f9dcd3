"""tests/parallel.py: the whole suite is spread over the cores, a chosen run is left as asked."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.parallel import LONGEST_FIRST, longest_first, processes

WHOLE = pytest.Config.ArgsSource.TESTPATHS


def config(source: Any = WHOLE, xdist: bool = True, **option: Any) -> Any:
    opt = {"numprocesses": None, "dist": "no", "usepdb": False, "trace": False, "collectonly": False,
           "markexpr": "not gpu", **option}
    return SimpleNamespace(option=SimpleNamespace(**opt), args_source=source,
                           pluginmanager=SimpleNamespace(hasplugin=lambda name: xdist and name == "xdist"))


def test_the_whole_suite_takes_every_core_up_to_four():
    assert processes(config(), 2, {}) == 2
    assert processes(config(), 64, {}) == 4
    assert processes(config(markexpr="slow"), 2, {}) == 2
    assert processes(config(), 2, {"MKB_TEST_PROCESSES": "3"}) == 3


@pytest.mark.parametrize("cfg,env", [
    (config(source=pytest.Config.ArgsSource.ARGS), {}),          # chosen files or tests
    (config(markexpr="gpu"), {}),                                 # the GPU tests: one GPU
    (config(markexpr="gpu and not slow"), {}),
    (config(numprocesses=3), {}),                                 # -n of its own
    (config(dist="load"), {}),
    (config(usepdb=True), {}),
    (config(collectonly=True), {}),
    (config(xdist=False), {}),                                    # not installed, or -p no:xdist
    (config(), {"MKB_TEST_PROCESSES": "1"}),
    (config(), {"PYTEST_XDIST_WORKER": "gw0"}),                   # inside a worker: never again
])
def test_a_run_asked_for_otherwise_stays_in_one_process(cfg: Any, env: dict[str, str]):
    assert processes(cfg, 8, env) == 1


def test_the_longest_files_are_handed_out_first(tmp_path):
    items = [SimpleNamespace(path=tmp_path / p) for p in ("tests/a.py", LONGEST_FIRST[1], "tests/b.py", LONGEST_FIRST[0])]
    longest_first(items, str(tmp_path))
    assert [str(i.path.relative_to(tmp_path)) for i in items] == [LONGEST_FIRST[0], LONGEST_FIRST[1], "tests/a.py",
                                                                  "tests/b.py"]


def test_the_longest_files_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert all((root / p).is_file() for p in LONGEST_FIRST), [p for p in LONGEST_FIRST if not (root / p).is_file()]
