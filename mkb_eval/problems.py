"""Problem folders: loading, validation with precise errors, hashing, speed-of-light model.

A problem is a folder ``problems/<family>/<NN>_<slug>/`` holding ``reference.py`` (code) and
``problem.yaml`` (data). Validation reads both without importing the reference, so a broken
folder is reported, never executed; ``load_module`` imports it when a caller needs to run it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from mkb_eval.vocab import DSLS as DSLS  # re-exported: P.DSLS is used across the package
from mkb_eval.vocab import FAMILIES
from mkb_eval.vocab import SIZES as SIZES  # re-exported: P.SIZES (the CLI's --size choices)

DTYPES = ("bf16", "fp16", "fp32", "fp8", "nvfp4", "uint8", "int32_int64")
LICENSES = ("Apache-2.0",)

# H200 SXM datasheet: 4.8 TB/s HBM3e; dense tensor-core / CUDA-core rates in FLOP/s.
H200_BANDWIDTH = 4.8e12
H200_RATES = {
    "bf16_tensor": 989.5e12,
    "fp16_tensor": 989.5e12,
    "fp8_tensor": 1979e12,
    "tf32_tensor": 494.5e12,
    "fp32": 67e12,
    "fp64": 34e12,
}

_FOLDER_RE = re.compile(r"^(\d{2})_([a-z0-9]+(?:_[a-z0-9]+)*)$")
_REPO_ROOT = Path(__file__).resolve().parent.parent


class ProblemError(ValueError):
    """A problem folder is malformed; the message names the folder, the file and the field."""


@dataclass(frozen=True)
class SolModel:
    """Speed-of-light model at ``full`` size: the larger of the memory and the arithmetic time."""

    flops: float
    bytes: float
    rate: str
    bound: str

    @property
    def memory_ms(self) -> float:
        return self.bytes / H200_BANDWIDTH * 1e3

    @property
    def compute_ms(self) -> float:
        return self.flops / H200_RATES[self.rate] * 1e3

    @property
    def sol_ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)


@dataclass(frozen=True)
class Problem:
    """One validated problem folder."""

    id: int
    slug: str
    family: str
    dtype: str
    description: str
    docstring: str
    path: Path
    sizes: dict[str, dict[str, Any]]
    tolerance_factor: float
    mutates: tuple[int, ...]
    provenance: dict[str, Any]
    license: str
    sol: SolModel
    hash: str
    meta: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.id:02d}_{self.slug}"

    @property
    def reference_path(self) -> Path:
        return self.path / "reference.py"

    @property
    def reference_source(self) -> str:
        return self.reference_path.read_text()

    def solution_path(self, dsl: str) -> Path:
        return self.path / "solutions" / f"{dsl}.py"

    def wrong_solutions(self) -> list[Path]:
        return sorted((self.path / "solutions" / "wrong").glob("*.py"))


def _fail(path: Path, what: str) -> ProblemError:
    return ProblemError(f"{path}: {what}")


def _require(cfg: dict[str, Any], key: str, types: type | tuple[type, ...], path: Path) -> Any:
    if key not in cfg:
        raise _fail(path, f"missing required field '{key}'")
    value = cfg[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _fail(path, f"field '{key}' must be {types}, got bool")
    if not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise _fail(path, f"field '{key}' must be {names}, got {type(value).__name__} ({value!r})")
    return value


def check_reference_source(source: str, path: Path) -> str:
    """Check the reference contract statically; return the one-line docstring."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise _fail(path, f"syntax error at line {e.lineno}: {e.msg}") from None
    doc = ast.get_docstring(tree, clean=False)
    if not doc or not doc.strip():
        raise _fail(path, "missing module docstring (one line describing the computation)")
    if "\n" in doc.strip():
        raise _fail(path, "module docstring must be a single line")
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("reference", "make_inputs"):
        if name not in funcs:
            raise _fail(path, f"missing top-level function '{name}'")
    args = funcs["make_inputs"].args
    params = [a.arg for a in args.args + args.kwonlyargs]
    for p in ("size", "device"):
        if p not in params:
            raise _fail(path, f"make_inputs must take a '{p}' parameter (got {params})")
    return doc.strip()


