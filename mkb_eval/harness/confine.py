"""File-system confinement of the worker with Landlock (Linux 5.13+), through raw syscalls (ctypes).

Whoever runs the verifier (root, whose worker becomes ``nobody``, or an ordinary user, whose worker keeps that
user's rights), the worker may write only in its evaluation folder (and the GPU and a few harmless devices),
and read only what a worker needs: the system's programs and libraries (``/usr``, ``/lib*``, ``/bin``,
``/sbin``, ``/opt``), ``/etc`` less its secrets (shadow, sudoers, ssh, ssl, ...), ``/sys``, ``/proc`` less
other processes' folders (so not the parent's environment), the Python installation and its packages, the
harness's code and the problem folders, and its own folder. Not the user's home, the results store, the
caches, other evaluations' folders, the fork server's folder or ``/tmp``. Landlock also keeps the worker from
ptrace-ing (or reading the memory of) processes outside its domain, and from ABI 6 on, from signalling them or
reaching their abstract UNIX sockets.

The parent makes the rules (``plan``, plain data, so a fork server can receive them); the freshly forked child
applies them (``apply``) before it drops to the worker's user. Where Landlock is missing the plan says why,
the worker runs unconfined, and the record says so (``outside_write`` in its sandbox facts).
On a host with a GPU the plan is kept only where a confined child can initialise CUDA (``cuda_blocked``);
``MKB_WORKER_CONFINE=0`` turns confinement off (recorded too), for diagnosis.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any

_NR_CREATE, _NR_ADD, _NR_RESTRICT = 444, 445, 446      # the same on every architecture (asm-generic)
_VERSION = 1                                            # LANDLOCK_CREATE_RULESET_VERSION
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_MAKE_ALL = sum(1 << i for i in range(4, 13))           # remove dir/file, make char/dir/reg/sock/fifo/block/sym
REFER, TRUNCATE = 1 << 13, 1 << 14
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1
READ = EXECUTE | READ_FILE | READ_DIR
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE   # the rights a rule on a non-directory may hold

_SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/opt", "/sys")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_ETC_SECRET = ("shadow", "gshadow", "sudoers", "ssh", "ssl", "pki", "security", "credstore", "krb5", "docker",
               "containerd", "kubernetes", "wireguard", "openvpn", "NetworkManager", "netrc", "cups", "libvirt",
               "machine-id", "subuid", "subgid")

_LIBC: Any = None


def libc() -> Any:
    """libc with errno, loaded once (before forking: a forked child should not load libraries)."""
    global _LIBC  # noqa: PLW0603 - one handle per process, loaded before forking
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.syscall.restype = ctypes.c_long
    return _LIBC


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi() -> tuple[int, str]:
    """(Landlock ABI version, '') or (0, why not)."""
    if not sys.platform.startswith("linux"):
        return 0, "not Linux"
    try:
        lib = libc()
    except OSError as e:
        return 0, f"no libc ({e})"
    v = lib.syscall(_NR_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    if v < 0:
        err = ctypes.get_errno()
        return 0, {38: "the kernel has no Landlock (ENOSYS)", 95: "Landlock is disabled at boot (EOPNOTSUPP)"}.get(
            err, f"Landlock unavailable ({os.strerror(err)})")
    return int(v), ""


def _handled(version: int) -> int:
    return READ | WRITE_FILE | _MAKE_ALL | (REFER if version >= 2 else 0) | (TRUNCATE if version >= 3 else 0)


def _read_paths(code: Path, extra_read: list[str] | None) -> list[str]:
    """What a worker reads beside the system: the Python installation, the import path, the harness and problems."""
    read = list(_SYSTEM_READ)
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}:
        read.append(p)
    code = Path(code).resolve()
    skip = {code, Path.cwd().resolve(), Path.home().resolve(), Path("/").resolve()}
    for entry in sys.path + os.environ.get("PYTHONPATH", "").split(os.pathsep) + (extra_read or []):
        # the import path (site-packages, .pth and PYTHONPATH entries), not the folder the parent runs in
        if entry and os.path.isdir(entry) and Path(entry).resolve() not in skip:
            read.append(entry)
    return read


def _etc_proc_dev_rules() -> list[tuple[str, int]]:
    """``/etc`` less its secrets, ``/proc`` less other processes' folders, the harmless devices and the GPU's."""
    rules: list[tuple[str, int]] = []
    try:
        rules += [(e.path, READ) for e in os.scandir("/etc") if not e.name.startswith(_ETC_SECRET)]
    except OSError:
        pass
    # /proc: the system-wide entries and the worker's own process (``/proc/self`` is opened by the child,
    # so the rule lands on its own pid); not other processes' folders (their environ, cmdline, maps)
    rules += [("/proc", READ_DIR), ("/proc/self", READ)]
    try:
        rules += [(e.path, READ) for e in os.scandir("/proc") if not e.name.isdigit()
                  and e.name not in ("self", "thread-self")]
    except OSError:
        pass
    rules.append(("/dev", READ_DIR))
    rules += [(d, READ_FILE | WRITE_FILE) for d in _DEVICES]
    try:        # the GPU: nvidiactl, nvidia0.., nvidia-uvm, nvidia-caps/
        rules += [(e.path, READ_FILE | WRITE_FILE | (READ_DIR if e.is_dir() else 0)) for e in os.scandir("/dev")
                  if e.name.startswith("nvidia")]
    except OSError:
        pass
    return rules


def plan(folder: Path, code: Path, extra_read: list[str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """The rules for a worker of evaluation ``folder`` whose harness code and problems are under ``code``
    (data for ``apply``), and the fact for the record; (None, why) where Landlock cannot be used."""
    if os.environ.get("MKB_WORKER_CONFINE", "1") == "0":
        return None, "off (MKB_WORKER_CONFINE=0): the worker has its user's rights on files"
    version, why = abi()
    if not version:
        return None, f"unavailable: {why}; the worker has its user's rights on files"
    handled = _handled(version)
    rules: list[tuple[str, int]] = [(str(folder), handled)]
    rules += [(p, READ) for p in _read_paths(code, extra_read)]
    code = Path(code).resolve()
    rules += [(str(code), READ_DIR), (str(code / "mkb_eval"), READ), (str(code / "problems"), READ)]
    rules += _etc_proc_dev_rules()
    seen: set[tuple[str, int]] = set()
    uniq = []
    for p, acc in rules:
        if os.path.exists(p) and (p, acc) not in seen:
            seen.add((p, acc))
            uniq.append([p, acc])
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if version >= 6 else 0
    spec = {"abi": version, "handled": handled, "scoped": scoped, "rules": uniq}
    if gpu_device():
        why = cuda_blocked(spec, code)
        if why:
            return None, (f"unavailable: CUDA does not initialise under the Landlock rules on this host ({why}); "
                          "the worker has its user's rights on files")
    return spec, (f"landlock ABI {version}: writes only in its evaluation folder; reads only system, Python and "
                  f"harness paths" + ("; no signals or abstract sockets outside" if scoped else ""))


def gpu_device() -> bool:
    """Whether this host has an NVIDIA GPU's device nodes (workers may then need CUDA under the rules)."""
    return os.path.exists("/dev/nvidiactl")


