"""Every status reachable on the CPU tier, each in its own worker, with the next evaluation unaffected.

The statuses are taken in workers forked by one fork server, as a sweep's are (each evaluation still
gets a fresh process): a cold worker pays ~5 s of torch and DSL imports before its job, twice per case.
The cold, exec'd path is checked by ``test_a_cold_exec_worker_compiles_too`` (test_solutions_compile.py),
by the guard and containment cheats (test_cheats_cpu.py) and, for the process-level failures (raise,
hang, abort, exit, an output flood), by the exec'd variants in test_faults.py.
"""

import importlib.util

import pytest

from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.verify import Limits, verify

from .conftest import KERNELS, compose

spec = importlib.util.spec_from_file_location("bodies", KERNELS / "bodies.py")
bodies = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bodies)
LIMITS = Limits(correctness_s=60, timing_s=60, cpu_s=60)
FORKED = "warm (forked from a server with the toolchains imported)"


@pytest.fixture(scope="module")
def forked_pool():
    """One idle forked worker ahead of each evaluation (the hang's shorter limit shares the sandbox key)."""
    with WarmPool(fork=True) as pool:
        pool.fill("cpu", 0, LIMITS)
        yield pool


@pytest.mark.parametrize("case", sorted(bodies.CPU_CASES))
def test_status_then_healthy(case, p28, tmp_path, forked_pool):
    body, expected = bodies.CPU_CASES[case]
    # the worker's imports are done before its job: 5 s reach into solve with room to spare
    limits = Limits(cpu_s=5) if case == "hangs" else LIMITS
    taken = forked_pool.taken
    rec = verify(p28, "cutedsl", compose(body, tmp_path, case), tier="cpu", limits=limits, pool=forked_pool)
    assert rec.status == expected, (rec.status, rec.message[-2000:])
    assert rec.tier == "cpu" and rec.kernel_sha256 and rec.problem_hash == p28.hash
    if case == "prints_10mb":
        assert len(rec.stdout_tail) < 5000 and "bytes cut" in rec.stdout_tail
    if case == "hangs":
        assert "hung during" in rec.message
    if case == "aborts":
        assert "SIGABRT" in rec.message
    if case == "dsl_type_error":
        assert "undefined_name_in_dsl" in rec.message
    # a fresh process per evaluation: the next one is untouched by whatever this one did
    good = verify(p28, "cutedsl", compose(bodies.CPU_CASES["good"][0], tmp_path, "good_after"), tier="cpu",
                  limits=LIMITS, pool=forked_pool)
    assert good.status == "unverified", good.message
    ran = rec.stage != "parse"                 # a kernel without solve is refused before any worker
    assert forked_pool.taken == taken + 1 + ran and good.sandbox.worker == FORKED
    assert rec.sandbox.worker == (FORKED if ran else None), rec.sandbox


def test_syntax_error_is_compile_error(p28, tmp_path):
    path = tmp_path / "k.py"
    path.write_text("def solve(h, r, w)\n    return h\n")
    rec = verify(p28, "cutedsl", path, tier="cpu")
    assert rec.status == "compile_error" and "expected ':'" in rec.message


def test_policy_violation_is_not_executed(p28, tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "k.py"
    path.write_text(f"import triton\nopen({str(marker)!r}, 'w').write('x')\n\ndef solve(h, r, w):\n    return h\n")
    rec = verify(p28, "cutedsl", path, tier="cpu")
    assert rec.status == "policy_violation" and "triton" in rec.message
    assert not marker.exists()


def test_known_bad_kernels_compile_on_cpu(p28, forked_pool):
    """The wrong/ kernels are rejected on the GPU; on the CPU they must at least compile (or be caught).
    Each in its own forked worker (the cold path compiles a solution per DSL in test_solutions_compile.py)."""
    expected_cpu = {"torch_only.py": "no_dsl_kernel", "patch_timer.py": "policy_violation",
                    "side_stream.py": "runtime_error",   # torch.cuda.Stream needs CUDA
                    "cheat_time_forged_send.py": "policy_violation"}   # the worker's guard sees the patched send
    from .test_cheats_cpu import CHEATS_CPU                # the guard's cheat suite has its own test

    for path in p28.wrong_solutions():
        if path.name in CHEATS_CPU:
            continue
        rec = verify(p28, "cutedsl", path, tier="cpu", limits=LIMITS, pool=forked_pool)
        assert rec.status == expected_cpu.get(path.name, "unverified"), (path.name, rec.status, rec.message[-500:])
        assert "forked" in rec.sandbox.worker, rec.sandbox


def test_records_carry_no_machine_paths():
    import sys
    import tempfile
    from pathlib import Path

    import mkb_eval
    from mkb_eval.harness.redact import redact_paths

    repo = Path(mkb_eval.__file__).resolve().parent.parent
    folder = Path(tempfile.gettempdir()) / "mkb-eval-ab_12"
    site = Path(sys.prefix) / "lib" / "python3.12" / "site-packages"
    text = (f'File "{folder / "work" / "kernel.py"}", line 3\n{site / "torch" / "x.py"}:1: UserWarning\n'
            f"{repo / 'mkb_eval' / 'cli.py'}\nleft in {folder}")
    assert redact_paths(text) == ('File "work/kernel.py", line 3\n<site-packages>/torch/x.py:1: UserWarning\n'
                                  "<repo>/mkb_eval/cli.py\nleft in <eval>")
