import json
import shutil
from pathlib import Path

import pytest

from mkb_eval.agent.store import RunStore
from mkb_eval.metrics.inputs import SchemaVersionError
from mkb_eval.skills.model import SkillError
from mkb_eval.skills.runs import read_run, run_skills
from tests.helpers import attempt
from tests.skills.runfolder import MODEL, OUTCOMES, SKILLS


def test_latest_record_per_trial_and_the_stores_trial_folders(run_dir: Path):
    run = read_run(run_dir)
    assert sorted(a.outcome.trial for a in run.attempts) == sorted(OUTCOMES)
    a = run.find(MODEL, "p28_r1_solo_tirx")
    assert a is not None and a.outcome.status == "ok"            # the earlier "incorrect" line is superseded
    assert a.trial_dir == run_dir / "trials" / "p28_r1_solo_tirx"
    assert a.skill is not None and a.skill.read_text() == SKILLS["p28_r1_solo_tirx"]
    assert a.kernel is not None and a.kernel.name == "kernel.py"


def test_skills_come_from_solo_attempts_with_paired_verdicts(run_dir: Path):
    skills = {s.source_trial: s for s in run_skills(read_run(run_dir))}
    assert set(skills) == set(SKILLS)
    verdicts = {t: s.verdict for t, s in skills.items()}
    assert verdicts == {"p28_r1_solo_cutedsl": "helped", "p28_r1_solo_tirx": "harmed",
                        "p28_r2_solo_cutedsl": "harmed", "p28_r2_solo_tirx": "helped",
                        "p36_r1_solo_tirx": "unresolved"}
    s = skills["p28_r1_solo_cutedsl"]
    assert (s.direction, s.source_verdict, s.source_speedup, s.text) == (
        "cutedsl2tirx", "ok", 7.0, SKILLS["p28_r1_solo_cutedsl"])
    assert s.outcome is not None
    assert (s.outcome.skill_trial, s.outcome.skill_speedup, s.outcome.base_speedup) == (
        "p28_r1_cutedsl2tirx_skill", 8.0, 2.0)
    assert skills["p28_r2_solo_cutedsl"].source_speedup is None   # a failed source has no speedup


def test_archived_artifacts_are_not_a_second_trial_folder(run_dir: Path):
    with RunStore(run_dir) as store:                              # a rerun archives the old folder
        store.begin_trial("p28_r1_solo_tirx").skill(SKILLS["p28_r1_solo_tirx"])
    assert any(p.name.endswith("p28_r1_solo_tirx") for p in (run_dir / "archive").iterdir())
    assert read_run(run_dir).find(MODEL, "p28_r1_solo_tirx").trial_dir == run_dir / "trials" / "p28_r1_solo_tirx"


def test_a_skill_changed_after_its_record_is_refused(run_dir: Path):
    (run_dir / "trials" / "p28_r1_solo_tirx" / "SKILL.md").write_text("- rewritten later\n")
    with pytest.raises(SkillError, match=r"SKILL.md of trial p28_r1_solo_tirx .* record says skill_md_sha256"):
        read_run(run_dir)


def test_folders_found_by_name_outside_the_store_layout(tmp_path: Path):
    run = tmp_path / "r"
    for d in ("models/a/ab12cd_p28_r1_solo_tirx", "models/b/ef34ab_p28_r1_solo_tirx"):
        (run / d).mkdir(parents=True)
        (run / d / "SKILL.md").write_text("- x\n")
    (run / "attempts.jsonl").write_text(json.dumps(attempt("p28_r1_solo_tirx", "ok", 2.0)) + "\n")
    with pytest.raises(SkillError, match=r"has 2 folders .* keep one"):
        read_run(run)
    shutil.rmtree(run / "models/a")
    assert read_run(run).attempts[0].skill == run / "models/b/ef34ab_p28_r1_solo_tirx/SKILL.md"


def test_a_record_that_is_not_a_full_attempt_record_is_named_never_released(run_dir: Path):
    """The metrics' subset alone (another tool's record, with its trial_dir) is refused with the line and
    field; read leniently it is skipped and takes the trial's earlier valid record with it."""
    subset = {"schema_version": 1, "kind": "attempt", "trial": "p28_r1_solo_tirx", "status": "ok", "speedup": 2.0,
              "trial_dir": "trials/p28_r1_solo_tirx"}
    n = len((run_dir / "attempts.jsonl").read_text().splitlines()) + 1
    with open(run_dir / "attempts.jsonl", "a") as f:
        f.write(json.dumps(subset) + "\n")
    with pytest.raises(SkillError, match=rf"attempts.jsonl:{n}: not a valid attempt record.*trial_dir: Extra inputs"):
        read_run(run_dir)
    with pytest.warns(UserWarning, match=rf"attempts.jsonl:{n}: .*record skipped"):
        run = read_run(run_dir, strict=False)
    assert run.find(MODEL, "p28_r1_solo_tirx") is None and len(run.attempts) == len(OUTCOMES) - 1


def test_a_newer_schema_version_is_refused_even_when_reading_leniently(run_dir: Path):
    with open(run_dir / "attempts.jsonl", "a") as f:
        f.write(json.dumps({**attempt("p28_r1_solo_tirx"), "schema_version": 2}) + "\n")
    with pytest.raises(SchemaVersionError, match="schema_version 2"):
        read_run(run_dir, strict=False)


def test_strict_reading_refuses_a_torn_line_lenient_reading_warns(run_dir: Path):
    with open(run_dir / "attempts.jsonl", "a") as f:
        f.write('{"trial": "p28_r1_solo_tirx", "sta')
    with pytest.raises(SkillError, match=r"attempts.jsonl:\d+: malformed JSON"):
        read_run(run_dir)
    with pytest.warns(UserWarning, match="record skipped"):
        run = read_run(run_dir, strict=False)
    assert len(run.attempts) == len(OUTCOMES) and len(run.warnings) == 1


def test_not_a_run_folder(tmp_path: Path):
    with pytest.raises(SkillError, match="not a run folder"):
        read_run(tmp_path)
