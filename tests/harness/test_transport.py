"""The output transport: the worker refuses what is not an output (with the reason), and the judge's
parser takes hostile files (symlinks, FIFOs, pickles, lies about sizes, deep nesting) as errors, never
crashes, never unpickles, and reads no tensor bytes before the structure matches the reference's."""

import json
import os
import pickle

import pytest
import torch

from mkb_eval.harness import transport as T
from mkb_eval.harness.tolerance import check_descriptor


def roundtrip(value, tmp_path):
    path = tmp_path / "out.bin"
    T.write(value, path)
    with T.open_output(path) as out:
        try:
            return out.root, out.values()
        except T.TransportError:              # a refusal somewhere in the output
            return out.root, None


def raw(tmp_path, header, data=b"", magic=T.MAGIC, length=None):
    h = json.dumps(header).encode() if isinstance(header, dict) else header
    path = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.bin"
    path.write_bytes(magic + (len(h) if length is None else length).to_bytes(8, "little") + h + data)
    return path


def test_plain_outputs_round_trip_exactly(tmp_path):
    x = torch.randn(5, 7).to(torch.bfloat16)
    value = (x, [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor([True, False])], 3, 2.5, None,
             torch.empty(0, 4), torch.tensor(1.5, dtype=torch.float64))
    root, out = roundtrip(value, tmp_path)
    assert type(out) is tuple and type(out[1]) is list
    assert torch.equal(out[0], x) and out[0].dtype == torch.bfloat16
    assert torch.equal(out[1][0], value[1][0]) and torch.equal(out[1][1], value[1][1])
    assert out[2:5] == (3, 2.5, None) and out[5].shape == (0, 4) and out[6].item() == 1.5


def test_odd_strides_that_do_not_overlap_are_plain_outputs(tmp_path):
    y = torch.randn(8, 4).t()                      # transposed view
    z = torch.randn(8, 16)[:, ::2]                 # strided slice
    _, out = roundtrip([y, z], tmp_path)
    assert torch.equal(out[0], y) and torch.equal(out[1], z) and out[0].is_contiguous()


def test_nan_travels_as_a_value(tmp_path):
    _, out = roundtrip(torch.tensor([1.0, float("nan")]), tmp_path)
    assert torch.isnan(out[1])


class Sub(torch.Tensor):
    def __reduce_ex__(self, proto):
        raise AssertionError("pickled")


@pytest.mark.parametrize("value,reason", [
    (torch.ones(3).as_subclass(Sub), "subclass (Sub)"),
    (torch.ones(3, 3).to_sparse(), "sparse_coo"),
    (torch.ones(3, 3).to_sparse_csr(), "sparse_csr"),
    (torch.empty(3, device="meta"), "meta tensor"),
    (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8), "quantized"),
    (torch.ones(1, 4).expand(3, 4), "overlapping memory"),
    (torch.ones(5).as_strided((3, 3), (1, 1)), "overlapping memory"),
    ({"out": torch.ones(2)}, "a dict is not"),
    ("text", "a str is not"),
    (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
], ids=["subclass", "sparse", "csr", "meta", "quantized", "expanded", "aliased", "dict", "str", "nested"])
def test_what_is_not_an_output_is_refused_with_its_reason(value, reason, tmp_path):
    root, _ = roundtrip(value, tmp_path)
    assert isinstance(root, T.Refused) and reason in root.reason
    bad = check_descriptor(root, torch.ones(3))
    assert bad is not None and reason in bad.reason


def test_containers_odd_and_deep_are_refused_in_place(tmp_path):
    from collections import namedtuple

    cyclic = []
    cyclic.append(cyclic)
    deep = torch.ones(1)
    for _ in range(10000):
        deep = [deep]
    root, _ = roundtrip((namedtuple("P", "a")(torch.ones(1)), cyclic, deep), tmp_path)
    assert "subclass of tuple" in root.items[0].reason
    assert "nested deeper" in str(root.items[1]) and "nested deeper" in str(root.items[2])
    root, _ = roundtrip([1] * (T.MAX_NODES + 5), tmp_path)
    assert isinstance(root, T.Refused) and "more than" in root.reason


def test_a_huge_output_is_refused_before_it_is_copied(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "MAX_BYTES", 1000)
    root, _ = roundtrip(torch.ones(1000), tmp_path)
    assert isinstance(root, T.Refused) and "over the cap" in root.reason


