"""The worker → judge output format: a JSON structure descriptor followed by raw tensor bytes; no pickle.

The worker is untrusted, so the two sides are not symmetric. The worker's side (``capture``, ``write``)
turns what ``solve`` returned into plain data and *refuses* anything that is not exactly a dense strided
``torch.Tensor`` (no subclass, no sparse / meta / quantized tensor, no overlapping view), a plain
list / tuple of them, or a plain number: a refusal travels in the file as a reason, so it becomes an
``incorrect`` with that reason, never a crash. The judge's side (``open_output``) assumes a hostile file:
a regular file only (no symlink, FIFO or device), a capped header, a capped and strictly validated
descriptor (known dtypes, int shapes, byte ranges that tile the data exactly), no code execution
(``json`` only), and the tensor bytes are read only after the descriptor matched the reference's
structure, so a "huge" output costs the judge nothing. Any problem is a :class:`TransportError`.

File layout: ``MAGIC``, the descriptor's length as 8 little-endian bytes, the descriptor (UTF-8 JSON),
then every tensor's bytes, contiguous and in descriptor order.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

MAGIC = b"MKBOUT1\n"
MAX_HEADER = 1 << 20          # descriptor bytes
MAX_NODES = 4096              # tensors, numbers and containers in one output
MAX_DEPTH = 16                # container nesting
MAX_NDIM = 16
MAX_BYTES = 8 << 30           # tensor bytes in one output (the worker's file-size cap is the same)

_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16",
                "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn",
                "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None),
                                                                                             torch.dtype)}
_NAME_OF = {d: n for n, d in DTYPES.items()}


class TransportError(Exception):
    """The output file cannot be read as an output (the reason is for the record)."""


# -- the descriptor -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorDesc:
    dtype: str
    shape: tuple[int, ...]
    device: str                    # the device type the worker's tensor was on ("cuda", "cpu")
    offset: int                    # into the data section
    nbytes: int


@dataclass(frozen=True)
class SeqDesc:
    kind: str                      # "list" | "tuple"
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Scalar:
    value: int | float | bool | None


@dataclass(frozen=True)
class Refused:
    """What the worker would not send, and why (an output the contract does not allow)."""

    reason: str


Node = Union[TensorDesc, SeqDesc, Scalar, Refused]


# -- the worker's side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Captured:
    """``solve``'s output as plain data: contiguous clones of plain tensors, numbers, containers, refusals."""

    tree: Any


def _name(obj: Any) -> str:
    try:
        return str(type(obj).__qualname__)[:80]
    except Exception:  # noqa: BLE001 - a hostile metaclass
        return "object"


def overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when two indices of the view share memory (an expanded or otherwise aliased view)."""
    dims = sorted((st, n) for n, st in zip(shape, strides, strict=True) if n != 1)
    if any(n == 0 for n in shape):
        return False
    need = 1
    for st, n in dims:
        if st < need:
            return True
        need = st * n
    return False


def _refuse_tensor(t: torch.Tensor) -> str | None:
    if type(t) is not torch.Tensor:
        return f"a torch.Tensor subclass ({_name(t)}), not a plain tensor"
    if t.layout != torch.strided or t.is_nested:
        return f"layout {t.layout}{' (nested)' if t.is_nested else ''}: only dense strided tensors are outputs"
    if t.is_quantized:
        return "a quantized tensor: only plain dtypes are outputs"
    if t.device.type == "meta":
        return "a meta tensor holds no values"
    if t.dtype not in _NAME_OF:
        return f"dtype {t.dtype} is not an output dtype"
    if t.dim() > MAX_NDIM:
        return f"{t.dim()} dimensions, over the cap of {MAX_NDIM}"
    if t.numel() * t.element_size() > MAX_BYTES:
        return f"{t.numel() * t.element_size()} bytes, over the cap of {MAX_BYTES}"
    if overlapping(tuple(t.shape), tuple(t.stride())):
        return f"overlapping memory (shape {tuple(t.shape)}, strides {tuple(t.stride())}): an expanded or aliased view"
    return None


def capture(value: Any) -> Captured:
    """Copy ``value`` on the caller's current stream (no synchronization first), refusing what is not an
    output. Never raises for an odd value: the refusal is kept in its place, with the reason."""
    if isinstance(value, Captured):
        return value
    count = [0]

    def walk(v: Any, depth: int) -> Any:
        count[0] += 1
        if count[0] > MAX_NODES:
            return Refused(f"more than {MAX_NODES} values in the output")
        try:
            if isinstance(v, torch.Tensor):
                why = _refuse_tensor(v)
                if why:
                    return Refused(why)
                return v.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
            if type(v) in (list, tuple):
                if depth >= MAX_DEPTH:
                    return Refused(f"containers nested deeper than {MAX_DEPTH}")
                return type(v)(walk(x, depth + 1) for x in v)
            if isinstance(v, (list, tuple)):
                return Refused(f"a {_name(v)} (a subclass of {'list' if isinstance(v, list) else 'tuple'}), "
                               "not a plain list or tuple")
            if v is None or type(v) in (bool, int, float):
                return v
            return Refused(f"a {_name(v)} is not a tensor, list, tuple or number")
        except Exception as e:  # noqa: BLE001 - whatever an odd object raises becomes the reason
            return Refused(f"copying a {_name(v)} raised {_name(e)}")

    tree = walk(value, 0)
    return Captured(Refused(f"more than {MAX_NODES} values in the output") if count[0] > MAX_NODES else tree)


def write(value: Any, path: Path) -> None:
    """Write ``value`` (captured here if it is not yet) in the transport format."""
    tree = capture(value).tree
    blobs: list[torch.Tensor] = []
    offset = [0]

    def desc(v: Any) -> Any:
        if isinstance(v, Refused):
            return {"t": "refused", "reason": v.reason}
        if isinstance(v, torch.Tensor):
            cpu = v.detach().to("cpu").contiguous().reshape(-1)
            nbytes = cpu.numel() * cpu.element_size()
            d = {"t": "tensor", "dtype": _NAME_OF[v.dtype], "shape": list(v.shape), "device": v.device.type,
                 "offset": offset[0], "nbytes": nbytes}
            offset[0] += nbytes
            if nbytes:
                blobs.append(cpu.view(torch.uint8))
            return d
        if isinstance(v, (list, tuple)):
            return {"t": type(v).__name__, "items": [desc(x) for x in v]}
        return {"t": "scalar", "v": v}

    header = json.dumps({"version": 1, "root": desc(tree)}).encode()
    if len(header) > MAX_HEADER:
        header = json.dumps({"version": 1, "root": {"t": "refused", "reason": "the output's descriptor is too large"}}
                            ).encode()
        blobs = []
    with open(path, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        for b in blobs:
            f.write(b.numpy().data)          # (the array's buffer, as memoryview(array) gives it)


# -- the judge's side -----------------------------------------------------------------------------
def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise TransportError(f"bad {what}: {str(v)[:40]}")
    return v


class _Parser:
    def __init__(self) -> None:
        self.nodes = 0
        self.next_offset = 0

    def node(self, d: Any, depth: int) -> Node:  # noqa: C901, PLR0912 - one strict check per descriptor field
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise TransportError(f"more than {MAX_NODES} values")
        if depth > MAX_DEPTH:
            raise TransportError(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(d, dict):
            raise TransportError("a descriptor entry is not an object")
        t = d.get("t")
        if t == "tensor":
            dtype = d.get("dtype")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise TransportError(f"unknown dtype {str(dtype)[:40]}")
            shape = d.get("shape")
            if not isinstance(shape, list) or len(shape) > MAX_NDIM:
                raise TransportError("bad shape")
            dims = tuple(_int(n, "dimension", 0, MAX_BYTES) for n in shape)
            device = d.get("device")
            if device not in ("cuda", "cpu"):
                raise TransportError(f"bad device {str(device)[:40]}")
            itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
            nbytes = _int(d.get("nbytes"), "byte count", 0, MAX_BYTES)
            if math.prod(dims) * itemsize != nbytes:
                raise TransportError(f"byte count {nbytes} does not match shape {dims} of {dtype}")
            if _int(d.get("offset"), "offset", 0, MAX_BYTES) != self.next_offset:
                raise TransportError("tensor bytes out of order or overlapping")
            self.next_offset += nbytes
            if self.next_offset > MAX_BYTES:
                raise TransportError(f"more than {MAX_BYTES} bytes of tensors")
            return TensorDesc(dtype, dims, device, d["offset"], nbytes)
        if t in ("list", "tuple"):
            items = d.get("items")
            if not isinstance(items, list):
                raise TransportError("bad container")
            return SeqDesc(t, tuple(self.node(x, depth + 1) for x in items))
        if t == "scalar":
            v = d.get("v")
            if v is not None and type(v) not in (bool, int, float):
                raise TransportError("bad number")
            if type(v) is int and abs(v) >= 1 << 64:
                raise TransportError("integer out of range")
            return Scalar(v)
        if t == "refused":
            r = d.get("reason")
            return Refused(r[:500] if isinstance(r, str) else "refused by the worker")
        raise TransportError(f"unknown entry {str(t)[:40]}")


class Output:
    """An opened output file: its descriptor (``root``), and ``values()`` to read the tensors."""

    def __init__(self, fd: int, root: Node, data_start: int) -> None:
        self._fd, self.root, self._start = fd, root, data_start

    def _read(self, d: TensorDesc) -> torch.Tensor:
        dtype = DTYPES[d.dtype]
        if d.nbytes == 0:
            return torch.empty(d.shape, dtype=dtype)
        buf = bytearray(d.nbytes)
        view, got = memoryview(buf), 0
        while got < d.nbytes:
            n = os.preadv(self._fd, [view[got:]], self._start + d.offset + got)
            if n <= 0:
                raise TransportError("the output file ended early")
            got += n
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        if dtype == torch.bool:
            return (raw != 0).reshape(d.shape)      # any byte but 0 or 1 would be an undefined bool
        return raw.view(dtype).reshape(d.shape)

    def values(self, node: Node | None = None) -> Any:
        """The output as tensors (CPU), lists, tuples and numbers; a refusal raises TransportError."""
        node = self.root if node is None else node
        if isinstance(node, TensorDesc):
            return self._read(node)
        if isinstance(node, SeqDesc):
            items = [self.values(x) for x in node.items]
            return items if node.kind == "list" else tuple(items)
        if isinstance(node, Scalar):
            return node.value
        raise TransportError(node.reason)


@contextmanager
def open_output(path: Path) -> Iterator[Output]:
    """Open and validate an output file the worker wrote (hostile input): TransportError on any problem."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise TransportError(f"cannot open the output file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TransportError("the output is not a regular file")
        if st.st_nlink != 1:
            raise TransportError("the output file has other names (a hard link)")
        if st.st_size > MAX_BYTES + MAX_HEADER + 64:
            raise TransportError(f"the output file is {st.st_size} bytes, over the cap")
        head = os.pread(fd, len(MAGIC) + 8, 0)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise TransportError("not an output file (bad magic)")
        n = int.from_bytes(head[len(MAGIC):], "little")
        start = len(MAGIC) + 8
        if n > MAX_HEADER or start + n > st.st_size:
            raise TransportError("bad descriptor length")
        raw = os.pread(fd, n, start)
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TransportError(f"unreadable descriptor ({type(e).__name__})") from None
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise TransportError("unknown descriptor version")
        parser = _Parser()
        try:
            root = parser.node(doc.get("root"), 0)
        except RecursionError:
            raise TransportError("descriptor nested too deeply") from None
        if start + n + parser.next_offset != st.st_size:
            raise TransportError(f"the file holds {st.st_size - start - n} data bytes, the descriptor "
                                 f"{parser.next_offset}")
        yield Output(fd, root, start + n)
    finally:
        os.close(fd)
