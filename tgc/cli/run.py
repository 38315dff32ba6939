"""`tgc run`: compile a program, feed it inputs, and write or summarize its outputs."""
from __future__ import annotations

import dataclasses
import io
import re
import zipfile
from contextlib import contextmanager

import click

import numpy as np

from tgc import pipeline
from tgc.cli.errors import SOURCE, handle_errors, report
from tgc.cli.interrupt import waiting
from tgc.cli.flags import AUTOCAST, DIM_FLAGS, FP_STRICT, MEMORY_BUDGET, LoweringBackends, dims_option, report_memory
from tgc.cli.outputs import check_outputs, sources
from tgc.fsutil import NotASource, open_regular, write_atomic
from tgc.ir import interp
from tgc.ir.inputs import random_inputs as make_random_inputs
from tgc.ir.dtypes import LOW_FLOATS, TYPES, is_low_array, narrower
from tgc.ir.complex_io import COMPLEX_OF, RI, is_complex_order
from tgc.ir.input_checks import check_known
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.module import Module
from tgc.ir.sizes import SizeError

DEFAULT_RANDOM_DIM = 4


def check_dim_flags(module, dims: dict[str, int]) -> None:
    """-D/--dim names only symbolic dims of `module` (a usage error otherwise; `Module.dim_error`)."""
    for d, n in dims.items():
        why = module.dim_error(d, n)
        if why:
            raise click.BadParameter(why, param_hint=DIM_FLAGS)


def _input_binding(ctx, param, value):
    out = {}
    for item in value:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"'{item}' is not NAME=FILE.npy")
        out[name] = path
    return out


def _load_array(path: str, what: str) -> np.ndarray:
    try:
        with open_regular(path, "an .npy file") as f:
            data = np.load(f, allow_pickle=False)
    except OSError as e:   # its reason only: the path is said already
        raise EvalError(f"cannot read {what} from '{path}': {e.strerror or e}") from None
    except (ValueError, EOFError, zipfile.BadZipFile) as e:   # ValueError: NotASource too
        raise EvalError(f"cannot read {what} from '{path}': {e}") from None
    if not isinstance(data, np.ndarray):  # an .npz archive
        data.close()
        raise EvalError(f"cannot read {what} from '{path}': an .npz archive, not one .npy array "
                        "(pass archives with --inputs)")
    return data


def _load_archive(path: str) -> dict[str, np.ndarray]:
    """The arrays of an .npz archive or a .safetensors file; a clear error for anything else."""
    if path.endswith(".safetensors"):
        from tgc.params import ParamsError, read_file

        try:
            return read_file(path)[0]
        except ParamsError as e:
            raise EvalError(str(e)) from None
    try:
        f = open_regular(path, "an .npz archive")
    except OSError as e:
        raise EvalError(f"cannot read inputs from '{path}': {e.strerror or e}") from None
    except NotASource as e:
        raise EvalError(f"cannot read inputs from '{path}': {e}") from None
    with f:
        try:
            data = np.load(f, allow_pickle=False)
        except OSError as e:
            raise EvalError(f"cannot read inputs from '{path}': {e.strerror or e}") from None
        except (ValueError, EOFError, zipfile.BadZipFile):   # numpy's guess at the format ("pickled data") misleads
            raise EvalError(f"cannot read inputs from '{path}': not an .npz archive of arrays") from None
        if isinstance(data, np.ndarray):
            raise EvalError(f"cannot read inputs from '{path}': one .npy array, not an .npz archive "
                            "(pass one array with --input NAME=FILE.npy)")
        try:
            with data:
                arrays = {k: data[k] for k in data.files}
        except Exception as e:  # noqa: BLE001 -- numpy raises many kinds for a damaged member
            raise EvalError(f"cannot read inputs from '{path}': a damaged .npz archive ({e})") from None
    bad = [k for k, a in arrays.items() if not isinstance(a, np.ndarray)]
    if bad:
        raise EvalError(f"cannot read inputs from '{path}': member '{bad[0]}' is not an array")
    return arrays


