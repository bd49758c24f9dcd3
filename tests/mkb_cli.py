"""Run ``mkb`` with the dataset/skills commands registered the way the maintainer's hook will."""

from __future__ import annotations

import argparse

import pytest

from dataset_builder.cli import register
from mkb_eval import cli


def run_mkb(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    original = cli.build_parser

    def build_parser() -> argparse.ArgumentParser:
        ap = original()
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
        if "dataset" not in sub.choices:          # not hooked in yet: register as the hook will
            register(sub)
        return ap

    monkeypatch.setattr(cli, "build_parser", build_parser)
    return cli.main(argv)
