"""Helpers of the f32 numerics suite (`tests/e2e/test_numerics_f32.py`).

A `Case` is a .tg program, deterministic inputs and a hand-written PyTorch reference.
`compare(case, backend)` runs the reference in float64 (the wanted values) and in
float32 (PyTorch's own error), runs tgc's f32 build on `backend`, and returns one
`Result` per output and update. The measures and the pass rule are described in the
suite's docstring; they are implemented here:

- `normwise_err(got, want)`  = max|got - want| / max(max|want|, FLOOR)
- `elementwise_err(got, want)`[i] = |got[i] - want[i]| / max(|want[i]|, FLOOR)

Non-finite values: where `want` is non-finite, `got` must be the same value (the same
infinity, or NaN), else the error is inf; a non-finite `got` where `want` is finite is
an error of inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np

from backends_util import EMULATED, backends, compile_on

FLOOR = 1e-30     # the tiny absolute floor of the scale divided by (see the suite's docstring)
FACTOR = 10.0     # tgc may be this many times worse than PyTorch f32 ...
ABS_OK = 1e-6     # ... or always within this relative error
EPS64 = 2.0 ** -52

# Every tgc backend the suite runs. "interp" is the reference interpreter on the lowered
# module; any other name is a registered backend (`backends_util.backends`: a new backend
# folder runs here without editing this), passed to `tgc.compile(..., backend=name)`; one
# that cannot run here skips. cuda-sim's own tests cover it (a g++ build per case).
BACKENDS = ("interp", *backends(exclude=EMULATED))


@dataclass
class Case:
    id: str
    src: str
    inputs: dict            # name -> numpy array (any float type; rounded to f32 once) or i32
    ref: Callable           # ref(T) -> {output name: tensor}; T.name is a torch tensor
    elementwise: bool = False   # per-element errors (elementwise functions' tails)
    note: str = ""
    options: dict | None = None   # `tgc.options.Options` fields the program is compiled with (default: none)

    def f32_inputs(self) -> dict[str, np.ndarray]:
        out = {}
        for k, v in self.inputs.items():
            a = np.asarray(v)
            out[k] = a.astype(np.int32) if a.dtype.kind in "iu" else a.astype(np.float32)
        return out


@dataclass
class Result:
    name: str
    tgc_err: float          # normwise; for elementwise cases the error at the worst element
    torch_err: float
    passed: bool
    vacuous: bool           # torch's own f32 error is inf everywhere: nothing to compare to
    where: str = ""         # elementwise: the worst element's index and values


def normwise_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    fin = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), fin):
        return math.inf
    if (~fin).any() and not np.array_equal(got[~fin], want[~fin], equal_nan=True):
        return math.inf
    if not fin.any():
        return 0.0
    d = np.max(np.abs(got[fin] - want[fin]))
    return float(d / max(float(np.max(np.abs(want[fin]))), FLOOR))


def elementwise_err(got, want) -> np.ndarray:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    with np.errstate(all="ignore"):
        err = np.abs(got - want) / np.maximum(np.abs(want), FLOOR)
    fin_w, fin_g = np.isfinite(want), np.isfinite(got)
    same_nonfinite = ~fin_w & ((got == want) | (np.isnan(got) & np.isnan(want)))
    err = np.where(fin_w & fin_g, err, np.inf)
    return np.where(same_nonfinite, 0.0, err)


def ok(tgc_err, torch_err):
    """The pass rule (scalars or arrays alike)."""
    return (tgc_err <= FACTOR * torch_err) | (tgc_err <= ABS_OK)


# ---------------------------------------------------------------- running

def torch_outputs(case: Case, dtype) -> dict[str, np.ndarray]:
    import torch

    T = SimpleNamespace()
    for k, v in case.f32_inputs().items():
        t = torch.from_numpy(np.array(v))
        setattr(T, k, t if v.dtype == np.int32 else t.to(dtype))
    out = case.ref(T)
    return {k: np.asarray(v.detach().to(torch.float64).numpy() if hasattr(v, "detach") else v, np.float64)
            for k, v in out.items()}


def tgc_outputs(case: Case, backend: str) -> dict[str, np.ndarray]:
    from tgc.options import Options

    inputs = case.f32_inputs()
    if backend == "interp":
        from tgc import pipeline
        from tgc.frontend import compile_source
        from tgc.ir.interp import evaluate

        opts = Options(dtype="f32", **(case.options or {}))
        module = compile_source(case.src, f"<{case.id}>", opts)
        lowered = pipeline.lower(module, opts).module
        return evaluate(lowered, inputs, dtype="f32")

    prog = compile_on(case.src, backend, dtype="f32", options=Options(**(case.options or {})))
    arrays = {k: v.copy() for k, v in inputs.items()}
    result = dict(prog(**arrays))
    for target in prog.updates:     # updates are written in place: the caller's arrays are what counts
        result[prog.module.update_key(target)] = arrays[target]
    return result


_REF_CACHE: dict[str, tuple[dict, dict]] = {}


def references(case: Case) -> tuple[dict, dict]:
    """(want: torch float64, torch float32) outputs of the case, computed once."""
    if case.id not in _REF_CACHE:
        import torch

        _REF_CACHE[case.id] = (torch_outputs(case, torch.float64), torch_outputs(case, torch.float32))
    return _REF_CACHE[case.id]


def compare(case: Case, backend: str) -> list[Result]:
    want, t32 = references(case)
    got = tgc_outputs(case, backend)
    assert set(got) == set(want), f"outputs: tgc {sorted(got)}, reference {sorted(want)}"
    results = []
    for name in want:
        w, t, g = want[name], t32[name], np.asarray(got[name], np.float64)
        assert g.shape == w.shape, f"{name}: tgc shape {g.shape}, reference {w.shape}"
        if case.elementwise:
            te, ge = elementwise_err(t, w), elementwise_err(g, w)
            # where PyTorch's formula gives exactly 0 in float64 and in float32 (sigmoid'(80)
            # as s (1 - s), tanh'(30) as 1 - t^2), the reference cannot tell a tiny true value
            # from 0: there tgc must be 0 to float64's resolution of the output
            fin = np.isfinite(w)
            resolution = EPS64 * (float(np.max(np.abs(w[fin]))) if fin.any() else 0.0)
            unresolved = (w == 0) & (t == 0) & (np.abs(g) <= resolution)
            ge = np.where(unresolved, 0.0, ge)
            good = ok(ge, te)
            with np.errstate(invalid="ignore"):   # inf - inf where both are inf: a passing element
                slack = np.where(good, -np.inf, ge - FACTOR * te)   # the worst failing element, else the
            i = int(np.argmax(slack)) if (~good).any() else int(np.argmax(ge))  # largest tgc error
            idx = np.unravel_index(i, w.shape) if w.ndim else ()
            where = (f"at {tuple(int(j) for j in idx)}: want {w.flat[i]:.9g}, tgc {g.flat[i]:.9g}, "
                     f"torch f32 {t.flat[i]:.9g}")
            results.append(Result(name, float(ge.flat[i]), float(te.flat[i]), bool(good.all()),
                                  bool(np.isinf(te).all()), where))
        else:
            te, ge = normwise_err(t, w), normwise_err(g, w)
            results.append(Result(name, ge, te, bool(ok(ge, te)), math.isinf(te)))
    return results


def report(case: Case, backend: str, results: list[Result]) -> str:
    lines = [f"{case.id} [{backend}]" + (" (element-wise)" if case.elementwise else "")]
    for r in results:
        lines.append(f"  {'ok  ' if r.passed else 'FAIL'} {r.name}: tgc_err {r.tgc_err:.3g}, "
                     f"torch_err {r.torch_err:.3g}" + (f"  {r.where}" if r.where else ""))
    return "\n".join(lines)


def case_registry(cases: list) -> Callable:
    """`case(id, src, inputs, elementwise=False, options=None)`: a decorator that registers
    its reference function as a `Case` in `cases`."""
    def case(id, src, inputs, elementwise=False, options=None):
        def register(ref):
            cases.append(Case(id, src, inputs, ref, elementwise, options=options))
            return ref
        return register
    return case


def rng(seed):
    return np.random.default_rng(seed)


def normal(seed, shape, scale=1.0, mean=0.0):
    """Normal draws of `shape` (mean, scale) from the seeded generator."""
    return mean + scale * rng(seed).standard_normal(shape)


def leaves(*ts):
    """Fresh copies of torch tensors that require gradients (a case's reference inputs)."""
    return [t.detach().clone().requires_grad_(True) for t in ts]


def grads(y, xs, create_graph=False):
    """torch's gradients of `y` with respect to `xs` (`create_graph` for a second order)."""
    import torch

    return torch.autograd.grad(y, xs, create_graph=create_graph)


def assert_not_worse_than_torch(case: Case, backend: str) -> None:
    """tgc's f32 outputs of `case` on `backend` within 10x PyTorch f32's error (`ok`),
    something compared."""
    results = compare(case, backend)
    text = report(case, backend, results)
    assert not all(r.vacuous for r in results), f"PyTorch f32 is inf everywhere: nothing compared\n{text}"
    assert all(r.passed for r in results), "tgc f32 is worse than 10x PyTorch f32\n" + text
