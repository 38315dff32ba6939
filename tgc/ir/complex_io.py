"""Complex arrays at a program's boundary: numpy complex64/complex128 in and out.

The front end makes a complex tensor a real one with a last edge `re.im` of size 2
(see tgc/frontend/complexes.py): part 0 real, part 1 imaginary. That is numpy's own
interleaved layout of a complex array, so a C-contiguous complex array of shape S
is, without a copy, a float array of shape S + (2,) (`a.view(float)` gives the
bytes the same meaning), and back. The interpreters and the compiled program call
these functions on their arguments and results; nothing else knows about complex
values. A float array that already has the trailing axis of 2 is taken as is (raw
pairs, as `--random-inputs` makes them).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

RI = "re.im"   # the parts edge: a complex value's last edge, index 0 real, 1 imaginary
COMPLEX_OF = {"f32": np.complex64, "f64": np.complex128}
FLOAT_OF = {"f32": np.float32, "f64": np.float64}


def is_complex_order(order) -> bool:
    return bool(order) and order[-1] == RI


def complex_args(module) -> set[str]:
    """The names of the module's complex arguments."""
    return {a.name for a in module.args.values() if is_complex_order(a.order)}


def complex_results(module) -> set[str]:
    """The result keys (outputs and updated targets' keys) that hold complex values."""
    keys = {o.name for o in module.outputs if is_complex_order(o.order)}
    keys |= {module.update_key(u.target) for u in module.updates if is_complex_order(module.args[u.target].order)}
    return keys


def as_pairs(a, dtype: str):
    """A complex array as floats of `dtype` with a last axis of 2, a view when `a` is
    C-contiguous complex of the matching width; anything else is returned as given."""
    if isinstance(a, (complex, np.complexfloating)) or (isinstance(a, np.ndarray) and a.dtype.kind == "c"):
        c = np.require(np.asarray(a, COMPLEX_OF[dtype]), requirements="C")
        return c.reshape(c.shape + (1,)).view(FLOAT_OF[dtype])
    return a


def as_complex(a: np.ndarray) -> np.ndarray:
    """Floats with a last axis of 2 as a complex array (a view); complex stays."""
    if a.dtype.kind == "c":
        return a
    a = np.require(a, requirements="C")
    return a.view(np.complex64 if a.dtype == np.float32 else np.complex128)[..., 0]


def not_pairs(name: str, a, order) -> str | None:
    """Why `a` cannot be the complex argument `name` of edges `order` (parts edge
    last): a real array without the trailing axis of 2; None when it can be."""
    if isinstance(a, (complex, np.complexfloating)) or getattr(getattr(a, "dtype", None), "kind", "c") == "c":
        return None
    if np.ndim(a) == len(order) and np.shape(a)[-1:] == (2,):
        return None
    edges = ", ".join(order[:-1])
    return (f"input '{name}' is complex ([{edges}]): pass a complex array, or its float pairs with a last "
            f"axis of 2, not a real array of shape {np.shape(a)}")


def pairs_inputs(module, inputs: Mapping, dtype: str | None, error=ValueError) -> dict:
    """`inputs` with each complex argument's array as float pairs; `error` (raised
    with the reason) for a real array where a complex one belongs."""
    names = complex_args(module)
    if not names:
        return dict(inputs)
    for k in names & inputs.keys():
        why = not_pairs(k, inputs[k], module.args[k].order)
        if why:
            raise error(why)
    return {k: as_pairs(v, dtype or module.args[k].dtype) if k in names else v for k, v in inputs.items()}


def complex_outputs(module, result: dict) -> dict:
    """`result` with each complex output's float pairs viewed as complex."""
    for k in complex_results(module):
        if k in result:
            result[k] = as_complex(result[k])
    return result
