"""`tgc explain`: a compiled step's kernels, FLOPs, bytes, workspace and peak memory."""
from __future__ import annotations

import json
import os
import tempfile

import click

from tgc import pipeline
from tgc.cli.errors import SOURCE, handle_errors, report as report_diagnostics
from tgc.cli.flags import BACKEND, BYTES, DIM_FLAGS, MEMORY_BUDGET, dims_option
from tgc.cli.outputs import check_outputs, sources
from tgc.cli.run import check_dim_flags
from tgc.fsutil import write_atomic
from tgc.ir.sizes import SizeError
from tgc.options import Options

DEFAULT_DIM = 64


@click.command(short_help="Report FILE's kernels, FLOPs, bytes, threads and memory.")
@click.argument("file", type=SOURCE)
@dims_option(f"Size of a symbolic dim (each one not given is {DEFAULT_DIM})")
@click.option("--dtype", type=click.Choice(["f32", "f64"]),
              help="The float type (default: f32, or a .tgir file's own).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: a report for people; json: one object for tools.")
@click.option("--timeline", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also draw the live temporaries per kernel: FILE.svg, or FILE.png (needs matplotlib).")
@click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder).")
@click.option("--specialized", is_flag=True,
              help="Explain the program that calls with these sizes run once the runtime has specialized "
                   "the program to them (its symbolic dims fixed; docs/optimization.md, \"Specialized sizes\"). "
                   "Default: the generic program, which serves every size.")
@click.option("--specialize-at-bytes", "specialize_at_bytes", type=BYTES, default=None, metavar="BYTES",
              help="The runtime's Options.specialize_at_bytes (default 256MiB): a first call whose generic "
                   "program would hold at least BYTES of temporaries runs its specialization, when that holds "
                   "at most half; the report says which program a first call with these sizes runs.")
@click.option("--specialize-first-work", "specialize_first_work", type=click.IntRange(min=0), default=None,
              metavar="N", help="The runtime's Options.specialize_first_work (default 2^36): a first call whose "
              "specialization would do at least N FLOPs plus bytes fewer runs it.")
