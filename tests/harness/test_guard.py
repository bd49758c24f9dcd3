"""The run-time guard: calls into the task's reference / make_inputs are caught however they are reached,
the harness's own make_inputs calls are not, and removing the guard is seen. Both mechanisms are tested
where the interpreter has them (sys.monitoring needs Python 3.12)."""

import importlib.util
import sys
import threading
import types

import pytest

from mkb_eval.harness import guard as G

TASK = '''"""A task."""
import torch

SCALE = 2.0


def _helper(x):
    return x * SCALE


@torch.no_grad()
def reference(x):
    return _helper(x) + 1


def make_inputs(size="full", device="cpu"):
    return [_helper(torch.ones(4, device=device))]
'''

MECHANISMS = ["trace", pytest.param("monitoring", marks=pytest.mark.skipif(
    not hasattr(sys, "monitoring"), reason="sys.monitoring needs Python 3.12+"))]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(params=MECHANISMS)
def task(request, tmp_path):
    path = tmp_path / "reference.py"
    path.write_text(TASK)
    mod = _load(path, "mkb_task_guard_test")
    sys.modules["mkb_task_guard_test"] = mod
    g = G.install(mod, request.param)
    yield mod, g, path
    g.remove()
    sys.modules.pop("mkb_task_guard_test", None)


def test_the_harness_may_make_inputs_and_nobody_else(task):
    mod, g, _ = task
    with g.harness():
        x = mod.make_inputs("smoke", "cpu")[0]
    assert g.check() == [] and float(x.sum()) == 8
    with pytest.raises(G.ReferenceCall):
        mod.make_inputs("smoke", "cpu")
    assert any("make_inputs" in v for v in g.check())


def test_reference_through_sys_modules_is_caught_and_gives_nothing(task):
    mod, g, _ = task
    got = []
    try:
        got.append(sys.modules["mkb_task_guard_test"].reference(mod.SCALE * 0 + __import__("torch").ones(2)))
    except G.ReferenceCall:
        pass
    assert got == [] and any("reference" in v for v in g.check())


def test_reference_is_forbidden_even_inside_the_harness_window(task):
    mod, g, _ = task
    import torch

    with g.harness(), pytest.raises(G.ReferenceCall):
        mod.reference(torch.ones(2))


def test_a_task_helper_is_task_code_too(task):
    mod, g, _ = task
    import torch

    with pytest.raises(G.ReferenceCall):
        mod._helper(torch.ones(2))


def test_copies_of_the_code_are_caught(task):
    mod, g, _ = task
    import torch

    inner = mod.reference.__wrapped__
    copy = types.FunctionType(inner.__code__, vars(mod), "not_reference")
    with pytest.raises(G.ReferenceCall):
        copy(torch.ones(2))
    g.check()                          # (3.11: CPython unsets a trace function that raised; the check re-arms it)
    renamed = types.FunctionType(inner.__code__.replace(co_name="x", co_filename="elsewhere.py"), vars(mod))
    with pytest.raises(G.ReferenceCall):
        renamed(torch.ones(2))


def test_reimporting_or_execing_the_source_is_caught(task):
    mod, g, path = task
    import torch

    with pytest.raises(G.ReferenceCall):           # the module body of reference.py is task code
        _load(path, "a_copy_of_the_task")
    g.check()
    ns = {}
    exec(compile(path.read_text(), "innocent.py", "exec"), ns)    # another file name: same bytecode
    with pytest.raises(G.ReferenceCall):
        ns["reference"].__wrapped__(torch.ones(2))
    assert len(g.check()) >= 2


def test_an_edited_reference_is_not_a_reference_call(task):
    """The documented limit: changed bytecode is the candidate's own code (judged by the DSL-dependence draw)."""
    mod, g, path = task
    import torch

    ns = {}
    exec(compile(path.read_text().replace("return _helper(x) + 1", "y = _helper(x)\n    return y + 1"), "edited.py", "exec"), ns)
    assert float(ns["reference"](torch.ones(2)).sum()) == 6 and g.check() == []


def test_threads_are_watched(task):
    mod, g, _ = task
    import torch

    caught = []

    def run():
        try:
            mod.reference(torch.ones(2))
        except G.ReferenceCall:
            caught.append(True)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert caught == [True] and g.check()


def test_removing_the_guard_is_seen(task):
    mod, g, _ = task
    if g.mechanism == "sys.monitoring":
        sys.monitoring.register_callback(g.tool, sys.monitoring.events.PY_START, lambda code, off: None)
        assert any("callback was replaced" in v for v in g.check())
        assert g.check() == []                       # the check put the guard's callback back
        sys.monitoring.set_events(g.tool, 0)
        assert any("turned off" in v for v in g.check())
        sys.monitoring.set_events(g.tool, sys.monitoring.events.PY_START)
        sys.monitoring.free_tool_id(g.tool)
        assert any("freed" in v for v in g.check())
    else:
        sys.settrace(None)
        assert any("trace function was removed" in v for v in g.check())
        threading.settrace(lambda *a: None)
        assert any("new threads" in v for v in g.check())


def test_swapping_make_inputs_code_is_seen(task):
    mod, g, _ = task
    mod.make_inputs.__code__ = (lambda size="full", device="cpu": []).__code__
    assert any("make_inputs' code was replaced" in v for v in g.check())
