"""One attempt: a conversation under a budget, as a small state machine the runner advances.

The runner asks each attempt for its next request (``request``), sends many of them to the
backend in one batch, and hands each answer back (``on_answer``). A usable answer becomes a
submission the runner verifies (``on_verified``); an unusable one gets a precise correction and
spends no submission. The attempt ends when the submissions are spent, the token or wall-clock
budget runs out, the conversation no longer fits the model's context, or too many unusable
answers come in a row. The final kernel is the last submitted one; the best is recorded too.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mkb_eval.agent import prompts
from mkb_eval.agent.generation import Generation, Message, Sampling
from mkb_eval.agent.parse import Answer, parse_answer
from mkb_eval.agent.store import TrialArtifacts

GENERATE, VERIFY, DONE = "generate", "verify", "done"
MIN_TURN_TOKENS = 16            # below this an answer cannot hold a kernel: the attempt ends
_RANK = {"ok": 3, "unverified": 2, "incorrect": 1}


@dataclass(frozen=True)
class Budget:
    """Limits of one attempt (recorded with it; a change makes finished trials stale)."""

    submissions: int = 10
    max_tokens_per_turn: int = 8192
    max_total_tokens: int = 131072      # generated tokens over the whole attempt
    wall_s: float = 2400.0
    max_corrections: int = 3            # unusable answers in a row that end the attempt

    def __post_init__(self) -> None:
        for name in ("submissions", "max_tokens_per_turn", "max_total_tokens", "max_corrections"):
            if getattr(self, name) < 1:
                raise ValueError(f"budget {name} must be >= 1, got {getattr(self, name)}")
        if self.wall_s <= 0:
            raise ValueError(f"budget wall_s must be > 0, got {self.wall_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Submission:
    """One graded submission and what came back."""

    k: int
    kernel: str
    kernel_sha256: str
    status: str = ""
    message: str = ""
    speedup: float | None = None
    kernel_ms: float | None = None
    eager_ms: float | None = None
    eval_s: float = 0.0
    record: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"k": self.k, "kernel_sha256": self.kernel_sha256, "status": self.status,
                "message": self.message[:500], "speedup": self.speedup, "kernel_ms": self.kernel_ms,
                "eager_ms": self.eager_ms, "eval_s": self.eval_s}


def _turn_seed(base: int | None, trial: str, turn: int) -> int | None:
    """A distinct, reproducible seed per (trial, turn) derived from the run's seed."""
    if base is None:
        return None
    h = hashlib.sha256(f"{base}:{trial}:{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


class Attempt:
    """The conversation of one trial."""

    def __init__(self, trial: str, first_message: str, budget: Budget, sampling: Sampling, *, tier: str,
                 artifacts: TrialArtifacts | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.trial = trial
        self.budget = budget
        self.sampling = sampling
        self.tier = tier
        self.art = artifacts
        self._clock = clock
        self.started = clock()
        self.messages: list[Message] = []
        self.state = GENERATE
        self.stop_reason = ""
        self.turns = 0
        self.corrections = 0
        self.corrections_in_row = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.submissions: list[Submission] = []
        self.skill: str | None = None
        self.pending: Submission | None = None
        self.error: str | None = None
        self._add("user", first_message, kind="task")

    # -- bookkeeping ---------------------------------------------------------------------------
    def _add(self, role: str, content: str, **extra: Any) -> None:
        self.messages.append({"role": role, "content": content})
        if self.art:
            self.art.message({"role": role, "content": content, "turn": self.turns, **extra})

    def _finish(self, reason: str) -> None:
        self.state, self.stop_reason = DONE, reason

    @property
    def elapsed(self) -> float:
        return self._clock() - self.started

    @property
    def tokens_left(self) -> int:
        return self.budget.max_total_tokens - self.completion_tokens

    @property
    def submissions_left(self) -> int:
        return self.budget.submissions - len(self.submissions)

    # -- the runner's side ---------------------------------------------------------------------
    def request(self, prompt_tokens: int | None, max_context: int | None) -> tuple[list[Message], Sampling] | None:
        """The next generation request, or None when the attempt has just ended for lack of budget."""
        if self.state != GENERATE:
            return None
        if self.elapsed >= self.budget.wall_s:
            self._finish("wall_clock")
            return None
        room = min(self.budget.max_tokens_per_turn, self.tokens_left)
        if prompt_tokens is not None and max_context:
            room = min(room, max_context - prompt_tokens)
        if room < MIN_TURN_TOKENS:
            self._finish("tokens" if self.tokens_left < MIN_TURN_TOKENS else "context")
            return None
        s = self.sampling
        seed = _turn_seed(s.seed, self.trial, self.turns)
        return list(self.messages), Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=room, seed=seed)

    def on_answer(self, gen: Generation) -> Submission | None:
        """Take the model's answer; returns the submission to verify, or None (corrected or ended)."""
        self.turns += 1
        self.prompt_tokens += gen.prompt_tokens
        self.completion_tokens += gen.completion_tokens
        self._add("assistant", gen.text, kind="answer", prompt_tokens=gen.prompt_tokens,
                  completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason)
        parsed = parse_answer(gen.text, max_kernel_bytes=prompts.KERNEL_BYTE_LIMIT)
        if not isinstance(parsed, Answer):
            self.corrections += 1
            self.corrections_in_row += 1
            left = self.budget.max_corrections - self.corrections_in_row
            if left <= 0:
                self._finish("corrections")
                self._add("user", prompts.fill("correction", problem=parsed.reason, corrections_left=0).strip(),
                          kind="correction", final=True)
                return None
            self._add("user", prompts.fill("correction", problem=parsed.reason, corrections_left=left).strip(),
                      kind="correction")
            return None
        self.corrections_in_row = 0
        if parsed.skill is not None:
            self.skill = parsed.skill
            if self.art:
                self.art.skill(parsed.skill + "\n")
        k = len(self.submissions) + 1
        sub = Submission(k=k, kernel=parsed.kernel, kernel_sha256=hashlib.sha256(parsed.kernel.encode()).hexdigest())
        if self.art:
            self.art.submission(k, parsed.kernel)
        self.pending = sub
        self.state = VERIFY
        return sub

    def on_verified(self, record: dict[str, Any]) -> None:
        """Record the verification of the pending submission and send the report back."""
        sub = self.pending
        assert sub is not None and self.state == VERIFY
        t = record.get("timing") or {}
        sub.status, sub.message, sub.record = record["status"], record.get("message", ""), record
        sub.speedup, sub.kernel_ms, sub.eager_ms = t.get("speedup"), t.get("kernel_ms"), t.get("eager_ms")
        sub.eval_s = float((record.get("stages_s") or {}).get("total", 0.0))
        self.submissions.append(sub)
        self.pending = None
        if self.art:
            self.art.verification(sub.k, record)
        timing = ""
        if sub.kernel_ms is not None:
            timing = (f"- median time: kernel {_fmt(sub.kernel_ms, '.4f')} ms, eager PyTorch "
                      f"{_fmt(sub.eager_ms, '.4f')} ms, speedup {_fmt(sub.speedup, '.2f')}x\n")
        last = self.submissions_left <= 0
        minutes_left = max(0.0, (self.budget.wall_s - self.elapsed) / 60)
        report = prompts.fill(
            "feedback", k=sub.k, n_submissions=self.budget.submissions, tier=record.get("tier", self.tier),
            eval_s=f"{sub.eval_s:.1f}", status=sub.status,
            stage=f" (stage: {record['stage']})" if record.get("stage") else "",
            message=(sub.message or "(no message)").replace("\n", "\n  ")[:4000], timing=timing,
            submissions_left=self.submissions_left, tokens_left=max(0, self.tokens_left),
            minutes_left=f"{minutes_left:.1f}",
            next_step=("That was the last submission: the attempt is over." if last else
                       "Answer with your next submission (the whole kernel.py and SKILL.md)."),
        ).strip()
        self._add("user", report, kind="feedback", submission=sub.k)
        if last:
            self._finish("submissions")
        else:
            self.state = GENERATE

    def on_error(self, message: str) -> None:
        """An infrastructure failure (backend or verifier): the attempt ends with an error record."""
        self.error = message
        self._finish("error")

    # -- outcome ---------------------------------------------------------------------------------
    @property
    def final(self) -> Submission | None:
        return self.submissions[-1] if self.submissions else None

    @property
    def best(self) -> Submission | None:
        if not self.submissions:
            return None
        return max(reversed(self.submissions), key=lambda s: (_RANK.get(s.status, 0), s.speedup or 0.0))

    def usage(self) -> dict[str, Any]:
        return {"turns": self.turns, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "submissions": len(self.submissions), "corrections": self.corrections,
                "wall_s": round(self.elapsed, 3)}
