"""Property-based: any problem.yaml content gives a Problem or a ProblemError, nothing else."""

import shutil

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mkb_eval import problems as P

GOOD = P.find(28).path
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True), st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
                      max_leaves=6)
FIELDS = ["id", "slug", "family", "dtype", "description", "sizes", "tolerance", "mutates", "provenance", "license", "sol"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(FIELDS + ["extra"]), values, max_size=4), st.sampled_from([True, False]))
def test_any_yaml_is_loaded_or_refused_clearly(tmp_path, changes, raw):
    folder = tmp_path / "mlp_norm" / GOOD.name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(GOOD, folder, ignore=shutil.ignore_patterns("solutions", "__pycache__"))
    cfg = yaml.safe_load((folder / "problem.yaml").read_text())
    cfg.update(changes)
    text = yaml.safe_dump(cfg) if not raw else yaml.safe_dump(changes)
    (folder / "problem.yaml").write_text(text)
    try:
        P.load_problem(folder)
    except P.ProblemError as e:
        assert str(folder) in str(e)
