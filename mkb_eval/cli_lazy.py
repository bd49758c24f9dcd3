"""Subcommands of ``mkb`` whose module is imported only when the command is chosen, so that the light
commands (``mkb --help``, ``mkb problems``) do not pay for the heavy ones' imports."""

from __future__ import annotations

import argparse
import importlib
from typing import Any


class LazySubParsers(argparse._SubParsersAction):
    """Subcommands whose module is imported only when the command is chosen.

    The agent's and the dataset builder's commands pull in vLLM, transformers, ``datasets`` and the
    metrics on import; ``mkb --help`` or ``mkb problems list`` must not pay for them (seconds on a
    2-core machine). Each such command is listed with its help line at once and filled in by its
    module's ``register`` when argparse reaches it (or by :meth:`fill_all`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy: dict[str, str] = {}

    def add_lazy(self, name: str, module: str, text: str) -> None:
        self._lazy[name] = module
        self.add_parser(name, help=text)

    def fill(self, name: str) -> None:
        module = self._lazy.get(name)
        if module is None:
            return
        for other in [n for n, m in self._lazy.items() if m == module]:    # one register adds all its commands
            del self._lazy[other]
        importlib.import_module(module).register(_Placeholders(self))

    def fill_all(self) -> None:
        for name in list(self._lazy):
            self.fill(name)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values:
            self.fill(values[0])
        super().__call__(parser, namespace, values, option_string)


class _Placeholders:
    """What a module's ``register`` is handed: ``add_parser`` returns the command's listed parser."""

    def __init__(self, action: LazySubParsers) -> None:
        self.action = action

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        found = self.action.choices.get(name)
        return found if found is not None else self.action.add_parser(name, **kwargs)
