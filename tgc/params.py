"""Saving and loading a program's parameters: its params and states, by name.

    tgc.save_params("model.safetensors", program, arrays)   # or "model.npz"
    arrays = tgc.load_params("model.safetensors", program)  # {name: array}, checked

Two formats, chosen by the file's suffix: safetensors (`.safetensors`, the format
model weights are exchanged in; no code runs on load) and numpy's `.npz`. Both hold
one array per param and state, in the program's float type and with its axes in the
argument's ABI order, and a description of them: the program's float type and each
array's kind and edges. safetensors keeps the description as JSON under the metadata
key `tgc`; an `.npz` keeps the same JSON in a member named `__tgc__` (a string array,
read without pickles).

Loading checks each array against the program before anything is returned: every
param and state is there and nothing else is; the edges match the argument's (a file
that lists the same edges in another order is transposed into the ABI order: the
names say which axis is which); the dtype is the program's float type, or the
argument's own for bf16/f16 ones (`cast=True` converts another float type); and each axis has its edge's size (a symbolic dim takes
one size across the file). A file without the description (written by another tool)
is checked by names, dtypes and shapes in ABI order alone. Any mismatch raises
`ParamsError`, naming the array and what differs; so does a description of another
shape than the one `save_params` writes (checked once, as the file is read).

The arrays returned are fresh, writable and C-contiguous: a call can update them in
place.
"""
from __future__ import annotations

import io
import json
import os
import zipfile
from typing import Mapping

import numpy as np

from tgc.fsutil import NotASource, open_regular
from tgc.ir.dtypes import LOW_FLOATS, TYPES, is_low_array, round_to, type_of_numpy
from tgc.ir.complex_io import as_complex, as_pairs, is_complex_order
from tgc.ir.sizes import Size, SizeError, UnboundDim, size_eval, size_str

META_KEY = "tgc"          # safetensors metadata key
NPZ_MEMBER = "__tgc__"    # the .npz member holding the same JSON
FORMAT_VERSION = 1


class ParamsError(ValueError):
    """A parameter file that cannot be read or written, or does not fit the program."""


def _format(path) -> str:
    name = os.fspath(path)
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(".npz"):
        return "npz"
    raise ParamsError(f"'{name}': the file name must end in .safetensors or .npz (it chooses the format)")


def _specs(program, caller: str) -> list:
    """The program's params and states (`TensorSpec`s), in ABI order; a TypeError naming
    `caller` when `program` is not a compiled program (a `Program`, a data-parallel
    step: anything with the `inputs` and `float_dtype` they have)."""
    if not (hasattr(program, "inputs") and hasattr(program, "float_dtype")):
        raise TypeError(f"{caller}: program must be a compiled tgc.Program (what tgc.compile returns), "
                        f"not {type(program).__name__}")
    return [s for s in program.inputs if s.kind in ("param", "state")]


def _describe(program, specs: list) -> str:
    return json.dumps({"version": FORMAT_VERSION, "dtype": program.float_dtype,
                       "tensors": {s.name: {"kind": s.kind, "edges": list(s.edges)} for s in specs}},
                      sort_keys=True)


def _bind(name: str, edges, shape: tuple[int, ...], want: tuple[Size, ...], env: dict[str, int]) -> None:
    """Check `shape` against the sizes `want` (binding symbolic dims into `env`)."""
    if len(shape) != len(want):
        raise ParamsError(f"'{name}' has {len(shape)} axes, the program's has {len(want)} ([{', '.join(edges)}])")
    for e, n, s in zip(edges, shape, want):
        if isinstance(s, str):
            if env.setdefault(s, int(n)) != n:
                raise ParamsError(f"'{name}': edge '{e}' has size {n}, but dim '{s}' is {env[s]} elsewhere in the file")
            continue
        try:
            expect = size_eval(s, env)
        except UnboundDim:
            continue
        except SizeError as err:
            raise ParamsError(f"'{name}': edge '{e}' ({size_str(s)}): {err}") from None
        if expect != n:
            raise ParamsError(f"'{name}': edge '{e}' has size {n}, the program's is {expect}"
                              + ("" if isinstance(s, int) else f" ({size_str(s)})"))


