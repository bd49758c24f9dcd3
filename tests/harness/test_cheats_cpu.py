"""The cheat suite on the CPU tier (issue 27): each ``cheat_*`` kernel of problem 28's ``solutions/wrong/``
gets its status here too where the CPU tier can tell (run-time reference calls, odd outputs,
containment); ``pytest -m gpu`` runs all of them on the GPU against ``expected.yaml``. The GPU judge's
load path is exercised on CPU with hostile output files."""

import os
from pathlib import Path

import pytest
import torch
import yaml

from mkb_eval.harness import confine, transport
from mkb_eval.harness.judge import Judge
from mkb_eval.harness.verify import Limits, verify

LIMITS = Limits(correctness_s=60, timing_s=60, cpu_s=90)
# CPU-tier status and a phrase of the record's message; the CPU tier runs solve once on smoke inputs with
# launches intercepted, so wrong values (the NaN) need a GPU
CHEATS_CPU = {
    "cheat_call_reference.py": ("policy_violation", "called reference"),
    "cheat_reimport_reference.py": ("policy_violation", "re-imported or exec'd the task's reference.py"),
    "cheat_exec_reference_source.py": ("policy_violation", "called reference"),
    "cheat_unhook_guard.py": ("policy_violation", "guard"),
    "cheat_tensor_subclass.py": ("incorrect", "torch.Tensor subclass (Evil)"),
    "cheat_sparse_output.py": ("incorrect", "sparse_coo"),
    "cheat_meta_output.py": ("incorrect", "meta tensor"),
    "cheat_expanded_output.py": ("incorrect", "overlapping memory"),
    "cheat_dict_output.py": ("incorrect", "a dict is not"),
    "cheat_deep_nesting.py": ("incorrect", "expected a tensor, got list"),
    "cheat_nan_output.py": ("unverified", "compiled for sm_90a"),
    "cheat_escape_write.py": ("runtime_error", "PermissionError"),
}


# evaluated in a cold, exec'd worker; the others in forked ones (the guard is the same code on both paths)
COLD = {"cheat_call_reference.py", "cheat_reimport_reference.py", "cheat_exec_reference_source.py",
        "cheat_unhook_guard.py", "cheat_escape_write.py"}


def _wrong(p28) -> Path:
    return p28.path / "solutions" / "wrong"


def test_every_cheat_has_its_expected_statuses(p28):
    gpu = yaml.safe_load((_wrong(p28) / "expected.yaml").read_text())
    mine = {f.name for f in _wrong(p28).glob("cheat_*.py") if not f.name.startswith("cheat_time_")}
    assert mine == set(CHEATS_CPU) and mine <= set(gpu)


@pytest.fixture(scope="module")
def forked_pool():
    from mkb_eval.harness.pool import WarmPool

    with WarmPool(fork=True) as pool:
        pool.fill("cpu", 0, LIMITS)
        yield pool


@pytest.mark.parametrize("name", sorted(CHEATS_CPU))
def test_cheat_gets_its_status_on_the_cpu_tier(p28, name, forked_pool):
    """The guard and containment cheats in a cold worker (``mkb verify`` of one kernel: the guard is
    installed by the worker's own start-up); the odd outputs in workers forked by one server."""
    status, phrase = CHEATS_CPU[name]
    if name == "cheat_escape_write.py" and not confine.abi()[0] and os.geteuid() != 0:
        pytest.skip("no Landlock here: the escape would succeed (the record says so)")
    pool = None if name in COLD else forked_pool
    rec = verify(p28, "cutedsl", _wrong(p28) / name, tier="cpu", limits=LIMITS, pool=pool)
    assert ("forked" in rec.sandbox.worker) == (pool is not None), rec.sandbox
    assert rec.status == status and phrase in rec.message, (rec.status, rec.message[-1500:])
    if "reference" in name:
        assert "reference_call" in rec.flags or "guard_tamper" in rec.flags
    if name == "cheat_tensor_subclass.py":
        assert not Path("/tmp/mkb-evil-unpickled").exists()
    if confine.abi()[0]:
        assert rec.sandbox.outside_write == "denied", rec.sandbox


@pytest.mark.skipif(not confine.abi()[0], reason="no Landlock here")
def test_a_forked_worker_is_confined_too(p28, forked_pool):
    rec = verify(p28, "cutedsl", _wrong(p28) / "cheat_escape_write.py", tier="cpu", pool=forked_pool, limits=LIMITS)
    assert "forked" in rec.sandbox.worker, rec.sandbox
    assert rec.status == "runtime_error" and "PermissionError" in rec.message, rec.message[-1500:]
    assert rec.sandbox.outside_write == "denied"


def test_the_gpu_judge_turns_hostile_output_files_into_mismatches(p28, tmp_path):
    """The judge's load path (GPU tier; here on CPU at smoke size): a refused subclass, a pickle, a lie
    about the shape, a symlink are each a mismatch with the reason, never an exception."""
    import pickle

    judge = Judge(p28, "smoke", "cpu")
    seed = 1234
    ref, _ = judge.expected(judge.inputs(seed))
    cases = {}
    sub = tmp_path / "sub.bin"
    transport.write(ref.as_subclass(type("Evil", (torch.Tensor,), {})), sub)
    cases[sub] = "torch.Tensor subclass"
    pick = tmp_path / "pickle.bin"
    pick.write_bytes(pickle.dumps(ref))
    cases[pick] = "bad magic"
    short = tmp_path / "short.bin"
    transport.write(ref[:3], short)
    cases[short] = "shape (3, 4096) != expected (64, 4096)"
    link = tmp_path / "link.bin"
    link.symlink_to(sub)
    cases[link] = "cannot open"
    for path, why in cases.items():
        bad = judge.check(seed, path)
        assert bad is not None and why in str(bad), (path.name, bad)
    good = tmp_path / "good.bin"
    transport.write(ref, good)
    assert judge.check(seed, good) is None
