"""A safetensors shard's header, read and checked as safetensors' own reader checks it.

A shard is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape,
data offsets relative to the data start), then the data; each tensor is one contiguous
range. Only the header is read here.

A hostile file is refused in one line before anything past its header is trusted, and a
shard is refused whenever safetensors' own reader (``safe_open``, 0.8) refuses it: a header
over 100,000,000 bytes, not UTF-8 or with a byte order mark, not a JSON object, with a
``__metadata__`` that is not an object of strings or a name with an unpaired surrogate; a
tensor of a dtype safetensors does not know, whose shape or size overflows 64 bits, whose
bytes are not its dtype x shape (sub-byte dtypes ending mid-byte included); tensors that
overlap, leave a gap in the data or do not cover it to its end. A name twice in a header
(which safetensors would read as its last entry) is refused too.

What headers may cost is bounded per model, not per shard (``Budget``: the limits are the
expert table's, ``pipeline.foundation.safetensors_table``). A header is parsed once, each
entry made a small tuple as the JSON parser builds it (never a dict per tensor kept), and
its tensors are sorted once, by offset, for both the layout check and the table's order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeAlias

from moestream.pipeline.foundation.errors import ModelFileError
from moestream.pipeline.foundation.files import ModelFile
from moestream.pipeline.foundation.inputs import JSONDepthError, load_json_bounded, read_input

__all__ = ["HEADER_LIMIT_BYTES", "SAFETENSORS_DTYPE_BITS", "Budget", "Entry", "EntryHook",
           "Shard", "check_contiguous", "check_metadata", "check_text", "entry",
           "header_length", "parse_object", "read_header", "read_json", "refuse_duplicate",
           "short"]

HEADER_LIMIT_BYTES = 100_000_000
"""The largest shard header read (safetensors' own limit)."""
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64}
"""Every dtype safetensors 0.8 reads, with its bits an element; a header naming another is
refused."""
_DTYPE_NAMES = {name: name for name in SAFETENSORS_DTYPE_BITS}
"""Each dtype's one string: an entry keeps it, not the copy its header parsed."""
_U64 = 1 << 64  # safetensors reads shapes and offsets as usize: nothing reaches 2**64
Entry: TypeAlias = tuple[int, int, str, tuple[int, ...]]
"""One header entry, checked: (begin, end, dtype, shape), offsets relative to the data."""
_SPAN = itemgetter(1)  # of a (name, entry) pair: sorts by (begin, end), as safetensors does


@dataclass(frozen=True, slots=True)
class Shard:
    """A shard's tensors as its header declares them, in data order."""

    file: ModelFile
    data_start: int  # where its data begins in the file: after the length and the header
    entries: list[tuple[str, Entry]]


