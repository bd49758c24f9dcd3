"""Leak check: flag skills that carry code or DSL API calls instead of knowledge.

The benchmark measures transfer of kernel knowledge beyond code, so a skill that smuggles a
kernel (or the DSL calls to write one) measures something else. The patterns are data
(``leak_patterns.yaml``); they are a screening aid for review and for filtering training
exports, not a security boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

PATTERNS_FILE = Path(__file__).resolve().parent / "leak_patterns.yaml"


@dataclass(frozen=True)
class Finding:
    """One flagged place: 1-based line, kind (code_block, code_statement, dsl_api, api_call), excerpt."""

    line: int
    kind: str
    excerpt: str

    @property
    def tag(self) -> str:
        """Compact ``kind@line`` form stored in the dataset."""
        return f"{self.kind}@{self.line}"


@dataclass(frozen=True)
class Patterns:
    fences: tuple[str, ...]
    lines: tuple[tuple[str, re.Pattern[str]], ...]


@cache
def load_patterns(path: Path = PATTERNS_FILE) -> Patterns:
    """Compile the pattern file; a bad regex raises ValueError naming it."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    compiled = []
    for entry in doc.get("lines", []):
        try:
            compiled.append((str(entry["kind"]), re.compile(entry["regex"])))
        except (KeyError, re.error) as e:
            raise ValueError(f"{path}: bad line pattern {entry!r} ({e})") from None
    return Patterns(fences=tuple(doc.get("fences", [])), lines=tuple(compiled))


def check_text(text: str, patterns: Patterns | None = None) -> list[Finding]:
    """Every finding in a skill's text, in line order (at most one per kind and line)."""
    pats = patterns or load_patterns()
    findings: list[Finding] = []
    in_block = False
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if any(stripped.startswith(f) for f in pats.fences):
            if not in_block:
                findings.append(Finding(n, "code_block", stripped[:80]))
            in_block = not in_block
            continue
        if in_block:
            continue
        seen = set()
        for kind, rx in pats.lines:
            if kind in seen:
                continue
            m = rx.search(line)
            if m:
                seen.add(kind)
                findings.append(Finding(n, kind, m.group(0)[:80]))
    return findings
