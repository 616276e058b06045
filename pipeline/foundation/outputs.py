"""Output files: checked before any work, and only ever regular files.

Every file moestream writes goes through here: run logs, recorded traces, CSVs, plots,
models, benchmark results. The rules, checked by :func:`check_output` when a command starts
(before the model is opened or any work is done) and again when the file is written:

- a symbolic link is followed: the file it names is written, the link itself stays
  (user-named outputs); files moestream names itself in its own cache (the digest manifest)
  are written atomically with ``follow_links=False``: whatever entry is at that path (a
  link, a FIFO) is replaced by the rename, never opened nor written through, so a link
  planted there cannot make a run overwrite its target (only a directory is refused);
- the target is absent or a regular file: a directory, a character or block device
  (``/dev/null``, ``/dev/full``), a FIFO or a socket is refused, never replaced nor
  written into;
- its directory exists (with ``make_parents``: its nearest existing ancestor is a directory)
  and accepts a new file, which is probed by creating and removing an empty temporary file:
  that also catches read-only file systems, ``/proc`` and ``/sys``;
- a file written in place (the run log) must open for writing, and is locked
  (``flock``) while one process writes it: a second writer is refused.

Atomic outputs (:func:`atomic_path`, :func:`atomic_output`, :func:`write_atomic`) appear
under their name only once complete: temporary file in the target's directory, fsync,
rename, fsync of the directory; on any error the temporary file is removed and the target
is untouched. Every refusal or failed write is an :class:`~pipeline.foundation.errors.OutputError`
(exit 2) that names the option and the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from moestream.pipeline.foundation.errors import OutputError
from moestream.pipeline.foundation.inputs import file_kind

__all__ = [
    "atomic_output",
    "atomic_path",
    "check_not_input",
    "check_output",
    "check_output_dir",
    "fsync_path",
    "open_exclusive",
    "write_atomic",
]

PathLike = str | os.PathLike[str]


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _refuse_kind(shown: Path, target: Path, mode: int, what: str | None) -> None:
    """Refuse a target that exists and is not a regular file."""
    via = f" (a link to {target})" if target != Path(os.path.abspath(shown)) else ""
    if stat.S_ISDIR(mode):
        raise OutputError(shown, f"cannot write: is a directory{via}", what=what)
    kind = file_kind(mode)
    if kind is not None:
        raise OutputError(shown, f"cannot write: is {kind}{via}; outputs are written only to "
                          "regular files (leave the option out to write nothing)", what=what)


def _stat_target(shown: Path, target: Path, what: str | None, *,
                 follow_links: bool = True) -> os.stat_result | None:
    """The target's status, None when absent (a missing directory is reported later).

    With ``follow_links`` False the entry at ``target`` is not followed nor opened: a
    rename replaces it, so anything but a directory (a link, a FIFO) is accepted.
    """
    try:
        st = os.stat(target) if follow_links else os.lstat(target)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise OutputError(shown, f"cannot write: {_reason(exc)}", what=what) from exc
    if not follow_links and not stat.S_ISDIR(st.st_mode):
        return st
    _refuse_kind(shown, target, st.st_mode, what)
    return st


def _resolve(shown: Path, follow_links: bool) -> Path:
    """The file to write: ``shown`` with links resolved, or (not ``follow_links``) with
    links resolved in its directory only."""
    if follow_links:
        return Path(os.path.realpath(shown))
    absolute = Path(os.path.abspath(shown))
    return Path(os.path.realpath(absolute.parent)) / absolute.name


def _existing_dir(shown: Path, directory: Path, what: str | None, *, ancestors: bool) -> Path:
    """``directory`` (or, with ``ancestors``, its nearest existing ancestor), checked to be a
    directory that accepts a new file."""
    for candidate in (directory, *directory.parents) if ancestors else (directory,):
        try:
            st = os.stat(candidate)
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            continue  # a component above is a file: found when the walk reaches it
        except OSError as exc:
            raise OutputError(shown, f"cannot write: {candidate}: {_reason(exc)}",
                              what=what) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise OutputError(shown, f"cannot write: {candidate} is not a directory",
                              what=what)
        _probe(shown, candidate, what)
        return candidate
    raise OutputError(shown, f"cannot write: directory {directory} does not exist", what=what)


def _probe(shown: Path, directory: Path, what: str | None) -> None:
    """Create and remove an empty file: permissions alone say nothing for root, and nothing
    for read-only mounts or pseudo file systems."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".moestream-probe-")
    except OSError as exc:
        raise OutputError(shown, f"cannot write: cannot create a file in {directory} "
                          f"({_reason(exc)})", what=what) from exc
    os.close(fd)
    os.unlink(name)


