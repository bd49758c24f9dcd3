"""GPU tier (opt-in: pytest -m gpu), issue 27's non-timing half: a shipped solution still passes inside the
confinement, exec'd and forked, and the record says the worker could not write outside its folder; the
escape cheat fails in a forked worker too. (The whole cheat suite runs in test_gpu.py from expected.yaml.)"""

import pytest
import torch

from mkb_eval import problems as P
from mkb_eval.harness import confine
from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.verify import Limits, verify

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "forked"])
def test_a_solution_passes_confined_and_the_escape_fails(fork):
    p28 = P.find(28)
    dsl = "cutedsl"
    limits = Limits()
    with WarmPool(fork=fork) as pool:
        pool.fill("gpu", 0, limits)
        good = verify(p28, dsl, p28.solution_path(dsl), pool=pool, limits=limits, compile_baseline=False)
        bad = verify(p28, dsl, p28.path / "solutions" / "wrong" / "cheat_escape_write.py", pool=pool, limits=limits,
                     compile_baseline=False)
    assert good.status == "ok", f"{good.status} at {good.stage}: {good.message[-2000:]}\n{good.stderr_tail[-2000:]}"
    assert bad.status == "runtime_error" and "PermissionError" in bad.message, bad.message[-1500:]
    assert ("forked" in good.sandbox.worker) == fork, good.sandbox
    if good.sandbox.confinement.startswith("unavailable: CUDA does not initialise"):
        # the H200 hosts (scripts/diagnostics/confine_cuda_probe.py): the record says so, and it is no pass
        assert good.sandbox.outside_write == "allowed", good.sandbox
        pytest.xfail("Landlock is dropped on this host: CUDA does not initialise under its rules")
    if confine.abi()[0]:
        assert good.sandbox.outside_write == bad.sandbox.outside_write == "denied", good.sandbox
        assert good.sandbox.confinement.startswith("landlock ABI"), good.sandbox
