"""`tgc run`: compile a program, feed it inputs, and write or summarize its outputs."""
from __future__ import annotations

import io
import sys

import click
import numpy as np

from tgc import driver
from tgc.cli_errors import handle_errors
from tgc.fsutil import write_atomic
from tgc.ir import interp
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.module import Module

DEFAULT_RANDOM_DIM = 4


def _dim_binding(ctx, param, value):
    out = {}
    for item in value:
        name, sep, n = item.partition("=")
        if not sep or not name.strip() or not n.strip().lstrip("-").isdigit():
            raise click.BadParameter(f"'{item}' is not NAME=N")
        if int(n) <= 0:
            raise click.BadParameter(f"'{item}': a size must be positive")
        out[name.strip()] = int(n)
    return out


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
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot read {what} from '{path}': {e}") from None


def gather_inputs(module: Module, npz: str | None, singles: dict[str, str], random: bool,
                  seed: int, dims: dict[str, int], dtype: str) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    arrays: dict[str, np.ndarray] = {}
    if npz:
        try:
            with np.load(npz, allow_pickle=False) as f:
                arrays.update({k: f[k] for k in f.files})
        except (OSError, ValueError) as e:
            raise EvalError(f"cannot read inputs from '{npz}': {e}") from None
    for name, path in singles.items():
        arrays[name] = _load_array(path, f"input '{name}'")
    unknown = [d for d in dims if d not in module.dims]
    if unknown:
        raise click.BadParameter(f"the program has no dim '{unknown[0]}'", param_hint="--dim")
    fixed = [d for d in dims if module.dims[d] is not None]
    if fixed:
        raise click.BadParameter(f"dim '{fixed[0]}' has a fixed size", param_hint="--dim")
    if random:
        from tgc.ir.interp import bind_dims

        given = {a: arrays[a] for a in arrays if a in module.args}
        partial = dict(dims)
        for arg in module.args.values():
            if arg.name in given:
                for axis, e in enumerate(arg.order):
                    d = module.edges[e]
                    if module.dims[d] is None:
                        partial.setdefault(d, int(np.shape(given[arg.name])[axis]))
        for d in module.symbolic_dims():
            partial.setdefault(d, DEFAULT_RANDOM_DIM)
        env = module.bind_dims(partial)
        generated = interp.random_inputs(module, env, seed, dtype)
        for name, a in generated.items():
            arrays.setdefault(name, a)
        dims = {d: partial[d] for d in module.symbolic_dims()}
    return arrays, dims


def summarize(name: str, edges: tuple[str, ...], a: np.ndarray) -> str:
    head = f"{name}[{', '.join(edges)}] {a.dtype} shape={tuple(a.shape)}"
    if a.size == 0:
        return head + " (empty)"
    if a.size <= 8:
        return head + " = " + np.array2string(a.ravel(), precision=6, separator=", ")
    return (head + f" mean={a.mean():.6g} std={a.std():.6g} min={a.min():.6g} max={a.max():.6g}")


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--inputs", "npz", type=click.Path(dir_okay=False), help="An .npz with one array per input.")
@click.option("--input", "singles", multiple=True, callback=_input_binding, metavar="NAME=FILE.npy",
              help="One input from an .npy file (repeatable).")
@click.option("--random-inputs", is_flag=True,
              help=f"Fill missing inputs with seeded random data (symbolic dims default to {DEFAULT_RANDOM_DIM}).")
@click.option("--seed", default=0, show_default=True, help="Seed for --random-inputs.")
@click.option("--dim", "dims", multiple=True, callback=_dim_binding, metavar="NAME=N",
              help="Bind a symbolic dim (repeatable).")
@click.option("--backend", type=click.Choice(["interp", "cpu"]), default="interp", show_default=True)
@click.option("--dtype", type=click.Choice(["f32", "f64"]), default="f32", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the outputs to this .npz.")
@handle_errors
def run(file, npz, singles, random_inputs, seed, dims, backend, dtype, output) -> None:
    """Run FILE on inputs; write one array per out and per update (named as its target).

    Arrays are in each output's ABI order; integer inputs are int32.
    Without -o, print each output's name, edges, shape and a short summary.

    \b
    Examples:
      tgc run examples/mlp.tg --random-inputs --dim batch=32
      tgc run examples/mlp.tg --inputs data.npz -o result.npz
    """
    from tgc.options import Options

    options = Options(dtype=dtype, dims=tuple(sorted(dims.items())))
    module = driver.lower(driver.load(file, options), options).module
    inputs, dims = gather_inputs(module, npz, singles, random_inputs, seed, dims, dtype)
    if backend == "interp":
        results = evaluate(module, inputs, dtype=dtype, dims=dims)
    else:
        from tgc.runtime import run_compiled

        results = run_compiled(module, inputs, options)
    if output:
        buf = io.BytesIO()
        np.savez(buf, **results)
        write_atomic(output, buf.getvalue())
        return
    orders = {o.name: o.order for o in module.outputs}
    orders.update({u.target: module.args[u.target].order for u in module.updates})
    for name, a in results.items():
        click.echo(summarize(name, orders[name], a))
