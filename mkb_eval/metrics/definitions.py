"""The definitions behind every number, as text: embedded in results, reports and the metric cards."""

from __future__ import annotations

from mkb_eval.metrics.paired import FLOOR, NEUTRAL_BAND, NOISE_MARGIN
from mkb_eval.metrics.stats import CONFIDENCE, N_RESAMPLES

LEGEND: dict[str, str] = {
    "arms": "solo_cutedsl, solo_tirx, cutedsl2tirx_skill, tirx2cutedsl_skill. For a unit (problem, direction a2b, "
    "replicate k): source = solo_a, base = solo_b, skill = a2b_skill (solo_b's task with solo_a's SKILL.md).",
    "resolved": "A unit is resolved when its source, base and skill records exist and none has an infrastructure "
    "error. Only resolved units are scored; units are pooled (no per-problem averaging first).",
    "passed": "status == 'ok' (correct on every draw and timed). speedup = eager_ms / kernel_ms, uncapped.",
    "R@t": "Share of resolved units whose attempt passed with speedup >= t, for t in 0, 0.5, 1, 2, 4. "
    "R@0 is the pass rate, R@1 the eager-matching rate.",
    "S": "100 x mean of the five R@t.",
    "skipped": "A skipped skill (the source wrote no usable SKILL.md) counts as the base's outcome for R@t, S and "
    "lift, and as neutral (ratio 1) for the paired outcomes.",
    "lift": "skill - base for every R@t (a difference of shares) and S (in S points).",
    "with_skill": "The same contrast restricted to units whose skill was not skipped.",
    "by_source_verdict": "The same contrast split by whether the source solo passed.",
    "source_coverage": "Share of resolved units whose source passed.",
    "skill_coverage": "Share of resolved units whose skill was not skipped.",
    "tier": "Highest t in (0, 0.5, 1, 2, 4) an attempt attains; 'fail' if it did not pass. "
    "Order: fail < 0 < 0.5 < 1 < 2 < 4.",
    "paired outcome": "(verdict='original', as in the paper) Skill vs base per resolved unit: "
    "helped if the skill's tier is higher, harmed if lower. "
    f"Same tier, both passed: helped if t_skill x (1 + m) < t_base, harmed if t_base x (1 + m) < t_skill "
    f"(kernel times; speedups when a time is missing), else neutral; m = {NOISE_MARGIN:g} by default. "
    "Both failed, or skill skipped: neutral.",
    "re-timing": "When all selected trials of a (problem, replicate) are finished, their final kernels (that passed, "
    "or are unverified on the CPU tier) are re-timed together: interleaved rounds on one GPU, one timing window per "
    "kernel per round, the order alternated round by round (default 5 rounds); end-to-end (kernel_ms) and device "
    "time (device_ms) are kept. The eager and torch.compile baselines of a run are timed once per problem and GPU "
    "model, with the GPU to itself, and shared by every evaluation of the run. Submission-time numbers stay in "
    "the attempt records.",
    "paired verdict": "The default where a run was re-timed. Per unit, paired ratio of round r = base_ms_r / "
    "skill_ms_r (the speedup ratio skill/base); the unit's ratio = exp(mean ln ratio) with a 95% Student t interval "
    f"over the rounds. Both passed: helped iff the interval's low end > 1 + b, harmed iff its high end < 1/(1 + b), "
    f"else neutral; b = {NEUTRAL_BAND:g} by default (above the A/A noise floor, stated in the report with its "
    "source, results/<gpu>/<date>_aa/summary.json). One passed and the other not: helped / harmed. Both failed or "
    "skill skipped: neutral. An unverified attempt (CPU tier) or a passed pair without 2+ usable rounds: "
    "unresolved. Lift, tiers, ΔGM and standing use the re-timed medians (speedup = the run's shared eager / "
    "re-timed time). The verdict's timer (end-to-end by default) is stated; the other is shown beside it. "
    "verdict='original' is the benchmark's definition on submission-time numbers ('paired outcome').",
    "T": "Help rate: helped units / resolved units.",
    "H": "Harm rate: harmed units / resolved units.",
    "ΔGM": "exp(mean over resolved units of ln(speedup_skill / speedup_base)) - 1, in percent. A failed "
    f"attempt's speedup is the floor {FLOOR:g} (a passing speedup below it is raised to it, so a failure never "
    "outranks a pass); a skipped skill gives ratio 1.",
    "relative standing": "Source tier vs base tier: above / same / below; helped and harmed shares within each "
    "group.",
    "fast_p": "KernelBench fast_p: share of attempts that passed with speedup > p (strict), p in 0, 1, 2.",
    "geomean_speedup": "Geometric mean speedup over the passed attempts.",
    "attempt-level rates": "Per arm, over its attempts without infrastructure error; skipped skill attempts "
    "are counted apart and left out. 'unverified' (no GPU) counts as not passed.",
    "CI": f"Percentile {CONFIDENCE:.0%} intervals from {N_RESAMPLES} bootstrap resamples of problems (with "
    "replacement, numpy PCG64, seed 0 by default) for lift of S, T, H and ΔGM.",
    "sign test": "Two-sided exact binomial test of helped vs harmed counts under p = 1/2; neutral excluded.",
    "empty": "An empty group gives None (shown as n/a), never 0.",
}
