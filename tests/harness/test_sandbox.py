"""The worker's user: a root parent's worker runs as an unprivileged user only where that user can
really run it (probed), and the record says which user it got and why."""

import os

from mkb_eval.harness import sandbox as S


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