@MEMORY_BUDGET
@BACKEND
@handle_errors
def explain(file, dims, dtype, fmt, timeline, import_dirs=(), specialized=False, specialize_at_bytes=None,
            memory_budget=None, backend="cpu", specialize_first_work=None) -> None:
    """Explain what FILE's compiled step does: its kernels in order with FLOPs and
    bytes, the workspace and its slots, the temporaries alive during each kernel, the
    peak and what is alive at it, and the save/recompute decisions. On the CPU, each
    kernel's threads: serial (too small to gain from threads), parallel, or parallel
    only right after another parallel region.

    With symbolic dims, the report also says which program a first call with these
    sizes runs: the generic one, or (when the generic one would hold at least
    --specialize-at-bytes of temporaries, and the specialization at most half; or
    when the specialization would do --specialize-first-work FLOPs plus bytes fewer)
    the specialization, built before that call runs.

    Sizes are those of the dims given with --dim (the others: 64). FLOPs count each
    arithmetic operation once (an exp is one); bytes count each buffer a kernel reads
    or writes once (a loop over an edge: its step's kernels once per step), and their
    total is the bytes a call moves.

    \b
    Examples:
      tgc explain examples/gpt.tg --dim batch=64
      tgc explain examples/mlp.tg --format json
      tgc explain examples/gpt.tg --timeline gpt-memory.svg
      tgc explain benchmarks/workloads/gpt.tg --memory-budget 6.7M
      tgc explain examples/mlp.tg --backend cuda     # the program the CUDA backend compiles
      tgc explain examples/gpt.tg --dim batch=64 --specialized   # what repeated calls of that size run
    """
    from tgc.backends.base import get_backend
    from tgc.explain import (explain as report_of, format_explain, kept_after_stream, loop_steps, timeline_png,
                             timeline_svg)

    if timeline and not timeline.endswith((".svg", ".png")):
        raise click.BadParameter("the timeline is a .svg or .png file", param_hint="--timeline")
    options = Options(dtype=pipeline.float_type(file, dtype), import_dirs=tuple(import_dirs),
                      memory_budget=memory_budget)
    if specialize_at_bytes is not None:
        options = options.with_(specialize_at_bytes=specialize_at_bytes)
    if specialize_first_work is not None:
        options = options.with_(specialize_first_work=specialize_first_work)
    loaded = pipeline.load_program(file, options)
    report_diagnostics(loaded.widened)   # a type held narrower than it is named: said wherever it is built
    check_outputs([("the timeline", timeline)], sources(loaded.files), hint="--timeline")
    module = loaded.module
    check_dim_flags(module, dims)
    sizes = {d: dims.get(d, DEFAULT_DIM) for d in module.symbolic_dims()}
    try:
        env = module.bind_dims(sizes)
    except SizeError as e:   # sizes whose arrays would pass the size limit: the -D values' fault
        raise click.BadParameter(str(e), param_hint=DIM_FLAGS) from None
    lowered = pipeline.lower(module, options.with_(dims=tuple(sorted(sizes.items()))), backend=backend)   # the budget's sizes
    # the runtime's specialization (tgc.runtime.specialize): the optimized module with its dims fixed
    optimized = pipeline.specialized_module(lowered.module, sizes, options) if specialized else lowered.module
    low = pipeline.lower_module(optimized, options, backend)
    report = report_of(low, env, options if backend == "cpu" else None)
    if sizes:
        report["program"] = "specialized" if specialized else "generic"
        if get_backend(backend).specializes:
            report["first_call"] = _first_call(lowered.module, low, specialized, sizes, env, options, backend)
    if any(v.op == "loop" for v in module.values()):   # what each step keeps for the backward pass
        primal = lowered.memory.primal if lowered.memory is not None and lowered.memory.primal is not None \
            else pipeline.lower(module, options.with_(passes=("normalize",), memory_budget=None)).module
        unrolled = not any(v.op == "loop" for v in lowered.module.values())   # (the cost model unrolled them)
        report["loops"] = loop_steps(primal, env, unrolled)   # the planner's choice where it made one
        kept_after_stream(lowered.module, optimized, env, report["loops"])   # less where a reverse step streams
    if lowered.memory is not None:
        report["memory_budget"] = lowered.memory.as_dict()
        report["memory_budget"]["summary"] = lowered.memory.summary()
        report["memory_budget"]["lines"] = lowered.memory.lines()
    report["dims"] = {d: env[d] for d in module.symbolic_dims()}
    if timeline:
        title = os.path.basename(file)
        if timeline.endswith(".svg"):
            write_atomic(timeline, timeline_svg(report, title))
        else:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise click.UsageError("--timeline FILE.png needs matplotlib (pip install matplotlib); "
                                       "FILE.svg needs nothing") from None
            with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(timeline))) as tmp:
                path = os.path.join(tmp, "timeline.png")
                timeline_png(report, title, path)
                with open(path, "rb") as f:
                    write_atomic(timeline, f.read())
    if fmt == "json":
        click.echo(json.dumps({"file": file, **report}, indent=2))
    else:
        click.echo(format_explain(report, file), nl=False)


def _first_call(module, low, specialized, sizes, env, options, backend) -> dict:
    """Which program a first call with these sizes runs (`tgc.runtime.specialize`), and
    why: the generic program's peak of temporaries against `Options.specialize_at_bytes`,
    its work (FLOPs plus bytes) against `Options.specialize_first_work` where `stream`
    may block one of its temporaries once the sizes are fixed, and the specialization's
    (lowered only when one of the first reaches its bound)."""
    from tgc.explain import Liveness
    from tgc.runtime.specialize import Specializations, work_of, first_call_specializes

    generic_low = None if specialized else low
    if generic_low is None:
        generic_low = pipeline.lower_module(module, options, backend)
    live = Liveness(generic_low)
    at, first_work = options.specialize_at_bytes, options.specialize_first_work
    generic = live.peak_bytes(env)
    streams = Specializations.streams_from(options)
    work = work_of(generic_low, env) if first_work is not None and streams is not None \
        and live.largest_unfixed(env) >= streams else None
    special = special_work = reason = None
    if (at is not None and generic >= at) or (work is not None and work >= first_work):
        special_low = low if specialized else \
            pipeline.lower_module(pipeline.specialized_module(module, sizes, options), options, backend)
        special = Liveness(special_low).peak_bytes(env)
        special_work = None if work is None else work_of(special_low, env)
        reason = first_call_specializes(generic, special, at, work, special_work, first_work)
    return {"runs": "specialized" if reason else "generic", "reason": reason, "generic_peak": generic,
            "specialized_peak": special, "specialize_at_bytes": at, "generic_work": work,
            "specialized_work": special_work, "specialize_first_work": first_work}
