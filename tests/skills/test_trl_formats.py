"""The exports as TRL's trainers take them (runs where ``trl`` is importable and the embedded model is prepared).

TRL is not a dependency of the toolkit: CI checks the documented column shapes in test_export.py;
this file hands the same files to ``SFTTrainer`` and ``DPOTrainer``, which tokenize them at
construction (a few records, the 135M embedded model, CPU), e.g. with
``pip install --no-deps --target /tmp/trl trl`` and ``PYTHONPATH=/tmp/trl``.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from mkb_eval import problems as P
from mkb_eval import verification_set as V
from mkb_eval.agent import models
from mkb_eval.skills.corpus import CORPUS_ROOT, read_corpus
from mkb_eval.skills.export import export
from mkb_eval.skills.runs import read_run, run_skills
from tests.skills.test_export import task_prompt

trl = pytest.importorskip("trl", reason="trl is not installed (optional: TRL's trainers are not a dependency)")
MODEL = models.model_dir("smollm2-135m-instruct")
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                reason="the embedded model is not prepared (mkb models prepare)")


def _trainer_args(tmp_path: Path, cls):
    """No truncation: an apply_skill record is a long prompt (task + skill) and a long completion (a kernel)."""
    return cls(output_dir=str(tmp_path / "out"), max_length=None, report_to=[], per_device_train_batch_size=1,
               use_cpu=True)


@pytest.mark.parametrize("fmt,conversational", [("sft", False), ("sft-messages", True)])
def test_sft_trainer_takes_the_sft_exports(fmt: str, conversational: bool, tmp_path: Path):
    from trl.data_utils import is_conversational

    probs = {p.id: p for p in P.load_all()}
    skills = [s for s in read_corpus(CORPUS_ROOT) if s.problem_id in (28, 36)]
    evidence = V.match(V.read_set(V.set_path("h200")), V.shipped_hashes(probs.values())).matched
    out = tmp_path / f"{fmt}.jsonl"
    export(skills, probs, fmt, out, evidence=evidence, task_prompt=task_prompt)
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert is_conversational(ds[0]) is conversational
    tr = trl.SFTTrainer(model=str(MODEL), train_dataset=ds, args=_trainer_args(tmp_path, trl.SFTConfig))
    assert len(tr.train_dataset) == 2 and "input_ids" in tr.train_dataset.column_names
    n = [len(x) for x in tr.train_dataset["input_ids"]]
    print(f"{fmt}: tokens per record {n}")


def test_dpo_trainer_takes_the_dpo_export(run_dir: Path, tmp_path: Path):
    probs = {p.id: p for p in (P.find(28), P.find(36))}
    out = tmp_path / "dpo.jsonl"
    export(run_skills(read_run(run_dir)), probs, "dpo", out, include_flagged=True)
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    tr = trl.DPOTrainer(model=str(MODEL), train_dataset=ds, args=_trainer_args(tmp_path, trl.DPOConfig))
    assert len(tr.train_dataset) == 2 and {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(tr.train_dataset.column_names)