def _as_float_input(module: Module, name: str, a: np.ndarray, dtype: str) -> np.ndarray:
    """File data for a float input as an array of its declared type (float32 or float64,
    the program's type or f32 in an f64 program; bf16, f16; complex of that width):
    integers, booleans and floats of another width are converted (a file has no
    caller's array for an update to write into, so updated params are converted too),
    and raw 2-byte items (what `np.savez` makes of an ml_dtypes.bfloat16 array) for a
    bf16/f16 input are viewed as it. Every backend then takes what the interpreter takes."""
    arg = module.args.get(name)
    if arg is None or arg.dtype == "i32":
        return a
    if arg.dtype in LOW_FLOATS and a.dtype == np.dtype("V2"):
        return a.view(TYPES[arg.dtype].numpy)   # numpy saves a bfloat16 array as raw 2-byte items
    width = arg.dtype if arg.dtype in narrower(dtype) else dtype
    if a.dtype.kind == "c":   # for a complex input, of its width; for a real one, refused as it is
        return a.astype(COMPLEX_OF[width], copy=False) if is_complex_order(arg.order) and width in COMPLEX_OF else a
    if a.dtype.kind in "fiub" or is_low_array(a):
        return a.astype(TYPES[width].numpy, copy=False)
    return a


def gather_inputs(module: Module, npz: str | None, singles: dict[str, str], random: bool,
                  seed: int, dims: dict[str, int], dtype: str, full: Module | None = None,
                  onehot: dict[str, str] | None = None) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, str]]:
    """The arrays to call `module` with, its symbolic dims, and the file each array
    read from a file came from: the --inputs archive, then each --input, then (with
    `random`) seeded data for whatever is missing. A name the program does not take is
    an error naming its file and the closest argument.

    `full` is the program before `--no-update` pruned it (default: `module`). Archive
    keys that name its outputs are skipped with a note, so that `-o` of one run can
    feed the next; a key `T'` (an update's new value, saved beside an output `T`)
    is the input `T`. `onehot` ({input: edge}) names the inputs that random data
    fills with one-hot rows along the edge (cross-entropy targets)."""
    arrays: dict[str, np.ndarray] = {}
    origins: dict[str, str] = {}
    if npz:
        arrays.update(_inputs_from_archive(module, full or module, npz, _load_archive(npz)))
        origins.update(dict.fromkeys(arrays, npz))
    for name, path in singles.items():
        arrays[name] = _load_array(path, f"input '{name}'")
        origins[name] = path
    with naming_files(origins):
        check_known(list(module.args), arrays, suggest=True)
    arrays = {k: _as_float_input(module, k, a, dtype) for k, a in arrays.items()}
    check_dim_flags(module, dims)
    if random:
        partial = _random_dims(module, arrays, dims)
        try:
            env = module.bind_dims(partial)
        except SizeError as e:
            raise EvalError(str(e)) from None
        generated = make_random_inputs(module, env, seed, dtype)
        for name, edge in (onehot or {}).items():
            if name in generated and name not in arrays and edge in module.args[name].order:
                generated[name] = _one_hot(generated[name], module.args[name].order.index(edge), seed)
        for name, a in generated.items():
            arrays.setdefault(name, a)
        dims = {d: partial[d] for d in module.symbolic_dims()}
    else:
        _check_dims_bound(module, arrays, dims)
    return arrays, dims, origins


def _check_dims_bound(module: Module, arrays: dict[str, np.ndarray], dims: dict[str, int]) -> None:
    """An EvalError asking for `-D NAME=N` when a symbolic dim is neither given with -D
    nor the size of an edge of an input given (a loop's `repeat[L]` over no stacked
    input): the call's own message would name the Python API's `dims=`."""
    known = dict(dims)
    for arg in module.args.values():
        shape = np.shape(arrays[arg.name]) if arg.name in arrays else None
        if shape is None or len(shape) != len(arg.order):
            return   # missing or of the wrong rank: the call says so first
        for axis, edge in enumerate(arg.order):
            if module.dims[module.edges[edge]] is None:
                known.setdefault(module.edges[edge], int(shape[axis]))
    unbound = [d for d in module.symbolic_dims() if d not in known]
    if unbound:
        raise EvalError(f"dim '{unbound[0]}' is not bound: no input has it; give its size with "
                        f"-D {unbound[0]}=N")


@contextmanager
def naming_files(origins: dict[str, str]):
    """An EvalError about an input (`input 'NAME' ...`, as every backend words it) that
    was read from a file names the file too."""
    try:
        yield
    except EvalError as e:
        found = re.search(r"\binput '([^']+)'", str(e))
        if found is None or found.group(1) not in origins:
            raise
        raise EvalError(f"{origins[found.group(1)]}: {e}") from None


