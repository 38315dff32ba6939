"""Run one fuzzed program on the oracle and on each system under test, and compare.

The oracle is `tests/torch_oracle.py` on the *elaborated* module (before any pass):
float64 torch tensors, every `grad`/`jvp`/`vjp` by torch.autograd, so it shares
neither tgc's optimization passes nor its derivative rules. The systems under test:

- `interp-f64`: `tgc.pipeline.lower` (the whole default pipeline) in float64, then the
  numpy reference interpreter;
- `cpu-f64`: `tgc.compile(text, backend="cpu", dtype="f64")`, native code;
- `lowered-f64`: the CPU backend's lowered program (its lowering stages, through
  `Options.stages`), run kernel by kernel by the `lowered` backend (the numpy
  lowered-program interpreter, `tgc.lower.interp`): the lowering stages checked apart
  from code generation;
- `so-f64`, `so-f32`: the program built by `tgc build` into a shared library and
  called through ctypes as a C caller would (`run_so`: the generated header's orders of
  dims, arguments and outputs, a workspace, updates written into the arguments);
- `NAME-f64` for any other registered backend (`tgc.backends.base.backend_names`):
  `tgc.compile(text, backend=NAME)`; one that cannot run here (`BackendUnavailable`)
  is `skipped`, not a failure. `registered()` names every such system under test
  (less cuda-sim, whose own fuzz tests run it: tests/backends/test_cuda_sim_fuzz.py);
- `interp-f32`, `cpu-f32`, `lowered-f32`, `NAME-f32`: the same in float32, against the
  float64 oracle with a looser bound (reported separately: float32 rounding can flip
  a comparison, a sign or a `where` whose operand is zero in exact arithmetic;
  `f32_comparable` tells the programs free of such steps).

All see the same seeded random inputs (`tgc.ir.inputs.random_inputs`, ids in range).
The error is norm-wise relative, `|got - want| / max(|want|, floor)` (Frobenius norms),
and non-finite entries must agree exactly. The CPU program writes updates in place
into the caller's arrays, so it is given copies.

An update's new value comes back under the target's name, or `W'` when an output is
also named `W` (`Module.update_key`); the oracle reports every update under its
target, so the harness hands the oracle a module whose updates are extra outputs.
"""
from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass, field

import numpy as np

# tgc is imported inside the functions: scripts/fuzz forks its workers from a parent
# that never imported it, so each worker runs one consistent version of the tree.

BACKENDS = ("interp-f64", "cpu-f64", "interp-f32", "cpu-f32", "lowered-f64", "lowered-f32",
            "so-f64", "so-f32", "cuda-sim-f64", "cuda-sim-f32")   # scripts/fuzz's choices
DEFAULT_BACKENDS = ("interp-f64", "cpu-f64", "lowered-f64")
DTYPES = ("f64", "f32")


def registered() -> tuple[str, ...]:
    """The interpreter and every registered backend but the emulated ones
    (`backends_util`), in both float types: what the saved regressions run on."""
    from backends_util import EMULATED, backends

    return tuple(f"{b}-{d}" for d in DTYPES for b in ("interp", *backends(exclude=EMULATED)))
RTOL = {"f64": 1e-6, "f32": 2e-3}
FLOOR = {"f64": 1e-6, "f32": 1e-2}


@dataclass
class Outcome:
    """What one backend did with one program: `kind` is ok | mismatch | error | skipped
    (the backend cannot run here)."""
    backend: str
    kind: str
    detail: str = ""
    output: str = ""          # the first output that disagreed
    error: float = 0.0

    def signature(self) -> tuple:
        """What the shrinker keeps: the backend and the kind (and an error's class and gist)."""
        if self.kind == "error":
            return (self.backend, "error", _gist(self.detail))
        return (self.backend, self.kind)


@dataclass
class Report:
    """The oracle's verdict on the program (`valid`) and each backend's outcome."""
    text: str
    valid: bool = True
    invalid_reason: str = ""
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes.values() if o.kind not in ("ok", "skipped")]


