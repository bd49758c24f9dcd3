"""``python -m mkb_eval.report <run dir> [--out DIR]``: the same as ``mkb report``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mkb_eval.metrics.inputs import InputError
from mkb_eval.metrics.paired import FLOOR, NEUTRAL_BAND, NOISE_MARGIN, VERDICTS
from mkb_eval.metrics.retimed import TIMERS
from mkb_eval.metrics.stats import N_RESAMPLES, SEED
from mkb_eval.report.build import build_report


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, build the report, print the written paths; 2 on unreadable input."""
    ap = argparse.ArgumentParser(prog="mkb report", description="Score a run dir and write its report.")
    ap.add_argument("run_dir", type=Path, help="folder holding attempts.jsonl")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: <run dir>/report)")
    ap.add_argument("--margin", type=float, default=NOISE_MARGIN, help="relative runtime noise margin")
    ap.add_argument("--floor", type=float, default=FLOOR, help="speedup given to failures in ΔGM")
    ap.add_argument("--resamples", type=int, default=N_RESAMPLES, help="bootstrap resamples of problems")
    ap.add_argument("--seed", type=int, default=SEED, help="bootstrap seed")
    ap.add_argument("--verdict", choices=VERDICTS, default=None,
                    help="paired (re-timed pairs; the default when the run has retime.jsonl) or original (the paper's)")
    ap.add_argument("--band", type=float, default=NEUTRAL_BAND, help="paired verdict: neutral band (relative)")
    ap.add_argument("--timer", choices=TIMERS, default="kernel_ms", help="paired verdict: end-to-end, parent-attested or device time")
    args = ap.parse_args(argv)
    try:
        paths = build_report(args.run_dir, args.out, margin=args.margin, floor=args.floor,
                             n_resamples=args.resamples, seed=args.seed, verdict=args.verdict, band=args.band,
                             timer=args.timer)
    except (InputError, FileNotFoundError) as e:
        print(f"mkb report: {e}", file=sys.stderr)
        return 2
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
