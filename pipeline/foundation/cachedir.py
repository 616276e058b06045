"""The user cache moestream trusts: a directory, and files in it, that are the user's own.

What moestream reads back from its cache decides what it serves: the default tiny model is
found there by name, and a digest manifest there says what every expert of a model must
hash to. A directory another user can write (``XDG_CACHE_HOME`` on a 1777 directory, a
group-writable home) would let that user plant a model that is served as "verified", or a
manifest of wrong digests that makes a healthy model fail verification. So the cache is
trusted only on the rules of ssh's ``StrictModes`` and pip's cache:

- the ``moestream`` directory and every folder moestream uses in it (``digests/``) belong to
  the current user (``os.geteuid()``) and are writable by nobody else (no ``S_IWGRP``,
  no ``S_IWOTH``);
- every directory above it (``XDG_CACHE_HOME``, ``~``, ``/``) belongs to the user or to
  root, and is writable by nobody else unless it has the sticky bit (``/tmp``: others may
  create entries there, but never rename or remove ours); checked on the path with its
  links resolved, without following a link at any step, so nobody but the user or root can
  move what the checks saw;
- every file read from it is opened by :func:`open_private`: ``O_NOFOLLOW`` (a link at its
  path is refused, never followed), ``fstat`` of the descriptor: a regular file, the
  user's, writable by nobody else.

Directories moestream creates are created ``0o700``. A configured directory that fails
these rules, or cannot be made, is never used: one warning names the directory and why,
and :func:`trusted_cache_dir` answers a private fallback instead (``moestream-<uid>`` in the
system's temporary directory, checked by the same rules, else a fresh ``mkdtemp``). The
fallback chosen for a directory is kept for the process, so the warning comes once.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tempfile
from pathlib import Path

import structlog

from moestream.pipeline.foundation.errors import OutputError
from moestream.pipeline.foundation.inputs import NotRegularFileError, file_kind, read_input

__all__ = [
    "UntrustedPathError",
    "configured_cache_dir",
    "forget_fallbacks",
    "open_private",
    "read_private",
    "trusted_cache_dir",
]

_log = structlog.get_logger("moestream.cachedir")

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

_FALLBACKS: dict[Path, Path] = {}
"""Configured directory (with its parts) -> the private root used instead, this process."""


class UntrustedPathError(OSError):
    """A cache directory or file that someone other than the user could have written or
    could replace; ``strerror`` says who and how.

    An ``OSError``, as :class:`~pipeline.foundation.inputs.NotRegularFileError` is: readers
    that already turn open errors into "ignored, computed again" treat it the same way.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(reason)
        self.strerror = reason
        self.filename = os.fspath(path)