def _gist(detail: str) -> str:
    """An exception's class and message with names and numbers blanked: its kind."""
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    first = re.sub(r"'[^']*'|\"[^\"]*\"|%\w+|\b\d+(\.\d+)?\b|<[^>]*>", "_", first)
    return first[:80]


def _oracle_module(m: "Module") -> tuple["Module", dict[str, str]]:
    """`m` with each update as an extra output; {that output's name: the update's result key}."""
    from tgc.ir.module import Module, Output

    outs, keys = list(m.outputs), {}
    for i, u in enumerate(m.updates):
        nm = f"__update{i}"
        outs.append(Output(nm, u.value, m.args[u.target].order))
        keys[nm] = m.update_key(u.target)
    return Module(dict(m.dims), dict(m.edges), dict(m.args), outs, []), keys


def oracle(m: "Module", inputs, dims) -> dict[str, np.ndarray]:
    import torch_oracle

    om, keys = _oracle_module(m)
    res = torch_oracle.evaluate(om, inputs, dims=dims)
    return {keys.get(k, k): v for k, v in res.items()}


def run_backend(backend: str, text: str, inputs, dims, *, path: str | None = None,
                options: dict | None = None) -> dict[str, np.ndarray]:
    """The results of `text` on `backend` ({output or update key: array}). `path`: where
    `text` is written beside the files it imports (it is compiled from there); `options`:
    more `Options` fields (`memory_budget`, ...) for every backend."""
    from tgc.options import Options

    kind, dtype = backend.rsplit("-", 1)
    np_t = np.float64 if dtype == "f64" else np.float32
    # float64 arrays take the program's float type; a declared narrower type keeps its array
    ins = {k: (v.astype(np_t) if v.dtype == np.float64 else v.copy()) for k, v in inputs.items()}
    extra = dict(options or {})
    if kind == "interp":
        from tgc import pipeline
        from tgc.frontend import compile_source
        from tgc.ir.interp import evaluate

        m = compile_source(text, path or "<fuzz>", Options(dtype=dtype))
        low = pipeline.lower(m, Options(dtype=dtype, **extra)).module
        return evaluate(low, ins, dtype=dtype, dims=dims)
    if kind == "so":
        return run_so(text, ins, dims, dtype, path=path, options=extra)
    import tgc
    from tgc import pipeline
    from tgc.backends.base import BackendUnavailable, backend_names, get_backend

    if kind not in backend_names() or dtype not in DTYPES:
        raise ValueError(f"unknown backend '{backend}' (have: interp, {', '.join(backend_names())}; "
                         f"each -f64 or -f32)")
    why = get_backend(kind).unavailable()
    if why:
        raise BackendUnavailable(why)
    options = Options(**extra).with_(compile_jobs=1)
    if kind == "lowered":   # the CPU's lowered program, run by the numpy lowered-program interpreter
        options = options.with_(stages=pipeline.lowering("cpu"))
    prog = tgc.compile(path or text, backend=kind, dtype=dtype, options=options)
    return prog.run(ins, dict(dims) or None)


_HEADER_DIM = re.compile(r"#define PROG_DIM_(\w+) (\d+)")
_HEADER_ARG = re.compile(r"#define PROG_ARG_\w+ (\d+)\s+/\* (?:input|param|state) (\S+?): (\w+) ")
_HEADER_OUT = re.compile(r"#define PROG_OUT_\w+ (\d+)\s+/\* (\S+?): (\w+) ")


