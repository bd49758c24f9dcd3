"""Fault injection: hostile kernels and machine faults, each followed by a healthy evaluation.

Every fault wraps problem 28's shipped CuTe DSL solution: the fault runs inside ``solve`` before
the real kernel, so the kernel is otherwise valid. The table says whether the fault was
survived (expected status, nothing left running), whether the next evaluation was affected,
and whether any stored record was lost. ``mkb safety`` prints it; tests run the same cases.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.sandbox import SandboxConfig
from mkb_eval.harness.verify import Limits, verify
from mkb_eval.records import StoreError, append_jsonl, read_jsonl, repair_jsonl


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    body: str                         # Python run at the start of solve(*args)
    expect: tuple[str, ...]           # acceptable statuses
    tier: str = "any"                 # "any" | "gpu"
    must_mention: str = ""            # a phrase the message must contain
    limits: dict[str, Any] = field(default_factory=dict)


FAULTS = (
    Fault("raises", "solve raises", "raise RuntimeError('injected failure')", ("runtime_error",),
          must_mention="injected failure"),
    Fault("hang_cpu", "solve spins forever on the CPU", "while True:\n        pass", ("timeout",),
          must_mention="hung during", limits={"timeout": 6}),
    Fault("abort", "the process aborts", "import os as _o\n    _o.abort()", ("crashed",), must_mention="SIGABRT"),
    Fault("exit", "the process exits with code 3", "import os as _o\n    _o._exit(3)", ("crashed",),
          must_mention="code 3"),
    Fault("output_flood", "prints 64 MiB", "import sys as _s\n    _s.stdout.write('x' * (64 << 20))",
          ("unverified", "ok")),
    Fault("fork_bomb", "forks until refused", "_bomb()", ("runtime_error", "crashed", "timeout"),
          limits={"max_tasks": 96, "timeout": 30}),
    Fault("socket", "opens a TCP connection to a server on this machine", "_dial()", ("runtime_error",),
          must_mention="unreachable"),
    Fault("memory_hog", "allocates host memory past the cap", "_hog = bytearray(6 << 30)\n    _hog[::4096] = b'x' * len(_hog[::4096])",
          ("crashed", "runtime_error"), must_mention="memory", limits={"memory_bytes": 3 << 30}),
    Fault("disk_fill", "writes a file past the size cap", "_fill()", ("runtime_error", "crashed"),
          limits={"max_file_bytes": 64 << 20}),
    Fault("gpu_spin", "a GPU kernel that never ends", "_gpu_spin()", ("timeout",), tier="gpu",
          limits={"timeout": 20}),
    Fault("gpu_oom", "allocates more GPU memory than exists", "import torch as _t\n    _t.empty(1 << 40, device='cuda')",
          ("runtime_error",), tier="gpu", must_mention="memory"),
)

# helpers appended to the kernel; spelled so the static policy records them instead of refusing
_HELPERS = '''

def _bomb():
    import importlib, time
    o = importlib.import_module("o" + "s")
    for _ in range(100000):
        if getattr(o, "fo" + "rk")() == 0:
            time.sleep(600)
            getattr(o, "_exit")(0)


def _dial():
    import importlib
    s = importlib.import_module("soc" + "ket")
    s.create_connection(("127.0.0.1", int("{port}")), timeout=2).close()


def _fill():
    with open("filler.bin", "wb") as f:
        for _ in range(4096):
            f.write(b"\\0" * (1 << 20))


def _gpu_spin():
    import torch
    torch.cuda._sleep(1 << 62)
    torch.cuda.synchronize()


_real_solve = solve


def solve(*args):
    {body}
    return _real_solve(*args)
'''


def fault_kernel(fault: Fault, folder: Path, port: int = 9) -> Path:
    base = P.find(28).solution_path("cutedsl").read_text()
    path = folder / f"fault_{fault.name}.py"
    path.write_text(base + _HELPERS.replace("{body}", fault.body).replace("{port}", str(port)))
    return path


@dataclass
class Row:
    fault: str
    what: str
    status: str
    survived: bool
    next_ok: bool
    leftovers: int
    note: str


class _Listener:
    """A loopback TCP server counting connections (the socket fault must never reach it)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
                self.accepted += 1
                c.close()
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=2)
        self.sock.close()