def _inputs_from_archive(module: Module, full: Module, path: str, arrays: dict[str, np.ndarray]) -> dict:
    """The archive's arrays that are arguments of `module`. Keys that name an output of
    `full`, or an argument that only its updates read, are left out with a note on
    stderr; the new value of an update target (`T'`) stands for `T`. Anything else is
    kept, for the input check to refuse."""
    outputs = {o.name for o in full.outputs}
    renamed = {full.update_key(u.target): u.target for u in full.updates if full.update_key(u.target) != u.target}
    kept: dict[str, np.ndarray] = {}
    skipped: list[tuple[str, str]] = []
    for key, a in arrays.items():
        if key in renamed:
            if renamed[key] in module.args:
                kept[renamed[key]] = a
            else:
                skipped.append((key, "only the updates read it"))
        elif key in module.args:
            if key in outputs and any(renamed.get(k) == key for k in arrays):
                skipped.append((key, f"an output; its new value {key}' is the input"))
            else:
                kept.setdefault(key, a)
        elif key in outputs:
            skipped.append((key, "an output of the program, not an input"))
        elif key in full.args:
            skipped.append((key, "only the updates read it (--no-update)"))
        else:
            kept[key] = a
    for key, why in skipped:
        click.echo(f"note: --inputs {path}: ignoring '{key}' ({why})", err=True)
    return kept


def _one_hot(a: np.ndarray, axis: int, seed: int) -> np.ndarray:
    """An array of `a`'s shape and dtype with one 1 along `axis` at a seeded random
    place per row, and 0 elsewhere."""
    rng = np.random.default_rng([seed, 1])
    moved = np.moveaxis(np.zeros_like(a), axis, -1)
    n = moved.shape[-1]
    flat = moved.reshape(-1, n)
    flat[np.arange(flat.shape[0]), rng.integers(0, n, size=flat.shape[0])] = 1
    return np.ascontiguousarray(np.moveaxis(flat.reshape(moved.shape), -1, axis))


def cross_entropy_targets(path: str) -> dict[str, str]:
    """{input: edge} for every float input of the .tg file at `path` passed by name as
    the target of a prelude `cross_entropy[edge](logits, target)` in one of its
    statements, where the edge is one of the input's. Found in the file's own syntax
    tree (not its imports, not inside functions); anything unusual finds nothing."""
    from tgc.frontend import ast
    from tgc.frontend.parser import parse

    if path == "-" or pipeline.is_ir_file(path):
        return {}
    try:
        tree = parse(pipeline.read_text(path), path)
    except Exception:  # noqa: BLE001 -- the compile reports errors; here nothing is found
        return {}
    items = tree.items
    if any(isinstance(i, ast.FnDef) and i.name == "cross_entropy" for i in items):
        return {}
    decls = {i.name: i for i in items if isinstance(i, ast.TensorDecl)}
    bound = {i.name for i in items if isinstance(i, (ast.Bind, ast.Out)) and getattr(i, "expr", None) is not None}
    found: dict[str, str] = {}

    def visit(node) -> None:
        if isinstance(node, tuple):
            for n in node:
                visit(n)
            return
        if not isinstance(node, ast.Node):
            return
        if isinstance(node, ast.Call) and node.fn == "cross_entropy" and node.edges and len(node.edges) == 1:
            target = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.kwargs if k.name == "target"), None)
            decl = decls.get(target.id) if isinstance(target, ast.Name) else None
            edge = node.edges[0].id
            if (decl is not None and decl.kind == "input" and decl.dtype != "i32" and decl.name not in bound
                    and edge in [e.name for e in decl.edges]):
                found.setdefault(decl.name, edge)
        for f in dataclasses.fields(node):
            visit(getattr(node, f.name))

    for item in items:
        if isinstance(item, (ast.Bind, ast.Out, ast.Update)):
            visit(item.expr)
    return found


def in_float_type(results: dict[str, np.ndarray], dtype: str, module: Module | None = None) -> dict[str, np.ndarray]:
    """Every float result in its declared type (with `module`: an f32 output or update
    target of an f64 program is f32), else the program's float type: the compiled program
    writes an update back into the caller's array, which may be of the other float width.
    bf16/f16 results stay what they are."""
    declared: dict[str, str] = {}
    if module is not None:
        declared = {o.name: o.value.dtype for o in module.outputs}
        declared.update({module.update_key(u.target): module.args[u.target].dtype for u in module.updates})

    def want(k):
        t = declared.get(k, dtype)
        return interp.NP_DTYPES[t if t in narrower(dtype) and t in interp.NP_DTYPES else dtype]

    return {k: a.astype(want(k), copy=False) if a.dtype.kind == "f" and not is_low_array(a) else a
            for k, a in results.items()}


