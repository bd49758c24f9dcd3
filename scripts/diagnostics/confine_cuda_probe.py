"""Which Landlock rule does CUDA need? Each variant of the worker's confinement plan is applied in a fresh
forked child that then initialises CUDA and allocates one tensor; prints a line per variant (JSON).

    python3 scripts/diagnostics/confine_cuda_probe.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from mkb_eval.harness import confine
from mkb_eval.harness.sandbox import repo_root

RW = confine.READ | confine.WRITE_FILE


def variants(base: dict) -> dict[str, dict]:
    def with_rules(extra: list[tuple[str, int]], scoped: int | None = None) -> dict:
        spec = json.loads(json.dumps(base))
        spec["rules"] += [[p, a] for p, a in extra if os.path.exists(p)]
        if scoped is not None:
            spec["scoped"] = scoped
        return spec

    devs = [(e.path, RW | (confine.READ_DIR if e.is_dir() else 0)) for e in os.scandir("/dev")]
    procs = [(e.path, confine.READ) for e in os.scandir("/proc") if e.name.isdigit()]
    return {
        "as_planned": with_rules([]),
        "no_scope": with_rules([], scoped=0),
        "+/dev_all_rw": with_rules(devs),
        "+/proc_all": with_rules(procs),
        "+/run,/tmp,/var": with_rules([("/run", RW), ("/tmp", RW), ("/var", confine.READ), ("/dev/shm", RW)]),
        "+everything_read": with_rules([("/", confine.READ)]),
        "+everything_rw": with_rules([("/", base["handled"])], scoped=0),
    }


def child(spec: dict) -> str:
    folder = spec["rules"][0][0]                  # as in a worker: its temp, home and caches in its folder
    os.environ.update(TMPDIR=folder, HOME=folder, XDG_CACHE_HOME=folder)
    err = confine.apply(spec)
    if err:
        return f"apply: {err}"
    import torch

    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        return f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="mkb-probe-"))
    base, fact = confine.plan(folder, repo_root())
    print(json.dumps({"plan": fact}))
    if base is None:
        return
    for name, spec in variants(base).items():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                out = child(spec)
            except BaseException as e:  # noqa: BLE001
                out = f"{type(e).__name__}: {e}"
            os.write(w, out.encode()[:4000])
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 4096):
            data += chunk
        os.waitpid(pid, 0)
        print(json.dumps({"variant": name, "result": data.decode(errors="replace")}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
