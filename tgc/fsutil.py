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
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
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
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
