"""The on-disk cache of compiled code, keyed by content.

A key hashes everything the machine code depends on: the module's IR text, every
option that reaches code generation, tgc's own source (so a changed compiler never
reuses old code), and the backend's key parts (for the CPU: its name, the host CPU's name and features). Entries are object files,
written atomically (temp file + rename), so processes that build the same program
at once never see a partial entry; an unreadable entry is rebuilt.

A first level, looked up before anything is parsed (`tgc.compile`), maps the
source text itself (with its name, the folders its imports are looked for in as
this compile resolves them, the options, the dims, tgc's source and the CPU) to what
a `Program` needs: the module after the IR pipeline as IR text, a hash of the
lowered program made from it, and the object code. A hit parses the IR, lowers it
again (milliseconds) and uses the code only if the lowered program hashes the same.
An entry also lists what the front end read (`Reads`): every file by absolute path
with the hash of the text it read, and every path an import looked at first and
found no file at. A file whose text differs now, or a file that appeared where an
import looks first, is a miss. Those files are read as the front end reads sources
(regular files, bounded: `tgc.fsutil.read_source_bytes`), so a FIFO or device put in
an import's place is a miss at once, never a wait.

Nothing in the cache is code to Python: entries are a checksummed binary layout
(magic, sha256, lengths) with JSON metadata, never pickles. Any damage is a miss
and the full build runs: an entry is read only if it is a regular file (no FIFO,
device or symlink) of at most `MAX_ENTRY` bytes whose checksum holds, and its object
files must pass `tgc.backends.objfile.check_objects` before LLVM loads them.

Security: the directory is created 0700 (whatever the umask), and before every use
it must be a real directory (not a symlink), owned by this user, and not writable
by group or others; otherwise the cache is not used at all and one warning says why.
So only this user can place code in it. That check is the protection; what follows
is defence in depth against damage and mix-ups, not against a writer of the directory:
- the checksum (sha256 of the body) catches a torn or damaged entry (a crash, a full
  disk, flipped bits); anyone can recompute it, so it proves nothing about who wrote it;
- each entry names its program: the object code's `tgc_fingerprint` is its key (read
  as data after loading, before any of its code runs: `cpu.kernels.from_object`), and
  a first-level entry's metadata holds its own key. Another program's code under a
  key (entries swapped, copied or renamed, checksums recomputed) is a miss and the
  program is compiled again;
- neither is a signature: code written to pass both (a recomputed fingerprint and
  checksum, say with a patched `tgc_run`) is loaded and run. The child-process load
  (`from_cached_object`) runs only `tgc_init`, so it catches objects that do not load
  or initialize, not wrong code.

Location: `$TGC_CACHE_DIR`, else `$XDG_CACHE_HOME/tgc`, else `~/.cache/tgc`;
`TGC_CACHE=off` disables it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import stat
import warnings
from pathlib import Path

from tgc.fsutil import read_at_most, write_atomic
from tgc.options import Options

MAX_ENTRY = 1 << 30   # bytes: a larger "entry" is damage, never read


class CacheWarning(UserWarning):
    """The cache directory is unsafe to use (so it is not used)."""


# options a call reads, not the compiler: neither key holds them
RUNTIME = frozenset({"collective_timeout", "specialize_calls", "specialize_work", "specialize_max"})
PRESENTATION = frozenset({"print_ir_before", "print_ir_after", "print_ir_after_all", "time_passes",
                          "locs", "verify_each", "verify_seed", "stats", "passes"}) | RUNTIME
CPU_PRESENTATION = frozenset({"compile_jobs"})   # CpuOptions fields that do not change the code


def _key_fields(options: Options) -> dict:
    """The options the code depends on, as plain data (nested backend options too)."""
    fields = {k: v for k, v in sorted(dataclasses.asdict(options).items()) if k not in PRESENTATION}
    fields["cpu"] = {k: v for k, v in fields["cpu"].items() if k not in CPU_PRESENTATION}
    return fields


def cache_dir() -> Path | None:
    """The cache directory, created 0700 if absent; None when the cache is off or
    the directory fails the checks in the module docstring (then one warning)."""
    if os.environ.get("TGC_CACHE", "").lower() in ("0", "off", "no", "false"):
        return None
    if os.environ.get("TGC_CACHE_DIR"):
        path = Path(os.environ["TGC_CACHE_DIR"])
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "tgc"
    problem = _unsafe(path)
    if problem is None:
        return path
    if problem and path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(f"not using the code cache '{path}': {problem}", CacheWarning, stacklevel=2)
    return None


_WARNED: set[Path] = set()


def _unsafe(path: Path) -> str | None:
    """Why `path` must not hold the cache (None: it is safe; '': it cannot be made,
    e.g. a read-only home, which only costs time and is not warned about)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            _make_private(path)
            st = os.lstat(path)
        except OSError:
            return ""
    except OSError as e:
        return f"cannot inspect it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