_CUDA_PROBE = """
import json, sys
from mkb_eval.harness import confine
err = confine.apply(json.load(sys.stdin))
if err:
    sys.exit("confine: " + err)
import torch
torch.zeros(1, device="cuda").add_(1)
torch.cuda.synchronize()
"""
_CUDA_VERDICT: dict[str, str] = {}


def cuda_blocked(spec: dict[str, Any], code: Path) -> str:
    """'' when a child confined by ``spec`` can initialise CUDA, else the reason (the child's last line); probed
    once per process. On the H200 hosts (2026-12-01, Landlock ABI 7) CUDA's initialisation failed with error 304
    under these rules and every variant tried short of write access to the whole file system
    (scripts/diagnostics/confine_cuda_probe.py), so there workers run unconfined and their records say so."""
    if "verdict" not in _CUDA_VERDICT:
        import json
        import subprocess

        folder = spec["rules"][0][0]                       # the evaluation folder: the worker's temp and home
        env = {**os.environ, "TMPDIR": folder, "HOME": folder, "XDG_CACHE_HOME": folder,
               "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        try:
            r = subprocess.run([sys.executable, "-c", _CUDA_PROBE], input=json.dumps(spec), env=env, cwd="/",
                               capture_output=True, text=True, timeout=180)
            lines = r.stderr.strip().splitlines() or [f"exit status {r.returncode}"]
            _CUDA_VERDICT["verdict"] = "" if r.returncode == 0 else lines[-1][-200:]
        except (OSError, subprocess.SubprocessError) as e:
            _CUDA_VERDICT["verdict"] = f"the probe could not run ({type(e).__name__})"
    return _CUDA_VERDICT["verdict"]


def apply(spec: dict[str, Any] | None) -> str:
    """Confine this process (a freshly forked worker) to ``spec``; '' when done, else why not.
    Irreversible, and inherited by everything this process starts."""
    if not spec:
        return "no plan"
    lib = libc()
    attr = _RulesetAttr(spec["handled"], 0, spec["scoped"])
    size = 24 if spec["abi"] >= 6 else 16 if spec["abi"] >= 4 else 8
    fd = lib.syscall(_NR_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
    try:
        for path, access in spec["rules"]:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue                        # gone since the plan: nothing to allow
            try:
                allowed = access if os.path.isdir(path) else access & _FILE_ONLY
                rule = _PathBeneath(allowed, pfd)
                if lib.syscall(_NR_ADD, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule),
                               ctypes.c_uint32(0)) < 0:
                    return f"landlock_add_rule({path}): {os.strerror(ctypes.get_errno())}"
            finally:
                os.close(pfd)
        if lib.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)) != 0:
            return f"prctl(NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
        if lib.syscall(_NR_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) < 0:
            return f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"
        return ""
    finally:
        os.close(fd)


def outside_write(folder: Path) -> str:
    """Whether this process can create a file beside its evaluation ``folder`` (run inside the worker,
    before the candidate is imported): 'denied' when confinement holds, else 'allowed'."""
    probe = folder.parent / f".mkb-confine-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except PermissionError:
        return "denied"
    except OSError as e:
        return f"denied ({e.strerror})" if e.errno in (13, 30) else f"unknown ({e.strerror})"
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return "allowed"
