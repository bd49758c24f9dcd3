"""Does a host's CPU slow down as more of it is busy? A CPU-bound Python loop per process, each on a
vCPU of its own: the mean time of k at once against one alone, and how much each other vCPU, busy
beside vCPU 0, slows it (a hidden SMT sibling under a hypervisor would stand out). Prints JSON.

    python3 scripts/diagnostics/cpu_probe.py > cpu_probe.json
"""

from __future__ import annotations

import json
import os
import time
from multiprocessing import Process, Queue


def _spin(cpu: int, q: Queue, n: int = 6_000_000) -> None:
    os.sched_setaffinity(0, {cpu})
    t, x = time.perf_counter(), 0
    for i in range(n):
        x += i * i
    q.put((cpu, time.perf_counter() - t))


def _at_once(cpus: list[int]) -> dict[int, float]:
    q: Queue = Queue()
    procs = [Process(target=_spin, args=(c, q)) for c in cpus]
    for p in procs:
        p.start()
    times = dict(q.get() for _ in cpus)
    for p in procs:
        p.join()
    return times


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    alone = min(_at_once(cpus[:1])[cpus[0]] for _ in range(3))     # the first runs warm the host up
    out: dict = {"alone_s": alone}
    for k in sorted({len(cpus) // 4, len(cpus) // 2, 3 * len(cpus) // 4, len(cpus)} - {0}):
        t = _at_once(cpus[:k])
        out[f"k{k}_mean_slowdown"] = round(sum(t.values()) / k / alone, 3)
    out["pair_slowdown_of_cpu0"] = {c: round(_at_once([cpus[0], c])[cpus[0]] / alone, 3) for c in cpus[1:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
