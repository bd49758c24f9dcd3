"""Rows of ``tasks``: problem x DSL with the prompt rendered by the agent's prompt module.

The prompt is never invented here: without ``mkb_eval.agent.prompts.render_task`` (returning an
object with ``.text``, ``.sha256`` and ``.version``) the config cannot be built and the error
says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dataset_builder.errors import BuildError
from mkb_eval.problems import DSLS, Problem


def load_renderer() -> Callable[[Problem, str], Any]:
    """``mkb_eval.agent.prompts.render_task``, or BuildError explaining why the config cannot be built."""
    try:
        from mkb_eval.agent.prompts import render_task
    except ImportError as e:
        raise BuildError(f"config 'tasks' needs mkb_eval.agent.prompts.render_task, which cannot be imported "
                         f"({e}); build without it with --configs (listing the other configs)") from None
    return render_task


def task_rows(problems: Sequence[Problem], render: Callable[[Problem, str], Any] | None = None) -> list[dict[str, Any]]:
    """One row per (problem, DSL), ordered by id then DSL."""
    render = render or load_renderer()
    rows = []
    for p in sorted(problems, key=lambda p: p.id):
        for dsl in DSLS:
            try:
                task = render(p, dsl)
                text, sha, version = task.text, task.sha256, task.version
            except Exception as e:  # noqa: BLE001 - the renderer is another module; name where it failed
                raise BuildError(f"render_task({p.name}, {dsl}) failed: {type(e).__name__}: {e}") from None
            if not isinstance(text, str) or not text.strip():
                raise BuildError(f"render_task({p.name}, {dsl}) returned an empty prompt")
            rows.append({"task_id": f"{p.name}_{dsl}", "problem_id": p.id, "problem": p.name, "dsl": dsl,
                         "prompt": text, "prompt_sha256": str(sha), "prompt_version": str(version),
                         "problem_hash": p.hash})
    return rows
