"""Routing trace files read: the ``.npz`` and ``.jsonl`` forms, each within a trace's bounds.

Nothing is allocated for what a file merely claims: an ``.npz`` member's ``.npy`` header is
checked against its size in the zip directory and against the most entries a trace may hold
(``entries``, which ``pipeline.foundation.trace`` passes: its ``MAX_TRACE_ENTRIES``) before
it is read, and a zip directory larger than a trace's is refused before ``zipfile`` reads
it; a ``.jsonl`` trace's lines are read with a length cap, and its rows refused once past the
bound. What the arrays hold (ids in range, weights) is checked by
``pipeline.foundation.trace``'s ``Trace``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import TraceError
from moestream.pipeline.foundation.inputs import JSONDepthError, load_json_bounded

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "Arrays", "read_jsonl", "read_npz"]

TRACE_FORMAT = "moestream-trace"
"""The ``format`` value both file forms carry."""

TRACE_VERSION = 1
"""The only format version this module reads and writes."""

_MAX_ITEM_BYTES = 8
"""The widest element an .npz trace's ``experts`` or ``weights`` may declare (int64)."""

_MAX_SCALAR_BYTES = 4096
"""The largest 0-d member of an .npz trace (``format``, ``version``, ``n_experts``,
``preset``)."""

_MAX_DIRECTORY_BYTES = 1 << 16
"""The largest zip directory of an .npz trace; ``np.savez`` writes six entries, about
400 bytes. ``zipfile`` reads the whole directory into memory, so it is checked first."""

_READ_BYTES = 1 << 20
"""An .npz member is read into its array in pieces of this size."""

_EOCD = struct.Struct("<4s4H2LH")
"""The zip end-of-central-directory record (without its comment)."""

_MAX_HEADER_CHARS = 1 << 16
"""The longest first line of a ``.jsonl`` trace."""

_ROW_CHARS_BASE, _ROW_CHARS_PER_ENTRY = 256, 64
"""A ``.jsonl`` row's length cap: the base plus this much per (layer, choice) entry (an id
and a float32 weight take at most about 35 characters)."""



Arrays = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], int, str]
"""A trace file's contents: expert ids, weights, the expert count and the preset."""


