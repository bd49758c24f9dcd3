"""Containment of the worker's files (Landlock): a confined process writes only in its evaluation folder
and reads nothing private, as root and as an ordinary user; the control runs (unconfined) show that
the same attempts succeed without it, so these tests can fail. Exercised through ``confine`` directly,
through ``Sandbox.preexec`` (the exec'd worker's entry), and through real evaluations (exec'd and
forked workers) with the escape kernel of the cheat suite."""

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from mkb_eval.harness import confine
from mkb_eval.harness import sandbox as S

PROBE = Path(__file__).with_name("confine_probe.py")
HAVE = confine.abi()[0] > 0
needs_landlock = pytest.mark.skipif(not HAVE, reason=f"no Landlock here: {confine.abi()[1]}")


@pytest.fixture(autouse=True)
def file_rules_only(monkeypatch, request):
    """These tests are about the file rules: no CUDA probe (on a GPU host the plan would first ask whether CUDA
    initialises under them), except in the tests of that decision; and the user's MKB_WORKER_CONFINE=0 unset."""
    monkeypatch.delenv("MKB_WORKER_CONFINE", raising=False)
    if "cuda" not in request.node.name:
        monkeypatch.setattr(confine, "gpu_device", lambda: False)


@pytest.fixture
def arena():
    """A world-readable scratch tree: the worker's folder, a world-writable folder outside it, a private file."""
    top = Path(tempfile.mkdtemp(prefix="mkb-confine-test-"))
    top.chmod(0o755)
    for d in ("outside", "outside/eval", "outside/eval/work", "code", "private"):
        (top / d).mkdir()
        (top / d).chmod(0o755)
    (top / "outside").chmod(0o777)             # the evaluation folder's world-writable parent (like /tmp)
    (top / "private" / "secret").write_text("token")
    (top / "private" / "secret").chmod(0o644)
    shutil.copy(confine.__file__, top / "code" / "confine.py")
    shutil.copy(PROBE, top / "code" / "probe.py")
    for f in (top / "code").iterdir():
        f.chmod(0o644)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def run_probe(top, mode, python=sys.executable, preexec=None):
    args = [python, str(top / "code" / "probe.py"), str(top / "code" / "confine.py"), str(top / "outside" / "eval"),
            str(top / "code"), str(top / "outside"), str(top / "private" / "secret"), mode]
    r = subprocess.run(args, capture_output=True, text=True, cwd="/", preexec_fn=preexec, timeout=60,
                       env={"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": "/"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def denied(res, *names):
    return all(res[n].startswith("denied") for n in names)


@needs_landlock
def test_root_confined_writes_only_its_folder_and_reads_nothing_private(arena):
    if os.geteuid() != 0:
        pytest.skip("the root case needs root")
    control = run_probe(arena, "control")
    assert control["write_outside"] == control["write_root"] == control["read_private"] == "ok", control
    res = run_probe(arena, "confine")
    assert res["apply"] == "" and res["write_folder"] == "ok" and res["read_system"] == "ok", res
    assert res["read_own_status"] == res["read_cpuinfo"] == "ok", res
    assert denied(res, "write_outside", "mkdir_outside", "write_root", "read_private", "read_parent_environ"), str(res)
    assert res["outside_write"] == "denied" and control["outside_write"] == "allowed"


def _nobody():
    if os.geteuid() != 0:
        return None                    # an ordinary user already: the probe runs as this user
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' to drop to")
    return pw.pw_uid, pw.pw_gid


@needs_landlock
def test_an_ordinary_user_confined_writes_only_its_folder(arena):
    """As a non-root user (root drops to nobody first, then the child plans and confines itself, as a
    non-root verifier's worker does): a world-writable folder outside is writable without confinement
    and not with it; a world-readable file outside the allowed paths is not readable with it."""
    ids = _nobody()
    python = sys.executable
    if ids is not None:
        os.chown(arena / "outside" / "eval", *ids)
        os.chown(arena / "outside" / "eval" / "work", *ids)
        python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)
        if python is None:               # (a venv's interpreter may sit in root's home)
            pytest.skip("no system interpreter the unprivileged user could run")

    def drop():
        if ids is not None:
            os.setgroups([])
            os.setgid(ids[1])
            os.setuid(ids[0])

    try:
        control = run_probe(arena, "control", python, drop)
    except AssertionError as e:
        pytest.skip(f"the unprivileged user cannot run {python} here: {e}")
    assert control["uid"] != 0 and control["write_outside"] == "ok" and control["read_private"] == "ok", control
    res = run_probe(arena, "confine", python, drop)
    assert res["uid"] != 0 and res["apply"] == "" and res["write_folder"] == "ok", res
    assert denied(res, "write_outside", "mkdir_outside", "write_root", "read_private"), res
    assert res["outside_write"] == "denied" and control["outside_write"] == "allowed"


@needs_landlock
def test_the_exec_path_entry_confines(arena, monkeypatch):
    """``Sandbox.preexec`` (what an exec'd worker runs before exec) applies the plan ``create`` made."""
    monkeypatch.setenv("MKB_WORKER_USER", "")                  # keep the user: the interpreter is root's here
    sb = S.Sandbox.create(S.SandboxConfig(run_as=None), owned=arena / "outside" / "eval")
    try:
        assert sb.facts["confinement"].startswith("landlock ABI")
        assert any(p == str(arena / "outside" / "eval") for p, _ in sb.spec["confine"]["rules"])
        # the probe's source on the command line: the plan lets the worker read the harness's code, not the arena's
        args = [sys.executable, "-c", PROBE.read_text(), confine.__file__, str(arena / "outside" / "eval"),
                str(arena / "code"), str(arena / "outside"), str(arena / "private" / "secret"), "entered"]
        r = subprocess.run(args, capture_output=True, text=True, cwd="/", preexec_fn=sb.preexec, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads(r.stdout)
    finally:
        sb.cleanup()
    assert res["write_folder"] == "ok" and denied(res, "write_outside", "read_private"), res


def test_confinement_off_or_missing_is_said(monkeypatch, tmp_path):
    monkeypatch.setenv("MKB_WORKER_CONFINE", "0")
    plan, fact = confine.plan(tmp_path, S.repo_root())
    assert plan is None and "MKB_WORKER_CONFINE=0" in fact
    monkeypatch.delenv("MKB_WORKER_CONFINE")
    monkeypatch.setattr(confine, "abi", lambda: (0, "the kernel has no Landlock (ENOSYS)"))
    plan, fact = confine.plan(tmp_path, S.repo_root())
    assert plan is None and "unavailable: the kernel has no Landlock" in fact


def test_an_unconfined_worker_is_warned_about_once(monkeypatch):
    from mkb_eval.harness import verify as V
    from mkb_eval.records import SandboxFacts

    monkeypatch.setattr(V, "_WARNED", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        V.warn_unconfined(SandboxFacts(outside_write="denied"))
        V.warn_unconfined(SandboxFacts(outside_write="allowed", confinement="unavailable: x"))
        V.warn_unconfined(SandboxFacts(outside_write="allowed", confinement="unavailable: x"))
    assert len(seen) == 1 and "outside its evaluation folder" in str(seen[0].message)


@needs_landlock
def test_a_gpu_host_where_cuda_fails_under_the_rules_gets_no_confinement_and_says_why(monkeypatch, tmp_path):
    """On the H200 hosts CUDA did not initialise under the rules (error 304): the plan is dropped there, with the
    reason in the record's fact, rather than every evaluation crashing."""
    monkeypatch.setattr(confine, "gpu_device", lambda: True)
    monkeypatch.setattr(confine, "_CUDA_VERDICT", {"verdict": "RuntimeError: ... Error 304: OS call failed"})
    plan, fact = confine.plan(tmp_path, S.repo_root())
    assert plan is None and fact.startswith("unavailable: CUDA does not initialise") and "Error 304" in fact
    monkeypatch.setattr(confine, "_CUDA_VERDICT", {"verdict": ""})       # where CUDA works confined: kept
    plan, fact = confine.plan(tmp_path, S.repo_root())
    assert plan is not None and fact.startswith("landlock ABI")


@needs_landlock
def test_the_cuda_probe_runs_a_confined_child(monkeypatch, tmp_path):
    """The probe really applies the rules in a child and tries CUDA: here (no GPU) it fails and says so; a rule set
    the child cannot apply is reported as such."""
    monkeypatch.setattr(confine, "_CUDA_VERDICT", {})
    spec, _ = confine.plan(tmp_path, S.repo_root())
    assert spec is not None
    why = confine.cuda_blocked(spec, S.repo_root())
    assert why and "confine:" not in why and "temporary directory" not in why   # confined, imported torch, no GPU
    monkeypatch.setattr(confine, "_CUDA_VERDICT", {})
    assert confine.cuda_blocked({**spec, "handled": 1 << 62}, S.repo_root()).startswith("confine: ")