def _random_dims(module: Module, arrays: dict[str, np.ndarray], dims: dict[str, int]) -> dict[str, int]:
    """Symbolic dims for --random-inputs: --dim, then the given inputs' shapes, then the default.
    An input of the wrong rank binds nothing here; the input check reports it."""
    partial = dict(dims)
    for arg in module.args.values():
        shape = np.shape(arrays[arg.name]) if arg.name in arrays else ()
        if len(shape) != len(arg.order):
            continue
        for e, n in zip(arg.order, shape):
            if module.dims[module.edges[e]] is None:
                partial.setdefault(module.edges[e], int(n))
    for d in module.symbolic_dims():
        partial.setdefault(d, DEFAULT_RANDOM_DIM)
    return partial


def summarize(name: str, edges: tuple[str, ...], a: np.ndarray) -> str:
    edges = tuple(e for e in edges if e != RI)   # a complex array's axes: not its parts edge
    head = f"{name}[{', '.join(edges)}] {a.dtype} shape={tuple(a.shape)}"
    if a.size == 0:
        return head + " (empty)"
    if a.size <= 8:
        return head + " = " + np.array2string(a.ravel(), precision=6, separator=", ")
    return (head + f" mean={a.mean():.6g} std={a.std():.6g} min={a.min():.6g} max={a.max():.6g}")


PROFILE_MAX_RUNS = 1_000_000   # a larger --profile count is a typo, not a measurement: refused, not run for hours


def print_profile(program, inputs: dict, dims, calls: int) -> None:
    """Run `program` `calls` more times and print each kernel's time per call (to
    stderr): the cycles `CpuOptions(profile=True)` counts, scaled to the wall time."""
    import time

    def calls_timed() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            program.run({k: np.copy(v) for k, v in inputs.items()}, dims)
        return (time.perf_counter() - start) / calls

    program.profile(reset=True)
    wall = waiting(calls_timed)
    rows = program.profile()
    total = sum(c for c, _, _ in rows) or 1
    click.echo(f"# {calls} calls, {wall * 1e6:.1f} us per call (with input copies); kernels, costliest first:", err=True)
    for cycles, i, text in rows:
        if cycles:
            click.echo(f"{100 * cycles / total:6.2f}%  k{i}: {text}", err=True)
    steps = [(c, j, text) for j, (c, text) in enumerate(program.step_profile()) if c]
    if steps:
        click.echo("# inside loops (part of their kernels' figures above), costliest first:", err=True)
        for cycles, j, text in sorted(steps, reverse=True):
            click.echo(f"{100 * cycles / total:6.2f}%  step kernel {j}: {text}", err=True)


def _host(a):
    """A result as a numpy array (a CuPy array of the cuda backend is copied to the host)."""
    return a if isinstance(a, np.ndarray) or not hasattr(a, "get") else a.get()


@click.command(short_help="Run FILE on inputs and print or save its outputs.")
@click.argument("file", type=SOURCE)
@click.option("--inputs", "npz", type=click.Path(dir_okay=False),
              help="An .npz (or .safetensors) with one array per input; keys that name outputs are "
                   "skipped with a note, so that -o of one run can feed the next.")
@click.option("--input", "singles", multiple=True, callback=_input_binding, metavar="NAME=FILE.npy",
              help="One input from an .npy file (repeatable).")
@click.option("--random-inputs", is_flag=True,
              help=f"Fill missing inputs with seeded random data (symbolic dims default to {DEFAULT_RANDOM_DIM}); "
                   "an input used as a cross_entropy target gets one-hot rows.")
@click.option("--no-update", "no_update", is_flag=True,
              help="Forward only: apply no update, and compute nothing that only the updates need "
                   "(inputs that only they read may be left out).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Seed for --random-inputs.")
@dims_option("Bind a symbolic dim")
@click.option("--backend", type=LoweringBackends(extra=("interp",)), default="cpu",
              show_default=True, help="cpu (native code through LLVM, as every command compiles by default), "
                                      "cuda (an NVIDIA GPU through CuPy), cuda-sim (the CUDA kernels emulated "
                                      "on this CPU), lowered (the lowered program run kernel by kernel by its "
                                      "numpy interpreter), any other backend folder's, or interp (the "
                                      "reference interpreter of the IR, numpy: slow).")
@click.option("--dtype", type=click.Choice(["f32", "f64"]),
              help="The float type (default: f32, or a .tgir file's own).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=False),
              help="Write the outputs to this .npz archive (atomically); the name must end in .npz.")
@click.option("--profile", type=click.IntRange(min=1, max=PROFILE_MAX_RUNS), metavar="N",
              help=f"With --backend cpu: run N (at most {PROFILE_MAX_RUNS:,}) more times (on copies of the inputs) "
                   "and print, to stderr, "
                   "each kernel's share of the time, the costliest first.")
