"""What the harness and the agent need to know about one DSL, as a plain description.

A :class:`DslSpec` names the DSL, its toolchain's imports, the folders and environment variables a
worker gets for it, its prompt card, and two functions that take the harness's own helpers as
arguments (this layer imports nothing of the harness): ``install_hooks`` wraps the toolchain's
launch and compile entry points (:mod:`mkb_eval.harness.observe` calls it), ``compiled_artifacts``
checks what a CPU-tier compile produced (:mod:`mkb_eval.harness.compile_check` calls it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCH = "sm_90a"          # the GPU architecture every DSL compiles for (the CPU tier's cubins, nvcc's -arch)


@dataclass(frozen=True)
class Hooks:
    """The observer's helpers, handed to a spec's ``install_hooks`` (:mod:`mkb_eval.harness.observe`).

    ``patch(cls, name, dsl)``: wrap a class attribute so its outermost calls are counted (and may be
    suppressed); ``wrap_call(dsl, fn)``: the same wrapper for a function; ``count_creation(cls, dsl)``:
    count the instances created (compiled functions); ``compiling(fn)``: a compile entry point that
    announces its outermost main-thread calls; ``log``: the launch log (``compiled``, ``artifacts``)."""

    patch: Callable[[type, str, str], None]
    wrap_call: Callable[[str, Callable[..., Any]], Callable[..., Any]]
    count_creation: Callable[[type, str], None]
    compiling: Callable[[Callable[..., Any]], Callable[..., Any]]
    log: Any


# nvcc_cubin(source, work_dir, name) -> {'cubin_bytes': n} | {'skipped': why} | {'error': why}
NvccCubin = Callable[[str, Path, str], dict[str, Any]]


@dataclass(frozen=True)
class DslSpec:
    """One DSL. ``env`` and ``cpu_env`` values may hold ``{root}``, the worker's evaluation folder."""

    name: str                                   # the vocabulary's name (vocab.Dsl)
    display: str                                # how prompts and skill files name it
    card: str                                   # its prompt card, relative to mkb_eval/agent/prompts
    toolchain: tuple[str, ...]                  # top-level imports: probed by the sandbox, guarded by the policy
    error_modules: tuple[str, ...]              # packages whose exceptions before any launch are compile errors
    preload: tuple[str, ...]                    # modules a warm worker imports before its job
    cache_dirs: tuple[str, ...]                 # folders made in every evaluation folder
    env: Mapping[str, str]                      # a worker's variables, both tiers
    cpu_env: Mapping[str, str]                  # and the CPU tier's (compile-only, artifacts kept)
    fork_env: Mapping[str, str]                 # and a fork server's (its children inherit them)
    install_hooks: Callable[[Hooks], None]      # wrap launches and compiles (imports the toolchain)
    compiled_artifacts: Callable[[Any, Path, NvccCubin], dict[str, Any]]   # (log, dump folder, nvcc_cubin)

    def worker_env(self, root: Path, tier: str) -> dict[str, str]:
        """This DSL's variables for a worker of ``tier`` whose evaluation folder is ``root``."""
        items = {**self.env, **(self.cpu_env if tier == "cpu" else {})}
        return {k: v.format(root=root) for k, v in items.items()}
