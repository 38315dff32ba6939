"""The on-disk cache of compiled code, keyed by content.

A key hashes everything the machine code depends on: the module's IR text, every
option that reaches code generation, tgc's own source (so a changed compiler never
reuses old code), and the host CPU's name and features. Entries are object files,
written atomically (temp file + rename), so processes that build the same program
at once never see a partial entry; an unreadable entry is rebuilt.

A first level, looked up before anything is parsed (`tgc.compile`), maps the
source text itself (with its name, the options, the dims, tgc's source and the CPU)
to everything a `Program` needs: the module after the IR pipeline, the lowered
program and the object code, pickled. An entry also lists the files the program
imported with their hashes; a changed import is a miss. Entries carry a checksum;
anything unreadable, stale or failing to load is a miss, and the full build runs.

Location: `$TGC_CACHE_DIR`, else `$XDG_CACHE_HOME/tgc`, else `~/.cache/tgc`;
`TGC_CACHE=off` disables it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
from pathlib import Path

from tgc.fsutil import write_atomic
from tgc.options import Options

# Options that only change what is printed, never the code; and compile_jobs, which
# only changes how the same code is cut into object files (any cut loads the same).
PRESENTATION = frozenset({"print_ir_before", "print_ir_after", "print_ir_after_all", "time_passes",
                          "locs", "verify_each", "verify_seed", "stats", "passes", "compile_jobs"})


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
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        paths += [Path(folder) / f for f in files if f.endswith((".py", ".tg", ".lark"))]
    for path in sorted(paths):
        if path.is_file():
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


MAGIC = b"tgc-objects-2\n"


def lookup(key: str) -> tuple[bytes, ...] | None:
    """The object files cached for `key`, or None (absent, unreadable, or failing
    its checksum)."""
    d = cache_dir()
    if d is None:
        return None
    try:
        data = (d / key[:2] / f"{key}.o").read_bytes()
    except OSError:
        return None
    head, digest, body = data[:len(MAGIC)], data[len(MAGIC):len(MAGIC) + 64], data[len(MAGIC) + 65:]
    if head != MAGIC or digest != hashlib.sha256(body).hexdigest().encode():
        return None
    return _unpack(body)


def store(key: str, objs: tuple[bytes, ...]) -> None:
    """Save the object files `objs` under `key` with a checksum, atomically."""
    d = cache_dir()
    if d is None:
        return
    body = _pack(objs)
    try:
        _write(d / key[:2], f"{key}.o", MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    except OSError:
        pass  # a read-only or full cache only costs the next build its time


def _pack(objs: tuple[bytes, ...]) -> bytes:
    """Each object as its 8-byte little-endian length, then its bytes."""
    return b"".join(len(o).to_bytes(8, "little") + o for o in objs)


def _unpack(body: bytes) -> tuple[bytes, ...] | None:
    objs, at = [], 0
    while at < len(body):
        n = int.from_bytes(body[at:at + 8], "little")
        if at + 8 + n > len(body):
            return None
        objs.append(body[at + 8:at + 8 + n])
        at += 8 + n
    return tuple(objs) or None


# ------------------------------------------------------------ the first level: source -> program

PROGRAM_MAGIC = b"tgc-program-2\n"
# options that print while the pipeline runs: a hit would skip the printing
PRINTS = ("print_ir_before", "print_ir_after", "print_ir_after_all", "time_passes", "stats", "verify_each")


def source_cacheable(options: Options) -> bool:
    return not any(getattr(options, f) for f in PRINTS)


def source_key(kind: str, name: str, text: str, options: Options, cpu: tuple[str, str]) -> str:
    """The first-level key: the source as given (kind: tg | ir; its file name, which
    the module's locations carry), every option (dims included), tgc, the CPU."""
    h = hashlib.sha256()
    for part in ("source", compiler_digest(), repr(sorted(dataclasses.asdict(options).items())),
                 cpu[0], cpu[1], kind, name, text):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def file_hashes(paths) -> list[tuple[str, str]] | None:
    """(path, sha256 of its bytes) per file; None if one cannot be read."""
    out = []
    for path in paths:
        try:
            out.append((str(path), hashlib.sha256(Path(path).read_bytes()).hexdigest()))
        except OSError:
            return None
    return out


def lookup_program(key: str):
    """(module, lowered, object code) stored under `key`, or None: absent, unreadable,
    failing its checksum, not loading, or an imported file changed since."""
    d = cache_dir()
    if d is None:
        return None
    try:
        data = (d / key[:2] / f"{key}.prog").read_bytes()
        n = len(PROGRAM_MAGIC)
        head, digest, body = data[:n], data[n:n + 64], data[n + 65:]
        if head != PROGRAM_MAGIC or digest != hashlib.sha256(body).hexdigest().encode():
            return None
        entry = pickle.loads(body)
        deps, module, lowered, obj = entry["deps"], entry["module"], entry["lowered"], entry["obj"]
        if not (isinstance(obj, tuple) and all(isinstance(o, bytes) for o in obj)) or file_hashes(p for p, _ in deps) != deps:
            return None
        return module, lowered, obj
    except Exception:  # noqa: BLE001 -- any damage is a miss: the full build runs
        return None


def store_program(key: str, deps: list[tuple[str, str]], module, lowered, obj: tuple[bytes, ...]) -> None:
    """Save a program under `key` (checksummed, atomically); silently skipped on failure."""
    d = cache_dir()
    if d is None:
        return
    try:
        body = pickle.dumps({"deps": deps, "module": module, "lowered": lowered, "obj": obj},
                            protocol=pickle.HIGHEST_PROTOCOL)
        _write(d / key[:2], f"{key}.prog", PROGRAM_MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    except Exception:  # noqa: BLE001 -- unpicklable, read-only or full: the next build only costs its time
        pass


def _write(folder: Path, name: str, data: bytes) -> None:
    """Write atomically without fsync: a torn entry after a crash fails its checksum
    and is rebuilt, so durability is not needed, only atomicity."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / name, data, durable=False)
