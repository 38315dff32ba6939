"""Sanity checks of cached object files before LLVM's loader sees them.

LLVM's in-process loader (RuntimeDyld, behind MCJIT) trusts the object files it is
given: a truncated file, a section or relocation pointing past the end, an unknown
relocation type or a symbol that nothing defines ends in a segfault or an abort of
the whole process, not in an error. Object files from the on-disk cache are checked
here first, so that damage of any kind (the checksum only catches accidents) is a
cache miss: `check_objects(objs)` returns None when the set is fit to load, else a
reason.

What is checked (ELF64, little-endian relocatable files, which LLVM emits on Linux):
the header (magic, class, byte order, type, the host's machine), every section
header within the file and its links in range, string tables NUL-terminated, symbol
and relocation tables of whole entries, every symbol's name and section in range,
every relocation's symbol in range, its offset inside its section and (x86-64) its
type one RuntimeDyld implements, and every symbol left undefined by one object
defined by another or resolvable in this process. Anything else (another object
format, another machine) is refused: a miss, and the program is compiled again.
The machine code itself is not checked: the cache directory is private (see
`tgc.backends.cache`), so only damage, not another user, can change it.
"""
from __future__ import annotations

import platform
import struct
import sys

_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}
# relocation types RuntimeDyldELF resolves on x86-64 (NONE, 64, PC32, PLT32,
# GOTPCREL, 32, 32S, PC64, GOTOFF64, GOTPC32, GOTPCRELX, REX_GOTPCRELX)
_X86_64_RELOCS = frozenset({0, 1, 2, 4, 9, 10, 11, 24, 25, 26, 41, 42})

_WIDE = frozenset({1, 24, 25})   # R_X86_64_64, PC64, GOTOFF64: 8 bytes; the rest 4
SHT_NULL, SHT_SYMTAB, SHT_STRTAB, SHT_RELA, SHT_NOBITS, SHT_REL, SHT_GROUP = 0, 2, 3, 4, 8, 9, 17
SHN_LORESERVE, SHN_ABS, SHN_COMMON = 0xFF00, 0xFFF1, 0xFFF2
STB_LOCAL = 0
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")
_REL = struct.Struct("<QQ")


class BadObject(ValueError):
    pass


def check_objects(objs, resolve=None) -> str | None:
    """None if every object file in `objs` passes the checks above and together they
    leave no symbol undefined that `resolve(name)` (default: a lookup in this
    process) cannot find; else why not."""
    defined: set[str] = set()
    undefined: set[str] = set()
    try:
        for i, obj in enumerate(objs):
            d, u = _check(obj)
            twice = defined & d
            if twice:
                raise BadObject(f"symbol {sorted(twice)[0]!r} defined twice")
            defined |= d
            undefined |= u
    except BadObject as e:
        return f"object {i}: {e}"
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        return f"object {i}: malformed ({e})"
    resolve = resolve or _in_process
    missing = sorted(n for n in undefined - defined if not resolve(n))
    return f"undefined symbol {missing[0]!r}" if missing else None


def _in_process(name: str) -> bool:
    """Whether the dynamic linker finds `name` in this process (as MCJIT will)."""
    import ctypes

    try:
        ctypes.CDLL(None)[name]
    except (AttributeError, OSError, TypeError):
        return False
    return True


def _host_machine() -> int | None:
    return _MACHINES.get(platform.machine().lower())