def _make_private(path: Path) -> None:
    """Create `path` and any missing parents with mode 0700, whatever the umask."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue
        os.chmod(p, 0o700)   # the umask only removes bits; this also drops any it kept


@functools.lru_cache(maxsize=1)
def compiler_digest() -> str:
    """A hash of tgc's own source files (code, prelude, grammar)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        paths += [Path(folder) / f for f in files if f.endswith((".py", ".tg", ".lark", ".json"))]
    for path in sorted(paths):
        if path.is_file():
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(ir_text: str, options: Options, target: tuple[str, ...]) -> str:
    """The key of a module's code: `target` is the backend's own key parts
    (`Backend.cache_parts()`: its name, and for the CPU the host CPU's name and features)."""
    h = hashlib.sha256()
    for part in (compiler_digest(), repr(_key_fields(options)), *target, ir_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


MAGIC = b"tgc-objects-3\n"


def lookup(key: str) -> tuple[bytes, ...] | None:
    """The object files cached for `key`, or None (absent, unreadable, failing its
    checksum, or objects unfit to load)."""
    d = cache_dir()
    if d is None:
        return None
    body = _read_entry(d, key, ".o", MAGIC)
    objs = _unpack(body) if body is not None else None
    if objs is None or _objects_unfit(objs):
        return None
    return objs


def store(key: str, objs: tuple[bytes, ...]) -> None:
    """Save the object files `objs` under `key` with a checksum, atomically."""
    d = cache_dir()
    if d is None:
        return
    body = _pack(objs)
    try:
        _write(d, key, ".o", MAGIC, body)
    except OSError:
        pass  # a read-only or full cache only costs the next build its time


def _objects_unfit(objs) -> bool:
    from tgc.backends.objfile import check_objects

    return check_objects(objs) is not None


def _pack(objs: tuple[bytes, ...]) -> bytes:
    """Each object as its 8-byte little-endian length, then its bytes."""
    return b"".join(len(o).to_bytes(8, "little") + o for o in objs)


def _unpack(body: bytes) -> tuple[bytes, ...] | None:
    objs, at = [], 0
    while at < len(body):
        n = int.from_bytes(body[at:at + 8], "little")
        if at + 8 > len(body) or at + 8 + n > len(body):
            return None
        objs.append(body[at + 8:at + 8 + n])
        at += 8 + n
    return tuple(objs) or None


def _entry_name(key: str, suffix: str) -> tuple[str, str]:
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"not a cache key: {key!r}")
    return key[:2], key + suffix


