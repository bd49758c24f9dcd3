"""build -> plain ``datasets.load_dataset(folder, config)`` offline -> every row equals its sources."""

import hashlib
import json
import statistics
from pathlib import Path

import datasets
import pytest

from dataset_builder.features import config_specs
from dataset_builder.versioning import fingerprint, fingerprint_parts
from mkb_eval import problems as P
from mkb_eval.records import read_jsonl
from tests.dataset_builder.conftest import CORPUS_SKILL, IDS, Built
from tests.skills.runfolder import OUTCOMES, SKILLS


def load(built: Built, config: str, tmp_path: Path) -> datasets.Dataset:
    spec = config_specs()[config]
    return datasets.load_dataset(str(built.out), config, split=spec.split, cache_dir=str(tmp_path / "cache"))


def test_every_config_loads_offline_with_its_declared_features(built: Built, tmp_path: Path):
    assert datasets.config.HF_HUB_OFFLINE
    assert datasets.get_dataset_config_names(str(built.out)) == list(config_specs())
    for name, spec in config_specs().items():
        ds = load(built, name, tmp_path)
        assert ds.features == spec.features, name
        assert len(ds) == built.result.rows[name] > 0, name
        assert set(ds["dataset_version"]) == {"1.0.0"}, name


def test_problem_rows_equal_the_problem_folders(built: Built, tmp_path: Path):
    rows = load(built, "problems", tmp_path).to_list()
    assert [r["problem_id"] for r in rows] == list(IDS)
    for r in rows:
        p = P.find(r["problem_id"])
        assert r["reference_source"].encode() == p.reference_path.read_bytes()
        assert r["problem_yaml"].encode() == (p.path / "problem.yaml").read_bytes()
        assert r["reference_path"] == f"problems/{p.family}/{p.name}/reference.py"
        assert (r["problem"], r["family"], r["dtype"], r["license"]) == (p.name, p.family, p.dtype, p.license)
        assert json.loads(r["sizes_json"]) == p.sizes and r["sol_ms"] == pytest.approx(p.sol.sol_ms)
        assert r["problem_hash"] == p.hash and r["fingerprint"] == fingerprint(fingerprint_parts(p))
        assert r["solution_dsls"] == [d for d in P.DSLS if p.solution_path(d).is_file()]


def test_task_rows_are_the_rendered_prompts(built: Built, tmp_path: Path):
    from mkb_eval.agent.prompts import render_task

    rows = load(built, "tasks", tmp_path).to_list()
    assert [(r["problem_id"], r["dsl"]) for r in rows] == [(i, d) for i in IDS for d in P.DSLS]
    for r in rows:
        task = render_task(P.find(r["problem_id"]), r["dsl"])
        assert (r["prompt"], r["prompt_sha256"], r["prompt_version"]) == (task.text, task.sha256, str(task.version))


def _records() -> list[dict]:
    path = Path(__file__).resolve().parents[2] / "results" / "h200" / "verification.jsonl"
    return [r for r in read_jsonl(path) if r.get("kind") == "verification" and r.get("tier") == "gpu"]


def test_solution_rows_join_the_shipped_kernels_with_their_gpu_records(built: Built, tmp_path: Path):
    rows = load(built, "solutions", tmp_path).to_list()
    records = _records()
    assert len(rows) == sum(P.find(i).solution_path(d).is_file() for i in IDS for d in P.DSLS)  # one GPU folder
    for r in rows:
        p = P.find(r["problem_id"])
        path = p.solution_path(r["dsl"])
        assert r["kernel_source"].encode() == path.read_bytes()
        assert r["kernel_path"] == f"problems/{p.family}/{p.name}/solutions/{r['dsl']}.py"
        assert r["kernel_sha256"] == hashlib.sha256(path.read_text().encode()).hexdigest()
        same = [x for x in records if (x["problem_id"], x["dsl"], x["kernel_sha256"], x["problem_hash"])
                == (p.id, r["dsl"], r["kernel_sha256"], p.hash)]
        if not same:                       # the kernel or the problem changed since it was measured
            assert r["verified"] is False and r["gpu"] is None and r["status"] is None and r["kernel_ms"] is None
            assert r["note"].startswith("no GPU verification record for this kernel and problem version")
            continue
        rec = same[-1]
        assert r["record_json"] == json.dumps(rec, sort_keys=True) and json.loads(r["env_json"]) == rec["env"]
        assert (r["gpu"], r["gpu_name"], r["status"]) == ("h200", rec["env"]["gpu"], rec["status"])
        assert r["verified"] == (rec["status"] == "ok") and r["note"] is None
        assert r["kernel_ms"] == rec["timing"]["kernel_ms"] and r["speedup"] == rec["timing"]["speedup"]


