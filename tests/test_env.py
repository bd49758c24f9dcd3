"""env.py: the commit a record names."""

import pytest

from mkb_eval.env import git_commit


def test_a_given_commit_must_be_a_full_sha(monkeypatch):
    sha = "ab" * 20
    monkeypatch.setenv("MKB_GIT_COMMIT", sha)
    git_commit.cache_clear()
    try:
        assert git_commit() == {"commit": sha, "dirty": False}
        git_commit.cache_clear()
        monkeypatch.setenv("MKB_GIT_COMMIT", "2454418")            # a short sha is not taken on trust
        with pytest.warns(UserWarning, match="not a full 40-hex commit"):
            got = git_commit()
        assert got.get("commit") != "2454418"
    finally:
        git_commit.cache_clear()