@click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder).")
@click.option("--check-assumptions", "check_assumptions", is_flag=True,
              help="Check every `assume` of FILE on the inputs before running (an error names the first that "
                   "fails); without it nothing is checked.")
@FP_STRICT
@AUTOCAST
@MEMORY_BUDGET
@handle_errors
def run(file, npz, singles, random_inputs, seed, dims, backend, dtype, output, profile, import_dirs=(),
        fp_strict=False, no_update=False, check_assumptions=False, autocast=None, memory_budget=None) -> None:
    """Run FILE on inputs; write one array per out and per update (named as its
    target, or TARGET' when an output has that name).

    Each array's axes follow its edges in ABI order (`tgc info` lists them). An
    input file's array may be of any numeric type: it is converted to its argument's
    declared type (ids to int32). Without -o, print each output's name, edges, shape
    and a short summary.

    \b
    Examples:
      tgc run examples/mlp.tg --random-inputs --dim batch=32
      tgc run examples/mlp.tg --inputs data.npz -o result.npz
      tgc run examples/mlp.tg --inputs result.npz --input x=x.npy --input y=y.npy --no-update
      tgc run examples/gpt.tg --random-inputs --profile 100
      tgc run examples/mlp.tg --random-inputs --backend interp   # the reference interpreter
    """
    from tgc.manager import run_passes
    from tgc.opt.dims import FixDims
    from tgc.options import Options

    if output == "-":
        raise click.BadParameter("an .npz archive cannot go to standard output: give a file name",
                                 param_hint="-o")
    if output and not output.lower().endswith(".npz"):   # --inputs reads by suffix: the name must say the format
        raise click.BadParameter(f"-o writes an .npz archive: name it .npz, not '{output}' "
                                 "(tgc.save_params writes .safetensors)", param_hint="-o")
    if profile and backend != "cpu":
        raise click.UsageError("--profile needs --backend cpu")
    from tgc.progress import status

    dtype = pipeline.float_type(file, dtype)
    options = Options(dtype=dtype, dims=tuple(sorted(dims.items())), import_dirs=tuple(import_dirs),
                      fp_strict=fp_strict, autocast=autocast,
                      memory_budget=memory_budget).with_(profile=bool(profile))
    with status("compiling"):
        loaded = pipeline.load_program(file, options)
        report(loaded.widened)   # a type held narrower than it is named: said wherever it is built
        check_outputs([("the output", output)], [*sources(loaded.files), ("the inputs", npz),
                                                 *((f"input '{k}'", v) for k, v in singles.items())])
        full = loaded.module
        planned_for = "cpu" if backend == "interp" else backend   # the interpreter runs the CPU's plan
        lowered = pipeline.lower(run_passes(full, ("forward_only",), options) if no_update else full, options,
                                 backend=planned_for)
        module = lowered.module
    report_memory(lowered.memory)
    onehot = cross_entropy_targets(file) if random_inputs else {}
    inputs, dims, origins = gather_inputs(module, npz, singles, random_inputs, seed, dims, dtype, full, onehot)
    with naming_files(origins):
        if check_assumptions and module.facts:
            from tgc.ir.assume import check_facts

            with status("checking assumptions"):
                check_facts(module, inputs, dims, dtype)
        if backend == "interp":
            with status("running (interpreter)"):
                # an f32 program's floats are all f32; an f64 one's keep their types (f32 declarations)
                results = waiting(lambda: evaluate(module, inputs, dtype="f32" if dtype == "f32" else None, dims=dims))
        else:
            with status("compiling (LLVM)" if backend == "cpu" else f"compiling ({backend})"):
                if any(v.op == "loop" for v in module.values()):   # compiled loops need their trip counts
                    module = pipeline.lower(run_passes(module, (FixDims.of(dims),), options), options,
                                            backend=backend).module
                program = pipeline.compile_module(module, options, backend)
            call_dims = dict(options.dims) or None
            with status("running"):
                results = waiting(lambda: program.run(dict(inputs), call_dims))
                results = in_float_type({k: _host(v) for k, v in results.items()}, dtype, module)
            if profile:
                with status(f"profiling ({profile} runs)"):
                    print_profile(program, inputs, call_dims, profile)
    if output:
        buf = io.BytesIO()
        np.savez(buf, **results)
        write_atomic(output, buf.getvalue())
        return
    orders = {o.name: o.order for o in module.outputs}
    orders.update({module.update_key(u.target): module.args[u.target].order for u in module.updates})
    for name, a in results.items():
        click.echo(summarize(name, orders[name], a))