def short(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters: a value echoed from a file (a
    4000-digit number, a shape of 10,000 axes) never makes a long message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

def read_json(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object from a small regular file, refused in one line when it is not one."""
    try:
        data = read_input(path, limit)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    return parse_object(path, data, "file")


def refuse_duplicate(path: Path, pairs: list[tuple[str, Any]], what: str) -> None:
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise ModelFileError(path, f"its {what} names {short(k, 120)} twice")
        seen.add(k)


def parse_object(path: Path, data: bytes, what: str,
                  hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> dict[str, Any]:
    """``data`` as a JSON object without duplicate keys, its nesting bounded; refused in one
    line otherwise. The bytes must be UTF-8, with no byte order mark: ``json.loads`` would
    guess UTF-16 or skip a mark where safetensors and transformers refuse the file. ``hook``
    replaces the duplicate-refusing ``object_pairs_hook`` (and must refuse them too)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            refuse_duplicate(path, pairs, what)
        return out

    if data.startswith(b"\xef\xbb\xbf"):
        raise ModelFileError(path, f"its {what} starts with a UTF-8 byte order mark "
                                   f"(safetensors and transformers refuse one)")
    if b"\x00" in data[:4]:  # json.loads would read it as UTF-16 or UTF-32; no JSON has NULs
        raise ModelFileError(path, f"its {what} is not JSON (NUL bytes: UTF-16 or UTF-32?)")
    try:
        data.decode("utf-8")  # strict: json.loads lets encoded surrogates pass
        doc = load_json_bounded(data, f"its {what}", object_pairs_hook=hook or no_duplicates)
    except JSONDepthError as exc:
        raise ModelFileError(path, f"its {what} nests too deeply ({exc})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ModelFileError(path, f"its {what} is not JSON ({str(exc)[:80]})") from None
    if isinstance(doc, tuple):  # the hook made the whole header one entry
        raise ModelFileError(path, f"its {what} is one tensor entry, not an object of them")
    if not isinstance(doc, dict):
        raise ModelFileError(path, f"its {what} is not a JSON object")
    return doc

class Budget:
    """What the model's headers may still cost: bytes and tensors, over all its shards, up
    to ``header_limit`` bytes and ``tensor_limit`` tensors."""

    __slots__ = ("header_bytes", "header_limit", "tensor_limit", "tensors")

    def __init__(self, header_limit: int, tensor_limit: int) -> None:
        self.header_limit, self.tensor_limit = header_limit, tensor_limit
        self.header_bytes = 0
        self.tensors = 0

    def take_header(self, path: Path, nbytes: int) -> int:
        """Count a header of ``nbytes`` before it is read (and return it); refuse one past
        the limit."""
        self.header_bytes += nbytes
        if self.header_bytes > self.header_limit:
            raise ModelFileError(path, f"brings the checkpoint's headers to "
                                       f"{self.header_bytes} bytes, over the "
                                       f"{self.header_limit}-byte limit for a model")
        return nbytes


class EntryHook:
    """The JSON parser's ``object_pairs_hook`` for a shard header: refuses duplicate keys,
    turns each object shaped like a tensor entry (a ``data_offsets`` array) into its checked
    ``Entry`` as soon as it is parsed, and counts them against the model's tensor limit,
    stopping the parse once past it. A malformed entry stays a dict, refused by name once
    the header is parsed."""

    __slots__ = ("budget", "data_bytes", "path")

    def __init__(self, path: Path, data_bytes: int, budget: Budget) -> None:
        self.path, self.data_bytes, self.budget = path, data_bytes, budget

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any] | Entry:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            refuse_duplicate(self.path, pairs, "header")
        if obj.get("data_offsets").__class__ is not list:
            return obj
        self.budget.tensors += 1
        if self.budget.tensors > self.budget.tensor_limit:
            raise ModelFileError(self.path, f"brings the checkpoint to more than "
                                            f"{self.budget.tensor_limit} tensors, the limit "
                                            f"for a model")
        checked = entry(obj, self.data_bytes)
        return obj if isinstance(checked, str) else checked


def header_length(path: Path, fd: int, file: ModelFile) -> int:
    """The length a shard declares for its header, refused past its end or the limit."""
    size = file.nbytes
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ModelFileError(path, f"is {size} bytes, too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if n > HEADER_LIMIT_BYTES:
        raise ModelFileError(path, f"declares a {n}-byte header, over the "
                                   f"{HEADER_LIMIT_BYTES}-byte limit")
    if 8 + n > size:
        raise ModelFileError(path, f"declares a {n}-byte header past its end ({size} bytes)")
    return n


def read_header(path: Path, fd: int, file: ModelFile, n: int, budget: Budget) -> Shard:
    """Every tensor the shard's header of ``n`` bytes declares, checked against the file as
    safetensors checks it (see the module docstring), in data order."""
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise ModelFileError(path, "was cut short while its header was read")
    data_bytes = file.nbytes - 8 - n
    header = parse_object(path, raw, "header", EntryHook(path, data_bytes, budget))
    del raw
    entries: list[tuple[str, Entry]] = []
    for name, value in header.items():
        if name == "__metadata__":
            check_metadata(path, value)
            continue
        if value.__class__ is not tuple:  # the hook left it a dict, or it is no object
            problem = entry(value, data_bytes) if isinstance(value, dict) else None
            raise ModelFileError(path, f"header entry {short(name, 120)} "
                                       f"{problem or 'is not an object'}")
        if not name.isascii():
            check_text(path, name)
        entries.append((name, value))
    del header
    entries.sort(key=_SPAN)
    check_contiguous(path, entries, data_bytes)
    return Shard(file, 8 + n, entries)


def entry(obj: dict[str, Any], data_bytes: int) -> Entry | str:
    """One header entry as an ``Entry``, or what is wrong with it in words (its checks are
    safetensors', and that it lies within the shard's ``data_bytes``)."""
    dtype, shape, offsets = obj.get("dtype"), obj.get("shape"), obj.get("data_offsets")
    if dtype.__class__ is not str or shape.__class__ is not list or offsets.__class__ is not list:
        return "lacks dtype, shape or data_offsets"
    bits = SAFETENSORS_DTYPE_BITS.get(dtype)
    if bits is None:
        return f"has dtype {short(dtype)}, which safetensors does not know"
    if len(offsets) != 2 or offsets[0].__class__ is not int or offsets[1].__class__ is not int:
        return "has a bad shape or data_offsets"
    begin, end = offsets
    elements = 1
    for n in shape:
        if n.__class__ is not int or not 0 <= n < _U64:
            return "has a bad shape or data_offsets"
        elements *= n  # checked step by step, left to right, as safetensors multiplies
        if elements >= _U64:
            return f"has shape {short(shape)}: its element count overflows 64 bits"
    if not 0 <= begin <= end:
        return f"has data_offsets {short(offsets)}, not a begin and an end after it"
    if end > data_bytes:
        return f"lies at bytes {begin}..{end}, outside its {data_bytes} bytes of data"
    nbits = elements * bits
    if nbits >= _U64:
        return f"is {dtype} {short(shape)}: its size in bits overflows 64 bits"
    if nbits % 8:
        return f"is {dtype} {short(shape)}: {nbits} bits, which end mid-byte"
    if nbits // 8 != end - begin:
        return (f"is {dtype} {short(shape)} ({nbits // 8} bytes) but spans {end - begin}")
    return begin, end, _DTYPE_NAMES[dtype], tuple(shape)


def check_metadata(path: Path, value: object) -> None:
    """``__metadata__``: absent (null) or an object of strings, as safetensors reads it."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ModelFileError(path, "its header's __metadata__ is not an object of strings")
    for k, v in value.items():
        check_text(path, k)
        check_text(path, v)


def check_text(path: Path, text: str) -> None:
    """Refuse a name with a lone surrogate (an escape ``\\ud800`` unpaired): not Unicode text,
    refused by safetensors, and a string no UTF-8 log or terminal could print."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ModelFileError(path, f"its header names {short(text, 120)}, with an unpaired "
                                   f"surrogate escape (not text)") from None


def check_contiguous(path: Path, entries: list[tuple[str, Entry]], data_bytes: int) -> None:
    """The tensors, sorted by their data offsets, lie end to end from the data's first byte
    to its last: safetensors refuses an overlap, a gap or bytes after the last tensor."""
    at, before = 0, None
    for name, (begin, end, _, _) in entries:
        if begin != at:
            if before is None:
                raise ModelFileError(path, f"its data starts with {begin} bytes that are no "
                                           f"tensor's, before {short(name, 120)}")
            if begin < at:
                raise ModelFileError(path, f"tensors {short(before, 120)} and "
                                           f"{short(name, 120)} overlap")
            raise ModelFileError(path, f"its data has a gap of {begin - at} bytes (no tensor's) "
                                       f"between {short(before, 120)} and {short(name, 120)}")
        at, before = end, name
    if at != data_bytes:
        raise ModelFileError(path, f"its tensors cover {at} of its {data_bytes} bytes of data; "
                                   f"the rest is no tensor's")