def run_fault(fault: Fault, tier: str, folder: Path, pool: WarmPool | None = None) -> Row:
    """Inject one fault, then run the healthy solution; report what happened. With ``pool`` both
    take their workers from it (forked by its fork server, as a sweep's are)."""
    p28 = P.find(28)
    cfg = SandboxConfig(**{k: v for k, v in fault.limits.items() if k != "timeout"})
    t = float(fault.limits.get("timeout", 120))
    limits = Limits(correctness_s=t, timing_s=t, cpu_s=t, sandbox=cfg)
    listener = _Listener()
    try:
        kernel = fault_kernel(fault, folder, listener.port)
        if pool is not None:
            pool.fill(tier, 0, limits)
        rec = verify(p28, "cutedsl", kernel, tier=tier, limits=limits, compile_baseline=False, pool=pool)
    finally:
        listener.close()
    left = int(rec.sandbox.leftover_processes or "0")
    ok_status = rec.status in fault.expect
    mentions = fault.must_mention.lower() in (rec.message or "").lower()
    reached = listener.accepted
    survived = ok_status and mentions and left == 0 and reached == 0
    if pool is not None:
        pool.fill(tier, 0, Limits())
    healthy = verify(p28, "cutedsl", p28.solution_path("cutedsl"), tier=tier, compile_baseline=False, pool=pool)
    note = (rec.message or "").strip().splitlines()[-1][:160] if rec.message else ""
    if reached:
        note = f"server reached {reached} time(s); " + note
    return Row(fault.name, fault.what, rec.status, survived, healthy.status in ("ok", "unverified"), left, note)


@dataclass
class StoreRow:
    fault: str
    survived: bool
    lost: int
    note: str


def store_faults(folder: Path) -> list[StoreRow]:
    """Torn last line (SIGKILL mid-write) and a full disk: records lost must be 0."""
    rows = []
    path = folder / "store.jsonl"
    for i in range(3):
        append_jsonl(path, {"i": i})
    with open(path, "ab") as f:
        f.write(b'{"i": 3, "half')                       # what a kill mid-write leaves
    msg = repair_jsonl(path)
    append_jsonl(path, {"i": 4})
    got = [r["i"] for r in read_jsonl(path)]
    rows.append(StoreRow("torn last line", got == [0, 1, 2, 4] and msg is not None and Path(str(path) + ".torn").exists(),
                         3 - sum(1 for i in got if i < 3), msg or "not detected"))
    rows.append(_disk_full(folder))
    return rows


def _disk_full(folder: Path) -> StoreRow:
    mnt = Path(tempfile.mkdtemp(dir=folder))
    if os.system(f"mount -t tmpfs -o size=16k tmpfs {mnt} 2>/dev/null") != 0:
        return StoreRow("disk full", False, 0, "could not mount a small filesystem here (needs root)")
    try:
        path = mnt / "store.jsonl"
        kept, failed = 0, None
        for i in range(1000):
            try:
                append_jsonl(path, {"i": i, "pad": "x" * 200})
                kept += 1
            except StoreError as e:
                failed = str(e)
                break
        got = [r["i"] for r in read_jsonl(path)]
        ok = failed is not None and got == list(range(kept))
        return StoreRow("disk full", ok, kept - len(got), failed or "never filled")
    finally:
        os.system(f"umount {mnt}")


def table(rows: list[Row], store: list[StoreRow]) -> str:
    out = ["| fault | injected | status | survived | next evaluation healthy | processes left | note |",
           "|---|---|---|---|---|---:|---|"]
    for r in rows:
        out.append(f"| {r.fault} | {r.what} | {r.status} | {'yes' if r.survived else 'NO'} | "
                   f"{'yes' if r.next_ok else 'NO'} | {r.leftovers} | {r.note.replace('|', '/')} |")
    out += ["", "| store fault | survived | records lost | note |", "|---|---|---:|---|"]
    for s in store:
        out.append(f"| {s.fault} | {'yes' if s.survived else 'NO'} | {s.lost} | {s.note.replace('|', '/')[:160]} |")
    survived = sum(r.survived for r in rows) + sum(s.survived for s in store)
    affected = sum(not r.next_ok for r in rows)
    out += ["", f"Faults injected: {len(rows) + len(store)}, survived: {survived}; records lost: "
                f"{sum(s.lost for s in store)}; evaluations affected by a previous bad kernel: {affected}."]
    return "\n".join(out) + "\n"


def run_all(tier: str, progress: Callable[[str], None] = print, only: set[str] | None = None,
            forked: bool = False) -> str:
    """Every fault of the tier (or just those named in ``only``), then the store faults; ``forked``:
    in workers forked by a fork server (a sweep's), not exec'd ones."""
    unknown = (only or set()) - {f.name for f in FAULTS}
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {[f.name for f in FAULTS]}")
    with tempfile.TemporaryDirectory(prefix="mkb-faults-") as d, \
            (WarmPool(fork=True) if forked else contextlib.nullcontext()) as pool:
        rows = []
        for f in FAULTS:
            if (f.tier == "gpu" and tier != "gpu") or (only and f.name not in only):
                continue
            progress(f"fault: {f.name}")
            rows.append(run_fault(f, tier, Path(d), pool))
        text = table(rows, store_faults(Path(d)))
        return text.replace(d, "<tmp>")          # no machine paths in the published table
