"""The `evaluate` Metric and Comparison: offline loading, doctests, agreement with the library, opt-in GPU mode."""

from __future__ import annotations

import doctest
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from mkb_hand_records import REPO_ROOT, hand_records

from mkb_eval.metrics import build_units, read_attempts, score, score_attempts

MODULES = REPO_ROOT / "mkb_eval" / "metrics" / "evaluate_modules"


def load(name: str, **kwargs: Any) -> Any:
    import evaluate

    return evaluate.load(str(MODULES / name), keep_in_memory=True, **kwargs)


def module_source(name: str) -> types.ModuleType:
    path = MODULES / name / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_mkb_test_{name}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["mkb_attempts", "mkb_transfer"])
def test_docstring_examples_run(name: str, hf_offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the examples load the modules by their repo-relative path
    monkeypatch.delenv("MKB_ALLOW_KERNEL_EXEC", raising=False)
    mod = module_source(name)
    test = doctest.DocTestParser().get_doctest(mod._KWARGS_DESCRIPTION, {}, name, str(MODULES / name), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 5 and result.failed == 0


def test_evaluate_load_offline_with_explicit_features(hf_offline_cache: Path) -> None:
    import evaluate

    assert evaluate.config.HF_EVALUATE_OFFLINE
    m = load("mkb_attempts")
    assert isinstance(m, evaluate.Metric) and list(m.features) == ["status", "speedup"]
    v = load("mkb_attempts", config_name="verify")
    assert list(v.features) == ["problem_id", "dsl", "kernel_source"]
    c = load("mkb_transfer")
    assert isinstance(c, evaluate.Comparison)
    assert list(c.features) == ["predictions1", "predictions2", "source", "problem_id", "direction", "family"]
    assert list(c.features["predictions1"]) == ["status", "speedup", "kernel_ms", "skipped"]
    assert (hf_offline_cache / "modules").is_dir()  # the private cache was used
    with pytest.raises(KeyError, match="unknown config"):
        load("mkb_attempts", config_name="nope")


def test_metric_matches_library(hf_offline_cache: Path) -> None:
    outcomes = [o for o in read_attempts(hand_records()).outcomes if o.arm == "solo_cutedsl"]
    r = load("mkb_attempts").compute(status=[o.status for o in outcomes], speedup=[o.speedup for o in outcomes])
    assert r == score_attempts(outcomes)
    assert r["S"] == pytest.approx(50.0)


def test_metric_rejects_bad_rows(hf_offline_cache: Path) -> None:
    m = load("mkb_attempts")
    with pytest.raises(ValueError, match=r"status\[1\]: unknown status 'passed'"):
        m.compute(status=["ok", "passed"], speedup=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"attempt 0: status 'ok' needs a speedup"):
        m.compute(status=["ok"], speedup=[None])


def comparison_inputs(units: list) -> dict[str, list]:
    def row(o: Any) -> dict[str, Any]:
        return {"status": o.status, "speedup": o.speedup, "kernel_ms": o.kernel_ms, "skipped": o.skipped}

    return {
        "predictions1": [row(u.base) for u in units],
        "predictions2": [row(u.skill) for u in units],
        "source": [row(u.source) for u in units],
        "problem_id": [u.problem_id for u in units],
        "direction": [u.direction for u in units],
        "family": [u.family for u in units],
    }


def test_comparison_matches_library_on_hand_set(hf_offline_cache: Path) -> None:
    units = [u for u in build_units(read_attempts(hand_records()).outcomes) if u.resolved]
    r = load("mkb_transfer").compute(**comparison_inputs(units), n_resamples=300)
    lib = score(hand_records(), n_resamples=300)["overall"]
    for key in ("base", "skill", "lift", "paired", "standing", "with_skill", "by_source_verdict", "ci",
                "source_coverage", "skill_coverage", "n_problems"):
        assert r[key] == lib[key], key
    assert (r["n_units"], r["n_resolved"]) == (9, 9)
    assert r["lift_S"] == pytest.approx(-8.888888889) and r["help_rate"] == pytest.approx(1 / 3)
    assert r["harm_rate"] == pytest.approx(2 / 9) and r["delta_gm"] == pytest.approx(-41.2282, abs=1e-3)
    assert r["by_family"]["quantization"]["lift"]["S"] == 0.0


def test_comparison_names_bad_rows(hf_offline_cache: Path) -> None:
    units = [u for u in build_units(read_attempts(hand_records()).outcomes) if u.resolved][:2]
    inputs = comparison_inputs(units)
    inputs["source"][1] = {**inputs["source"][1], "skipped": True}
    with pytest.raises(ValueError, match=r"source\[1\]: only a skill arm can be skipped"):
        load("mkb_transfer").compute(**inputs)
    inputs = comparison_inputs(units)
    inputs["direction"][0] = "cuda2tirx"
    with pytest.raises(ValueError, match=r"direction\[0\]"):
        load("mkb_transfer").compute(**inputs)


def test_comparison_empty_groups_are_none(hf_offline_cache: Path) -> None:
    units = [u for u in build_units(read_attempts(hand_records()).outcomes)
             if u.resolved and u.direction == "cutedsl2tirx"]
    r = load("mkb_transfer").compute(**comparison_inputs(units), n_resamples=50)
    other = r["by_direction"]["tirx2cutedsl"]
    assert other["n_resolved"] == 0 and other["lift"]["S"] is None and other["paired"]["delta_gm"] is None


VERIFY_ARGS = {"problem_id": [28], "dsl": ["tirx"], "kernel_source": ["def solve(*inputs):\n    return inputs\n"]}


def test_verify_mode_refuses_without_opt_in(hf_offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MKB_ALLOW_KERNEL_EXEC", raising=False)
    with pytest.raises(ValueError, match=r"untrusted model-written kernels.*MKB_ALLOW_KERNEL_EXEC=1"):
        load("mkb_attempts", config_name="verify").compute(**VERIFY_ARGS)
    monkeypatch.setenv("MKB_ALLOW_KERNEL_EXEC", "yes")  # only "1" opts in
    with pytest.raises(ValueError, match="MKB_ALLOW_KERNEL_EXEC=1"):
        load("mkb_attempts", config_name="verify").compute(**VERIFY_ARGS)


def test_verify_mode_without_harness_says_so(hf_offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MKB_ALLOW_KERNEL_EXEC", "1")
    monkeypatch.setitem(sys.modules, "mkb_eval.harness.verify", None)  # makes the lazy import fail
    with pytest.raises(RuntimeError, match="needs mkb_eval.harness.verify.verify_source"):
        load("mkb_attempts", config_name="verify").compute(**VERIFY_ARGS)


def test_verify_mode_maps_verdicts(hf_offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict-to-outcome mapping, with a stand-in verifier (no kernel is executed)."""
    calls: list[tuple] = []

    def fake_verify_source(problem: Any, dsl: str, source: str) -> dict[str, Any]:
        calls.append((problem, dsl, source))
        if dsl == "tirx":
            return {"status": "ok", "timing": {"kernel_ms": 0.5, "eager_ms": 1.0, "speedup": None}}
        return {"status": "incorrect", "timing": {}}

    fake = types.ModuleType("mkb_eval.harness.verify")
    fake.verify_source = fake_verify_source  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mkb_eval.harness.verify", fake)
    monkeypatch.setenv("MKB_ALLOW_KERNEL_EXEC", "1")
    r = load("mkb_attempts", config_name="verify").compute(
        problem_id=[28, 28], dsl=["tirx", "cutedsl"], kernel_source=["a", "b"])
    assert calls == [(28, "tirx", "a"), (28, "cutedsl", "b")]
    assert (r["n_attempts"], r["n_passed"], r["R@2"], r["geomean_speedup"]) == (2, 1, 0.5, 2.0)
    assert [v["status"] for v in r["verdicts"]] == ["ok", "incorrect"]


@pytest.mark.parametrize("name", ["mkb_attempts", "mkb_transfer"])
def test_cards_follow_the_hf_format(name: str) -> None:
    card = (MODULES / name / "README.md").read_text(encoding="utf-8")
    assert card.startswith("---\n") and "\ntags:\n" in card and "- evaluate\n" in card
    for section in ("## How to Use", "### Inputs", "### Output Values", "## Limitations and Bias", "## Citation"):
        assert section in card, section
    terms = ["R@t", "S", "skipped", "n/a", "speedup = eager_ms / kernel_ms"]
    if name == "mkb_transfer":
        terms += ["ΔGM", "FLOOR = 0.01", "5%", "tier", "helped", "harmed", "neutral", "above / same / below",
                  "bootstrap", "sign test", "resolved"]
    else:
        terms += ["fast_p", "MKB_ALLOW_KERNEL_EXEC=1", "strictly greater"]
    for term in terms:
        assert term in card, term


def test_card_examples_run(hf_offline_cache: Path) -> None:
    globs = {"attempts": load("mkb_attempts"), "transfer": load("mkb_transfer")}
    for name in ("mkb_attempts", "mkb_transfer"):
        # a closing fence right after an example would read as expected output: end examples at fences
        card = (MODULES / name / "README.md").read_text(encoding="utf-8").replace("\n```", "\n\n```")
        test = doctest.DocTestParser().get_doctest(card, dict(globs), name, f"{name}/README.md", 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        result = runner.summarize(verbose=False)
        assert result.attempted >= 3 and result.failed == 0, name


def test_module_files_have_one_import_per_line() -> None:
    for name in ("mkb_attempts", "mkb_transfer"):
        for line in (MODULES / name / f"{name}.py").read_text().splitlines():
            if line.startswith("import "):
                assert "," not in line, line


def test_classes_import_directly(hf_offline_cache: Path) -> None:
    """The robust route for an installed package: no dynamic loading at all."""
    from mkb_eval.metrics.evaluate_modules.mkb_attempts.mkb_attempts import MkbAttempts
    from mkb_eval.metrics.evaluate_modules.mkb_transfer.mkb_transfer import MkbTransfer

    r = MkbAttempts(keep_in_memory=True).compute(status=["ok", "incorrect"], speedup=[1.5, None])
    assert (r["pass_rate"], r["R@1"], r["fast_1"]) == (0.5, 0.5, 0.5)
    assert "predictions1" in MkbTransfer(keep_in_memory=True).features
