"""Deterministic parquet writing: same rows, same bytes.

Rows are converted with the config's explicit ``datasets.Features`` (whose arrow schema carries
the ``huggingface`` metadata that ``datasets`` reads the features back from) and written with
fixed writer options. Nothing time- or machine-dependent goes into the file, so building twice
with the same pyarrow gives byte-identical files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dataset_builder.errors import BuildError
from dataset_builder.features import ConfigSpec

WRITER_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": True,
    "write_statistics": True,
    "version": "2.6",
    "data_page_version": "1.0",
    "store_schema": True,
}


def to_table(rows: Sequence[dict[str, Any]], spec: ConfigSpec) -> pa.Table:
    """Rows (each with exactly the config's columns) as an arrow table of the config's schema."""
    columns = list(spec.features)
    for i, row in enumerate(rows):
        if list(row) != columns:
            missing = [c for c in columns if c not in row]
            extra = [c for c in row if c not in spec.features]
            raise BuildError(f"config '{spec.name}' row {i}: columns differ from the features "
                             f"(missing {missing}, unknown {extra}, or out of order)")
    try:
        return pa.Table.from_pylist(list(rows), schema=spec.features.arrow_schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise BuildError(f"config '{spec.name}': a value does not fit its feature type ({e})") from None


def write_rows(rows: Sequence[dict[str, Any]], spec: ConfigSpec, path: Path) -> None:
    """Write one config's rows to ``path`` as a single parquet file."""
    table = to_table(rows, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=spec.row_group_size, **WRITER_OPTIONS)
