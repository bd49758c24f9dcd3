"""The worker's private result channel: JSON lines prefixed with a per-evaluation random sentinel.

Only lines carrying the sentinel are trusted; the last message of each kind wins. The parent
maps silence (no final message) to ``crashed`` or ``timeout``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Channel:
    def __init__(self, path: str | Path, sentinel: str) -> None:
        self._fd = os.open(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._sentinel = sentinel

    def send(self, **msg: Any) -> None:
        line = self._sentinel + json.dumps(msg, default=str) + "\n"
        os.write(self._fd, line.encode())


def read_messages(path: str | Path, sentinel: str) -> list[dict[str, Any]]:
    """Trusted messages in order; torn or foreign lines are ignored."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for raw in data.decode(errors="replace").splitlines():
        if raw.startswith(sentinel):
            try:
                msg = json.loads(raw[len(sentinel):])
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict):
                out.append(msg)
    return out
