"""Digest manifests: the expected digests of a model file that records none.

``tools.make_model`` writes the digest of every expert matrix into the file's metadata
(``moestream.expert_digests``); real GGUF files carry nothing of the kind. For those, the
same per-matrix digests (``pipeline.foundation.digest``, what the device kernel computes) are
computed once from the file (``moestream.stages.manifest_build``) and kept here, in the user's cache
(``$XDG_CACHE_HOME/moestream/digests/``, else ``~/.cache/moestream/digests/``), so that
verification never re-reads an expert on the decode path. That directory is used only when
it is the user's own (``moestream.pipeline.foundation.cachedir``: another user who could write it
could plant wrong digests and make a healthy model fail); otherwise a private one is, after
one warning.

A manifest is only as good as its key: the file's resolved path, size, modification and
change times (ns), inode and device, a fingerprint of its expert layout, and the digest
scheme. The key is stored inside the manifest and compared with the file on load; one that
differs (a file rewritten in place, replaced by rename, touched) is ignored, logged once,
and the digests are computed again. A manifest may be partial: ``known`` marks the experts
whose digests it holds, so an interrupted computation is resumed, not restarted.

File format (little-endian): the magic line, a uint32 header length, a JSON header (format
version, key, MoE layers, expert count, CRC-32 of the payload), then the payload: one byte
per (MoE layer, expert), 1 where known, then three uint64 digests per (MoE layer, expert).

The manifest is an input like any other and is read as one, through the cache's checked
open (``moestream.pipeline.foundation.cachedir.read_private``): only the user's own regular file,
writable by nobody else, is read (a link at its path is never followed, a FIFO never waited
on, a manifest another user owns or could write is ignored like a stale one), at most
:func:`manifest_max_bytes` of it (what the model's expert count can fill, plus the header
allowance), and its header through the bounded JSON loader. Anything else is
ignored with one warning and the digests are computed again. It is written atomically
(``moestream.pipeline.foundation.outputs``: temporary file in the same directory, fsync, rename)
without following a link at its path: a link there is replaced, never written through.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from moestream.pipeline.foundation.cachedir import (
    UntrustedPathError,
    read_private,
    trusted_cache_dir,
)
from moestream.pipeline.foundation.errors import ModelFileError
from moestream.pipeline.foundation.inputs import load_json_bounded
from moestream.pipeline.foundation.outputs import write_atomic
from moestream.pipeline.foundation.table import ExpertKey, ExpertTable

__all__ = [
    "DIGEST_SCHEME",
    "DigestManifest",
    "ManifestKey",
    "load_manifest",
    "manifest_max_bytes",
    "manifest_path",
    "user_cache_dir",
]

_log = structlog.get_logger("moestream.manifest")

DIGEST_SCHEME = 1
"""Version of the digest function and its per-matrix order (gate, up, down); a manifest of
another scheme is stale."""
_FORMAT = 1
_MAGIC = b"MOESTREAM-DIGESTS\n"
_HEADER_MAX = 1 << 20  # a header is a few hundred bytes plus the MoE layer list
_CELL_BYTES = 1 + 3 * 8  # per (MoE layer, expert): the known flag, three uint64 digests
_HEADER_DEPTH = 4  # the header nests two levels (the key object in the header object)


def user_cache_dir() -> Path:
    """The user's moestream cache (where the tiny model and the manifests go):
    ``$XDG_CACHE_HOME/moestream``, else ``~/.cache/moestream``, when it is the user's own;
    otherwise a private fallback, after one warning (``cachedir.trusted_cache_dir``).

    Raises:
        OutputError: no private directory can be had at all.
    """
    return trusted_cache_dir()


def manifest_path(model: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """Where the manifest of ``model`` lives: named after the file, tagged with a hash of
    its resolved path (two files of one name in different directories never share one).

    Args:
        model: the model file.
        cache_dir: a cache the caller chose (its ``digests`` folder is neither made nor
            checked); None: the user's trusted cache, whose ``digests`` folder is made
            ``0o700`` and checked (``cachedir.trusted_cache_dir``).

    Raises:
        OutputError: ``cache_dir`` None and no private directory can be had at all.
    """
    resolved = Path(model).resolve()
    tag = hashlib.sha256(os.fsencode(resolved)).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", resolved.name)[:64]
    digests = cache_dir / "digests" if cache_dir is not None else trusted_cache_dir("digests")
    return digests / f"{stem}-{tag}.digests"


def manifest_max_bytes(table: ExpertTable) -> int:
    """The largest manifest ``table``'s file can have: its (MoE layer, expert) cells, plus
    the header allowance. A larger file is no manifest of it and is never read whole."""
    return len(_MAGIC) + 4 + _HEADER_MAX + len(table.moe_layers) * table.n_experts * _CELL_BYTES


def layout_fingerprint(table: ExpertTable) -> str:
    """A hash of where every expert matrix lies in the model: a manifest computed from another
    layout (a file replaced by one of the same size and times) never applies. A model of
    several files adds every file's name and identity: a changed shard changes the key."""
    parts: list[object] = [
        (n, m.n_experts, m.gate_offset, m.up_offset, m.down_offset, m.gate_bytes, m.up_bytes,
         m.down_bytes, m.gate_up_stride)
        for n, m in table.layers.items()
    ]
    parts += [m.expert_offsets for m in table.layers.values() if m.expert_offsets is not None]
    if len(table.files) > 1:
        parts += [(f.path.name, f.base, f.identity) for f in table.files]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class ManifestKey:
    """What must be unchanged for a manifest to describe a file."""

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int
    layout: str
    scheme: int = DIGEST_SCHEME

    @classmethod
    def of(cls, table: ExpertTable) -> ManifestKey:
        """The key of ``table``'s model as the table's own open saw it (never a second look at
        the path: a file renamed over the model since is not what this key describes; the
        readers check every later open against the same identity).

        Raises:
            ModelFileError: the model's path cannot be resolved.
        """
        try:
            path = Path(table.path).resolve()
        except OSError as exc:
            raise ModelFileError(table.path, f"cannot resolve: {exc.strerror or exc}") from exc
        first = table.files[0].identity
        return cls(str(path), table.data_bytes,
                   max(f.identity.mtime_ns for f in table.files),
                   max(f.identity.ctime_ns for f in table.files), first.ino, first.dev,
                   layout_fingerprint(table))

    def differences(self, other: ManifestKey) -> list[str]:
        """Names of the fields that differ from ``other``'s."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


class DigestManifest:
    """The expected (gate, up, down) digests of a file's routed experts, as far as known.

    Used on the event loop's thread only: the builder's workers hand their results back
    to the loop, which calls ``set``.

    Args:
        key: the file it describes.
        moe_layers: the MoE layer indices, ascending (the table's).
        n_experts: experts per MoE layer.
        digests: (MoE layer position, expert, matrix) uint64 values; zeros when None.
        known: (MoE layer position, expert) flags; none known when None.
    """

    def __init__(self, key: ManifestKey, moe_layers: list[int], n_experts: int,
                 digests: npt.NDArray[np.uint64] | None = None,
                 known: npt.NDArray[np.bool_] | None = None) -> None:
        self.key = key
        self.moe_layers = list(moe_layers)
        self.n_experts = n_experts
        shape = (len(self.moe_layers), n_experts)
        self.digests = (np.zeros((*shape, 3), dtype=np.uint64) if digests is None
                        else digests.astype(np.uint64).reshape(*shape, 3))
        self.known = (np.zeros(shape, dtype=bool) if known is None
                      else known.astype(bool).reshape(shape))
        self._positions = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.arrivals: list[ExpertKey] = []
        """Experts whose digests this process learned, in order (the verifier follows it)."""
        self.dirty = False
        """Digests were learned since the manifest was loaded or saved."""

    @classmethod
    def empty(cls, table: ExpertTable, key: ManifestKey | None = None) -> DigestManifest:
        """A manifest of ``table``'s file that knows nothing yet."""
        return cls(key or ManifestKey.of(table), table.moe_layers, table.n_experts)

    def get(self, key: ExpertKey) -> tuple[int, int, int] | None:
        """The digests of ``key``'s three matrices, or None while unknown."""
        pos = self._positions[key[0]]
        if not self.known[pos, key[1]]:
            return None
        row = self.digests[pos, key[1]]
        return (int(row[0]), int(row[1]), int(row[2]))

    def set(self, key: ExpertKey, values: tuple[int, int, int]) -> None:
        """Record the digests of ``key``'s gate, up and down matrices."""
        pos = self._positions[key[0]]
        self.digests[pos, key[1]] = values
        if not self.known[pos, key[1]]:
            self.known[pos, key[1]] = True
            self.arrivals.append(key)
        self.dirty = True

    def missing(self) -> list[ExpertKey]:
        """Experts without digests, layer by layer, in expert order."""
        return [(self.moe_layers[int(pos)], int(e)) for pos, e in np.argwhere(~self.known)]

    @property
    def known_count(self) -> int:
        return int(self.known.sum())

    @property
    def total(self) -> int:
        return int(self.known.size)

    @property
    def complete(self) -> bool:
        return bool(self.known.all())

    # -- file format ------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        payload = self.known.astype(np.uint8).tobytes() + self.digests.astype("<u8").tobytes()
        header = json.dumps({
            "format": _FORMAT, "key": asdict(self.key), "moe_layers": self.moe_layers,
            "n_experts": self.n_experts, "crc32": zlib.crc32(payload),
        }, sort_keys=True).encode()
        return _MAGIC + len(header).to_bytes(4, "little") + header + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> DigestManifest:
        """Parse a stored manifest.

        Raises:
            ValueError: not a manifest, another format version, or damaged (the message
                says which).
        """
        if not data.startswith(_MAGIC):
            raise ValueError("not a moestream digest manifest")
        at = len(_MAGIC)
        size = int.from_bytes(data[at : at + 4], "little")
        if size > _HEADER_MAX or at + 4 + size > len(data):
            raise ValueError(f"header of {size} bytes does not fit the file")
        try:
            header: Any = load_json_bounded(data[at + 4 : at + 4 + size], "header",
                                            max_depth=_HEADER_DEPTH)
            version = header["format"]
            if version == _FORMAT:
                key = ManifestKey(**header["key"])
                layers = [int(n) for n in header["moe_layers"]]
                n_experts = int(header["n_experts"])
                crc = int(header["crc32"])
        # JSON errors (too deep included) are ValueErrors; int() of inf is an OverflowError
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"unreadable header ({type(exc).__name__}: {exc})") from None
        if version != _FORMAT:
            raise ValueError(f"format {version!r}, expected {_FORMAT}")
        payload = data[at + 4 + size :]
        cells = len(layers) * n_experts
        if n_experts < 1 or not layers or len(payload) != cells * _CELL_BYTES:
            raise ValueError(f"payload of {len(payload)} bytes, expected "
                             f"{cells * _CELL_BYTES} for {len(layers)} layers x {n_experts} "
                             "experts")
        if zlib.crc32(payload) != crc:
            raise ValueError("payload checksum mismatch (damaged)")
        known = np.frombuffer(payload[:cells], dtype=np.uint8) != 0
        digests = np.frombuffer(payload[cells:], dtype="<u8").astype(np.uint64)
        return cls(key, layers, n_experts, digests, known)

    def save(self, path: Path) -> None:
        """Write the manifest to ``path`` atomically (its directories made as needed).

        A symbolic link at ``path`` is replaced by the new file, never followed: whatever
        it names (the model itself) is left as it was.

        Raises:
            OutputError: the cache directory cannot take the file, or ``path`` is a
                directory or a special file.
        """
        write_atomic(path, self.to_bytes(), what="digest manifest", make_parents=True,
                     follow_links=False)
        self.dirty = False

    def save_if_current(self, table: ExpertTable, path: Path) -> list[str]:
        """Save to ``path`` unless ``table``'s file changed since the manifest was keyed.

        Returns:
            The key fields that changed (nothing saved), or an empty list (saved).

        Raises:
            OutputError: the cache directory cannot take the file.
            ModelFileError: the model file cannot be stat'ed any more.
        """
        changed = ManifestKey.of(table).differences(self.key)
        if not changed:
            self.save(path)
        return changed


