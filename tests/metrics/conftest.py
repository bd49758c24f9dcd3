"""Fixtures for the metrics tests: the hand-built record set and an offline, private HF cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mkb_hand_records import hand_records

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["HF_EVALUATE_OFFLINE"] = "1"  # tests never reach the Hub


@pytest.fixture
def records() -> list[dict[str, Any]]:
    return hand_records()


@pytest.fixture(scope="session")
def hf_offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private HF module/metric cache for evaluate.load, so tests never touch ~/.cache or the network."""
    import evaluate

    home = tmp_path_factory.mktemp("hf_home")
    mp = pytest.MonkeyPatch()
    mp.setattr(evaluate.config, "HF_MODULES_CACHE", home / "modules")
    mp.setattr(evaluate.config, "HF_METRICS_CACHE", str(home / "metrics"))
    mp.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    mp.setattr(evaluate.config, "HF_HUB_OFFLINE", True, raising=False)
    yield home
    mp.undo()
