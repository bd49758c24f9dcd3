"""DSL specifics, one module per DSL: :mod:`.cutedsl` (NVIDIA CuTe DSL) and :mod:`.tirx` (Apache TVM
TIRx). Each holds a :class:`~mkb_eval.dsl.spec.DslSpec`; the harness and the agent look a DSL up
here (``get``) or loop over ``SPECS`` instead of naming DSLs. A third DSL is a new module here,
listed in ``SPECS``, its name in :data:`mkb_eval.vocab.Dsl` and its card under the agent's prompts.
"""

from __future__ import annotations

from mkb_eval.dsl import cutedsl, tirx
from mkb_eval.dsl.spec import ARCH, DslSpec, Hooks

SPECS: dict[str, DslSpec] = {s.name: s for s in (cutedsl.SPEC, tirx.SPEC)}

__all__ = ["ARCH", "SPECS", "DslSpec", "Hooks", "get"]


def get(name: str) -> DslSpec:
    """The spec of DSL ``name``; ValueError for a name no module describes."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown DSL '{name}'") from None
