"""The PyTorch baselines timed in a process of their own, one per GPU.

A sweep's parent runs a thread per evaluation in flight. A timed draw ends with a device-wide
sync, which lets go of the GIL, and the end event is recorded only once the GIL is back: while
another thread runs Python (judging another evaluation), that takes up to the 5 ms switch
interval. (On a CPU machine a 0.4 ms draw that waits with the GIL released measured 5.5 ms
beside one busy thread and 20.5 ms beside four.) On the H200 the same problem's eager time
differed by up to 2x between two sweeps, more often higher in the one with more in flight
(results/h200/2026-11-30_bench5). The candidate is timed in a worker with one thread; this child
gives the baselines the same conditions: one thread, the GPU's timing core, asked one request at
a time while the parent holds that GPU's lane exclusively.

Protocol: a JSON request per line on stdin, ``{"problem", "size", "warmup", "timing",
"compiled", "cpu"}``; a JSON reply per line on stdout, ``{"median_ms", "setup_s"}`` or
``{"error"}``. A request with ``"op": "window"`` and ``{"seeds", "key"}`` runs the reference's
attested window instead (:func:`mkb_eval.harness.attest.calibrate_window`) and replies
``{"window": {...}}``. End of stdin ends the child, so it never outlives its parent.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mkb_eval.harness.attest import WindowCalibration
from mkb_eval.harness.gpus import physical_gpu
from mkb_eval.harness.sandbox import own_code_env


class ReferenceTimer:
    """The parent's handle on the timer process of its GPU ``gpu``: started ahead; a fresh one after
    it died (then the request is asked once more) or answered with an error."""

    def __init__(self, gpu: int, timeout_s: float = 300.0) -> None:
        self.gpu, self.timeout_s = gpu, timeout_s
        self._physical = physical_gpu(gpu)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: Any = None
        self._start()

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "mkb_eval.harness.reference_timer"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1,
                                      env=own_code_env(CUDA_VISIBLE_DEVICES=self._physical))
        self._pending = b""

    def _restart(self) -> None:
        self.close()
        self._start()

    def _stderr_tail(self, n: int = 2000) -> str:
        try:
            self._stderr.seek(0)
            return self._stderr.read().decode(errors="replace")[-n:].strip()
        except (OSError, ValueError):
            return ""

    def _ask(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The reply, or None when the process is gone (it is then restarted by the caller)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        deadline, fd = time.monotonic() + self.timeout_s, proc.stdout.fileno()
        while True:                           # the pipe read raw: a buffered reader could hold a reply select cannot see
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                try:
                    reply = json.loads(line)
                except json.JSONDecodeError:
                    continue                  # a library's stray output on the same descriptor: not a reply
                if isinstance(reply, dict):
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                raise TimeoutError(f"reference timer for GPU {self.gpu}: no reply in {self.timeout_s:.0f} s "
                                   f"(problem {request['problem']})")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._pending += chunk

    def time(self, problem: str | Path, size: str, warmup: list[int], timing: list[int], compiled: bool = False,
             cpu: int | None = None) -> tuple[float, float]:
        """(median ms, setup s) of the reference timed like a candidate: see ``Judge.time_reference``."""
        request = {"problem": str(problem), "size": size, "warmup": list(warmup), "timing": list(timing),
                   "compiled": bool(compiled), "cpu": cpu}
        reply = self._request(request)
        return float(reply["median_ms"]), float(reply.get("setup_s", 0.0))

    def window(self, problem: str | Path, size: str, seeds: list[int], key: int,
               cpu: int | None = None) -> WindowCalibration:
        """The reference's attested window on ``seeds``, timed here: see ``Judge.time_window``."""
        request = {"op": "window", "problem": str(problem), "size": size, "seeds": [int(x) for x in seeds],
                   "key": int(key), "cpu": cpu}
        return WindowCalibration.from_dict(self._request(request)["window"])

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reply to ``request``; a process that died is restarted and asked once more, and one that
        answered with an error is replaced for the next request (fresh CUDA context and memory)."""
        with self._lock:
            reply = self._ask(request)
            if reply is None:
                died = self._stderr_tail()
                self._restart()
                reply = self._ask(request)
                if reply is None:
                    raise ChildProcessError(f"reference timer for GPU {self.gpu} exited twice; its stderr: "
                                            f"{self._stderr_tail() or died or '(empty)'}")
        if "error" in reply:
            with self._lock:
                self._restart()
            raise RuntimeError(f"timing the reference of {Path(request['problem']).name}: {reply['error']}")
        return reply

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()


def main() -> int:
    import traceback

    import torch

    from mkb_eval.harness.cores import pinned
    from mkb_eval.harness.judge import Judge
    from mkb_eval.problems import load_problem

    out = sys.stdout
    sys.stdout = sys.stderr               # a reference's prints must not look like replies
    # torch's CPU thread pool starts now, on every core this process may use. Started while the
    # thread was pinned, the whole pool would share the timing core: on the H200 that made an
    # eager baseline whose inputs are made on the CPU take 90 s instead of 1.
    torch.ones(1 << 22).add_(1)
    judges: dict[tuple[str, str], Judge] = {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            key = (req["problem"], req["size"])
            if key not in judges:
                judges.clear()
                judges[key] = Judge(load_problem(req["problem"]), req["size"], "cuda:0")
            with pinned(None if req.get("cpu") is None else int(req["cpu"])):      # this thread, this request
                if req.get("op") == "window":
                    cal = judges[key].time_window(req["seeds"], int(req["key"]))
                    reply: dict[str, Any] = {"window": asdict(cal)}
                else:
                    res, setup = judges[key].time_reference(req["warmup"], req["timing"],
                                                            compiled=bool(req["compiled"]))
                    reply = {"median_ms": res.median_ms, "setup_s": setup}
        except Exception as e:  # noqa: BLE001 - every failure is the parent's to report
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()          # cached blocks would crowd the evaluations sharing this GPU
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
