"""Atomic file output: write to a temporary name in the target's folder, then rename.

An interrupted or failed write never leaves a half-written file under the target
name, so `make` never takes a broken output as up to date.

A target that is not a regular file or a directory (a device such as /dev/null or
/dev/stdout, a FIFO, a socket; also through a symlink) is never replaced: it is
opened and written, as gcc does, after every regular target's temporary file is
complete. Error messages name the file asked for, never a temporary one.
"""
from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o644, durable: bool = True,
                 write_special: bool = True) -> None:
    """Write `data` to `path` through a temporary file renamed over it. `durable`:
    fsync before the rename (a build output); without it, only atomicity (a cache
    entry, whose checksum catches a torn write after a crash). `write_special`: a
    device or FIFO at `path` is written into (else replaced by the new file)."""
    write_all_atomic({path: (data, mode)}, durable, write_special)


def write_all_atomic(files: dict, durable: bool = True, write_special: bool = True) -> None:
    """`write_atomic` for several files ({path: (data, mode)}) as one step: every
    temporary file is written before any is renamed, so a failure while writing
    (a full disk, an unwritable folder) leaves every target as it was."""
    temps: list[tuple[str, Path]] = []
    special = {p: v for p, v in files.items() if write_special and is_special(p)}
    try:
        for path, (data, mode) in files.items():
            if path not in special:
                temps.append((_temporary(Path(path), data, mode, durable), Path(path)))
        for path, (data, _) in special.items():
            _write_through(Path(path), data)
        for tmp, path in temps:
            try:
                os.replace(tmp, path)
            except OSError as e:  # name the file asked for, not the temporary one
                raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise


MAX_SOURCE = 256 << 20   # bytes: the most a source file (or stdin) may hold


class NotASource(ValueError):
    """A path that names no file tgc may read (a source, an array or parameter file):
    a device, FIFO or socket, or a source too large."""


def open_regular(path: str | os.PathLike, what: str = "a regular file") -> BinaryIO:
    """`path` opened for reading, if it names a regular file (through links). A FIFO,
    device or socket raises NotASource at once ("a FIFO, not `what`"), never waiting
    for a writer or reading without end; a directory raises IsADirectoryError; OSError
    otherwise. The one check of every file tgc reads."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or \
                stat.S_ISBLK(mode) else "not a regular file"
            raise NotASource(f"{kind}, not {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_source_bytes(path: str | os.PathLike | None, limit: int = MAX_SOURCE) -> bytes:
    """The bytes of a source file (None: stdin), at most `limit` of them. A FIFO,
    device or socket is refused without blocking (stdin may be a pipe); a directory
    raises IsADirectoryError; NotASource or OSError otherwise."""
    if path is None:
        data = sys.stdin.buffer.read(limit + 1)
    else:
        with open_regular(path, "a source file (pipe a program to standard input with '-')") as f:
            data = read_at_most(f.fileno(), limit + 1)
    if len(data) > limit:
        raise NotASource(f"larger than {limit >> 20} MiB, the most a source may hold")
    return data


def read_at_most(fd: int, limit: int) -> bytes:
    """At most `limit` bytes from `fd`, read in chunks (up to its end, if sooner)."""
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def is_special(path: str | os.PathLike) -> bool:
    """Whether `path` (followed through links) exists and is neither a regular file
    nor a directory: a device or FIFO, written into rather than replaced."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def file_identity(path: str | os.PathLike) -> tuple:
    """What makes two paths one file: the device and inode of an existing file (so that
    a hard link, a symlink or another spelling of the path is the same file), else
    its absolute path with links resolved (a file still to be written)."""
    try:
        st = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    return ("inode", st.st_dev, st.st_ino)


def _encoded(data: bytes | str) -> bytes:
    """Text as UTF-8; a file name's bytes that are not UTF-8 (Python keeps them as
    surrogates) are written as they are, as the terminal output writes them."""
    return data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data


def _write_through(path: Path, data: bytes | str) -> None:
    """Open the existing device or FIFO `path` and write `data` into it."""
    payload = _encoded(data)
    try:
        with open(path, "wb", buffering=0) as f:
            view = memoryview(payload)
            while view:
                view = view[f.write(view):]
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def _temporary(path: Path, data: bytes | str, mode: int, durable: bool) -> str:
    """A temporary file beside `path` holding `data`."""
    payload = _encoded(data)
    if path.is_dir():
        raise IsADirectoryError(21, "Is a directory", str(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    except OSError as e:  # name the file asked for, not the temporary one
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode & ~_umask())
    except OSError as e:   # a full disk: name the file asked for
        os.unlink(tmp)
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
