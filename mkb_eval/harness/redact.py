"""Machine paths out of what a record keeps (messages, output tails), so records can be shared."""

from __future__ import annotations

import re
from pathlib import Path

from mkb_eval.harness.sandbox import repo_root

_SITE = re.compile(r"(?:/[^\s\"':]+)*/(?:site|dist)-packages/")
_CODE = re.compile(r"(?:/[^\s\"':]+)*/mkb-code-[0-9a-f]+")
_EVAL = re.compile(r"(?:/[^\s\"':]+)*/mkb-eval-[A-Za-z0-9_]+(/?)")


def redact_paths(text: str, root: Path | None = None) -> str:
    """Machine paths out of messages and output tails, so records can be shared and committed:
    files in the evaluation folder get paths relative to it (the folder itself is ``<eval>``),
    installed packages and this repository become ``<site-packages>`` and ``<repo>``."""
    if not text:
        return text
    if root is not None:
        text = text.replace(str(root) + "/", "").replace(str(root), "<eval>")
    text = _SITE.sub("<site-packages>/", text)               # first: a virtualenv may sit inside the repo
    text = _CODE.sub("<repo>", text.replace(str(repo_root()), "<repo>"))
    return _EVAL.sub(lambda m: "" if m.group(1) else "<eval>", text)