def load_manifest(table: ExpertTable, path: Path | None = None) -> DigestManifest:
    """The stored manifest of ``table``'s file, or an empty one to fill in.

    A stored manifest whose key differs from the file's now (size, times, inode, device,
    path, layout or digest scheme), that is not the user's own, or that cannot be read, is
    ignored with one warning naming why; the caller computes the digests again and saving
    replaces it. Not the user's own: owned by another user, or writable by group or others
    (anyone who could write it could make a healthy model fail verification). Cannot be
    read: a link (never followed), not a regular file (a FIFO is never waited on), larger
    than :func:`manifest_max_bytes` (never read whole), damaged, or a header nested deeper
    than a manifest's.

    Raises:
        ModelFileError: the model file itself cannot be stat'ed.
    """
    path = path or manifest_path(table.path)
    key = ManifestKey.of(table)
    try:
        data = read_private(path, manifest_max_bytes(table))
    except FileNotFoundError:
        return DigestManifest.empty(table, key)
    except UntrustedPathError as exc:
        _log.warning("digest_manifest_untrusted", path=str(path), reason=exc.strerror,
                     action="ignored; digests computed again")
        return DigestManifest.empty(table, key)
    except OSError as exc:
        _log.warning("digest_manifest_unreadable", path=str(path), reason=str(exc),
                     action="digests computed again")
        return DigestManifest.empty(table, key)
    try:
        stored = DigestManifest.from_bytes(data)
    except ValueError as exc:
        _log.warning("digest_manifest_unreadable", path=str(path), reason=str(exc),
                     action="digests computed again")
        return DigestManifest.empty(table, key)
    if stored.key != key or stored.moe_layers != table.moe_layers \
            or stored.n_experts != table.n_experts:
        changed = key.differences(stored.key) or ["expert table"]
        _log.warning("digest_manifest_stale", path=str(path), model=str(table.path),
                     changed=changed, action="ignored; digests computed again")
        return DigestManifest.empty(table, key)
    return stored