def check_output(
    path: PathLike, *, what: str | None = None, make_parents: bool = False,
    in_place: bool = False, follow_links: bool = True,
) -> Path:
    """Check that an output can be written at ``path`` before any work; returns the file to
    write (symbolic links resolved; with ``follow_links`` False, only those of its
    directory).

    Args:
        path: the output as the user gave it.
        what: the option or argument that named it (``--log``), for the message.
        make_parents: missing directories will be made: check the nearest existing one.
        in_place: the file will be written in place (not renamed over): an existing one must
            open for writing and not be locked by another writer.
        follow_links: False: the entry at ``path`` (a link, a FIFO; not a directory) is to
            be replaced (renamed over), never followed nor opened; only with atomic writes,
            never with ``in_place``.

    Raises:
        OutputError: the path is a directory or a special file, its directory is missing or
            refuses new files, or (``in_place``) it cannot be opened or is in use.
    """
    if in_place and not follow_links:
        raise ValueError("in_place writes follow links: a rename is what replaces one")
    shown = Path(path)
    target = _resolve(shown, follow_links)
    st = _stat_target(shown, target, what, follow_links=follow_links)
    _existing_dir(shown, target.parent, what, ancestors=make_parents)
    if in_place and st is not None:
        os.close(_open_locked(shown, target, what, truncate=False))
    return target


def check_output_dir(path: PathLike, *, what: str | None = None, create: bool = False) -> Path:
    """Check that files can be written in directory ``path`` (made with ``create``).

    Raises:
        OutputError: ``path`` is not a directory, or neither it nor its nearest existing
            ancestor accepts a new file, or it cannot be made.
    """
    shown = Path(path)
    directory = Path(os.path.realpath(shown))
    _existing_dir(shown, directory, what, ancestors=True)
    if create:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(shown, f"cannot make the directory ({_reason(exc)})",
                              what=what) from exc
    return directory


def check_not_input(path: PathLike, inputs: Mapping[str, PathLike | None], *,
                    what: str | None = None) -> None:
    """Refuse an output that is the same file as one of ``inputs`` (option -> path)."""
    for option, source in inputs.items():
        if source is None:
            continue
        with contextlib.suppress(OSError):  # either one absent: they cannot be the same
            if os.path.samefile(path, source):
                raise OutputError(path, f"cannot write: it is the {option} file", what=what)


def _open_locked(shown: Path, target: Path, what: str | None, *, truncate: bool) -> int:
    """Open ``target`` for writing, locked; truncated only once the lock is held."""
    # O_NONBLOCK: a FIFO swapped in since the check fails at once instead of waiting for
    # a reader (regular files ignore the flag)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(target, flags, 0o666)
    except OSError as exc:
        raise OutputError(shown, f"cannot write: {_reason(exc)}", what=what) from exc
    try:
        _refuse_kind(shown, target, os.fstat(fd).st_mode, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise OutputError(shown, "cannot write: in use by another run (locked); give each "
                              "run its own file", what=what) from exc
        if truncate:
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except OSError as exc:
        os.close(fd)
        raise OutputError(shown, f"cannot write: {_reason(exc)}", what=what) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_exclusive(path: PathLike, *, what: str | None = None) -> int:
    """Open an output written in place (a log) and lock it; returns the descriptor.

    The file is checked as :func:`check_output` does, created if absent, locked with
    ``flock(LOCK_EX | LOCK_NB)`` and only then truncated, so a second writer is refused
    without touching what the first one wrote. The lock goes with the descriptor.

    Raises:
        OutputError: the path cannot be written, or another process holds its lock.
    """
    shown = Path(path)
    target = check_output(shown, what=what)
    return _open_locked(shown, target, what, truncate=True)


def fsync_path(path: Path) -> None:
    """``fsync`` a file or a directory by path (a directory: its entries are durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(
    path: PathLike, *, what: str | None = None, make_parents: bool = False,
    follow_links: bool = True,
) -> Iterator[Path]:
    """A temporary path to write; it replaces ``path`` when the block ends without error.

    ``path`` is checked first (:func:`check_output`); a symbolic link is followed, so the
    file it names is replaced and the link stays; with ``follow_links`` False the link
    itself is replaced and what it named is left untouched. Errors of the block itself
    propagate as they are, after the temporary file is removed; the helper's own steps
    (temporary file, fsync, rename) raise :class:`OutputError`.
    """
    shown = Path(path)
    target = check_output(shown, what=what, make_parents=make_parents,
                          follow_links=follow_links)
    try:
        if make_parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                    suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise OutputError(shown, f"cannot write: {_reason(exc)}", what=what) from exc
    tmp = Path(name)
    try:
        yield tmp
        # it may have changed since the check
        _stat_target(shown, target, what, follow_links=follow_links)
        try:
            fsync_path(tmp)
            os.replace(tmp, target)
            fsync_path(target.parent)
        except OSError as exc:
            raise OutputError(shown, f"cannot write: {_reason(exc)}", what=what) from exc
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(
    path: PathLike, *, what: str | None = None, make_parents: bool = False,
    follow_links: bool = True,
) -> Iterator[BinaryIO]:
    """A binary file to write; it replaces ``path`` when the block ends without error.

    As :func:`atomic_path`; an ``OSError`` raised in the block (writing the file) becomes an
    :class:`OutputError` naming the path.
    """
    with atomic_path(path, what=what, make_parents=make_parents,
                     follow_links=follow_links) as tmp:
        try:
            with tmp.open("wb") as out:
                yield out
        except OSError as exc:
            raise OutputError(path, f"cannot write: {_reason(exc)}", what=what) from exc


def write_atomic(
    path: PathLike, data: bytes | str, *, what: str | None = None, make_parents: bool = False,
    follow_links: bool = True,
) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (``follow_links``: as
    :func:`atomic_path`)."""
    with atomic_output(path, what=what, make_parents=make_parents,
                       follow_links=follow_links) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