def run_so(text: str, inputs, dims, dtype: str, *, path: str | None = None,
           options: dict | None = None) -> dict[str, np.ndarray]:
    """The results of `text` built by `tgc build` into a shared library and called through
    ctypes as a C caller would: the dims, arguments and outputs in the orders its generated
    header names, a workspace of `prog_workspace_bytes`, updates written into the argument
    arrays (copies of `inputs`). `path`: the program's file beside its imports;
    `options`: only `memory_budget` (`--memory-budget`) is passed on."""
    import ctypes
    import shutil
    import tempfile
    from pathlib import Path

    from click.testing import CliRunner

    from tgc.backends.base import BackendUnavailable
    from tgc.cli import main
    from tgc.frontend import compile_source
    from tgc.options import Options

    if shutil.which("cc") is None:
        raise BackendUnavailable("tgc build needs a C compiler (cc)")
    m = compile_source(text, path or "<fuzz>", Options(dtype=dtype))
    env = m.bind_dims(dims)
    np_t = np.float64 if dtype == "f64" else np.float32
    flags = []
    if (options or {}).get("memory_budget") is not None:
        flags = ["--memory-budget", str(options["memory_budget"])]
    with tempfile.TemporaryDirectory() as d:
        src, lib_path = Path(d) / "prog.tg", Path(d) / "libprog.so"
        if path is not None:   # beside the files it imports
            src = Path(path)
        else:
            src.write_text(text)
        res = CliRunner().invoke(main, ["build", str(src), "-o", str(lib_path), "--dtype", dtype, *flags])
        if res.exit_code != 0:
            raise RuntimeError(f"tgc build failed ({res.exit_code}): {res.output}{res.exception!r}")
        header = (Path(d) / "prog.h").read_text()
        lib = ctypes.CDLL(str(lib_path))
    symbolic = {k.lower(): k for k in env}
    dim_list = sorted((int(i), symbolic[n.lower()]) for n, i in _HEADER_DIM.findall(header))
    # each argument's and output's C type as the header gives it: a bf16/f16 tensor crosses as
    # 2-byte elements where its buffer holds them, else (a scalar, ...) in the float type
    c_type = {n: t for _, n, t in _HEADER_ARG.findall(header)}
    c_type.update({("out", n): t for _, n, t in _HEADER_OUT.findall(header)})
    arg_list = sorted((int(i), n) for i, n, _ in _HEADER_ARG.findall(header))
    out_list = sorted((int(i), n) for i, n, _ in _HEADER_OUT.findall(header))
    assert [n for _, n in arg_list] == list(m.args), (arg_list, list(m.args))
    outs = {o.name: o for o in m.outputs}
    assert sorted(n for _, n in out_list) == sorted(outs), (out_list, list(outs))
    args = {n: np.array(inputs[n], _so_type(m.args[n].dtype, c_type[n]), order="C", copy=True) for _, n in arg_list}
    results = {n: np.zeros(tuple(env[m.edges[e]] for e in outs[n].order), _so_type(outs[n].value.dtype, c_type["out", n]))
               for _, n in out_list}
    c_dims = (ctypes.c_int64 * max(1, len(dim_list)))(*[env[n] for _, n in dim_list])
    c_args = (ctypes.c_void_p * max(1, len(arg_list)))(*[args[n].ctypes.data for _, n in arg_list])
    c_outs = (ctypes.c_void_p * max(1, len(out_list)))(*[results[n].ctypes.data for _, n in out_list])
    assert lib.prog_init_default() == 0
    lib.prog_workspace_bytes.restype = ctypes.c_int64
    ws = np.zeros(lib.prog_workspace_bytes(c_dims) + 64, np.uint8)
    addr = ws.ctypes.data + (-ws.ctypes.data) % 64
    rc = lib.prog_run(c_dims, c_args, c_outs, ctypes.c_void_p(addr))
    if rc != 0:
        raise RuntimeError(f"prog_run returned {rc}")
    for u in m.updates:
        results[m.update_key(u.target)] = args[u.target]
    return results


def _np_type(t: str, build: str):
    """The numpy type a compiled program of float type `build` returns for a result of type `t`."""
    if t == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if t == "f64" and build == "f32":
        t = "f32"
    return np.dtype({"f16": np.float16, "f32": np.float32, "f64": np.float64, "i32": np.int32}[t])


def _so_type(t: str, c: str):
    """The numpy type of a `tgc build` argument or output of element type `t` that the
    header gives the C type `c`: the 16 bits of bf16/f16 as `uint16_t`, else `c`."""
    if c == "uint16_t":
        if t == "bf16":
            import ml_dtypes

            return ml_dtypes.bfloat16
        return np.float16
    return {"int32_t": np.int32, "float": np.float32, "double": np.float64}[c]


