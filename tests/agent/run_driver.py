"""A run in its own process (for the kill-and-resume test): scripted model, real CPU-tier verifier.

    python -m tests.agent.run_driver <run_dir> [delay_s]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from mkb_eval.agent.backends import Generation, Sampling
from mkb_eval.agent.launch import RunOptions, run_trials
from mkb_eval.agent.loop import Budget
from tests.agent.conftest import solution_script
from tests.agent.scripted import ScriptedBackend


class SlowBackend(ScriptedBackend):
    """Takes ``delay`` seconds per batch, like a model would, so a kill can land mid-run."""

    def __init__(self, delay: float) -> None:
        super().__init__(solution_script)
        self.delay = delay

    def generate(self, conversations: Sequence, sampling: Sequence[Sampling]) -> list[Generation]:
        time.sleep(self.delay)
        return super().generate(conversations, sampling)


if __name__ == "__main__":
    run_dir = sys.argv[1]
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    opts = RunOptions(problems="28", arms="all", run_dir=run_dir, budget=Budget(submissions=2),
                      sampling=Sampling(seed=0), workers=2, progress=True)
    summary, _ = run_trials(opts, backend=SlowBackend(delay))
    print("FINISHED", 0 if summary is None else len(summary.finished), flush=True)
