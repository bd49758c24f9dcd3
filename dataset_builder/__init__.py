"""Builds the MetaKernelBench Hugging Face dataset folder (parquet per config + card + manifest),
versions it, and pushes it to the Hub as a tagged release."""

from dataset_builder.build import BuildOptions, BuildResult, build_dataset
from dataset_builder.errors import BuildError
from dataset_builder.push import PushPlan, plan_push, push_dataset

__all__ = ["BuildError", "BuildOptions", "BuildResult", "PushPlan", "build_dataset", "plan_push", "push_dataset"]
