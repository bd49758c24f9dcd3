"""scripts/code_size.py: module and function lengths, and an exit status for what is over a limit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("code_size", Path(__file__).resolve().parents[1] / "scripts" / "code_size.py")
assert _spec is not None and _spec.loader is not None
code_size = importlib.util.module_from_spec(_spec)
sys.modules["code_size"] = code_size      # its dataclass looks its module up
_spec.loader.exec_module(code_size)


def test_sizes_count_modules_and_nested_functions(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("class A:\n    def f(self):\n        x = 1\n        return x\n\n\ndef g():\n    pass\n")
    got = {(s.kind, s.name): s.lines for s in code_size.sizes(tmp_path, ("pkg",))}
    assert got == {("module", "pkg/m.py"): 8, ("function", "pkg/m.py:A.f"): 3, ("function", "pkg/m.py:g"): 2}


def test_the_exit_status_says_whether_anything_is_over(capsys):
    assert code_size.main(["--module-lines", "100000", "--function-lines", "100000"]) == 0
    assert code_size.main(["--module-lines", "1", "--json"]) == 1
    assert '"kind": "module"' in capsys.readouterr().out
