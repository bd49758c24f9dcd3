"""One-way imports: no cycle in mkb_eval or dataset_builder, layers that import only downward, and a
CLI that imports the heavy dependencies only for the commands that need them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import import_graph as G

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mkb_eval", "dataset_builder")

# Top to bottom: a module may import its own layer's modules and those of the layers below it only
# (the layout of the design: each entry imports only entries listed below it). A new subpackage
# or top-level module must be given a layer here.
LAYERS: list[tuple[str, ...]] = [
    ("mkb_eval", "mkb_eval.cli", "mkb_eval.cli_lazy", "mkb_eval.skills.cli", "dataset_builder"),   # the public API, the CLIs, the builder
    ("mkb_eval.agent",),
    ("mkb_eval.sweep",),
    ("mkb_eval.report",),
    ("mkb_eval.skills",),
    ("mkb_eval.metrics",),
    ("mkb_eval.harness",),
    ("mkb_eval.dsl", "mkb_eval.prompts"),
    ("mkb_eval.dataset", "mkb_eval.verification_set"),
    ("mkb_eval.problems",),
    ("mkb_eval.schemas",),      # the exporter of every record's JSON Schema
    ("mkb_eval.env", "mkb_eval.records", "mkb_eval.attempt_record", "mkb_eval.run_record", "mkb_eval.skill_record",
     "mkb_eval.baseline_record", "mkb_eval.vocab", "mkb_eval.frontmatter", "mkb_eval._version", "mkb_eval.record_migrations"),
]

EXACT = {"mkb_eval"}            # the package's __init__ only: its submodules need layers of their own

HEAVY = ("datasets", "vllm", "transformers", "torch", "pyarrow", "pandas", "evaluate", "dataset_builder",
         "mkb_eval.agent.backends")


def graph() -> G.ImportGraph:
    g = G.build(ROOT, PACKAGES)
    from mkb_eval import cli

    for module, _ in cli.LAZY_COMMANDS.values():       # imported by name when its command runs
        g.add("mkb_eval.cli", module, 0)
    return g


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None               # (prefix length, layer): the longest prefix decides
    for i, names in enumerate(LAYERS):
        for n in names:
            if module == n or (module.startswith(n + ".") and n not in EXACT):
                if best is None or len(n) > best[0]:
                    best = (len(n), i)
    return None if best is None else best[1]


def test_no_import_cycle_in_the_packages():
    cycles = graph().cycles()
    assert not cycles, "import cycles (break each at one edge):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer_and_imports_only_downward():
    g = graph()
    unplaced = sorted(m for m in g.edges if layer_of(m) is None)
    assert not unplaced, f"give these modules a layer in LAYERS: {unplaced}"
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}), line {g.lines[(a, b)]}"
              for a, outs in sorted(g.edges.items()) for b in sorted(outs)
              if (layer_of(b) or 0) < (layer_of(a) or 0)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_graph_sees_function_level_and_relative_imports(tmp_path: Path):
    """The checker itself: a cycle closed inside a function, or through a relative import, is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "d.py").write_text("import pkg.a\nimport os\n")
    g = G.build(tmp_path, ["pkg"])
    assert g.edges["pkg.d"] == {"pkg.a"}
    assert g.cycles() == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    (pkg / "sub" / "c.py").write_text("import json\n")
    assert G.build(tmp_path, ["pkg"]).cycles() == []


def _imported_by(argv: list[str]) -> tuple[int, list[str]]:
    code = ("import io, contextlib, json, sys\n"
            "from mkb_eval.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    try:\n"
            f"        rc = main({argv!r})\n"
            "    except SystemExit as e:\n"
            "        rc = e.code\n"
            f"print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    rc, heavy = json.loads(res.stdout.strip().splitlines()[-1])
    return rc, heavy


@pytest.mark.parametrize("argv", [["--help"], ["problems", "list"], ["problems", "show", "28"], ["skills", "--help"]])
def test_light_commands_import_no_heavy_dependency(argv: list[str]):
    rc, heavy = _imported_by(argv)
    assert rc == 0 and heavy == [], f"mkb {' '.join(argv)} imported {heavy}"


def test_a_heavy_command_still_gets_its_module():
    """The laziness is real: choosing the dataset command does import the builder (and ``datasets``)."""
    rc, heavy = _imported_by(["dataset", "--help"])
    assert rc == 0 and "dataset_builder" in heavy and "datasets" in heavy


def test_lazy_commands_list_the_help_their_modules_give():
    """``mkb --help`` shows each lazy command's line before its module is imported: it must be the
    line the module's ``register`` gives, and every command a module registers must be listed."""
    import argparse
    import importlib

    from mkb_eval import cli

    sub = argparse.ArgumentParser().add_subparsers()
    for module in sorted({m for m, _ in cli.LAZY_COMMANDS.values()}):
        importlib.import_module(module).register(sub)
    given = {a.dest: a.help for a in sub._choices_actions}
    assert given == {name: text for name, (_, text) in cli.LAZY_COMMANDS.items()}
    full = cli.build_parser(full=True)
    action = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    for name in cli.LAZY_COMMANDS:
        assert action.choices[name]._actions[1:], f"{name} was not filled in"     # more than -h


def test_skills_cli_checks_versions_as_the_builder_does():
    from dataset_builder import versioning
    from mkb_eval.skills import cli as skills_cli

    assert skills_cli._SEMVER.pattern == versioning._SEMVER.pattern


def test_the_package_api_loads_on_use():
    """``import mkb_eval`` imports no subpackage; every public name still resolves (and is listed)."""
    code = ("import sys, mkb_eval\n"
            "assert not [m for m in sys.modules if m.startswith('mkb_eval.') and m != 'mkb_eval._version'], "
            "sorted(sys.modules)\n"
            "print(sorted(n for n in mkb_eval.__all__ if getattr(mkb_eval, n, None) is None))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr[-2000:]
    import mkb_eval

    assert sorted(mkb_eval.__all__) == sorted([*mkb_eval._EXPORTS, "__version__"])
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mkb_eval.nope  # noqa: B018 - the attribute access is the test