def check(text: str, dims: dict[str, int], backends=DEFAULT_BACKENDS, seed: int = 0, *,
          files: dict[str, str] | None = None, options: dict | None = None,
          oracle_text: str | None = None, tol: float = 0.0, oracle_kind: str = "torch") -> Report:
    """Run `text` on the oracle and on every backend; the report.

    `files`: other .tg files by name ({"lib.tg": text}) that `text` imports: all are written
    to a fresh folder and compiled from there. `options`: more `Options` fields for every
    backend (`memory_budget`). `oracle_text`: the program the oracle runs instead of
    `text` (the same arguments and outputs; e.g. without custom rules that equal the true
    derivative). `tol`: a least relative bound and floor (programs of bf16/f16 values).
    `oracle_kind`: "torch" (above), or "interp0": the reference interpreter on the program
    through the pipeline at `opt_level=0` (derivatives by tgc's rules, no optimization), for
    programs whose every bf16/f16 rounding the oracle must repeat: a gradient that cancels to
    rounding noise (the sum of a layernorm) has noise no float64 oracle can match."""
    import tempfile

    if files:
        with tempfile.TemporaryDirectory() as d:
            for nm, body in files.items():
                with open(os.path.join(d, nm), "w") as f:
                    f.write(body)
            path = os.path.join(d, "prog.tg")
            with open(path, "w") as f:
                f.write(text)
            return _check(text, dims, backends, seed, path, options, oracle_text, tol, oracle_kind)
    return _check(text, dims, backends, seed, None, options, oracle_text, tol, oracle_kind)


def _check(text, dims, backends, seed, path, options, oracle_text, tol, oracle_kind="torch") -> Report:
    import torch_oracle
    from tgc.backends.base import BackendUnavailable
    from tgc.frontend import compile_source
    from tgc.ir.inputs import random_inputs
    from tgc.options import Options

    rep = Report(text)
    types = {}
    try:
        m = compile_source(text, path or "<fuzz>", Options(dtype="f64"))
        env = m.bind_dims(dims)
        inputs = random_inputs(m, env, seed, "f64")
        om = m if oracle_text is None else compile_source(oracle_text, path or "<fuzz>", Options(dtype="f64"))
        if oracle_kind == "interp0":
            from tgc import pipeline
            from tgc.ir.interp import evaluate

            low = pipeline.lower(om, Options(dtype="f64", opt_level=0)).module
            ref = evaluate(low, inputs, dtype="f64", dims=dims)
            want = {k: np.asarray(v, np.float64) for k, v in ref.items()}
            # each result's type as the language gives it (the elaborated program's)
            types = {o.name: o.value.dtype for o in m.outputs}
            types.update({m.update_key(u.target): m.args[u.target].dtype for u in m.updates})
        else:
            want = oracle(om, inputs, dims)
    except Exception as e:  # noqa: BLE001 -- a program the oracle cannot run is not a test
        rep.valid, rep.invalid_reason = False, f"{type(e).__name__}: {e}"
        return rep
    bad = [k for k, v in want.items() if not np.all(np.isfinite(v))]
    if bad:
        rep.valid, rep.invalid_reason = False, f"the oracle's '{bad[0]}' is not finite"
        return rep
    for b in backends:
        dtype = b.rsplit("-", 1)[1]
        try:
            # the keywords only where given: tests replace run_backend by a 4-argument function
            more = {k: v for k, v in (("path", path), ("options", options)) if v is not None}
            got = run_backend(b, text, inputs, dims, **more)
        except BackendUnavailable as e:
            rep.outcomes[b] = Outcome(b, "skipped", str(e))
            continue
        except Exception as e:  # noqa: BLE001 -- any exception is a finding
            rep.outcomes[b] = Outcome(b, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}")
            continue
        if set(got) != set(want):
            rep.outcomes[b] = Outcome(b, "mismatch", f"result keys {sorted(got)} != oracle's {sorted(want)}")
            continue
        # a compiled program returns each result in the type the language gives it
        # (docs/dtypes.md; f64 is f32 in an f32 build); the reference interpreter's `evaluate`
        # holds f32 values in float64, and a C caller of `tgc build` gets what the header says
        if types and not b.startswith(("so-", "interp-")):
            odd = [k for k, t in types.items() if k in got and np.asarray(got[k]).dtype != _np_type(t, dtype)]
            if odd:
                rep.outcomes[b] = Outcome(b, "mismatch", f"'{odd[0]}' is {np.asarray(got[odd[0]]).dtype}, "
                                          f"not {types[odd[0]]}", odd[0])
                continue
        worst = None
        for k in want:
            err = torch_oracle.rel_error(np.asarray(got[k], np.float64), want[k], max(FLOOR[dtype], tol))
            if not err <= max(RTOL[dtype], tol) and (worst is None or err > worst[1]):
                worst = (k, err)
        if worst is None:
            rep.outcomes[b] = Outcome(b, "ok")
        else:
            k, err = worst
            rep.outcomes[b] = Outcome(b, "mismatch", _describe(k, got[k], want[k], err), k, err)
    return rep


