"""A fork server: torch and both DSL toolchains imported once, a fresh worker forked per evaluation.

A warm worker started with exec pays its own imports: 18-19 CPU s on the H200 host, about 60% of
an evaluation's CPU (results/h200/2026-11-30_bench7). The server imports them once, never touches
CUDA, and forks a worker on request. The child enters its sandbox (``sandbox.enter``), takes its
pipes and files, environment and folder, and runs the same ``worker.main`` an exec'd worker runs;
CUDA is first initialised there, so every evaluation still has its own process and CUDA context.
Measured on one H200 host (results/h200/2026-12-01_bench8): a worker's CPU fell from 18.4 to 6.9 s
per evaluation and the full sweep from 418.4 to 365.7 s. TVM's FFI asks ``torch.cuda.is_available()``
when imported, which initialises CUDA; the server's environment has torch answer it through NVML
instead (``PYTORCH_NVML_BASED_CUDA_CHECK``), and a server that finds the driver initialised all the
same refuses to fork.

The server runs only this checkout's code, holds no job, seed or candidate code, and is reached
only through a socket pair its parent holds: a child closes every descriptor but its own five
before it runs anything. CuTe DSL reads its settings when imported, so the server's dump folder
is the relative ``../dump``: each child's working folder (``<eval>/work``) makes it its own.
Usage: ``python -m mkb_eval.harness.forkserver FD`` (FD: the server's end of the socket pair).
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from mkb_eval.harness.procs import proc_stat
from mkb_eval.harness.sandbox import enter

MAX_FDS = 5                        # the child's stdin, stdout, stderr, lane gate and ready pipe, as fds 0-4
_MSG = 1 << 20


def _send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([json.dumps(msg).encode()], anc)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) once the other end is gone."""
    data, anc, _flags, _addr = sock.recvmsg(_MSG, socket.CMSG_SPACE(MAX_FDS * 4))
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return (json.loads(data) if data else None), list(fds)