def load_problem(folder: str | Path) -> Problem:
    """Load and validate one problem folder; raise ProblemError naming what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProblemError(f"{folder}: not a directory")
    m = _FOLDER_RE.match(folder.name)
    if not m:
        raise _fail(folder, "folder name must be '<NN>_<slug>' (two digits, lowercase words joined by '_')")
    ref_path, yaml_path = folder / "reference.py", folder / "problem.yaml"
    for p in (ref_path, yaml_path):
        if not p.is_file():
            raise _fail(folder, f"missing {p.name}")
    source = ref_path.read_text()
    docstring = check_reference_source(source, ref_path)
    try:
        cfg = yaml.safe_load(yaml_path.read_text())
    except yaml.YAMLError as e:
        raise _fail(yaml_path, f"invalid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(yaml_path, "top level must be a mapping")
    pid, slug, family, dtype = _identity(cfg, m, folder, yaml_path)
    description = _require(cfg, "description", str, yaml_path).strip()
    if not description:
        raise _fail(yaml_path, "description is empty")
    sizes, tol, mutates = _sizes_and_rules(cfg, yaml_path)
    prov = _require(cfg, "provenance", dict, yaml_path)
    for k in ("source", "notes"):
        if not isinstance(prov.get(k), str) or not prov[k].strip():
            raise _fail(yaml_path, f"provenance.{k} must be a non-empty string")
    lic = _require(cfg, "license", str, yaml_path)
    if lic not in LICENSES:
        raise _fail(yaml_path, f"license '{lic}' is not one we can ship ({LICENSES})")
    sol = _sol_model(_require(cfg, "sol", dict, yaml_path), yaml_path)
    unknown = set(cfg) - _KNOWN_FIELDS
    if unknown:
        raise _fail(yaml_path, f"unknown fields {sorted(unknown)}")
    return Problem(
        id=pid, slug=slug, family=family, dtype=dtype, description=description, docstring=docstring,
        path=folder.resolve(), sizes=sizes, tolerance_factor=float(tol.get("factor", 3.0)),
        mutates=tuple(mutates), provenance=prov, license=lic, sol=sol,
        hash=problem_hash(source, cfg), meta=cfg,
    )


_KNOWN_FIELDS = {"id", "slug", "family", "dtype", "description", "sizes", "tolerance", "mutates",
                 "provenance", "license", "sol", "inputs", "outputs"}


def _identity(cfg: dict[str, Any], m: re.Match[str], folder: Path, yaml_path: Path) -> tuple[int, str, str, str]:
    """id, slug, family and dtype, each agreeing with the folder's name and place."""
    pid = _require(cfg, "id", int, yaml_path)
    if pid != int(m.group(1)):
        raise _fail(yaml_path, f"id {pid} does not match the folder number {m.group(1)}")
    if not 1 <= pid <= 99:
        raise _fail(yaml_path, f"id {pid} out of range 1..99")
    slug = _require(cfg, "slug", str, yaml_path)
    if slug != m.group(2):
        raise _fail(yaml_path, f"slug '{slug}' does not match the folder name '{m.group(2)}'")
    family = _require(cfg, "family", str, yaml_path)
    if family not in FAMILIES:
        raise _fail(yaml_path, f"family '{family}' is not one of {FAMILIES}")
    if folder.parent.name != family:
        raise _fail(yaml_path, f"family '{family}' but the folder sits under '{folder.parent.name}'")
    dtype = _require(cfg, "dtype", str, yaml_path)
    if dtype not in DTYPES:
        raise _fail(yaml_path, f"dtype '{dtype}' is not one of {DTYPES}")
    if not slug.endswith(dtype):
        raise _fail(yaml_path, f"slug '{slug}' must end with its dtype '{dtype}'")
    return pid, slug, family, dtype


def _sizes_and_rules(cfg: dict[str, Any], yaml_path: Path) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """The sizes (every one of SIZES, no other), the tolerance and the mutated input positions."""
    sizes = _require(cfg, "sizes", dict, yaml_path)
    for s in SIZES:
        if not isinstance(sizes.get(s), dict) or not sizes[s]:
            raise _fail(yaml_path, f"sizes.{s} must be a non-empty mapping of the dimensions at that size")
    extra = set(sizes) - set(SIZES)
    if extra:
        raise _fail(yaml_path, f"unknown sizes {sorted(extra)}; allowed: {SIZES}")
    tol = cfg.get("tolerance", {"factor": 3.0})
    if not isinstance(tol, dict) or not isinstance(tol.get("factor", 3.0), (int, float)) or tol.get("factor", 3.0) <= 0:
        raise _fail(yaml_path, "tolerance must be a mapping with a positive 'factor'")
    mutates = cfg.get("mutates", [])
    if not isinstance(mutates, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in mutates):
        raise _fail(yaml_path, "mutates must be a list of input positions (non-negative ints)")
    return sizes, tol, mutates