def configured_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/moestream``, else ``~/.cache/moestream``, as configured: not checked,
    not made. Read it only through :func:`trusted_cache_dir`."""
    return Path(os.path.abspath(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moestream"))


def _mode(st: os.stat_result) -> str:
    return oct(stat.S_IMODE(st.st_mode))


def _check_dir(path: Path, *, ours: bool) -> None:
    """Refuse a directory entry the user cannot rely on (see the module docstring).

    Args:
        path: a directory, looked at without following a link at it.
        ours: the cache itself (the user's, writable by nobody else), or a directory above
            it (the user's or root's, writable by others only with the sticky bit).

    Raises:
        UntrustedPathError: a link, not a directory, or another owner or writer.
        OSError: as ``lstat`` raises it.
    """
    st = os.lstat(path)
    euid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):  # the path was resolved: a link here appeared since
        raise UntrustedPathError(path, "is a symbolic link (replaced while checked)")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(path, "is not a directory")
    if ours:
        if st.st_uid != euid:
            raise UntrustedPathError(path, f"is owned by uid {st.st_uid}, not by this user "
                                     f"(uid {euid})")
        if st.st_mode & _OTHERS_WRITE:
            raise UntrustedPathError(path, f"is writable by group or others (mode "
                                     f"{_mode(st)})")
    else:
        if st.st_uid not in (euid, 0):
            raise UntrustedPathError(path, f"is owned by uid {st.st_uid}, who could replace "
                                     "what it holds")
        if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
            raise UntrustedPathError(path, f"is writable by group or others without the "
                                     f"sticky bit (mode {_mode(st)}): they could replace "
                                     "what it holds")


def _make_dirs(path: Path) -> None:
    """Make ``path`` and its missing parents, each ``0o700``."""
    missing: list[Path] = []
    at = path
    while not os.path.lexists(at) and at != at.parent:
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked as any other
            os.mkdir(directory, 0o700)


def _private_dir(root: Path, parts: tuple[str, ...]) -> Path:
    """``root/parts`` made as needed and checked; returned with ``root``'s links resolved.

    Raises:
        UntrustedPathError: a directory on the way fails the rules.
        OSError: a directory cannot be made or looked at (``root`` under a file, ``/proc``).
    """
    _make_dirs(root.joinpath(*parts))
    real = Path(os.path.realpath(root))
    for above in reversed(real.parents):
        _check_dir(above, ours=False)
    _check_dir(real, ours=True)
    for part in parts:
        real = real / part
        _check_dir(real, ours=True)
    return real


def _fallback_root() -> Path:
    """A private root in the system's temporary directory: ``moestream-<uid>``, else (taken
    by another user, or not private) a fresh ``mkdtemp``.

    Raises:
        OSError: neither is private (the temporary directory itself is not).
    """
    shared = Path(tempfile.gettempdir()) / f"moestream-{os.geteuid()}"
    try:
        return _private_dir(shared, ())
    except OSError as exc:
        _log.warning("cache_dir_untrusted", path=str(exc.filename or shared),
                     reason=exc.strerror or str(exc), action="a fresh temporary directory")
    return _private_dir(Path(tempfile.mkdtemp(prefix="moestream-")), ())


def trusted_cache_dir(*parts: str) -> Path:
    """The cache directory to use (``parts``: a folder in it, such as ``"digests"``), made
    ``0o700`` as needed and checked to be the user's own (see the module docstring).

    The configured directory (:func:`configured_cache_dir`) when it passes; otherwise one
    warning (``cache_dir_untrusted``: the directory and why) and a private fallback, the
    same one for the rest of the process.

    Raises:
        OutputError: no private directory at all (the temporary directory is not private
            either).
    """
    configured = configured_cache_dir()
    target = configured.joinpath(*parts)
    if target not in _FALLBACKS:
        try:
            return _private_dir(configured, parts)
        except OSError as exc:
            failed, reason = exc.filename or target, exc.strerror or str(exc)
        try:
            _FALLBACKS[target] = _fallback_root()
        except OSError as exc:
            raise OutputError(target, f"not private ({failed}: {reason}), and no private "
                              f"fallback ({exc.filename}: {exc.strerror or exc})",
                              what="the cache directory") from exc
        _log.warning("cache_dir_untrusted", path=str(failed), reason=reason,
                     action=f"using {_FALLBACKS[target].joinpath(*parts)}")
    try:
        return _private_dir(_FALLBACKS[target], parts)
    except OSError as exc:
        raise OutputError(target, f"the private fallback is not private any more "
                          f"({exc.filename}: {exc.strerror or exc})",
                          what="the cache directory") from exc


def forget_fallbacks() -> None:
    """Forget the fallbacks chosen so far: the next :func:`trusted_cache_dir` checks the
    configured directory again (tests; a long-lived process after permissions are fixed)."""
    _FALLBACKS.clear()


def _link_kind(path: str | os.PathLike[str]) -> str:
    """What a refused link is, for the message: where it points and, if that exists, what."""
    try:
        target = os.readlink(path)
        kind = file_kind(os.stat(path).st_mode) or "a regular file"
    except OSError:
        return "a symbolic link"
    return f"a symbolic link (to {target}, {kind}; never followed in the cache)"


def open_private(path: str | os.PathLike[str]) -> io.BufferedReader:
    """Open a file of the cache for binary reading if it is the user's own regular file.

    Never follows a link at ``path`` and never blocks (a FIFO opens at once and is refused);
    the checks are on the descriptor, so what is read is what was checked.

    Raises:
        NotRegularFileError: a link, a directory, a FIFO, a device or a socket.
        UntrustedPathError: owned by another user, or writable by group or others.
        OSError: as ``open`` raises it (missing, permission denied).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(path, _link_kind(path)) from None
        raise
    try:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise NotRegularFileError(path, kind)
        if st.st_uid != os.geteuid():
            raise UntrustedPathError(path, f"is owned by uid {st.st_uid}, not by this user "
                                     f"(uid {os.geteuid()})")
        if st.st_mode & _OTHERS_WRITE:
            raise UntrustedPathError(path, f"is writable by group or others (mode "
                                     f"{_mode(st)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_private(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole of a file of the cache of at most ``max_bytes`` bytes, opened by
    :func:`open_private` (the bounds are those of ``inputs.read_input``).

    Raises:
        NotRegularFileError: a link, a directory, a FIFO, a device or a socket.
        UntrustedPathError: owned by another user, or writable by group or others.
        InputTooLargeError: larger than ``max_bytes``.
        OSError: as ``open`` and ``read`` raise it.
    """
    return read_input(path, max_bytes, opener=open_private)
