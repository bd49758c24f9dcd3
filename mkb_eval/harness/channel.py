"""The worker's private result channel: JSON lines prefixed with a per-evaluation random sentinel.

Only lines carrying the sentinel are trusted; the last message of each kind wins. The parent
maps silence (no final message) to ``crashed`` or ``timeout``, and a line the protocol does not
allow (:mod:`.protocol`) to a protocol error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mkb_eval.harness.protocol import Malformed, Message, decode_line


class Channel:
    def __init__(self, path: str | Path, sentinel: str) -> None:
        self._fd = os.open(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._sentinel = sentinel

    def send(self, **msg: Any) -> None:
        """Write one message, as :func:`.protocol.encode` gives it."""
        line = self._sentinel + json.dumps(msg, default=str) + "\n"
        os.write(self._fd, line.encode())


def read_messages(path: str | Path, sentinel: str) -> list[Message | Malformed]:
    """Trusted messages in order, each decoded (a line the protocol does not allow kept as
    :class:`~.protocol.Malformed`); torn or foreign lines are ignored."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for raw in data.decode(errors="replace").splitlines():
        if raw.startswith(sentinel):
            msg = decode_line(raw[len(sentinel):])
            if msg is not None:
                out.append(msg)
    return out
