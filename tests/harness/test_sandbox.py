"""The worker's user: a root parent's worker runs as an unprivileged user only where that user can
really run it (probed), and the record says which user it got and why."""

import os
import tempfile

from mkb_eval.harness import sandbox as S
from mkb_eval.harness.procs import session_usage


def test_unknown_user_keeps_the_current_one_and_says_why(monkeypatch):
    monkeypatch.setattr(S.os, "geteuid", lambda: 0)
    ids, why = S.unprivileged_ids("no-such-user-mkb")
    assert ids is None and "no user 'no-such-user-mkb'" in why


def test_not_root_means_nothing_to_drop(monkeypatch):
    monkeypatch.setattr(S.os, "geteuid", lambda: 1000)
    assert S.unprivileged_ids("nobody") == (None, "")


def test_the_record_fact_names_the_user(tmp_path):
    sb = S.Sandbox.create(S.SandboxConfig(), owned=tmp_path)
    try:
        ids, why = S.unprivileged_ids("nobody")
        if ids is not None:          # dropped: the evaluation folder belongs to the worker's user
            assert sb.facts["uid"] == str(ids[0]) and tmp_path.stat().st_uid == ids[0]
        else:
            assert sb.facts["uid"].startswith(str(os.getuid()))
            assert (why in sb.facts["uid"]) if why else True
    finally:
        sb.cleanup()


def test_an_unreadable_checkout_is_staged_as_a_readonly_copy(monkeypatch, tmp_path):
    """A worker user that cannot read the checkout gets a world-readable copy of the worker's code
    and the problems, named by content, and the worker is pointed at the copy."""
    from mkb_eval.harness.jobs import worker_path
    from mkb_eval.harness.redact import redact_paths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tried = []

    def probe(ids, code):
        tried.append(code)
        return "ModuleNotFoundError: No module named 'mkb_eval'" if code == S.repo_root() else ""

    monkeypatch.setattr(S.os, "geteuid", lambda: 0)
    monkeypatch.setattr(S, "_probe", probe)
    monkeypatch.setattr(S, "_PROBED", {})
    ids, why = S.unprivileged_ids("nobody")
    assert ids is not None and why == ""
    code = S.code_root("nobody")
    assert tried == [S.repo_root(), code] and code.parent == tmp_path and code.name.startswith("mkb-code-")
    ref = next(S.repo_root().glob("problems/*/28_*/reference.py"))
    copy = code / ref.relative_to(S.repo_root())
    assert copy.read_bytes() == ref.read_bytes()
    assert copy.stat().st_mode & 0o777 == 0o444 and copy.parent.stat().st_mode & 0o777 == 0o555
    assert S.stage_code() == code                                    # same content: the same copy
    assert worker_path(ref.parent, "nobody") == copy.parent
    assert worker_path(tmp_path, "nobody") == tmp_path          # outside the checkout: unchanged
    assert "<repo>/problems" in redact_paths(f"error in {copy}")
    assert not list(code.glob("problems/*/*/solutions"))                # the workers need no solutions


def test_a_user_that_cannot_even_start_the_interpreter_is_not_staged_for(monkeypatch):
    monkeypatch.setattr(S.os, "geteuid", lambda: 0)
    monkeypatch.setattr(S, "_probe", lambda ids, code: "PermissionError: Permission denied (the interpreter)")
    monkeypatch.setattr(S, "_PROBED", {})
    monkeypatch.setattr(S, "stage_code", lambda: (_ for _ in ()).throw(AssertionError("staged")))
    ids, why = S.unprivileged_ids("nobody")
    assert ids is None and "the interpreter" in why and S.code_root("nobody") == S.repo_root()


def test_worker_user_can_be_kept_by_environment(monkeypatch):
    monkeypatch.setenv("MKB_WORKER_USER", "")
    assert S.SandboxConfig().run_as is None
    monkeypatch.setenv("MKB_WORKER_USER", "nobody")
    assert S.SandboxConfig().run_as == "nobody"


def test_session_usage_counts_a_session_and_shares_recent_scans():
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        rss, n = session_usage(p.pid)                  # a fresh scan sees the new session
        assert n == 1 and rss > 0
        p.kill()
        p.wait()
        assert session_usage(p.pid, max_age=60.0) == (rss, n)     # within max_age: the shared scan
        time.sleep(0.01)
        assert session_usage(p.pid, max_age=0.0) == (0, 0)        # a fresh one: gone
    finally:
        p.kill()
