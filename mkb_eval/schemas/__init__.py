"""The exported JSON Schemas of the typed records, and the one command that regenerates them all.

Each ``*.schema.json`` here is generated from its pydantic model (attempt, verification, the run
folder's ``run.json``/``invocations.jsonl``/``retime.jsonl``, a baseline cache entry, a skill's front
matter and its dataset row) for readers outside Python: ``python -m mkb_eval.schemas`` writes them, and a test fails when a
committed file differs from its model. In a checkout the front matter's schema is also copied to
``skills_corpus/schema/skill.schema.json``, where the corpus documents it.
"""

from __future__ import annotations

from pathlib import Path

CORPUS_SKILL_SCHEMA = Path(__file__).resolve().parents[2] / "skills_corpus" / "schema" / "skill.schema.json"


def schema_files() -> dict[Path, str]:
    """Every exported schema: path -> the text its model gives now."""
    from mkb_eval import attempt_record, baseline_record, records, run_record, skill_record

    files = {attempt_record.SCHEMA_PATH: attempt_record.schema_text(),
             baseline_record.SCHEMA_PATH: baseline_record.schema_text(),
             records.VERIFICATION_SCHEMA_PATH: records.verification_schema_text(),
             **run_record.schema_files(), **skill_record.schema_files()}
    if CORPUS_SKILL_SCHEMA.parent.is_dir():          # a checkout, not an installed package
        files[CORPUS_SKILL_SCHEMA] = files[skill_record.FRONT_MATTER_SCHEMA]
    return files


def stale() -> list[Path]:
    """The committed schemas that differ from their models (or are missing)."""
    return [p for p, text in schema_files().items() if not p.is_file() or p.read_text() != text]


def write_all() -> list[Path]:
    """Write every schema that changed; returns those written."""
    out = []
    for path, text in schema_files().items():
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            out.append(path)
    return out
