"""Run ``mkb`` in this process, through the real parser (its dataset, skills, run and models commands
are filled in when chosen, as for a user)."""

from __future__ import annotations

import pytest

from mkb_eval import cli


def run_mkb(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """``mkb ARGV``'s exit status (``monkeypatch`` is kept for the callers' signature)."""
    return cli.main(argv)
