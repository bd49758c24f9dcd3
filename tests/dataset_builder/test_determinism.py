from dataclasses import replace
from pathlib import Path

from dataset_builder.build import build_dataset
from tests.dataset_builder.conftest import Built


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_building_twice_gives_byte_identical_files(built: Built, tmp_path: Path):
    again = build_dataset(replace(built.options, out=tmp_path / "elsewhere" / "metakernelbench"))
    first, second = _files(built.out), _files(again.out)
    assert sorted(first) == sorted(second)
    assert [name for name in first if first[name] != second[name]] == []
    assert again.files == built.result.files


def test_no_machine_path_or_build_time_in_the_folder(built: Built):
    for name, data in _files(built.out).items():
        assert str(built.out).encode() not in data, name
        assert str(built.run).encode() not in data, name
        assert b"/tmp/" not in data and b"/work/" not in data, name
