"""YAML front matter of markdown files (dataset card, released skills, prompt files)."""

from __future__ import annotations

from typing import Any

import yaml


def split_front_matter(text: str, where: str, error: type[Exception] = ValueError) -> tuple[dict[str, Any], str]:
    """(front matter, body); ``error`` names ``where`` and what is wrong when the block is malformed."""
    if not text.startswith("---\n"):
        raise error(f"{where}: must start with a YAML front matter block ('---')")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise error(f"{where}: the YAML front matter is not closed by a '---' line")
    try:
        meta = yaml.safe_load(text[4:end + 1])
    except yaml.YAMLError as e:
        raise error(f"{where}: invalid YAML front matter ({str(e).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise error(f"{where}: the YAML front matter must be a mapping")
    return meta, text[end + 5:]