# -- the server -------------------------------------------------------------------------------
def _cuda_initialised() -> bool:
    """Whether the CUDA driver was initialised here: a forked child could not use it. The driver's
    device count answers CUDA_ERROR_NOT_INITIALIZED (3) until ``cuInit``, and initialises nothing."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False                   # no driver on this machine
    n = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(n)) != 3


def serve(fd: int) -> None:
    import ctypes
    import gc

    sock = socket.socket(fileno=fd)
    t0, c0 = time.perf_counter(), time.process_time()
    from mkb_eval.harness import worker

    worker._preload()
    import torch

    if torch.cuda.is_initialized() or _cuda_initialised():
        _send(sock, {"error": "CUDA was initialised while importing; forked workers could not use the GPU"})
        return
    unshare = ctypes.CDLL(None, use_errno=True).unshare
    from mkb_eval.harness import confine

    confine.libc()                     # loaded here, not in each forked child
    gc.collect()
    gc.freeze()                        # the imported objects stay shared with every child (no copy on write)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, {"ready": True, "import_s": round(time.perf_counter() - t0, 3),
                 "import_cpu_s": round(time.process_time() - c0, 3)})
    watched: list[socket.socket | int] = [sock, wake_r]
    while True:
        ready = select.select(watched, [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock)
        if sock not in ready:
            continue
        req, fds = _recv(sock)
        if req is None:                # the parent is gone or closed the server: its children live on
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            _send(sock, {"id": req.get("id"), "error": f"fork failed: {e}"})
            pid = -1
        if pid == 0:
            _child(req, fds, sock, unshare)
        for f in fds:
            os.close(f)
        if pid > 0:
            _send(sock, {"id": req["id"], "pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def _child(req: dict[str, Any], fds: list[int], sock: socket.socket, unshare: Any) -> None:
    """The forked child: become the worker ``req`` describes. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        high = [fcntl.fcntl(f, fcntl.F_DUPFD, 16) for f in fds]   # clear of 0-4 before they are overwritten
        for target, f in enumerate(high):
            os.dup2(f, target, inheritable=target < 3)
        sock.detach()
        os.closerange(len(fds), os.sysconf("SC_OPEN_MAX"))   # the server's socket and wake pipe too
        enter(req["sandbox"], unshare)
        was = os.getcwd()
        os.chdir(req["cwd"])
        sys.path[:] = [req["cwd"] if p == was else p for p in sys.path]   # as ``python -m`` started there
        os.environ.clear()
        os.environ.update(req["env"])
        import tempfile

        tempfile.tempdir = None                        # read again from this worker's TMPDIR
        sys.argv = ["mkb_eval.harness.worker", "-"]
        from mkb_eval.harness import worker

        code = worker.main(["-"])
    except BaseException as e:  # noqa: BLE001 - the parent sees an exit status and this message
        try:
            os.write(2, f"fork server child: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    os._exit(code)


# -- the parent's side --------------------------------------------------------------------------
class ForkedProc:
    """The ``Popen``-like handle of a worker the server forked: its pid arrives once the server has
    forked it (the server may still be importing) and its exit status through the server."""

    def __init__(self, stdin: IO[bytes]) -> None:
        self.stdin = stdin
        self.pid: int | None = None
        self.returncode: int | None = None
        self.cancelled = False
        self._done = threading.Event()
        self._settled = threading.Event()              # forked, or never will be

    def wait_forked(self, timeout: float) -> bool:
        """Whether the server forked it, waiting up to ``timeout`` s (the server may still be importing);
        False once the server ended or refused without forking it."""
        self._settled.wait(timeout)
        return self.pid is not None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.pid is None and self.cancelled:        # never forked, or killed on arrival
            return self.returncode
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("forked worker", timeout or 0)
        return self.returncode

    def cancel(self) -> None:
        """Kill it (its session) once it exists; one not yet forked exits on its closed stdin."""
        self.cancelled = True
        if self.pid is not None:               # first: an idle worker that saw its stdin close would exit 0 instead
            killpg(self.pid)
        try:
            self.stdin.close()
        except OSError:
            pass
        if self.pid is not None:               # forked meanwhile
            killpg(self.pid)

    def _exited(self, rc: int) -> None:
        self.returncode = rc
        self._done.set()
        self._settled.set()


def killpg(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads, if it still exists."""
    if pid > 1:                        # never a negative or init's group
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ForkServer:
    """One server process (started at once, importing in the background) and its socket."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.folder = folder
        self.gpu: int | str = "-"          # for messages only
        self.warned = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(folder / "server.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mkb_eval.harness.forkserver", str(theirs.fileno())], cwd=folder / "work",
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock = ours
        self.error: str | None = None
        self.started: dict[str, Any] = {}
        self.ready = threading.Event()
        self._send_lock = threading.Lock()
        self._ids = 0
        self._pending: dict[int, ForkedProc] = {}
        self._live: dict[int, ForkedProc] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def broken(self) -> bool:
        return self.error is not None

    def spawn(self, env: dict[str, str], cwd: str, sandbox: dict[str, Any], fds: list[int],
              stdin: IO[bytes]) -> ForkedProc:
        """Ask for a worker with these descriptors as its fds 0-4 (sent at once: the caller may close
        its copies on return); raises RuntimeError where the server cannot serve."""
        if self.error:
            raise RuntimeError(self.error)
        proc = ForkedProc(stdin)
        with self._send_lock:
            self._ids += 1
            with self._lock:
                self._pending[self._ids] = proc
            try:
                _send(self.sock, {"id": self._ids, "env": env, "cwd": cwd, "sandbox": sandbox}, fds)
            except OSError as e:
                with self._lock:
                    self._pending.pop(self._ids, None)
                raise RuntimeError(f"fork server unreachable: {e}") from e
        return proc

    def _read(self) -> None:
        resets = 0
        while True:
            try:
                msg, fds = _recv(self.sock)
            except ConnectionResetError:
                # a server that ends with requests unread resets the pair, possibly before what it
                # sent last (why it refused) was read; the error is reported once, the messages stay
                resets += 1
                if resets < 3:
                    continue
                msg, fds = None, []
            except (OSError, ValueError):
                msg, fds = None, []
            for f in fds:
                os.close(f)
            if msg is None:
                return self._lost()
            if "ready" in msg:
                self.started = msg
                self.ready.set()
            elif "exited" in msg:
                with self._lock:
                    proc = self._live.pop(msg["exited"], None)
                if proc is not None:
                    proc._exited(msg["rc"])
            elif "id" in msg:
                with self._lock:
                    proc = self._pending.pop(msg["id"], None)
                if proc is None:
                    continue
                if "pid" in msg:
                    with self._lock:
                        self._live[msg["pid"]] = proc
                    proc.pid = msg["pid"]
                    proc._settled.set()
                    if proc.cancelled:
                        killpg(proc.pid)
                else:
                    proc._exited(-signal.SIGKILL)
            elif "error" in msg:
                self.error = "fork server: " + msg["error"]

    def _lost(self) -> None:
        """The server ended: nothing more will be forked and no exit status will come. A worker that
        was never forked counts as killed; a live one is watched until its pid is gone."""
        if self.error is None:
            self.error = "fork server ended" + (f" (see {self.folder / 'server.log'})" if self.folder.exists() else "")
        self.ready.set()
        with self._lock:
            pending, live = list(self._pending.values()), dict(self._live)
            self._pending.clear()
        for proc in pending:
            proc._exited(-signal.SIGKILL)
        while live:
            for pid, proc in list(live.items()):
                if not os.path.exists(f"/proc/{pid}") or _zombie(pid):
                    proc._exited(-signal.SIGKILL)
                    live.pop(pid)
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the server (its running children are not touched)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _zombie(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] == "Z"
    except (OSError, IndexError):
        return True


if __name__ == "__main__":
    serve(int(sys.argv[1]))
