"""Module and function sizes of the packages, largest first (the architecture issue's limits: a
module of at most 400 lines, a function of at most 80).

    python scripts/code_size.py                 # modules over 400 lines, functions over 80
    python scripts/code_size.py --all --json    # every module and function

Exit status 1 when something is over a limit, so it can gate a check once the code is within them.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mkb_eval", "dataset_builder")


@dataclass(frozen=True)
class Size:
    kind: str            # "module" or "function"
    name: str            # path, or path:qualified.name
    lines: int


def sizes(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Size]:
    out: list[Size] = []
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            text = f.read_text()
            out.append(Size("module", rel, len(text.splitlines())))
            out += [Size("function", f"{rel}:{q}", n) for q, n in _functions(ast.parse(text))]
    return sorted(out, key=lambda s: (s.kind, -s.lines, s.name))


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            q = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                found.append((q, (node.end_lineno or node.lineno) - node.lineno + 1))
            found += _functions(node, q + ".")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module-lines", type=int, default=400)
    ap.add_argument("--function-lines", type=int, default=80)
    ap.add_argument("--all", action="store_true", help="list everything, not only what is over a limit")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    limit = {"module": args.module_lines, "function": args.function_lines}
    every = sizes()
    over = [s for s in every if s.lines > limit[s.kind]]
    shown = every if args.all else over
    if args.json:
        print(json.dumps([asdict(s) for s in shown], indent=1))
    else:
        for s in shown:
            print(f"{s.lines:5d}  {s.kind:8s}  {s.name}")
        print(f"{len(over)} over the limits ({args.module_lines} lines a module, {args.function_lines} a function)",
              file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
