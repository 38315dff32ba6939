"""The checks of a call's inputs, written once for everything that runs a program:
the reference interpreter (`tgc.ir.interp`, and the lowered one through it), the
runtime of compiled programs (`tgc.runtime.program.Program`), the CUDA backend's
device arrays (`tgc.backends.cuda.runtime`) and `tgc.torch`. So a program refuses
the same inputs with the same words whichever runs it: the names it takes, each
input's shape, its element type (ids are integers, floats are floats), and what an
update target must be (an array of its own type, written in place).

The checks only read; converting an input to the program's type is the caller's.
"""
from __future__ import annotations

import sys
from typing import Collection, Iterable, Sequence

import numpy as np

from tgc.ir.diag import did_you_mean
from tgc.ir.dtypes import LOW_FLOATS, TYPES, type_of_numpy


class EvalError(RuntimeError):
    """A runtime error in the user's inputs (names, shapes, dtypes, gather ids)."""


def check_names(names: Sequence[str], given: Iterable[str], error: type[Exception] = EvalError,
                what: str = "input", required: Collection[str] | None = None) -> None:
    """`given` names exactly the program's inputs `names` (in any order): else `error`
    naming the first missing one, or the first unexpected one (`what`: how the
    caller calls an input, "argument" in `tgc.torch`). With `required`, only those of
    `names` must be given (a data-parallel step's inputs that no part of it reads may
    be left out)."""
    given = list(given)
    missing = [n for n in names if (required is None or n in required) and n not in given]
    if missing:
        more = f"and {len(missing) - 1} more; " if len(missing) > 1 else ""
        raise error(f"missing {what} '{missing[0]}' ({more}{_takes(names)})")
    check_known(names, given, error, what)


def check_known(names: Sequence[str], given: Iterable[str], error: type[Exception] = EvalError,
                what: str = "input", suggest: bool = False) -> None:
    """Every name in `given` is one of the program's inputs `names` (some may be left
    out); with `suggest`, the message ends with the closest input's name, when one is
    close (`tgc.ir.diag.did_you_mean`: `tgc run`, whose names come from file names)."""
    extra = [n for n in given if n not in names]
    if extra:
        hint = did_you_mean(extra[0], names) if suggest else ""
        raise error(f"unexpected {what} '{extra[0]}' ({_takes(names)})" + hint)


LISTED = 16   # a program of more inputs names its first LISTED in a message, and their count


def _takes(names: Sequence[str]) -> str:
    """'the program takes: a, b' (or, past LISTED names, 'the program takes N: the first ones, ...')."""
    names = list(names)
    if len(names) <= LISTED:
        return f"the program takes: {', '.join(names)}"
    return f"the program takes {len(names)}: {', '.join(names[:LISTED])}, ..."


def check_shape(name: str, shape: tuple, want: tuple, edges: Sequence[str]) -> None:
    """Input `name` has the shape `want` (the sizes of its `edges`, in its order)."""
    if tuple(shape) != tuple(want):
        sizes = ", ".join(f"{e}={n}" for e, n in zip(edges, want))
        raise EvalError(f"input '{name}' has shape {tuple(shape)}, expected {tuple(want)} ([{sizes}])")


def check_element_type(name: str, dtype, want: str, what: str | None = None, numbers: bool = False) -> None:
    """An array of element type `dtype` may be input `name` of type `want`: ids (i32)
    are integers; floats are floats (numpy's, or bf16/f16 arrays of ml_dtypes), which
    the caller converts to the program's type; with `numbers` (the reference
    interpreter, whose arithmetic is numpy's) integers and booleans too. `what` names
    the float type in the message (default: `want`)."""
    dtype = np.dtype(dtype)
    if want == "i32":
        if dtype.kind not in "iu":
            raise EvalError(f"input '{name}' holds ids (i32): pass integers, not {dtype}")
        return
    if numbers and dtype.kind in "iub":
        return
    if dtype.kind != "f" and type_of_numpy(dtype, LOW_FLOATS) is None:
        raise EvalError(f"input '{name}' must be a float array ({what or want}), not {dtype}")


