"""The fork server: its workers hold only their own descriptors, exits are reported, none is left
behind, and a server that cannot start costs only the warm start."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from mkb_eval import problems as P
from mkb_eval.harness import spawn
from mkb_eval.harness.forkserver import ForkServer
from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.sandbox import code_root
from mkb_eval.harness.spawn import start_fork_server
from mkb_eval.harness.verify import Limits, spawn_worker, verify
from tests.helpers import until



def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        kids |= {int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()}
    return kids


def test_a_forked_worker_holds_only_its_own_descriptors_and_reports_its_exit():
    server = start_fork_server("cpu", 0, Limits())
    try:
        w = spawn_worker("cpu", 0, Limits(), preload=True, server=server)
        assert w.wait_preloaded(120) and w.proc.pid is not None
        pid = w.proc.pid
        # stdin, stdout, stderr, the lane gate: never the server's socket (a root process that forks)
        assert until(lambda: sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")) == [0, 1, 2, 3], 10)
        assert os.getsid(pid) == pid                              # its own session: the group kill reaches it all
        assert os.readlink(f"/proc/{pid}/cwd") == str(w.root / "work")
        if w.sandbox.spec["isolate_network"]:
            netns = os.readlink(f"/proc/{pid}/ns/net")
            assert netns != os.readlink("/proc/self/ns/net") or w.facts()["network"] != "isolated"
        assert pid in _children(server.proc.pid)
        w.proc.stdin.close()                                      # no job: it exits cleanly, the server says so
        assert w.proc.wait(timeout=30) == 0
        w.kill()
        hung = spawn_worker("cpu", 0, Limits(), preload=True, server=server)
        assert hung.wait_preloaded(30)
        hung.kill_group()
        assert hung.proc.wait(timeout=30) == -9
        hung.kill()
    finally:
        server.close()
        shutil.rmtree(server.folder, ignore_errors=True)


def test_a_worker_killed_before_the_server_forked_it_is_never_left_running():
    server = start_fork_server("cpu", 0, Limits())
    try:
        w = spawn_worker("cpu", 0, Limits(), preload=True, server=server)
        assert w.proc.pid is None                                 # the server is still importing
        w.kill()
        assert w.proc.poll() is not None or w.proc.cancelled
        assert server.ready.wait(120) and not server.broken
        assert until(lambda: w.proc.poll() is not None, 60)      # forked, then gone at once
        assert until(lambda: not _children(server.proc.pid), 60)
        shutil.rmtree(w.root, ignore_errors=True)
    finally:
        server.close()
        shutil.rmtree(server.folder, ignore_errors=True)


def test_a_pool_whose_fork_server_cannot_start_falls_back_to_exec_workers(monkeypatch, tmp_path):
    def dead_server(tier, gpu, limits):
        (tmp_path / "work").mkdir(exist_ok=True)
        return ForkServer({"PYTHONHOME": str(tmp_path / "no-python-here")}, tmp_path)

    monkeypatch.setattr(spawn, "start_fork_server", dead_server)
    with WarmPool(fork=True) as pool:
        pool.fill("cpu", 0, Limits())
        (server,) = pool.servers.values()
        assert until(lambda: server.broken, 60)
        w = None
        for _ in range(3):                                        # the one asked of the dead server is gone
            w = pool.take("cpu", 0, Limits())
            if w is not None:
                break
        assert w is not None and not w.forked and w.proc.poll() is None
        assert w.wait_preloaded(120)
        w.kill()
        shutil.rmtree(w.root, ignore_errors=True)


REFUSING = """
import json, socket, sys, time
time.sleep(1.0)                  # importing, while the pool's requests queue up
sock = socket.socket(fileno=int(sys.argv[1]))
sock.sendmsg([json.dumps({"error": "CUDA was initialised while importing"}).encode()])
"""


def test_workers_asked_of_a_server_that_refuses_are_replaced_not_crashed(monkeypatch, tmp_path):
    """On a GPU host a toolchain's import once initialised CUDA: the server refused to fork, and the
    evaluations it owed workers were recorded as crashed. They must get exec'd workers instead."""
    monkeypatch.setattr(spawn, "start_fork_server", _fake_server(tmp_path, REFUSING))
    p36 = P.find(36)
    with WarmPool(per_key=2, fork=True) as pool:
        pool.fill("cpu", 0, Limits())
        (server,) = pool.servers.values()
        assert not server.broken                         # requests sent while it "imports"
        rec = verify(p36, "tirx", p36.solution_path("tirx"), tier="cpu", pool=pool).to_dict()
        log = (server.folder / "server.log").read_text()
        assert server.broken and "CUDA" in server.error, log
    assert rec["status"] == "unverified", rec["message"]
    assert rec["sandbox"]["worker"] == "warm (started ahead, toolchains preloaded)"


def _fake_server(tmp_path: Path, code: str):
    """start_fork_server's stand-in: a server process running ``code``, in a folder of its own. (A real
    server started only for its folder and closed at once cost up to 10 s: it reads its socket, and so
    sees it closed, only once its imports are done.)"""
    fake = tmp_path / "fake" / "mkb_eval" / "harness"
    fake.mkdir(parents=True)
    for d in (fake.parent, fake):
        (d / "__init__.py").write_text("")
    (fake / "forkserver.py").write_text(code)

    def start(tier, gpu, limits):
        code_root(limits.sandbox.run_as)       # as the real one, before its process starts: the worker user's probe
        folder = Path(tempfile.mkdtemp(prefix="mkb-forkserver-", dir=tmp_path))
        (folder / "work").mkdir()
        return ForkServer({**os.environ, "PYTHONPATH": str(tmp_path / "fake")}, folder)

    return start


def test_a_hung_server_costs_one_wait_then_workers_are_execd(monkeypatch, tmp_path):
    monkeypatch.setattr(spawn, "start_fork_server", _fake_server(tmp_path, "import time\ntime.sleep(600)\n"))
    with WarmPool(fork=True) as pool:
        pool.import_timeout_s = 1.0
        pool.fill("cpu", 0, Limits())
        w = pool.take("cpu", 0, Limits())
        (server,) = pool.servers.values()
        assert w is not None and not w.forked and "within 1 s" in server.error
        assert w.wait_preloaded(120)
        w.kill()
        shutil.rmtree(w.root, ignore_errors=True)


def test_asking_an_ended_server_leaves_nothing_open(tmp_path):
    (tmp_path / "work").mkdir()
    server = ForkServer({"PYTHONHOME": str(tmp_path / "no-python-here")}, tmp_path)
    assert until(lambda: server.broken, 60)
    fds = set(os.listdir("/proc/self/fd"))
    tmp = Path(tempfile.gettempdir())
    folders = set(tmp.glob("mkb-eval-*"))
    with pytest.raises(RuntimeError, match="fork server"):
        spawn_worker("cpu", 0, Limits(), preload=True, server=server)
    assert set(os.listdir("/proc/self/fd")) == fds and set(tmp.glob("mkb-eval-*")) == folders
    server.close()
