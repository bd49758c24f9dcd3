"""scripts/bench_sweep.py: a benchmark spread over several device calls adds up its parts, and a
sweep cut by the deadline resumes where it stopped."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_sweep", ROOT / "scripts" / "bench_sweep.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


FORKED, EXECD = "warm (forked from a server with the toolchains imported)", "warm (started ahead, toolchains preloaded)"


def _rec(pid: int, dsl: str, ms: float, status: str = "ok", worker: str = FORKED) -> dict:
    return {"kind": "verification", "problem_id": pid, "dsl": dsl, "status": status, "sandbox": {"worker": worker},
            "stages_s": {"total": 10.0, "worker_timing": 1.0},
            "timing": {"kernel_ms": ms, "kernel_device_ms": ms * 0.9, "host_call_ms": 0.02, "cpu_probe_ms": 0.9,
                       "eager_ms": 10 * ms}}


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _part(stage: str, file: str, gpus: int, wall: float, cut: bool = False, workers: str = "forked") -> dict:
    return {"stage": stage, "file": file, "gpus": gpus, "cpus": 16 * gpus, "parallel": 8 * gpus, "warm": True, "wall_s": wall,
            "added": 0, "cut": cut, "workers": workers}


def test_summary_adds_up_parts_and_compares_gpu_counts(tmp_path):
    _write(tmp_path / "sweep_1gpu.jsonl", [_rec(i, d, 1.0) for i in range(1, 31) for d in ("cutedsl", "tirx")])
    _write(tmp_path / "sweep_2gpu.jsonl", [_rec(i, d, 1.0) for i in range(1, 31) for d in ("cutedsl", "tirx")]
           + [_rec(31, "tirx", 1.0, "incorrect", worker=EXECD)])     # its server could not serve it
    _write(tmp_path / "sweep_1gpu_exec.jsonl", [_rec(i, d, 1.0, worker=EXECD) for i in range(1, 31) for d in ("cutedsl", "tirx")])
    _write(tmp_path / "cold.jsonl", [_rec(1, "cutedsl", 1.0), _rec(1, "tirx", 1.0)])
    for k, ms in enumerate((1.00, 1.01, 0.99, 1.30)):
        _write(tmp_path / f"stable_{k}.jsonl", [_rec(3, "cutedsl", ms), _rec(3, "tirx", 2.0)])
    _write(tmp_path / "parts.jsonl", [_part("sweep", "sweep_1gpu.jsonl", 1, 50.0, cut=True),
                                       _part("sweep", "sweep_1gpu.jsonl", 1, 70.0),
                                       _part("sweep", "sweep_2gpu.jsonl", 2, 61.0),
                                       _part("sweep", "sweep_1gpu_exec.jsonl", 1, 240.0, workers="exec"),
                                       _part("cold", "cold.jsonl", 1, 20.0)])
    rep = bench.summary(tmp_path)
    one_exec, one, two = sorted(rep["sweeps"], key=lambda s: (s["gpus"], s["workers"]))
    assert one_exec["scaling"] == 1.0           # scaled against sweeps whose workers started the same way
    assert (one["wall_s"], one["calls"], one["complete"], one["per_minute"]) == (120.0, 2, True, 30.0)
    assert (two["evaluations"], two["passed"], two["per_minute"]) == (61, 60, 60.0)
    assert two["scaling"] == 2.0 and one["scaling"] == 1.0
    assert rep["cold"]["s_per_evaluation"] == 10.0 and rep["cold"]["ratio"] == 5.0
    st = rep["stability"]
    assert st["03/tirx"]["cv"] == 0 and st["03/tirx"]["load_shift"] == 0
    assert 0.008 < st["03/cutedsl"]["cv"] < 0.009 and st["03/cutedsl"]["load_shift"] == 0.3
    assert st["03/cutedsl"]["host_call_ms"] == [0.02] * 3 and st["03/cutedsl"]["cpu_probe_ms"] == [0.9] * 3
    assert "| 0.900, 0.900, 0.900 |" in (tmp_path / "README.md").read_text()
    assert st["03/cutedsl"]["device_cv"] == st["03/cutedsl"]["cv"] and st["03/cutedsl"]["device_load_shift"] == 0.3
    assert st["03/cutedsl"]["eager_ms"] == [10.0, 10.1, 9.9] and st["03/cutedsl"]["eager_cv"] == st["03/cutedsl"]["cv"]
    md = (tmp_path / "README.md").read_text()
    assert "| 1 GPU, forked workers | 16 | 8 | 60 | 60 | 120.0 | 2 | 30.0 | 1.0x |" in md and "**5.0x**" in md
    assert "| 1 GPU, exec'd workers | 16 | 8 | 60 | 60 | 240.0 | 1 | 15.0 | 1.0x |" in md
    assert two["worker_kinds"] == {FORKED: 60, EXECD: 1} and one["worker_kinds"] == {FORKED: 60}
    assert "**2 GPUs, forked workers: 1 of 61 evaluations had workers that started otherwise**" in md
    assert md.count("started otherwise") == 1
    assert "| 20.000, 20.000, 20.000 | 0.0000 |" in md
    assert "CV ≤ 1% for 2 of 2 event-timed medians and 2 of 2 device times. Under load within 1%: 1 of 2 medians" in md


def test_scaling_comes_from_unrounded_rates(tmp_path):
    """Session 8's sweeps: 148 in 582.5 s and in 325.3 s are 15.2 and 27.3 per minute (1.796), 1.79x."""
    recs = [_rec(i, d, 1.0) for i in range(1, 75) for d in ("cutedsl", "tirx")]
    _write(tmp_path / "sweep_1gpu.jsonl", recs)
    _write(tmp_path / "sweep_2gpu.jsonl", recs)
    _write(tmp_path / "parts.jsonl", [_part("sweep", "sweep_1gpu.jsonl", 1, 582.5),
                                       _part("sweep", "sweep_2gpu.jsonl", 2, 325.3)])
    two = max(bench.summary(tmp_path)["sweeps"], key=lambda s: s["gpus"])
    assert (two["per_minute"], two["scaling"]) == (27.3, 1.79)