def _sol_model(sol_cfg: dict[str, Any], yaml_path: Path) -> SolModel:
    """The speed-of-light model, whose stated bound must be the one its numbers give."""
    try:
        flops = float(sol_cfg["flops"])
        nbytes = float(sol_cfg["bytes"])
        rate = str(sol_cfg["rate"])
        bound = str(sol_cfg["bound"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(yaml_path, f"sol needs numeric 'flops', 'bytes' and strings 'rate', 'bound' ({e})") from None
    if rate not in H200_RATES:
        raise _fail(yaml_path, f"sol.rate '{rate}' is not one of {sorted(H200_RATES)}")
    if flops < 0 or nbytes <= 0:
        raise _fail(yaml_path, "sol.flops must be >= 0 and sol.bytes > 0")
    sol = SolModel(flops, nbytes, rate, bound)
    actual = "memory" if sol.memory_ms >= sol.compute_ms else "compute"
    if bound != actual:
        raise _fail(yaml_path, f"sol.bound says '{bound}' but the numbers give '{actual}' "
                               f"(memory {sol.memory_ms:.4f} ms, compute {sol.compute_ms:.4f} ms)")
    return sol


def normalize_source(source: str) -> str:
    """Canonical token text of Python source: comments and layout whitespace do not matter.

    f-strings are kept as one token on every Python version (3.12 splits them), so the hash
    is the same on the CPU machines and on the GPU host.
    """
    out: list[str] = []
    line: list[str] = []
    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines(keepends=True)
    fstart = getattr(tokenize, "FSTRING_START", None)
    fend = getattr(tokenize, "FSTRING_END", None)
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER):
            pass
        elif tok.type == tokenize.NEWLINE:
            if line:
                out.append(" ".join(line))
            line = []
        elif tok.type == tokenize.INDENT:
            line.append(">>")
        elif tok.type == tokenize.DEDENT:
            line.append("<<")
        elif fstart is not None and tok.type == fstart:
            depth, j = 1, i + 1
            while depth:
                depth += {fstart: 1, fend: -1}.get(toks[j].type, 0)
                j += 1
            end = toks[j - 1].end
            text = "".join(lines[tok.start[0] - 1:end[0]])
            start_off = tok.start[1]
            end_off = len(text) - len(lines[end[0] - 1]) + end[1]
            line.append(text[start_off:end_off])
            i = j
            continue
        else:
            line.append(tok.string)
        i += 1
    if line:
        out.append(" ".join(line))
    return "\n".join(out) + "\n"


def problem_hash(source: str, cfg: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(normalize_source(source).encode())
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    return h.hexdigest()


def problems_root(root: str | Path | None = None) -> Path:
    """The problems folder: an explicit path, else the one beside the package (source checkout)."""
    if root is not None:
        return Path(root)
    return _REPO_ROOT / "problems"


def discover(root: str | Path | None = None) -> list[Path]:
    base = problems_root(root)
    return sorted(p for fam in FAMILIES for p in (base / fam).glob("[0-9][0-9]_*") if p.is_dir())


def load_all(root: str | Path | None = None) -> list[Problem]:
    """Load every problem; raise one ProblemError listing every broken folder."""
    problems, errors = [], []
    for folder in discover(root):
        try:
            problems.append(load_problem(folder))
        except ProblemError as e:
            errors.append(str(e))
    if errors:
        raise ProblemError("\n".join(errors))
    ids = [p.id for p in problems]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise ProblemError(f"duplicate problem ids: {dups}")
    return sorted(problems, key=lambda p: p.id)


def find(key: str | int, root: str | Path | None = None) -> Problem:
    """Find a problem by id (``28``, ``"28"``) or by name/slug."""
    key_s = str(key).strip()
    for folder in discover(root):
        m = _FOLDER_RE.match(folder.name)
        if m and (key_s.isdigit() and int(key_s) == int(m.group(1)) or key_s in (folder.name, m.group(2))):
            return load_problem(folder)
    raise ProblemError(f"no problem '{key}' under {problems_root(root)}")


def load_module(problem: Problem) -> ModuleType:
    """Import a problem's reference.py under a private module name."""
    name = f"mkb_problem_{problem.id:02d}"
    spec = importlib.util.spec_from_file_location(name, problem.reference_path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