def _read_entry(d: Path, key: str, suffix: str, magic: bytes) -> bytes | None:
    """The checked body of an entry, or None: only a regular file, owned by this
    user, of at most MAX_ENTRY bytes, opened without following links or blocking
    (a FIFO), whose magic and sha256 hold."""
    sub, name = _entry_name(key, suffix)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        dfd = os.open(d / sub, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow)
    except OSError:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | nofollow | getattr(os, "O_NONBLOCK", 0), dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ENTRY or \
                (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return None
        data = read_at_most(fd, st.st_size)
    except OSError:
        return None
    finally:
        os.close(fd)
    n = len(magic)
    head, digest, newline, body = data[:n], data[n:n + 64], data[n + 64:n + 65], data[n + 65:]
    if head != magic or newline != b"\n" or digest != hashlib.sha256(body).hexdigest().encode():
        return None
    return body


# ------------------------------------------------------------ the first level: source -> program

PROGRAM_MAGIC = b"tgc-program-3\n"
# options that print while the pipeline runs: a hit would skip the printing
PRINTS = ("print_ir_before", "print_ir_after", "print_ir_after_all", "time_passes", "stats", "verify_each")


def source_cacheable(options: Options) -> bool:
    """Whether `tgc.compile` may look the source up (not when it prints, nor for an
    --fp-strict program, whose f32 emulation is rebuilt from the object cache)."""
    return not options.fp_strict and not any(getattr(options, f) for f in PRINTS)


def source_key(kind: str, name: str, text: str, options: Options, target: tuple[str, ...],
               folders: tuple[str, ...] = ()) -> str:
    """The first-level key: the source as given (kind: tg | ir; its file name, which
    the module's locations carry), the folders its imports are looked for in, as this
    compile resolves them (`tgc.frontend.import_folders`: a relative name means other
    files in another working directory), every option but those only a call reads
    (`RUNTIME`; dims included), tgc, and the backend's key parts (`Backend.cache_parts()`)."""
    h = hashlib.sha256()
    chosen = sorted((k, v) for k, v in dataclasses.asdict(options).items() if k not in RUNTIME)
    for part in ("source", compiler_digest(), repr(chosen),
                 *target, kind, name, text, repr(tuple(folders))):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def text_digest(text: str) -> str:
    """The digest of a source's text as the front end read it."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


BOM = b"\xef\xbb\xbf"


def file_digest(path: str) -> str | None:
    """`text_digest` of the file's text now, read as the front end reads a source
    (`tgc.fsutil.read_source_bytes`: a regular file, bounded, never blocking on a FIFO);
    None if it cannot be. The text of valid UTF-8 encodes back to the same bytes, so
    the bytes after a byte order mark are hashed; bytes that are not UTF-8 differ from
    every text's (a miss, then the front end's located error)."""
    from tgc.fsutil import read_source_bytes

    try:
        data = read_source_bytes(path)
    except (OSError, ValueError):
        return None
    return hashlib.sha256(data[len(BOM):] if data.startswith(BOM) else data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Reads:
    """What the front end read to build a program: each file (an absolute path) with
    `text_digest` of its text, and the paths an import looked at first and found no
    file at (a file there would change what the import means)."""
    files: tuple[tuple[str, str], ...] = ()
    absent: tuple[str, ...] = ()

    @classmethod
    def of(cls, loaded) -> "Reads":
        """The reads of an `Elaborated` program (names of text given in memory, such as
        "<source>", are left out: the first-level key holds that text)."""
        files = tuple((os.path.abspath(f), text_digest(loaded.texts[f])) for f in loaded.files if f in loaded.texts
                      and not (f.startswith("<") and f.endswith(">")))
        return cls(files, tuple(dict.fromkeys(os.path.abspath(p) for p in loaded.absent)))

    def hold(self) -> bool:
        """Whether a compile now would read the same: every file's text is the same and
        no file has appeared where an import looked first."""
        return all(file_digest(p) == h for p, h in self.files) and \
            not any(os.path.isfile(p) for p in self.absent)


def lowered_digest(lowered) -> str:
    """The hash of a lowered program's text (without its module, which the first-level
    key covers), which a first-level hit must reproduce."""
    from tgc.lower.lowered import print_lowered

    return hashlib.sha256(print_lowered(lowered, module=False).encode("utf-8", "surrogatepass")).hexdigest()


@dataclasses.dataclass(frozen=True)
class ProgramEntry:
    ir: str                       # the module after the IR pipeline, as IR text with locations
    lowered_sha256: str           # `lowered_digest` of the lowered program the code is for
    objs: tuple[bytes, ...]


def lookup_program(key: str) -> ProgramEntry | None:
    """The entry stored under `key`, or None: absent, unreadable, failing its checksum
    or its structure, an imported file changed since, or objects unfit to load."""
    d = cache_dir()
    if d is None:
        return None
    body = _read_entry(d, key, ".prog", PROGRAM_MAGIC)
    if body is None or len(body) < 8:
        return None
    n = int.from_bytes(body[:8], "little")
    try:
        meta = json.loads(body[8:8 + n].decode("utf-8"))
        reads = Reads(tuple((str(p), str(h)) for p, h in meta["deps"]), tuple(str(p) for p in meta["absent"]))
        ir, digest = meta["ir"], meta["lowered_sha256"]
        if meta["key"] != key:   # an entry names its own key: one stored under another name is a miss
            return None
        if not isinstance(ir, str) or not isinstance(digest, str):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    objs = _unpack(body[8 + n:])
    if objs is None or not reads.hold() or _objects_unfit(objs):
        return None
    return ProgramEntry(ir, digest, objs)


def store_program(key: str, reads: Reads, module, lowered, obj: tuple[bytes, ...]) -> None:
    """Save a program under `key` (checksummed, atomically); silently skipped on failure."""
    d = cache_dir()
    if d is None:
        return
    try:
        from tgc.ir.printer import print_module

        meta = json.dumps({"key": key, "deps": reads.files, "absent": reads.absent,
                           "ir": print_module(module, locs=True),
                           "lowered_sha256": lowered_digest(lowered)}).encode("utf-8")
        _write(d, key, ".prog", PROGRAM_MAGIC, len(meta).to_bytes(8, "little") + meta + _pack(obj))
    except Exception:  # noqa: BLE001 -- unprintable, read-only or full: the next build only costs its time
        pass


def _write(d: Path, key: str, suffix: str, magic: bytes, body: bytes) -> None:
    """Write an entry atomically without fsync: a torn entry after a crash fails its
    checksum and is rebuilt, so durability is not needed, only atomicity."""
    sub, name = _entry_name(key, suffix)
    folder = d / sub
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise NotADirectoryError(20, "not a directory", str(folder))
    except FileNotFoundError:
        _make_private(folder)
    data = magic + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    write_atomic(folder / name, data, mode=0o600, durable=False, write_special=False)