def test_busy_shares_are_weighted_by_wall_time(tmp_path):
    _write(tmp_path / "sweep_1gpu.jsonl", [_rec(1, "tirx", 1.0)])
    _write(tmp_path / "parts.jsonl", [{**_part("sweep", "sweep_1gpu.jsonl", 1, 50.0, cut=True), "cpu_busy": 0.5, "gpu_busy": [0.4]},
                                       {**_part("sweep", "sweep_1gpu.jsonl", 1, 150.0), "cpu_busy": 1.0, "gpu_busy": [0.8],
                                        "parent_cores": 0.9}])
    one = bench.summary(tmp_path)["sweeps"][0]
    assert (one["cpu_busy"], one["gpu_busy"], one["parent_cores"]) == (0.875, [0.7], 0.9)
    assert "| 88% | 70% | 0.90 |" in (tmp_path / "README.md").read_text()


def test_each_gpu_sweep_process_reports_its_cores(tmp_path):
    said = "x\nGPU 1 sweep process: 1.20 cores (600 CPU s in 500 s)\nGPU 0 sweep process: 0.95 cores (1 CPU s in 1 s)\n"
    assert bench.gpu_process_cores(said) == [0.95, 1.2] and bench.gpu_process_cores("| table |") == []
    _write(tmp_path / "sweep_2gpu.jsonl", [_rec(1, "tirx", 1.0)])
    _write(tmp_path / "parts.jsonl", [{**_part("sweep", "sweep_2gpu.jsonl", 2, 100.0), "parent_cores": 0.05,
                                        "gpu_process_cores": [0.95, 1.2]}])
    assert "| 0.05 (per GPU 0.95, 1.20) |" in bench.markdown(bench.summary(tmp_path))


def test_gpu_samples_skip_torn_lines_and_name_only_the_swept_gpus(tmp_path):
    f = tmp_path / "gpu.csv"
    f.write_text("0, 50\n1, 100\n0, 70\n1, [N/A]\n0, 6")     # the last line cut by the sampler's stop
    assert bench.gpu_busy(f, 1) == [0.6] and not f.exists()
    assert bench.gpu_busy(f, 1) is None                         # no samples: nothing claimed
    one, host = bench.cpu_times([0]), bench.cpu_times()
    assert len(one) > 7 and all(0 <= a <= b for a, b in zip(one, host, strict=True))     # a core's counters within the host's

