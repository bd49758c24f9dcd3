"""Run as a script (tests/harness/test_confine.py): confine this process or not, then try to escape.

Loads ``confine.py`` from a file so that it runs under any interpreter and user (no package import).
Prints one JSON object: each attempt's outcome, 'ok' or 'denied:<errno>'."""

import importlib.util
import json
import os
import sys
from pathlib import Path

confine_py, folder, code, outside, private, mode = sys.argv[1:7]
spec = importlib.util.spec_from_file_location("confine_under_test", confine_py)
c = importlib.util.module_from_spec(spec)
spec.loader.exec_module(c)
res = {"uid": os.getuid()}
if mode == "confine":
    c.gpu_device = lambda: False     # the file rules under test; whether CUDA starts under them is probed apart
    plan, fact = c.plan(Path(folder), Path(code))
    res["apply"] = c.apply(plan) if plan else fact


def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except OSError as e:
        res[name] = f"denied:{e.errno}"


def write(path):
    with open(path, "w") as f:
        f.write("x")
    os.unlink(path)


attempt("write_folder", lambda: write(os.path.join(folder, "inside")))
attempt("write_outside", lambda: write(os.path.join(outside, f"escape-{os.getpid()}")))
attempt("mkdir_outside", lambda: os.rmdir(os.mkdir(os.path.join(outside, f"d-{os.getpid()}")) or
                                           os.path.join(outside, f"d-{os.getpid()}")))
attempt("write_root", lambda: write(f"/mkb-escape-{os.getpid()}"))
attempt("read_private", lambda: open(private).read())
attempt("read_system", lambda: open("/etc/os-release").read())
attempt("read_parent_environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
attempt("read_own_status", lambda: open("/proc/self/status").read())
attempt("read_cpuinfo", lambda: open("/proc/cpuinfo").read())
res["outside_write"] = c.outside_write(Path(folder))
print(json.dumps(res))
