"""Confinement of the worker process: no network, files only in its folder, capped host memory and processes.

What is available depends on the machine, so every evaluation records what it actually got
(``facts``). Network: a fresh network namespace (root, or an unprivileged user namespace);
elsewhere the network stays shared and the record says so. User: a worker started by root runs as
``nobody`` (it owns only its evaluation folder, so it cannot touch the results store or the
caches), after a one-time probe shows that user can import the toolchain and open the GPU.
Files: Landlock (:mod:`~mkb_eval.harness.confine`), root or not: writes only in the evaluation folder,
reads only what a worker needs. Memory and processes: cgroup v1/v2
limits where the cgroup tree is writable; in every case the parent also watches the worker's
session (resident memory, process count) and kills it past the caps. ``RLIMIT_AS`` is not used:
the CUDA driver reserves far more address space than it touches.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval.harness import confine

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_CGROOT = Path("/sys/fs/cgroup")


@dataclass
class SandboxConfig:
    """Caps for one worker; ``None`` disables a cap."""

    isolate_network: bool = True
    memory_bytes: int | None = 48 << 30
    max_tasks: int | None = 1024          # threads count: CUDA, OpenMP and compilers start many
    max_file_bytes: int = 8 << 30
    # the user a root parent's worker becomes; None (MKB_WORKER_USER="") keeps root
    run_as: str | None = field(default_factory=lambda: os.environ.get("MKB_WORKER_USER", "nobody") or None)
    confine: bool = True                  # Landlock: writes only in the evaluation folder (see ``confine``)


@dataclass
class Sandbox:
    config: SandboxConfig
    cgroups: list[Path] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)
    _unshare: Any = None
    _procs: list[str] = field(default_factory=list)
    _ids: tuple[int, int] | None = None
    spec: dict[str, Any] = field(default_factory=dict)     # what ``enter`` needs, as plain data

    @classmethod
    def create(cls, config: SandboxConfig, owned: Path | None = None) -> Sandbox:
        """Prepare the caps; ``owned`` (the evaluation folder) is handed to the worker's user."""
        sb = cls(config)
        sb._make_cgroups()
        # everything the child needs is prepared here: after fork in a threaded parent the child
        # must not take locks (no dlopen, no allocation-heavy work)
        sb._unshare = ctypes.CDLL(None, use_errno=True).unshare
        sb._procs = [str(d / "cgroup.procs") for d in sb.cgroups]
        sb._ids, why = unprivileged_ids(config.run_as)
        sb.spec = {"procs": sb._procs, "isolate_network": config.isolate_network,
                   "max_file_bytes": config.max_file_bytes, "ids": list(sb._ids) if sb._ids else None}
        if config.confine and owned is not None:
            sb.spec["confine"], sb.facts["confinement"] = confine.plan(owned, code_root(config.run_as))
        else:
            sb.facts["confinement"] = "off (no evaluation folder)" if config.confine else "off (SandboxConfig)"
        if sb._ids is not None and owned is not None:
            for d in [owned, *owned.rglob("*")]:
                os.chown(d, *sb._ids)
        sb.facts["uid"] = str(sb._ids[0]) if sb._ids else str(os.getuid()) + (f" ({why})" if why else "")
        return sb

    # -- cgroups ---------------------------------------------------------------------------
    def _make_cgroups(self) -> None:
        name = f"mkb-{os.getpid()}-{secrets.token_hex(4)}"
        made: list[str] = []
        for ctrl, limits in (("memory", {"memory.limit_in_bytes": self.config.memory_bytes}),
                             ("pids", {"pids.max": self.config.max_tasks})):
            base = _v1_dir(ctrl)
            if base is None or all(v is None for v in limits.values()):
                continue
            try:
                d = base / name
                d.mkdir()
                for k, v in limits.items():
                    if v is not None:
                        (d / k).write_text(str(v))
                self.cgroups.append(d)
                made.append(ctrl)
            except OSError:
                continue
        if not made:
            v2 = _v2_dir()
            if v2 is not None:
                try:
                    d = v2 / name
                    d.mkdir()
                    if self.config.memory_bytes:
                        (d / "memory.max").write_text(str(self.config.memory_bytes))
                    if self.config.max_tasks:
                        (d / "pids.max").write_text(str(self.config.max_tasks))
                    self.cgroups.append(d)
                    made = ["memory", "pids"]
                    self.facts["cgroup"] = "v2"
                except OSError:
                    shutil.rmtree(v2 / name, ignore_errors=True)
        elif made:
            self.facts["cgroup"] = "v1 " + "+".join(made)
        self.facts.setdefault("cgroup", "unavailable (parent watchdog only)")

    def memory_events(self) -> int:
        """How often a memory cap was hit (0 where unknown)."""
        for d in self.cgroups:
            for f, key in (("memory.failcnt", None), ("memory.events", "oom_kill")):
                p = d / f
                if p.exists():
                    txt = p.read_text()
                    if key is None:
                        return int(txt.strip() or 0)
                    for line in txt.splitlines():
                        if line.startswith(key):
                            return int(line.split()[1])
        return 0

    # -- the child side ----------------------------------------------------------------------
    def preexec(self) -> None:
        """Runs in the forked child before exec (see ``enter``)."""
        enter(self.spec, self._unshare)

    # -- teardown ----------------------------------------------------------------------------
    def kill_all(self) -> None:
        """Kill every process left in the worker's cgroups (escapees from its process group too)."""
        for d in self.cgroups:
            procs = d / "cgroup.procs"
            for _ in range(20):
                try:
                    pids = [int(x) for x in procs.read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)

    def cleanup(self) -> None:
        self.kill_all()
        for d in self.cgroups:
            try:
                d.rmdir()
            except OSError:
                pass