def _checked(program, arrays: Mapping[str, np.ndarray], cast: bool, meta: dict | None,
             where: str) -> dict[str, np.ndarray]:
    specs = _specs(program, where)
    dtype = program.float_dtype
    names = [s.name for s in specs]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ParamsError(f"{where}: no array for {', '.join(repr(n) for n in missing)} "
                          f"(the program's params and states: {', '.join(names) or 'none'})")
    extra = [n for n in arrays if n not in names]
    if extra:
        raise ParamsError(f"{where}: '{extra[0]}' is not a param or state of the program "
                          f"(it has: {', '.join(names) or 'none'})")
    recorded = (meta or {}).get("tensors", {})
    env: dict[str, int] = {}
    out: dict[str, np.ndarray] = {}
    low = getattr(program, "low_types", {})
    for spec in specs:
        a = arrays[spec.name]
        want = low.get(spec.name, dtype)   # bf16/f16 params and states keep their type
        if isinstance(a, np.ndarray) and want in LOW_FLOATS and a.dtype == np.dtype("V2"):
            a = a.view(TYPES[want].numpy)   # numpy saves a bfloat16 array as raw 2-byte items
        if is_complex_order(spec.edges) and isinstance(a, np.ndarray) and a.dtype.kind == "c":
            a = as_pairs(a, dtype if a.dtype.itemsize == (8 if dtype == "f32" else 16) or cast else
                         ("f32" if a.dtype == np.complex64 else "f64"))   # stored as float pairs, edge re.im
        if not isinstance(a, np.ndarray) or (a.dtype.kind != "f" and not is_low_array(a)):
            kind = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
            raise ParamsError(f"{where}: '{spec.name}' is {kind}, not a float array")
        entry = recorded.get(spec.name)
        if entry is not None:
            edges = tuple(entry["edges"])
            if sorted(edges) != sorted(spec.edges):
                raise ParamsError(f"{where}: '{spec.name}' has edges [{', '.join(edges)}], the program's are "
                                  f"[{', '.join(spec.edges)}]")
            if len(edges) != a.ndim:
                raise ParamsError(f"{where}: '{spec.name}' has {a.ndim} axes, but the file's description "
                                  f"lists {len(edges)} edges [{', '.join(edges)}]")
            if entry.get("kind", spec.kind) != spec.kind:
                raise ParamsError(f"{where}: '{spec.name}' was saved as a {entry['kind']}, the program's is a {spec.kind}")
            if edges != spec.edges:   # the same edges in another order: into the ABI order
                a = np.transpose(a, [edges.index(e) for e in spec.edges])
        have = type_of_numpy(a.dtype) or str(a.dtype)
        if have != want and not cast:
            what = f"the program's '{spec.name}' is {want}" if want != dtype else f"the program's float type is {dtype}"
            raise ParamsError(f"{where}: '{spec.name}' is {have}, {what} (cast=True converts)")
        _bind(spec.name, spec.edges, a.shape, spec.shape, env)
        out[spec.name] = a
    for spec in specs:   # sizes that depend on dims bound by a later array
        _bind(spec.name, spec.edges, out[spec.name].shape, spec.shape, env)
    out = {n: np.array(round_to(a, low.get(n, dtype)), order="C", copy=True) for n, a in out.items()}
    return {n: as_complex(a) if is_complex_order(s.edges) and where != "save_params" else a
            for (n, a), s in zip(out.items(), specs)}


def save_params(path: str | os.PathLike, program, arrays: Mapping[str, np.ndarray]) -> None:
    """Write the params and states of `program` (a `tgc.Program`), taken by name from
    `arrays` (the mapping a call takes; other names are ignored), to `path`.

    The suffix chooses the format: `.safetensors` or `.npz`. Each array is checked
    against its argument (edges' sizes, float) and stored in the program's float type
    with its axes in ABI order; the file also records the float type and each array's
    kind and edges (see the module's documentation). Written atomically: through a
    temporary file in the same folder, renamed over `path` once whole, so a failure
    leaves what was there. The folder must exist (none is created); a file that
    cannot be written is a `ParamsError` naming it and the reason."""
    from tgc.fsutil import write_atomic

    fmt = _format(path)
    specs = _specs(program, "save_params")
    if not isinstance(arrays, Mapping):
        raise TypeError(f"save_params: arrays must be a mapping {{name: array}}, not {type(arrays).__name__}")
    chosen = {s.name: np.asarray(arrays[s.name]) if s.name in arrays else None for s in specs}
    missing = [n for n, a in chosen.items() if a is None]
    if missing:
        raise ParamsError(f"save_params: no array for {', '.join(repr(n) for n in missing)}")
    checked = _checked(program, chosen, True, None, "save_params")
    meta = _describe(program, specs)
    if fmt == "safetensors":
        import safetensors.numpy

        data = safetensors.numpy.save(checked, metadata={META_KEY: meta})
    else:
        if NPZ_MEMBER in checked:
            raise ParamsError(f"a param or state named '{NPZ_MEMBER}' cannot go to an .npz (the name is reserved)")
        buf = io.BytesIO()
        np.savez(buf, **checked, **{NPZ_MEMBER: np.array(meta)})
        data = buf.getvalue()
    name = os.fspath(path)
    folder = os.path.dirname(name) or "."
    if not os.path.isdir(folder):
        raise ParamsError(f"cannot write '{name}': no folder '{folder}' (save_params creates none)")
    try:
        write_atomic(path, data)
    except OSError as e:
        raise ParamsError(f"cannot write '{name}': {e.strerror or e}") from None