def test_cpu_sweep_cut_by_the_deadline_resumes(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUTE_DSL_ARCH": "sm_90a"}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_sweep.py"), "--out", str(tmp_path), "--tier", "cpu",
           "--problems", "28", "--parallel", "2", "--stage", "sweep", "--cpus", "1"]
    subprocess.run(cmd + ["--deadline-s", "1"], env=env, check=True, capture_output=True)
    subprocess.run(cmd + ["--deadline-s", "300"], env=env, check=True, capture_output=True)
    parts = bench.parts(tmp_path)
    assert [p["cut"] for p in parts] == [True, False] and {p["cpus"] for p in parts} == {1}
    assert all(p["steal"] is None or 0 <= p["steal"] < 1 for p in parts)
    assert all(0 < p["parent_cores"] < 4 for p in parts)       # the sweep process's own CPU, read before it was reaped
    assert sum(p["added"] for p in parts) == 2
    rep = bench.summary(tmp_path)
    assert rep["sweeps"][0]["evaluations"] == 2 and rep["sweeps"][0]["calls"] == 2
    assert rep["sweeps"][0]["wall_s"] == round(parts[0]["wall_s"] + parts[1]["wall_s"], 1)


def test_spread_compares_full_sweeps_by_kernel_size(tmp_path):
    files = []
    for k, ms in enumerate((1.00, 1.03, 0.97)):
        f = tmp_path / f"s{k}.jsonl"
        _write(f, [_rec(1, "tirx", ms), _rec(2, "tirx", 0.04), _rec(3, "tirx", 2.0, "incorrect" if k else "ok")])
        files.append(f)
    rep = bench.spread(tmp_path, files)
    assert rep["kernels"] == 2 and rep["above_50us"] == 1           # 3 failed once; 2 is 36 µs on the GPU
    assert rep["cv_within_1pct"] == 0 and rep["device_cv_within_1pct"] == 0
    assert (tmp_path / "spread.png").stat().st_size > 1000


def test_quarters_and_timeline_come_from_start_times_and_totals(tmp_path):
    """A record's created_at is when its evaluation started: evaluation k starts at k s and takes 10 s."""
    recs = [{**_rec(k, "tirx", 1.0), "created_at": f"2026-11-30T12:00:{k:02d}+00:00"} for k in range(8)]
    _write(tmp_path / "sweep_1gpu.jsonl", recs)
    _write(tmp_path / "parts.jsonl", [_part("sweep", "sweep_1gpu.jsonl", 1, 20.0)])
    (one,) = bench.summary(tmp_path)["sweeps"]
    assert one["quarters_s"] == [11.0, 13.0, 15.0, 17.0]
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert "1 GPU, forked workers 11.0, 13.0, 15.0, 17.0." in (tmp_path / "README.md").read_text()


def test_a_cpu_tier_benchmark_says_so(tmp_path):
    _write(tmp_path / "sweep_1gpu.jsonl", [_rec(i, "tirx", 1.0, "unverified") for i in range(1, 5)])
    _write(tmp_path / "sweep_1gpu_exec.jsonl", [_rec(i, "tirx", 1.0, "unverified", worker=EXECD) for i in range(1, 5)])
    _write(tmp_path / "parts.jsonl", [{**_part("sweep", "sweep_1gpu.jsonl", 1, 10.0), "gpus": None},
                                       {**_part("sweep", "sweep_1gpu_exec.jsonl", 1, 25.0, workers="exec"), "gpus": None}])
    bench.summary(tmp_path)
    md = (tmp_path / "README.md").read_text()
    assert md.startswith("# Sweep benchmark (CPU tier, compile-only")
    assert "| CPU tier, forked workers | 16 | 8 | 4 | 4 | 10.0 |" in md and "| CPU tier, exec'd workers |" in md
