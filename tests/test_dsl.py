"""The DSL registry (:mod:`mkb_eval.dsl`): one spec per name of the vocabulary, each complete."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from mkb_eval import dsl, vocab


def test_the_registry_covers_the_vocabulary_exactly():
    assert tuple(dsl.SPECS) == vocab.DSLS
    assert all(name == s.name for name, s in dsl.SPECS.items())


@pytest.mark.parametrize("name", vocab.DSLS)
def test_each_spec_names_a_card_that_exists(name: str):
    card = resources.files("mkb_eval.agent").joinpath("prompts").joinpath(*dsl.get(name).card.split("/"))
    assert card.is_file(), f"{name}: no prompt card at prompts/{dsl.get(name).card}"


def test_an_unknown_dsl_is_refused():
    with pytest.raises(ValueError, match="unknown DSL 'triton'"):
        dsl.get("triton")


def test_worker_env_fills_in_the_folder_and_the_tier():
    root = Path("/eval/x")
    cute = dsl.get("cutedsl")
    assert cute.worker_env(root, "gpu") == {"CUTE_DSL_DISABLE_FILE_CACHING": "1",
                                            "CUTE_DSL_CACHE_DIR": "/eval/x/cute_cache"}
    assert cute.worker_env(root, "cpu")["CUTE_DSL_DUMP_DIR"] == "/eval/x/dump"
    assert dsl.get("tirx").worker_env(root, "cpu") == {"TVM_HOME": "/eval/x/tvm"}
    # every folder a variable points into is one the evaluation folder has
    for s in dsl.SPECS.values():
        for v in {**s.env, **s.cpu_env}.values():
            if v.startswith("{root}/"):
                assert v.split("/")[1] in (*s.cache_dirs, "dump"), (s.name, v)


class _Module:
    """A TVM runtime module as ``_cuda_sources`` walks it: a kind, a source, imported modules."""

    def __init__(self, kind: str, source: str = "", imports: tuple = ()) -> None:
        self.kind, self._source, self.imports = kind, source, list(imports)

    def inspect_source(self) -> str:
        return self._source


class _Log:
    def __init__(self, *sources: str) -> None:
        self.artifacts = [{"dsl": "tirx", "executable": _Module("library", imports=(_Module("cuda", s),))}
                          for s in sources]


def test_tirx_compiles_each_distinct_cuda_source_once(tmp_path: Path):
    seen: list[str] = []

    def nvcc(source: str, work: Path, name: str) -> dict:
        seen.append(source)
        return {"cubin_bytes": len(source)}

    arts = dsl.get("tirx").compiled_artifacts(_Log("a", "bb", "a"), tmp_path, nvcc)
    assert seen == ["a", "bb"]                                   # the repeated module is not compiled again
    assert arts["cuda_sources"] == 3 and arts["nvcc"] == [{"cubin_bytes": 1}, {"cubin_bytes": 2}, {"cubin_bytes": 1}]


def test_tirx_reports_the_first_source_nvcc_refuses(tmp_path: Path):
    def nvcc(source: str, work: Path, name: str) -> dict:
        return {"error": f"nvcc failed on {name}"} if source == "bad" else {"cubin_bytes": 1}

    arts = dsl.get("tirx").compiled_artifacts(_Log("ok", "bad", "bad"), tmp_path, nvcc)
    assert arts["error"] == "nvcc failed on tirx_1" and arts["nvcc"] == [{"cubin_bytes": 1}]
    assert dsl.get("tirx").compiled_artifacts(_Log(), tmp_path, nvcc)["error"].startswith("no CUDA device module")
