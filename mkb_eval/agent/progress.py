"""The live progress view of ``mkb run``: a table on a terminal, one line per event otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


class ProgressView:
    """Tracks each trial's state; renders a live table (TTY) or prints event lines (logs, CI)."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(file=sys.stdout)
        self.rows: dict[str, dict[str, Any]] = {}
        self._live: Live | None = None

    def __enter__(self) -> ProgressView:
        if self.enabled and self.console.is_terminal:
            self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
            self._live = None

    def _table(self) -> Table:
        t = Table(title="mkb run", expand=False)
        for col in ("trial", "state", "subm.", "tokens", "corr.", "last", "final"):
            t.add_column(col)
        for tid, r in self.rows.items():
            t.add_row(tid, r.get("state", ""), f"{r.get('submissions', 0)}/{r.get('limit', '?')}",
                      str(r.get("tokens", 0)), str(r.get("corrections", 0)), r.get("last", "-"), r.get("final", ""))
        return t

    def _print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
            self._live.update(self._table())
        else:
            self.console.print(text, markup=False, highlight=False)

    def start(self, trial: str, arm: str, limit: int) -> None:
        self.rows[trial] = {"state": "started", "limit": limit, "submissions": 0, "tokens": 0, "corrections": 0}
        self._print(f"[start]  {trial}")

    def update(self, trial: str, **fields: Any) -> None:
        row = self.rows.setdefault(trial, {})
        before = (row.get("submissions"), row.get("corrections"))
        row.update(fields)
        if self._live is not None:
            self._live.update(self._table())
        elif (row.get("submissions"), row.get("corrections")) != before:
            self._print(f"[turn]   {trial}: submissions {row.get('submissions', 0)}/{row.get('limit', '?')}, "
                        f"corrections {row.get('corrections', 0)}, tokens {row.get('tokens', 0)}, "
                        f"last {row.get('last', '-')}")

    def finish(self, trial: str, rec: dict[str, Any]) -> None:
        final = "error" if rec.get("error") else rec["status"]
        row = self.rows.setdefault(trial, {})
        row.update(state="done", final=final)
        extra = f" ({rec['error']})" if rec.get("error") else f" ({rec.get('stop_reason', '')})"
        self._print(f"[done]   {trial}: {final}{extra}")

    def note(self, text: str) -> None:
        self._print(f"[note]   {text}")