def _check(data: bytes) -> tuple[set[str], set[str]]:
    """(global symbols defined, symbols undefined) of one object; BadObject if unfit."""
    if not isinstance(data, (bytes, bytearray)) or len(data) < _EHDR.size:
        raise BadObject("shorter than an ELF header")
    (ident, e_type, machine, version, _entry, phoff, shoff, _flags, ehsize, _phentsize, phnum,
     shentsize, shnum, shstrndx) = _EHDR.unpack_from(data, 0)
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1 or ident[6] != 1 or sys.byteorder != "little":
        raise BadObject("not a 64-bit little-endian ELF file")
    if e_type != 1 or version != 1 or ehsize != _EHDR.size or phnum != 0:
        raise BadObject("not a relocatable object")
    host = _host_machine()
    if host is None or machine != host:
        raise BadObject(f"machine {machine} is not this host's")
    if shentsize != _SHDR.size or not 0 < shnum < SHN_LORESERVE or shstrndx >= shnum:
        raise BadObject("bad section header table")
    if shoff + shnum * shentsize > len(data):
        raise BadObject("section headers past the end of the file")
    sections = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for name, kind, _f, _addr, off, size, link, info, align, entsize in sections:
        if kind not in (SHT_NULL, SHT_NOBITS) and off + size > len(data):
            raise BadObject("a section extends past the end of the file")
        if link >= shnum or align & (align - 1):
            raise BadObject("a section header is out of range")
        if kind == SHT_STRTAB and size and data[off + size - 1] != 0:
            raise BadObject("a string table is not NUL-terminated")
        if kind in (SHT_SYMTAB, SHT_RELA, SHT_REL):
            want = {SHT_SYMTAB: _SYM.size, SHT_RELA: _RELA.size, SHT_REL: _REL.size}[kind]
            if entsize != want or size % want:
                raise BadObject("a table of partial entries")
        if kind in (SHT_RELA, SHT_REL) and (info >= shnum or sections[link][1] != SHT_SYMTAB):
            raise BadObject("a relocation section points nowhere")
        if kind == SHT_GROUP and (size % 4 or any(
                m >= shnum for m in struct.unpack_from(f"<{size // 4}I", data, off)[1:])):
            raise BadObject("a section group lists a missing section")
    shstr = sections[shstrndx]
    if shstr[1] != SHT_STRTAB or any(s[0] >= max(shstr[5], 1) for s in sections):
        raise BadObject("section names out of range")
    symtabs = [i for i, s in enumerate(sections) if s[1] == SHT_SYMTAB]
    if len(symtabs) > 1:
        raise BadObject("more than one symbol table")
    defined: set[str] = set()
    undefined: set[str] = set()
    nsyms = 0
    if symtabs:
        _, _, _, _, off, size, link, _, _, _ = sections[symtabs[0]]
        strtab = sections[link]
        if strtab[1] != SHT_STRTAB:
            raise BadObject("the symbol table's names are not a string table")
        nsyms = size // _SYM.size
        for k in range(nsyms):
            st_name, st_info, _other, shndx, value, st_size = _SYM.unpack_from(data, off + k * _SYM.size)
            if st_name >= max(strtab[5], 1):
                raise BadObject("a symbol name out of range")
            if shndx >= shnum and shndx not in (SHN_ABS, SHN_COMMON):
                raise BadObject("a symbol in a missing section")
            if 0 < shndx < shnum and value + st_size > sections[shndx][5] and sections[shndx][1] != SHT_NULL:
                raise BadObject("a symbol extends past its section")
            name = _cstr(data, strtab[4] + st_name) if st_name else ""
            if not name or k == 0:
                continue
            if shndx == 0:
                undefined.add(name)
            elif st_info >> 4 != STB_LOCAL:
                defined.add(name)
    for i, (_n, kind, _f, _a, off, size, link, info, _al, _e) in enumerate(sections):
        if kind not in (SHT_RELA, SHT_REL):
            continue
        rec = _RELA if kind == SHT_RELA else _REL
        target = sections[info][5]
        for k in range(size // rec.size):
            r_offset, r_info = rec.unpack_from(data, off + k * rec.size)[:2]
            width = 8 if r_info & 0xFFFFFFFF in _WIDE else 4
            if r_info >> 32 >= max(nsyms, 1) or r_offset + width > target:
                raise BadObject("a relocation out of range")
            if machine == 62 and r_info & 0xFFFFFFFF not in _X86_64_RELOCS:
                raise BadObject(f"relocation type {r_info & 0xFFFFFFFF} is not supported")
    return defined, undefined


def _cstr(data: bytes, at: int) -> str:
    end = data.index(b"\0", at)
    return data[at:end].decode("utf-8")
