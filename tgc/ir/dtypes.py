"""The element types: one table that says how each is stored, computed and promoted.

Every IR value has one of these types (`TensorType.dtype`). A float type has a
storage type (the numpy dtype a caller's array holds) and a compute type (the type
arithmetic on it happens in): `f32` and `f64` compute in themselves; `bf16` and
`f16` are storage types whose arithmetic happens in f32, rounded once (to nearest,
ties to even, as ml_dtypes, numpy and PyTorch round) to the value's type, as the
field's low-precision types work. `rank` orders the floats for promotion; two
different types of the same rank (f16 and bf16: neither holds the other) promote to
the next wider type, f32. A new family (complex) adds rows here.

A program has one float type `fp` (`--dtype`: f32 or f64), the width its buffers
hold. A narrower declared type is honoured: bf16 and f16 in any program, and f32 in
an f64 program (`narrower(fp)`): such a value is computed in the program's type and
rounded to its own (`tgc.ir.lowp`). A wider one has the program's width (`at_width`:
f64 in an f32 program is f32, as f32 programs compute in f32).

numpy has no bfloat16: `ml_dtypes.bfloat16` (the type JAX uses) stands for it.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@functools.cache
def _numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype of that name; "bfloat16" is ml_dtypes', imported on first use
    (the import costs a second: a program without bf16 never pays it)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class ElemType:
    name: str
    numpy_name: str        # numpy's name of the dtype a caller's array holds it in
    compute: str           # the type its arithmetic is computed in
    bits: int
    rank: int              # promotion order among floats (0: not a float)

    @property
    def numpy(self) -> np.dtype:
        """How a caller's array holds it (bf16: ml_dtypes.bfloat16)."""
        return _numpy_dtype(self.numpy_name)

    @property
    def is_float(self) -> bool:
        return self.rank > 0

    @property
    def low(self) -> bool:
        """Stored narrower than it is computed (bf16, f16)."""
        return self.compute != self.name


TYPES: dict[str, ElemType] = {t.name: t for t in (
    ElemType("bf16", "bfloat16", "f32", 16, 1),
    ElemType("f16", "float16", "f32", 16, 1),
    ElemType("f32", "float32", "f32", 32, 2),
    ElemType("f64", "float64", "f64", 64, 3),
    ElemType("i32", "int32", "i32", 32, 0),
)}
LOW_FLOATS = tuple(n for n, t in TYPES.items() if t.low)          # ('bf16', 'f16')
FLOATS = tuple(n for n, t in TYPES.items() if t.is_float)
CONVERSIONS = {f"to_{n}": n for n in FLOATS}                      # the map fns that convert
ROUNDINGS = {f"round_{n}": n for n in LOW_FLOATS}                 # round to n, held in the compute type


def narrower(fp: str) -> tuple[str, ...]:
    """The float types a program of float type `fp` holds rounded in `fp`: bf16 and f16,
    and f32 in an f64 program."""
    return LOW_FLOATS + (("f32",) if fp == "f64" else ())


def at_width(name: str, fp: str) -> str:
    """The type a declaration or conversion naming float type `name` has in a program
    of float type `fp`: `name`, capped at `fp` (f64 in an f32 program is f32)."""
    return fp if TYPES[name].rank > TYPES[fp].rank else name


def rounding(name: str) -> str:
    """The map fn that rounds a value held in a wider float to type `name`, kept in
    the wider type: round_bf16, round_f16, or round32 (f32 held in f64)."""
    return "round32" if name == "f32" else f"round_{name}"


def promote(a: str, b: str) -> str:
    """The type of an operation on operands of types `a` and `b`: the wider one; two
    different types of one width (f16, bf16) give the next wider float (f32)."""
    if a == b:
        return a
    ta, tb = TYPES[a], TYPES[b]
    if ta.rank != tb.rank:
        return a if ta.rank > tb.rank else b
    return next(t.name for t in TYPES.values() if t.rank == ta.rank + 1)


def round_to(a, name: str) -> np.ndarray:
    """`a` (any float array) as type `name`: a low type is reached through f32 (its
    compute type), so that a value computed in f64 is rounded as the f32 computation
    would be when that one is exact-rounded."""
    a = np.asarray(a)
    t = TYPES[name]
    if t.low:
        return a.astype(np.float32, copy=False).astype(t.numpy)
    return a.astype(t.numpy, copy=False)


def itemsize(name: str) -> int:
    """Bytes per element of a buffer of type `name` (bf16/f16: 2)."""
    return TYPES[name].bits // 8


def is_low_array(a) -> str | None:
    """The low float type name an array holds (bf16 or f16), or None."""
    return type_of_numpy(getattr(a, "dtype", None), LOW_FLOATS)


def type_of_numpy(dtype, names=tuple(TYPES)) -> str | None:
    """The name among `names` of the element type numpy's `dtype` holds, or None (by
    the dtype's name: an array that is no bfloat16 array needs no ml_dtypes)."""
    name = getattr(dtype, "name", None)
    return next((n for n in names if TYPES[n].numpy_name == name), None)


class _ScalarTypes(Mapping):
    """{type name: numpy's scalar type} (bf16: ml_dtypes.bfloat16, imported when read)."""

    def __getitem__(self, name: str):
        return TYPES[name].numpy.type

    def __iter__(self):
        return iter(TYPES)

    def __len__(self) -> int:
        return len(TYPES)


SCALAR_TYPES = _ScalarTypes()
