"""The DSL cards' example kernels compile for sm_90a with the installed DSL packages (CPU, no GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mkb_eval.agent import prompts

DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("card_kernel", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = mod._compiled()
print("COMPILED", type(fn).__name__)
if sys.argv[2] == "tirx":
    src = fn.mod.imports[0].inspect_source()
    assert "__global__" in src, src[:200]
    print("CUDA_SOURCE_OK")
"""


@pytest.mark.slow
@pytest.mark.parametrize("dsl", ["cutedsl", "tirx"])
def test_card_example_compiles(dsl: str, tmp_path: Path) -> None:
    body = prompts.load(f"card_{dsl}").body
    blocks = re.findall(r"```python\n(.*?)```", body, re.S)
    assert blocks, "the card has an example kernel"
    kernel = tmp_path / "kernel.py"
    kernel.write_text(blocks[-1])
    assert "def solve(" in blocks[-1]
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", DRIVER, str(kernel), dsl], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "COMPILED" in res.stdout
