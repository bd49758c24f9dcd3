"""Report tests reuse the hand-built records of tests/metrics (loaded by path: test dirs are not packages)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_HAND = Path(__file__).resolve().parents[1] / "metrics" / "mkb_hand_records.py"
if "mkb_hand_records" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("mkb_hand_records", _HAND)
    assert _spec and _spec.loader
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["mkb_hand_records"] = _mod
    _spec.loader.exec_module(_mod)


@pytest.fixture
def make_run(tmp_path: Path) -> Callable[..., Path]:
    """Write records (dicts, or raw lines as str) to <tmp>/<name>/attempts.jsonl and return the run dir."""

    def make(records: list[Any], name: str = "run") -> Path:
        run = tmp_path / name
        run.mkdir()
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        (run / "attempts.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return run

    return make
