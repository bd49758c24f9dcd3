"""Are a host's slow spells per core or host-wide? (diagnostic, no GPU needed)

One thread visits every vCPU in turn and times the same pure-Python work on each (the verifier's
``cpu_probe_ms``), a round every ``--every`` seconds for ``--seconds``; nothing else runs. If the slow
spells come at the same moments on every core, the host runs slower as a whole (frequency); if each core
has its own, a timing lane could take the core that is fast at the moment. Prints one JSON line per round.

    python3 scripts/diagnostics/core_speed.py --seconds 60 > core_speed.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mkb_eval.harness.timing import cpu_probe_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between rounds")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    end = time.time() + a.seconds
    while time.time() < end:
        t = time.time()
        ms = {}
        for c in cpus:
            os.sched_setaffinity(0, {c})
            ms[c] = round(cpu_probe_ms(reps=3), 4)
        print(json.dumps({"t": round(t, 3), "ms": ms}), flush=True)
        time.sleep(max(0.0, a.every - (time.time() - t)))


if __name__ == "__main__":
    main()
