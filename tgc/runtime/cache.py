"""The on-disk cache of compiled code, keyed by content.

A key hashes everything the machine code depends on: the module's IR text, every
option that reaches code generation, tgc's own source (so a changed compiler never
reuses old code), and the host CPU's name and features. Entries are object files,
written atomically (temp file + rename), so processes that build the same program
at once never see a partial entry; an unreadable entry is rebuilt.

Location: `$TGC_CACHE_DIR`, else `$XDG_CACHE_HOME/tgc`, else `~/.cache/tgc`;
`TGC_CACHE=off` disables it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

from tgc.fsutil import write_atomic
from tgc.options import Options

# Options that only change what is printed, never the code.
PRESENTATION = frozenset({"print_ir_before", "print_ir_after", "print_ir_after_all", "time_passes",
                          "locs", "verify_each", "verify_seed", "stats", "passes"})


def cache_dir() -> Path | None:
    if os.environ.get("TGC_CACHE", "").lower() in ("0", "off", "no", "false"):
        return None
    if os.environ.get("TGC_CACHE_DIR"):
        return Path(os.environ["TGC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tgc"


@functools.lru_cache(maxsize=1)
def compiler_digest() -> str:
    """A hash of tgc's own source files (code, prelude, grammar)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".tg", ".lark") and path.is_file():
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(ir_text: str, options: Options, cpu: tuple[str, str]) -> str:
    fields = {k: v for k, v in sorted(dataclasses.asdict(options).items()) if k not in PRESENTATION}
    h = hashlib.sha256()
    for part in (compiler_digest(), repr(fields), cpu[0], cpu[1], ir_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


MAGIC = b"tgc-object-1\n"


def lookup(key: str) -> bytes | None:
    """The cached object for `key`, or None (absent, unreadable, or failing its checksum)."""
    d = cache_dir()
    if d is None:
        return None
    try:
        data = (d / key[:2] / f"{key}.o").read_bytes()
    except OSError:
        return None
    head, digest, obj = data[:len(MAGIC)], data[len(MAGIC):len(MAGIC) + 64], data[len(MAGIC) + 65:]
    if head != MAGIC or digest != hashlib.sha256(obj).hexdigest().encode():
        return None
    return obj


def store(key: str, obj: bytes) -> None:
    """Save `obj` under `key` with a checksum, atomically."""
    d = cache_dir()
    if d is None:
        return
    try:
        (d / key[:2]).mkdir(parents=True, exist_ok=True)
        write_atomic(d / key[:2] / f"{key}.o", MAGIC + hashlib.sha256(obj).hexdigest().encode() + b"\n" + obj)
    except OSError:
        pass  # a read-only or full cache only costs the next build its time