def enter(spec: dict[str, Any], unshare: Any) -> None:
    """Make this (freshly forked) process a sandboxed worker: join the cgroups, leave the network,
    set rlimits, drop to the worker's user. ``spec`` is ``Sandbox.spec``: a fork server gets it as data."""
    pid = str(os.getpid()).encode()
    for path in spec["procs"]:
        try:
            fd = os.open(path, os.O_WRONLY)
            os.write(fd, pid)
            os.close(fd)
        except OSError:
            pass
    if spec["isolate_network"] and unshare(CLONE_NEWNET) != 0:
        # unprivileged: a user namespace too; if both fail the worker reports a shared network
        unshare(CLONE_NEWUSER | CLONE_NEWNET)
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["max_file_bytes"], spec["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec.get("confine"):                      # before the user drop: the rules open root-only paths
        err = confine.apply(spec["confine"])
        if err:                                  # unconfined: the worker's probe puts it in the record
            os.write(2, f"sandbox: confinement failed: {err}\n".encode())
    if spec["ids"] is not None:                  # last: cgroups and the namespace need root
        _become(tuple(spec["ids"]))


_PROBED: dict[str, tuple[tuple[int, int] | None, str, Path]] = {}
# what a worker needs as its user: the package, the problems, torch, the DSL toolchains the parent
# has, and a working CUDA context
_PROBE = ("import importlib, os, mkb_eval.harness.worker, torch\n"
          "for m in filter(None, os.environ['MKB_PROBE_MODULES'].split(',')):\n"
          "    importlib.import_module(m)\n"
          "open(os.environ['MKB_PROBE_FILE'], 'rb').close()\n"
          "if os.environ.get('MKB_PROBE_CUDA') == '1':\n"
          "    assert torch.ones(8, device='cuda').sum().item() == 8\n")
_CODE = ("mkb_eval", "problems")         # what a worker reads: its own code and the problem folders
_NOT_STAGED = {"__pycache__", "solutions"}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def pythonpath_first(code: Path, env: dict[str, str]) -> str:
    """``env``'s PYTHONPATH with ``code`` in front: the worker imports mkb_eval from there."""
    return str(code) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")


def own_code_env(**extra: str) -> dict[str, str]:
    """This process's environment, ``extra`` added, for a trusted child that runs a module of this
    checkout (``python -m mkb_eval...``) whatever the working folder."""
    return {**os.environ, "PYTHONPATH": pythonpath_first(repo_root(), dict(os.environ)), **extra}


def _become(ids: tuple[int, int]) -> None:
    """Drop to (uid, gid) with no supplementary groups (a forked child, before exec)."""
    os.setgroups([])
    os.setgid(ids[1])
    os.setuid(ids[0])


def unprivileged_ids(user: str | None) -> tuple[tuple[int, int] | None, str]:
    """(uid, gid) a root parent's workers run as, or (None, why not); probed once per process.

    Where the user cannot read the checkout (a repo under root's home, say), the worker's code and
    the problems are staged as a world-readable copy and probed again (see ``code_root``)."""
    if user is None or os.geteuid() != 0:
        return None, ""
    if user not in _PROBED:
        import pwd

        try:
            pw = pwd.getpwnam(user)
            ids = (pw.pw_uid, pw.pw_gid)
        except KeyError:
            _PROBED[user] = None, f"no user '{user}'", repo_root()
            return None, f"no user '{user}'"
        code = repo_root()
        err = _probe(ids, code)
        if err and "(the interpreter)" not in err:       # the checkout may be unreadable to the user
            try:
                code = stage_code()
                err = _probe(ids, code)
            except OSError as e:
                err = f"staging the worker's code failed: {type(e).__name__}: {e.strerror}"
        _PROBED[user] = ((None, f"kept: '{user}' cannot run a worker here: {err[:160]}", repo_root()) if err
                         else (ids, "", code))
    return _PROBED[user][:2]


def code_root(user: str | None) -> Path:
    """The folder holding the ``mkb_eval`` and ``problems`` a worker of ``user`` imports and reads."""
    if user is None or unprivileged_ids(user)[0] is None:
        return repo_root()
    return _PROBED[user][2]


def _probe(ids: tuple[int, int], code: Path) -> str:
    """'' when ``ids`` can import the worker from ``code`` (and the toolchains, and open the GPU)."""
    import importlib.util
    import subprocess
    import sys

    from mkb_eval.dsl import SPECS

    mods = [m for s in SPECS.values() for m in s.toolchain if importlib.util.find_spec(m) is not None]
    probe_file = next((code / "problems").rglob("reference.py"), code / "mkb_eval" / "__init__.py")
    env = {**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "MKB_PROBE_MODULES": ",".join(mods),
           "MKB_PROBE_FILE": str(probe_file), "MKB_PROBE_CUDA": "1" if _has_gpu() else "0",
           "PYTHONPATH": pythonpath_first(code, dict(os.environ))}
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], preexec_fn=lambda: _become(ids), cwd="/", env=env,
                           capture_output=True, text=True, timeout=300)
        return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror} (the interpreter)"      # no machine paths in records
    except subprocess.SubprocessError as e:
        return type(e).__name__