def _as_ids(values: Any, source: str) -> npt.NDArray[np.int32]:
    """Expert ids as int32, refusing non-integers and values int32 cannot hold."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise TraceError(f"{source}: expert ids must be integers, got {array.dtype}")
    if array.size and (
        array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max
    ):
        raise TraceError(f"{source}: expert id {array.max()} does not fit in int32")
    return array.astype(np.int32)


def _as_weights(values: Any, source: str) -> npt.NDArray[np.float32]:
    array = np.asarray(values)
    if array.dtype.kind not in "fiu":
        raise TraceError(f"{source}: weights must be numbers, got {array.dtype}")
    return array.astype(np.float32)


def _check_directory(archive: IO[bytes], source: str, entries: int) -> None:
    """Refuse an archive whose zip directory is larger than a trace's, before ``zipfile``
    reads all of it into memory."""
    size = archive.seek(0, os.SEEK_END)
    tail = min(size, _EOCD.size + 0xFFFF)  # the record, then a comment of up to 64 KiB
    archive.seek(size - tail)
    data = archive.read(tail)
    at = data.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(data):
        raise TraceError(f"{source}: truncated or corrupt .npz trace (no zip directory)")
    members, directory_bytes, directory_offset = _EOCD.unpack_from(data, at)[4:7]
    if members == 0xFFFF or 0xFFFFFFFF in (directory_bytes, directory_offset):
        raise TraceError(f"{source}: a zip64 archive, larger than any trace (at most "
                         f"{entries} entries)")
    if directory_bytes > _MAX_DIRECTORY_BYTES:
        raise TraceError(f"{source}: its zip directory is {directory_bytes} bytes, a trace's "
                         f"is under {_MAX_DIRECTORY_BYTES}")
    archive.seek(0)


def _member(archive: zipfile.ZipFile, name: str, source: str, *, scalar_kind: str = "",
            entries: int = 0) -> npt.NDArray[Any]:
    """One array of the archive, read only once its ``.npy`` header agrees with the member's
    size and is within bounds: nothing is allocated for what a header merely claims.

    Args:
        scalar_kind: for a 0-d member, the dtype kinds it may have; empty for ``experts``
            and ``weights`` (at most ``entries`` elements of at most 8 bytes).
        entries: the most entries ``experts`` or ``weights`` may hold.
    """
    try:
        info = archive.getinfo(f"{name}.npy")
    except KeyError:
        raise TraceError(f"{source}: archive lacks '{name}'") from None
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise ValueError(f"'{name}' is .npy format {version}, not 1.0 or 2.0")
        if dtype.hasobject:
            raise ValueError(f"'{name}' holds Python objects, which are never unpickled")
        count = math.prod(shape)
        data_bytes = count * dtype.itemsize
        held = info.file_size - member.tell()
        if data_bytes != held:
            raise TraceError(f"{source}: '{name}' declares shape {shape} of {dtype} "
                             f"({data_bytes} bytes), the archive holds {held} bytes")
        if scalar_kind:
            if shape != () or dtype.kind not in scalar_kind or data_bytes > _MAX_SCALAR_BYTES:
                raise TraceError(f"{source}: '{name}' must be a scalar of kind {scalar_kind!r}")
        elif count > entries or dtype.itemsize > _MAX_ITEM_BYTES:
            raise TraceError(f"{source}: '{name}' declares shape {shape} of {dtype}, more than "
                             f"the {entries} entries of at most {_MAX_ITEM_BYTES} "
                             "bytes a trace holds")
        array = np.empty(count, dtype=dtype)
        raw = array.view(np.uint8)
        done = 0
        while done < data_bytes:
            piece = member.read(min(data_bytes - done, _READ_BYTES))
            if not piece:
                raise TraceError(f"{source}: truncated or corrupt .npz trace ('{name}' ends "
                                 f"after {done} of {data_bytes} bytes)")
            raw[done : done + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            done += len(piece)
    return array.reshape(shape, order="F" if fortran else "C")


def read_npz(path: str | os.PathLike[str], source: str, entries: int) -> Arrays:
    """The arrays of an ``.npz`` trace of at most ``entries`` entries, each member checked
    before it is read."""
    try:
        with open(path, "rb") as handle:
            _check_directory(handle, source, entries)
            with zipfile.ZipFile(handle) as archive:
                fmt = _member(archive, "format", source, scalar_kind="U").item()
                version = _member(archive, "version", source, scalar_kind="iu").item()
                if fmt != TRACE_FORMAT or version != TRACE_VERSION:
                    raise TraceError(
                        f"{source}: not a {TRACE_FORMAT} version {TRACE_VERSION} archive "
                        f"(format {fmt!r}, version {version!r})"
                    )
                n_experts = int(_member(archive, "n_experts", source, scalar_kind="iu").item())
                preset = str(_member(archive, "preset", source, scalar_kind="U").item())
                experts = _as_ids(_member(archive, "experts", source, entries=entries), source)
                weights = _as_weights(_member(archive, "weights", source, entries=entries),
                                      source)
    except TraceError:
        raise
    except ValueError as exc:
        # object arrays, and corrupt or oversized array headers (numpy.lib.format)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(f"{source}: unreadable .npz trace: {first}") from exc
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise TraceError(f"{source}: truncated or corrupt .npz trace ({exc})") from exc
    return experts, weights, n_experts, preset


def _line(lines: IO[str], limit: int, where: str) -> str:
    """The next line, refused if longer than ``limit`` characters (never read whole)."""
    line = lines.readline(limit + 1)
    if len(line) > limit and not line.endswith("\n"):
        raise TraceError(f"{where}: line longer than {limit} characters")
    return line


def read_jsonl(path: str | os.PathLike[str], source: str, entries: int) -> Arrays:
    """The arrays of a ``.jsonl`` trace of at most ``entries`` entries, refused as soon as
    its rows pass the bound."""
    experts_rows: list[npt.NDArray[np.int32]] = []
    weights_rows: list[npt.NDArray[np.float32]] = []
    try:
        with open(path, encoding="utf-8") as lines:
            header = _header(_line(lines, _MAX_HEADER_CHARS, f"{source}:1"), source)
            n_layers, top_k = header["n_layers"], header["top_k"]
            per_token = n_layers * top_k
            if per_token > entries:
                raise TraceError(f"{source}: header declares {n_layers} layers x top-{top_k}, "
                                 f"more than the {entries} entries a trace holds")
            row_chars = _ROW_CHARS_BASE + per_token * _ROW_CHARS_PER_ENTRY
            number = 1
            while line := _line(lines, row_chars, f"{source}:{number + 1}"):
                number += 1
                if not line.strip():
                    continue
                token = len(experts_rows)
                if (token + 1) * per_token > entries:
                    raise TraceError(f"{source}:{number}: more than the {entries} "
                                     f"entries a trace holds ({token} tokens)")
                row = _json_object(line, f"{source}:{number}")
                if row.get("token") != token:
                    raise TraceError(
                        f"{source}:{number}: expected token {token}, got {row.get('token')!r}"
                    )
                for name in ("experts", "weights"):
                    value: Any = row.get(name)
                    shape = np.shape(value)
                    if shape != (n_layers, top_k):
                        raise TraceError(
                            f"{source}:{number}: '{name}' has shape {shape}, "
                            f"the header says ({n_layers}, {top_k})"
                        )
                experts_rows.append(_as_ids(row["experts"], f"{source}:{number}"))
                weights_rows.append(_as_weights(row["weights"], f"{source}:{number}"))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not UTF-8 text at byte {exc.start}") from exc
    except ValueError as exc:  # np.shape of a ragged list
        raise TraceError(f"{source}: ragged rows ({str(exc).splitlines()[0]})") from exc
    except OSError as exc:
        raise TraceError(f"{source}: cannot read trace: {exc.strerror or exc}") from exc
    if not experts_rows:
        raise TraceError(f"{source}: header but no tokens")
    return np.stack(experts_rows), np.stack(weights_rows), header["n_experts"], header["preset"]


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        value = load_json_bounded(line, where)
    except JSONDepthError as exc:
        raise TraceError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg}); truncated file?") from exc
    if not isinstance(value, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _header(line: str, source: str) -> dict[str, Any]:
    if not line.strip():
        raise TraceError(f"{source}: empty file, no trace header")
    header = _json_object(line, f"{source}:1")
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(
            f"{source}: header format is {header.get('format')!r}, not {TRACE_FORMAT!r}"
        )
    if header.get("version") != TRACE_VERSION:
        raise TraceError(
            f"{source}: unsupported trace version {header.get('version')!r} "
            f"(this reader knows {TRACE_VERSION})"
        )
    for name in ("n_layers", "n_experts", "top_k"):
        value = header.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TraceError(f"{source}: header '{name}' must be a positive integer, got {value!r}")
    if not isinstance(header.get("preset"), str):
        raise TraceError(f"{source}: header 'preset' must be a string")
    return header
