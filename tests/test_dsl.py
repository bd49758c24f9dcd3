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