def test_baseline_rows_are_medians_of_the_records(built: Built, tmp_path: Path):
    rows = load(built, "baselines", tmp_path).to_list()
    latest: dict[tuple[int, str], dict] = {}
    for x in _records():
        if x["problem_id"] in IDS and x["problem_hash"] == P.find(x["problem_id"]).hash:
            latest[(x["problem_id"], x["dsl"])] = x
    assert {r["problem_id"] for r in rows} == {i for (i, _) in latest}
    for r in rows:
        recs = [latest[(r["problem_id"], d)] for d in P.DSLS if (r["problem_id"], d) in latest]
        assert r["eager_ms_samples"] == [x["timing"]["eager_ms"] for x in recs]
        assert r["eager_ms"] == pytest.approx(statistics.median(r["eager_ms_samples"]))
        assert r["n_records"] == len(recs) and r["size"] == "full"
        p = P.find(r["problem_id"])
        assert r["sol_ms"] == pytest.approx(p.sol.sol_ms) and r["sol_bound"] == p.sol.bound
        assert r["records_file"] == "results/h200/verification.jsonl"
        for x in recs:                     # the shipped solutions' times come from their own records
            assert r[f"{x['dsl']}_device_ms"] == x["timing"]["kernel_device_ms"]
            assert r[f"{x['dsl']}_kernel_ms"] == x["timing"]["kernel_ms"]
        assert (r["compile_ms"] is None) == (r["compile_note"] is not None)


def test_attempt_rows_are_the_latest_run_records_with_their_files(built: Built, tmp_path: Path):
    rows = load(built, "attempts", tmp_path).to_list()
    assert sorted(r["trial"] for r in rows) == sorted(OUTCOMES)
    latest = {}
    for line in (built.run / "attempts.jsonl").read_text().splitlines():
        rec = json.loads(line)
        latest[rec["trial"]] = rec
    for r in rows:
        assert r["record_json"] == json.dumps(latest[r["trial"]], sort_keys=True)
        assert r["status"] == latest[r["trial"]]["status"] and r["run"] == "run-a"
        assert r["kernel_source"] == (built.run / "trials" / r["trial"] / "kernel.py").read_text()
        assert r["skill_md"] == SKILLS.get(r["trial"])
        assert r["passed"] == (r["status"] == "ok")
        assert r["direction"] == (r["arm"].removesuffix("_skill") if r["arm"].endswith("_skill") else None)


def test_skill_rows_are_the_corpus_and_run_skills(built: Built, tmp_path: Path):
    rows = load(built, "skills", tmp_path).to_list()
    corpus = [r for r in rows if r["origin"].startswith("corpus:")]
    runs = {r["source_trial"]: r for r in rows if r["origin"].startswith("run:")}
    assert [r["text"] for r in corpus] == [CORPUS_SKILL] and corpus[0]["released_in"] == "1.0.0"
    assert {t: r["text"] for t, r in runs.items()} == SKILLS
    assert all(r["sha256"] == hashlib.sha256(r["text"].encode()).hexdigest() for r in rows)
    assert runs["p28_r1_solo_cutedsl"]["verdict"] == "helped"
    assert runs["p28_r2_solo_cutedsl"]["leak_flags"] == ["code_block@3"]
    assert runs["p36_r1_solo_tirx"]["verdict"] == "unresolved"