def check_ids_fit(name: str, a: np.ndarray) -> None:
    """Integer ids must fit in int32 (the type gathers index with): never wrapped."""
    if a.dtype != np.int32 and a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise EvalError(f"input '{name}': ids do not fit in int32")


def check_updated_dtype(name: str, given: np.dtype, want: np.dtype, what: str | None = None) -> None:
    """An argument that an `update` writes in place must be an array of its own element
    type `want` (`what` names it where that is not numpy's name): arguments that are
    only read are converted, but a converted copy of an updated one would receive the
    new values instead of the caller's array."""
    if given != want:
        raise EvalError(f"'{name}' is updated in place, so it must be {what or np.dtype(want).name}, "
                        f"not {given} (only arguments that are only read are converted)")


def check_writable(name: str, a: np.ndarray, how: str = "is updated in place") -> None:
    """An update target's array can be written in place, one element per value: a
    stride-0 view (numpy's as_strided, torch's `expand`), or any view whose elements
    overlap (`overlaps`), keeps only the last of the values written to its shared
    elements, so it is refused, as torch refuses an in-place
    op on an expanded tensor. The one check of every array tgc writes into: a call's
    update targets, and the params a data-parallel broadcast sets (`how` says which
    write it is, for the message)."""
    if not a.flags.writeable:
        raise EvalError(f"'{name}' {how}, but the array is read-only")
    if any(stride == 0 and n > 1 for stride, n in zip(a.strides, a.shape)):
        raise EvalError(f"'{name}' {how}, but its elements share memory (a stride-0 view, "
                        f"such as an expanded or broadcast one): pass an array with one element per value")
    if overlaps(a):
        raise EvalError(f"'{name}' {how}, but its elements share memory (a view whose strides make "
                        f"elements overlap, as as_strided can): pass an array with one element per value")


def overlaps(a: np.ndarray) -> bool:
    """Whether two elements of `a` share a byte. Nested strides (each axis, by the size
    of its stride, steps over the whole extent of the smaller ones: every C or Fortran
    order array, slices, transposes, negative steps) never overlap; otherwise the
    elements' offsets are compared (an interleaved view whose cells are distinct is
    not refused)."""
    if a.flags.c_contiguous or a.flags.f_contiguous:
        return False
    axes = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    extent = a.itemsize
    for stride, n in axes:
        if stride < extent:
            break
        extent = stride * (n - 1) + extent
    else:
        return False
    if a.size > 1 << 26:   # too many to compare: refused as overlapping (no layout torch or numpy makes)
        return True
    offsets = np.zeros(1, np.int64)
    for stride, n in zip(a.strides, a.shape):
        offsets = np.add.outer(offsets, np.arange(n, dtype=np.int64) * stride).ravel()
    offsets.sort()
    return bool(np.any(np.diff(offsets) < a.itemsize))


def dlpack_view(name: str, value):
    """A CPU array that is not numpy's but speaks DLPack (a torch CPU tensor) as a
    numpy array over the same memory, so that an update writes into it; others as given.
    A torch bfloat16 tensor, which numpy's DLPack import refuses, is viewed as int16
    through DLPack and then as ml_dtypes.bfloat16 (still no copy)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
        return value
    try:
        if str(getattr(value, "dtype", "")) == "torch.bfloat16" and "torch" in sys.modules:
            # numpy's DLPack has no bfloat16: the same memory as int16, viewed as ml_dtypes'
            return np.from_dlpack(value.view(sys.modules["torch"].int16)).view(TYPES["bf16"].numpy)
        return np.from_dlpack(value)
    except (RuntimeError, BufferError, TypeError, ValueError) as e:
        raise EvalError(f"input '{name}': {type(value).__name__} does not give its memory to numpy ({e}); "
                        f"pass a CPU tensor (detached from autograd), or a numpy array") from None
