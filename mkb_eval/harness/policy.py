"""Static policy flags for candidate kernels (AST, no execution).

Flags are evidence recorded in every result; those in ``FORBIDDEN`` reject the submission as
``policy_violation``. This is not a sandbox: isolation comes from the worker process, and the
dynamic checks (observed DSL launches, the DSL-dependence draw, tamper checks) back it up.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable
from dataclasses import dataclass

from mkb_eval.dsl import SPECS

# module prefixes → flag
_IMPORT_FLAGS = {
    "triton": "triton",
    "torch.utils.cpp_extension": "cpp_extension",
    "cupy": "other_kernel_language",
    "numba": "other_kernel_language",
    "pycuda": "other_kernel_language",
    "cuda.core": "cuda_driver_api",
    "tilelang": "other_kernel_language",
    "ctypes": "ctypes",
    "cffi": "ctypes",
    "subprocess": "subprocess",
    "multiprocessing": "subprocess",
    "socket": "network",
    "urllib": "network",
    "requests": "network",
    "http": "network",
    "gc": "introspection",
    "inspect": "introspection",
    "mkb_eval": "harness_access",
}
# attribute chains (suffix match on the dotted name) → flag
_CALL_FLAGS = {
    "torch.compile": "torch_compile",
    "torch.jit.script": "torch_jit",
    "torch.jit.trace": "torch_jit",
    "load_inline": "cpp_extension",
    "torch.cuda.CUDAGraph": "cuda_graph",
    "torch.cuda.graph": "cuda_graph",
    "torch.cuda.make_graphed_callables": "cuda_graph",
    "os.system": "subprocess",
    "os.popen": "subprocess",
    "os.fork": "subprocess",
    "os.execv": "subprocess",
    "os.execvp": "subprocess",
    "os.kill": "subprocess",
    "sys._getframe": "introspection",
    "gc.get_objects": "introspection",
    "gc.get_referrers": "introspection",
    "torch.manual_seed": "rng_access",
    "torch.cuda.manual_seed": "rng_access",
    "torch.initial_seed": "rng_access",
    "torch.get_rng_state": "rng_access",
    "torch.cuda.get_rng_state": "rng_access",
    "torch.cuda.Event": "timing_access",
    "time.perf_counter": "timing_access",
    "torch.cuda.Stream": "side_stream",
    "torch.cuda.stream": "side_stream",
    "torch.cuda.set_stream": "side_stream",
    "importlib.import_module": "dynamic_code",
}
# bare builtins → flag
_BUILTIN_FLAGS = {"setattr": "monkeypatch", "exec": "dynamic_code", "eval": "dynamic_code",
                  "compile": "dynamic_code", "__import__": "dynamic_code"}
_NAMES = {"reference": "calls_reference", "make_inputs": "calls_make_inputs"}
# packages whose attributes a candidate may not assign: torch and every DSL's toolchain
_GUARDED = ("torch", *(m for s in SPECS.values() for m in s.toolchain))

# flags that reject the submission; the rest are recorded for review
FORBIDDEN = frozenset({
    "triton", "cpp_extension", "other_kernel_language", "cuda_driver_api", "ctypes",
    "subprocess", "network", "harness_access", "torch_compile", "torch_jit", "cuda_graph",
    "calls_reference", "calls_make_inputs", "timing_patch", "rng_access",
})


@dataclass(frozen=True)
class PolicyResult:
    flags: tuple[str, ...]
    details: tuple[str, ...]

    @property
    def violations(self) -> tuple[str, ...]:
        return tuple(f for f in self.flags if f in FORBIDDEN)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


_PARSE_LOCK = threading.Lock()


def parse_python(source: str, filename: str = "kernel.py") -> ast.Module:
    """``ast.parse``, one thread at a time: CPython 3.11's parser is not thread-safe (parses in a
    sweep's threads raised "SystemError: AST constructor recursion depth mismatch")."""
    with _PARSE_LOCK:
        return ast.parse(source, filename=filename)


def check_source(source: str, filename: str = "kernel.py") -> PolicyResult:  # noqa: C901, PLR0912 - one branch per AST rule
    """Flag forbidden or suspicious constructs in a candidate's source."""
    try:
        tree = parse_python(source, filename)
    except SyntaxError as e:
        return PolicyResult(("syntax_error",), (f"line {e.lineno}: {e.msg}",))
    found: dict[str, list[str]] = {}

    def flag(name: str, node: ast.AST, what: str) -> None:
        found.setdefault(name, []).append(f"line {getattr(node, 'lineno', '?')}: {what}")

    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                _flag_module(a.name, node, flag)
        elif isinstance(node, ast.ImportFrom) and node.module:
            _flag_module(node.module, node, flag)
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                _flag_module(f"{node.module}.{a.name}", node, flag)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = _dotted(node)
            if not name:
                continue
            head, _, rest = name.partition(".")
            full = aliases.get(head, head) + (f".{rest}" if rest else "")
            for pattern, f in _CALL_FLAGS.items():
                if full == pattern or full.endswith("." + pattern):
                    flag(f, node, full)
            if isinstance(node, ast.Name) and node.id in _BUILTIN_FLAGS and node.id not in aliases:
                flag(_BUILTIN_FLAGS[node.id], node, node.id)
            if isinstance(node, ast.Name) and node.id in _NAMES and isinstance(node.ctx, ast.Load):
                flag(_NAMES[node.id], node, node.id)
            if isinstance(node, ast.Attribute) and node.attr in ("elapsed_time", "synchronize", "record") \
                    and isinstance(getattr(node, "ctx", None), ast.Store):
                flag("timing_patch", node, f"assigns {full}")
        if isinstance(node, ast.Assign):
            for t in node.targets:
                tn = _dotted(t)
                if tn.startswith(tuple(m + "." for m in _GUARDED)) or any(tn.startswith(a + ".") for a in aliases
                                                                         if aliases[a].split(".")[0] in _GUARDED):
                    flag("monkeypatch", node, f"assigns {tn}")
                    if tn.endswith(("elapsed_time", "synchronize", "Event", "manual_seed", "randn", "rand", "randint")):
                        flag("timing_patch" if "seed" not in tn and "rand" not in tn else "rng_access", node, f"assigns {tn}")
    funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    if "solve" not in funcs | assigned:
        found.setdefault("missing_solve", []).append("no top-level 'solve'")
    flags = tuple(sorted(found))
    details = tuple(f"{f}: {d}" for f in flags for d in found[f][:3])
    return PolicyResult(flags, details)


def _flag_module(mod: str, node: ast.AST, flag: Callable[[str, ast.AST, str], None]) -> None:
    for prefix, f in _IMPORT_FLAGS.items():
        if mod == prefix or mod.startswith(prefix + "."):
            flag(f, node, f"import {mod}")