def check_isolated(text: str, dims: dict[str, int], backends=DEFAULT_BACKENDS, seed: int = 0,
                   timeout: float = 300) -> Report:
    """`check` in a forked child: a crash (an LLVM assertion aborts the process) or a hang
    becomes every backend's error outcome instead of taking the caller down."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_check_into, args=(send, text, dims, tuple(backends), seed))
    child.start()
    send.close()
    rep = None
    try:
        if recv.poll(timeout):
            rep = recv.recv()
    except EOFError:
        pass
    child.join(5 if rep is not None else 0.1)
    if child.is_alive():
        child.kill()
        child.join()
    if rep is not None:
        return rep
    if len(backends) > 1:   # which backend: one child each
        rep = Report(text)
        for b in backends:
            one = check_isolated(text, dims, (b,), seed, timeout)
            if not one.valid:
                return one
            rep.outcomes.update(one.outcomes)
        return rep
    why = (f"crash: the process died with signal {-child.exitcode}" if child.exitcode and child.exitcode < 0
           else f"timeout: no result within {timeout:.0f} s" if child.exitcode is None or child.exitcode == -9
           else f"crash: exit status {child.exitcode}")
    rep = Report(text)
    rep.outcomes = {b: Outcome(b, "error", why) for b in backends}
    return rep


def _check_into(conn, text, dims, backends, seed) -> None:
    conn.send(check(text, dims, backends, seed))
    conn.close()
    os._exit(0)   # at once: no exit handlers of the parent's libraries (thread pools) in the child


def _describe(key: str, got, want, err: float) -> str:
    with np.printoptions(precision=6, threshold=20, edgeitems=3, linewidth=100):
        return (f"output '{key}': relative error {err:.3g}\n"
                f"  got  {np.asarray(got)!r}\n  want {np.asarray(want)!r}")


def no_cache() -> None:
    """Compiled programs are not cached on disk (thousands of one-off programs)."""
    os.environ["TGC_CACHE"] = "off"


_STEPS = re.compile(r"\bsign\(|\bwhere\(|\bmax\(|\bmin\(|\bmax\[|\bmin\[|\brelu\(|\babs\(|[<>]=?(?!\s*\w+\])|==|!="
                    r"|\brandn\[|\bdropout\[")


def f32_comparable(text: str) -> bool:
    """Whether a program has no step (sign, comparison, where, max/min, relu, abs) whose
    float32 rounding could flip it; indicators such as `[s <= t]` compare indices and are
    exact. `randn` draws other values in f32 (from 24-bit integers, docs/randomness.md) than
    in f64 (53-bit), and `dropout` compares a draw: neither is comparable either. The CI
    slice holds float32 only to programs that pass."""
    body = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    body = re.sub(r"\[[^\[\]]*[<>=][^\[\]]*\]", "", re.sub(r"->", "", body))
    return not _STEPS.search(body)
