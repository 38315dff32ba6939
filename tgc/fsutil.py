"""Atomic file output: write to a temporary name in the target's folder, then rename.

An interrupted or failed write never leaves a half-written file under the target
name, so `make` never takes a broken output as up to date.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o644, durable: bool = True) -> None:
    """Write `data` to `path` through a temporary file renamed over it. `durable`:
    fsync before the rename (a build output); without it, only atomicity (a cache
    entry, whose checksum catches a torn write after a crash)."""
    write_all_atomic({path: (data, mode)}, durable)


def write_all_atomic(files: dict, durable: bool = True) -> None:
    """`write_atomic` for several files ({path: (data, mode)}) as one step: every
    temporary file is written before any is renamed, so a failure while writing
    (a full disk, an unwritable folder) leaves every target as it was."""
    temps: list[tuple[str, Path]] = []
    try:
        for path, (data, mode) in files.items():
            temps.append((_temporary(Path(path), data, mode, durable), Path(path)))
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


def _temporary(path: Path, data: bytes | str, mode: int, durable: bool) -> str:
    """A temporary file beside `path` holding `data`."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
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
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