def test_a_hostile_file_is_an_error_never_a_crash(tmp_path):
    ok = {"version": 1, "root": {"t": "tensor", "dtype": "float32", "shape": [2], "device": "cpu", "offset": 0,
                                  "nbytes": 8}}
    cases = {
        "pickle": (tmp_path / "p.bin", None),
        "bad magic": (raw(tmp_path, ok, b"\0" * 8, magic=b"PK\x03\x04xxxx"), "bad magic"),
        "header past the end": (raw(tmp_path, ok, b"\0" * 8, length=1 << 19), "descriptor length"),
        "header over the cap": (raw(tmp_path, ok, b"\0" * 8, length=T.MAX_HEADER + 1), "descriptor length"),
        "not json": (raw(tmp_path, b"{nope"), "unreadable descriptor"),
        "deep json": (raw(tmp_path, b"[" * 200000 + b"]" * 200000), "unreadable descriptor"),
        "unknown dtype": (raw(tmp_path, {**ok, "root": {**ok["root"], "dtype": "object"}}, b"\0" * 8), "dtype"),
        "size lie": (raw(tmp_path, {**ok, "root": {**ok["root"], "nbytes": 4}}, b"\0" * 4), "does not match"),
        "bool shape": (raw(tmp_path, {**ok, "root": {**ok["root"], "shape": [True, True]}}, b"\0" * 8), "dimension"),
        "negative dim": (raw(tmp_path, {**ok, "root": {**ok["root"], "shape": [-2]}}, b""), "dimension"),
        "trailing bytes": (raw(tmp_path, ok, b"\0" * 9), "data bytes"),
        "short data": (raw(tmp_path, ok, b"\0" * 7), "data bytes"),
        "overlapping": (raw(tmp_path, {"version": 1, "root": {"t": "list", "items": [ok["root"], ok["root"]]}},
                            b"\0" * 16), "out of order"),
        "huge claim": (raw(tmp_path, {**ok, "root": {**ok["root"], "shape": [1 << 16, 1 << 16], "nbytes": 1 << 34}}),
                       "byte count"),
        "unknown entry": (raw(tmp_path, {"version": 1, "root": {"t": "__reduce__"}}), "unknown entry"),
        "no version": (raw(tmp_path, {"root": ok["root"]}, b"\0" * 8), "version"),
    }
    (tmp_path / "p.bin").write_bytes(pickle.dumps(torch.ones(2)))
    for what, (path, reason) in cases.items():
        with pytest.raises(T.TransportError) as e:
            with T.open_output(path) as out:
                out.values()
        assert reason is None or reason in str(e.value), (what, str(e.value))


def test_links_fifos_and_devices_are_not_followed(tmp_path):
    good = tmp_path / "good.bin"
    T.write(torch.ones(2), good)
    (tmp_path / "sym.bin").symlink_to(good)
    os.link(good, tmp_path / "hard.bin")
    os.mkfifo(tmp_path / "fifo.bin")
    for name, reason in (("sym.bin", "cannot open"), ("hard.bin", "hard link"), ("fifo.bin", "not a regular")):
        with pytest.raises(T.TransportError) as e:
            with T.open_output(tmp_path / name):
                pass
        assert reason in str(e.value)


def test_bools_are_sanitised(tmp_path):
    path = raw(tmp_path, {"version": 1, "root": {"t": "tensor", "dtype": "bool", "shape": [3], "device": "cpu",
                                                  "offset": 0, "nbytes": 3}}, bytes([0, 1, 7]))
    with T.open_output(path) as out:
        assert out.values().tolist() == [False, True, True]


def test_the_structure_is_checked_before_the_bytes_are_read(tmp_path):
    """A descriptor that claims the wrong shape is a mismatch without its data being read."""
    ref = torch.ones(4, 4, dtype=torch.bfloat16)
    path = tmp_path / "o.bin"
    T.write(torch.ones(2, 4, dtype=torch.bfloat16), path)
    with T.open_output(path) as out:
        bad = check_descriptor(out.root, ref)
    assert "shape (2, 4) != expected (4, 4)" in str(bad)
    T.write([torch.ones(4, 4)], path)
    with T.open_output(path) as out:
        assert "expected a tensor, got list" in str(check_descriptor(out.root, ref))
    T.write(torch.ones(4, 4), path)
    with T.open_output(path) as out:
        assert "dtype torch.float32 != expected torch.bfloat16" in str(check_descriptor(out.root, ref))
    T.write((torch.ones(4, 4, dtype=torch.bfloat16),), path)
    with T.open_output(path) as out:
        assert "expected a tensor, got tuple" in str(check_descriptor(out.root, ref))
        assert check_descriptor(out.root, (ref,)) is None
        assert "expected a list" in str(check_descriptor(out.root, [ref]))
