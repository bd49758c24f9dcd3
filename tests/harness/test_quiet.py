"""The quiet hold: busy sections share, a quiet one waits for them, keeps new ones out, and runs alone."""

from __future__ import annotations

import threading
import time

from mkb_eval.harness.quiet import LOUD, QuietHost


def test_quiet_waits_for_busy_sections_and_keeps_new_ones_out() -> None:
    q = QuietHost()
    events: list[str] = []
    in_busy = threading.Event()
    release_busy = threading.Event()
    quiet_waiting = threading.Event()

    def first_busy() -> None:
        with q.busy():
            events.append("busy1 in")
            in_busy.set()
            release_busy.wait(5)
            events.append("busy1 out")

    def quiet() -> None:
        in_busy.wait(5)
        quiet_waiting.set()
        with q.quiet():
            events.append(f"quiet in, busy {q.busy_now}")
            time.sleep(0.05)
            events.append("quiet out")

    def late_busy() -> None:
        quiet_waiting.wait(5)
        while not q.quiet_pending:             # until the quiet section waits
            time.sleep(0.001)
        with q.busy():
            events.append("busy2 in")

    threads = [threading.Thread(target=f) for f in (first_busy, quiet, late_busy)]
    for t in threads:
        t.start()
    quiet_waiting.wait(5)
    while not q.quiet_pending:
        time.sleep(0.001)
    time.sleep(0.1)
    assert events == ["busy1 in"]              # the quiet section waits; the late busy one waits behind it
    release_busy.set()
    for t in threads:
        t.join(5)
    assert events == ["busy1 in", "busy1 out", "quiet in, busy 0", "quiet out", "busy2 in"]
    assert q.quiet_wait_s > 0.1 and q.busy_wait_s > 0.0


def test_quiet_sections_run_one_at_a_time() -> None:
    q = QuietHost()
    inside: list[int] = []
    now = [0]
    lock = threading.Lock()

    def quiet() -> None:
        with q.quiet():
            with lock:
                now[0] += 1
                inside.append(now[0])
            time.sleep(0.02)
            with lock:
                now[0] -= 1

    threads = [threading.Thread(target=quiet) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert inside == [1, 1, 1, 1]


def test_busy_sections_share_and_loud_never_waits() -> None:
    q = QuietHost()
    with q.busy(), q.busy():
        assert q.busy_now == 2
    with LOUD.busy() as w1, LOUD.quiet() as w2:
        assert w1 == 0.0 and w2 == 0.0