def stage_code() -> Path:
    """A root-owned, world-readable, read-only copy of the worker's code and the problems, named by
    their content so concurrent sweeps share it and a changed checkout gets a new one."""
    import hashlib
    import tempfile

    root = repo_root()
    files = sorted(f for d in _CODE for f in (root / d).rglob("*")
                   if f.is_file() and not _NOT_STAGED & set(f.relative_to(root).parts) and f.suffix != ".pyc")
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    dest = Path(tempfile.gettempdir()) / f"mkb-code-{h.hexdigest()[:16]}"
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix="mkb-code-tmp-"))
    for f in files:
        out = tmp / f.relative_to(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        out.chmod(0o444)
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        d.chmod(0o555)
    try:
        tmp.rename(dest)
    except OSError:                      # another sweep staged the same content first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _own_cgroup(controller: str) -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path
    except OSError:
        return None
    return None


def _v1_dir(controller: str) -> Path | None:
    mount = _CGROOT / controller
    own = _own_cgroup(controller)
    if own is None or not mount.is_dir() or not os.access(mount, os.W_OK):
        return None
    d = mount / own.lstrip("/")
    return d if d.is_dir() and os.access(d, os.W_OK) else None


def _v2_dir() -> Path | None:
    if not (_CGROOT / "cgroup.controllers").exists():
        return None
    own = _own_cgroup("")
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:]
    except OSError:
        return None
    d = _CGROOT / (own or "/").lstrip("/")
    return d if d.is_dir() and os.access(d, os.W_OK) else None


def network_isolated() -> bool:
    """True when this process sees no network interface but loopback (run inside the worker)."""
    try:
        lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return all(line.split(":")[0].strip() == "lo" for line in lines)
