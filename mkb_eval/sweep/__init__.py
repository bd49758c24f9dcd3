"""Many verifications: jobs, the local pool, one sweep process per GPU, the Ray executor, tables.

Imports run one way: ``jobs`` (the leaf) <- ``local`` <- ``per_gpu``; ``ray_executor`` needs only
``jobs``; ``run`` picks an executor and imports it when a sweep uses it; ``tables`` reads records.
The names below are the package's public API (``from mkb_eval import sweep; sweep.run_sweep(...)``).
"""

from mkb_eval.sweep.jobs import Job, JobQueue, done_keys, folder_jobs, shipped_jobs, spread_order
from mkb_eval.sweep.local import oom_text, out_of_memory, run_local
from mkb_eval.sweep.run import run_sweep
from mkb_eval.sweep.tables import STAGES, fill_compile_baselines, latest, markdown_table, stage_table, summary

__all__ = [
    "STAGES",
    "Job",
    "JobQueue",
    "done_keys",
    "fill_compile_baselines",
    "folder_jobs",
    "latest",
    "markdown_table",
    "oom_text",
    "out_of_memory",
    "run_local",
    "run_sweep",
    "shipped_jobs",
    "spread_order",
    "stage_table",
    "summary",
]