def read_file(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict | None]:
    """The arrays of a `.safetensors` or `.npz` file, and tgc's description of them
    (None when the file has none)."""
    fmt = _format(path)
    name = os.fspath(path)
    try:
        with open_regular(name, f"a {fmt} file") as fh:   # a FIFO or device is refused, never waited on
            if fmt == "safetensors":
                import safetensors

                with safetensors.safe_open(name, framework="numpy") as f:   # it opens by name (and maps)
                    meta_text = (f.metadata() or {}).get(META_KEY)
                    stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
                    odd = [k for k, t in stored.items() if t == "F4" or t.startswith(("F6_", "F8_"))]
                    if odd:   # well formed, but numpy (and tgc) has no such type
                        raise ParamsError(f"cannot read '{name}': '{odd[0]}' is {stored[odd[0]]}, a type tgc does not "
                                          f"take (its floats: F64, F32, BF16, F16; convert the file's arrays first)")
                    if "BF16" in stored.values():
                        TYPES["bf16"].numpy   # the reader finds numpy's "bfloat16" only once ml_dtypes registered it
                    arrays = {k: f.get_tensor(k) for k in f.keys()}
            else:
                with np.load(fh, allow_pickle=False) as data:
                    arrays = {k: data[k] for k in data.files}
                member = arrays.pop(NPZ_MEMBER, None)
                meta_text = str(member) if member is not None and member.dtype.kind == "U" else None
    except ParamsError:
        raise
    except NotASource as e:
        raise ParamsError(f"cannot read '{name}': {e}") from None
    except OSError as e:
        raise ParamsError(f"cannot read '{name}': {e.strerror or e}") from None
    except (ValueError, EOFError, zipfile.BadZipFile, AttributeError) as e:
        raise ParamsError(f"cannot read '{name}': not a {fmt} file ({e})") from None
    except Exception as e:  # noqa: BLE001 -- safetensors' own error type for a damaged file
        raise ParamsError(f"cannot read '{name}': a damaged {fmt} file ({e})") from None
    return arrays, None if meta_text is None else _description(meta_text, name)


def _description(text, name: str) -> dict:
    """tgc's description of a file's arrays, parsed from its JSON and checked against
    the one shape `_describe` writes: {"version": int, "dtype": str, "tensors": {array:
    {"kind": "param" | "state", "edges": [distinct str, ...]}}}. Everything after
    reading relies on that shape; anything else is a `ParamsError` naming what is wrong."""
    def bad(what: str) -> ParamsError:
        return ParamsError(f"cannot read '{name}': its tgc description is malformed ({what})")

    if not isinstance(text, str):
        raise bad("not a string")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        raise ParamsError(f"cannot read '{name}': its tgc description is not JSON") from None
    if not isinstance(meta, dict):
        raise bad(f"a JSON {_json_kind(meta)}, not an object")
    for key, kind in (("version", int), ("dtype", str), ("tensors", dict)):
        if key not in meta:
            raise bad(f"no \"{key}\"")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise bad(f"\"{key}\" is a JSON {_json_kind(meta[key])}")
    if meta["version"] != FORMAT_VERSION:
        raise ParamsError(f"cannot read '{name}': its tgc description has format version {meta['version']}, "
                          f"this tgc reads version {FORMAT_VERSION}")
    for array, entry in meta["tensors"].items():
        if not isinstance(entry, dict):
            raise bad(f"the entry for '{array}' is a JSON {_json_kind(entry)}, not an object")
        if entry.get("kind") not in ("param", "state"):
            raise bad(f"the entry for '{array}' needs \"kind\": \"param\" or \"state\"")
        edges = entry.get("edges")
        if not isinstance(edges, list) or not all(isinstance(e, str) for e in edges):
            raise bad(f"the entry for '{array}' needs \"edges\": a list of edge names")
        twice = next((e for i, e in enumerate(edges) if e in edges[:i]), None)
        if twice is not None:
            raise bad(f"the entry for '{array}' lists edge '{twice}' twice")
    return meta


def _json_kind(value) -> str:
    """The JSON name of a parsed value's type, for messages."""
    for kind, name in ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def load_params(path: str | os.PathLike, program, cast: bool = False) -> dict[str, np.ndarray]:
    """Read the params and states of `program` from a file `save_params` wrote (or any
    `.safetensors` / `.npz` whose arrays have their names); returns {name: array}.

    Checks names, edges, dtype and sizes first (see the module's documentation) and
    raises `ParamsError` on any mismatch. `cast=True` accepts arrays of the other
    float width and converts them. The arrays are writable and C-contiguous."""
    _specs(program, "load_params")
    arrays, meta = read_file(path)
    return _checked(program, arrays, cast, meta, os.fspath(path))
