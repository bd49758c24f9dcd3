"""Child process that runs problem references on CPU at smoke size for public seeds.

Run as ``python -m dataset_builder.sources.reference_worker --out DIR --seeds 0,1,2 --ids 1,28
[--problems-root DIR]``. It runs in its own process so that importing 74 reference modules and
fixing torch's thread count never touch the builder's process. For each problem and seed it
draws inputs exactly as the verifier's judge does (``torch.manual_seed(seed)`` then
``make_inputs("smoke", "cpu")``), runs the reference with full-precision numerics in one
thread, and writes each output tensor's raw bytes to ``DIR/<id>_<seed>_<k>.bin`` plus one
``DIR/index.json`` describing them. A reference that raises is recorded as an error, not fatal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

SIZE = "smoke"


def flatten(value: Any, path: str = "output") -> tuple[str, list[tuple[str, Any]]]:
    """(structure signature, [(path, tensor)]) of an output; raises TypeError on a non-tensor leaf."""
    import torch

    if isinstance(value, torch.Tensor):
        return "tensor", [(path, value)]
    if isinstance(value, (tuple, list)):
        sigs, leaves = [], []
        for i, v in enumerate(value):
            s, sub = flatten(v, f"{path}[{i}]")
            sigs.append(s)
            leaves.extend(sub)
        return f"{type(value).__name__}[{','.join(sigs)}]", leaves
    raise TypeError(f"{path} is a {type(value).__name__}, not a tensor")


def tensor_bytes(t: Any) -> bytes:
    """C-contiguous little-endian bytes of a CPU tensor of any dtype (bf16 and fp8 included)."""
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def row_digest(structure: str, entries: list[dict[str, Any]]) -> str:
    """sha256 over the structure line and one ``path<TAB>dtype<TAB>shape<TAB>sha256`` line per tensor."""
    text = structure + "\n" + "".join(
        f"{e['path']}\t{e['dtype']}\t{','.join(str(s) for s in e['shape'])}\t{e['sha256']}\n" for e in entries)
    return hashlib.sha256(text.encode()).hexdigest()


def run(ids: list[int], seeds: list[int], out: Path, root: str | None) -> dict[str, Any]:
    import torch

    from mkb_eval.harness.judge import Judge
    from mkb_eval.harness.tolerance import run_reference
    from mkb_eval.problems import find

    torch.set_num_threads(1)
    index: dict[str, Any] = {"torch_version": torch.__version__,
                             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                             "num_threads": torch.get_num_threads(), "results": []}
    for pid in ids:
        problem = find(pid, root)
        try:
            judge = Judge(problem, SIZE, "cpu")
        except Exception as e:  # noqa: BLE001 - a reference that fails to import is a recorded fact
            for seed in seeds:
                error = f"import: {type(e).__name__}: {e}"[:500]
                index["results"].append({"problem_id": pid, "seed": seed, "error": error})
            continue
        for seed in seeds:
            res: dict[str, Any] = {"problem_id": pid, "seed": seed}
            try:
                structure, leaves = flatten(run_reference(judge.module.reference, judge.inputs(seed)))
                entries = []
                for k, (path, t) in enumerate(leaves):
                    data = tensor_bytes(t)
                    name = f"{pid:02d}_{seed}_{k}.bin"
                    (out / name).write_bytes(data)
                    entries.append({"path": path, "dtype": str(t.dtype).removeprefix("torch."),
                                    "shape": list(t.shape), "sha256": hashlib.sha256(data).hexdigest(),
                                    "file": name})
                res.update(structure=structure, outputs=entries, sha256=row_digest(structure, entries))
            except Exception as e:  # noqa: BLE001 - recorded per problem and seed
                res["error"] = f"{type(e).__name__}: {e}"[:500]
            index["results"].append(res)
    return index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--problems-root", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    index = run([int(x) for x in a.ids.split(",") if x], [int(x) for x in a.seeds.split(",") if x], out,
                a.problems_root)
    (out / "index.json").write_text(json.dumps(index, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
