"""The `tgc` command line: thin click commands over the library.

Exit status: 0 success, 1 errors in the user's program, 2 usage errors,
3 runtime errors in `tgc run`, 4 internal compiler errors.
"""
from __future__ import annotations

import sys
import typing
from dataclasses import replace

import click

import tgc
from tgc import pipeline
from tgc.cli.errors import EXIT_USER, SOURCE, handle_errors, report
from tgc.cli.flags import AUTOCAST, BACKEND, DIM_FLAGS, FP_STRICT, dims_option
from tgc.cli.interrupt import interrupted_exits
from tgc.cli.outputs import check_outputs, sources, write_output
from tgc.ir.diag import CompileError, Loc, did_you_mean
from tgc.ir.printer import print_module
from tgc.options import Options

def _emit_to_stderr(banner: str, text: str) -> None:
    click.echo(f"// ----- {banner} -----", err=True)
    click.echo(text, err=True, nl=False)


def _pass_list(ctx, param, value):
    if value is None:
        return None
    from tgc.backends.base import pass_registry
    from tgc.manager import parse_pass_list, split_levels

    try:   # -p may name every backend's own stages (the CPU's group)
        specs = parse_pass_list(value, pass_registry())
        split_levels(specs, pass_registry())
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return specs


def _pass_names(ctx, param, value):
    from tgc.backends.base import pass_registry

    known = ("elaborate",) + tuple(pass_registry())
    names = set()
    for item in value or ():
        for n in item.split(","):
            n = n.strip()
            if n and n not in known:
                raise click.BadParameter(f"unknown pass '{n}' (known: {', '.join(known)})" + did_you_mean(n, known))
            if n:
                names.add(n)
    return frozenset(names)


def _all_lowering_stages() -> tuple[str, ...]:
    """Every backend's lowering stages, in order, each once (loads the backends, so that
    their own stages are named)."""
    from tgc.backends.base import backend_names

    return tuple(dict.fromkeys(s for name in backend_names() for s in pipeline.lowering(name)))


def pipeline_options(fn):
    """The flags every command that runs passes shares; they become one Options."""
    decorators = [
        click.option("-p", "--passes", callback=_pass_list, metavar="LIST",
                     help="Comma-separated passes to run instead of the default pipeline: IR passes, then "
                          "lowering stages (these replace the backend's default stages, which `tgc passes` lists, where the list "
                          "names any). A pass sets its options as PASS{field=value,...}, e.g. "
                          "'group{blocks=8}'; `tgc passes` lists passes and options."),
        click.option("--dtype", type=click.Choice(["f32", "f64"]),
                     help="The program's float type (default: f32, or a .tgir file's own)."),
        BACKEND,
        click.option("--print-ir-before", "print_before", multiple=True, callback=_pass_names,
                     metavar="PASS", help="Print the IR to stderr before PASS."),
        click.option("--print-ir-after", "print_after", multiple=True, callback=_pass_names,
                     metavar="PASS", help="Print the IR to stderr after PASS."),
        click.option("--print-ir-after-all", is_flag=True, help="Print the IR to stderr after every pass."),
        click.option("--verify-each", is_flag=True,
                     help="Check after every pass that the program's values did not change (float64), "
                          "and after every lowering stage (fuse, layout, narrow, gemm_operands, implicit, accumulate, unsplit, epilogue, alias, pieces, group, plan) by running the "
                          "lowered program with the numpy lowered-program interpreter."),
        click.option("--time-passes", is_flag=True, help="Print each pass's time and op counts to stderr."),
        FP_STRICT,
        AUTOCAST,
        click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
                     help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder)."),
        click.option("--stats", is_flag=True,
                     help="Print ops, FLOPs, bytes of intermediates and the largest one after each pass to "
                          "stderr; after each lowering stage, its kernels, FLOPs and temporaries. Counted at the "
                          "sizes each table's first line gives (a symbolic dim at Options.rep_size, 64)."),
    ]
    for d in reversed(decorators):
        fn = d(fn)
    return fn


def make_options(passes=None, dtype=None, print_before=frozenset(), print_after=frozenset(),
                 print_ir_after_all=False, verify_each=False, time_passes=False, stats=False, import_dirs=(),
                 fp_strict=False, autocast=None, **extra) -> Options:
    """`passes` (a parsed -p list) splits into the IR passes and the lowering stages."""
    stages = None
    if passes is not None:
        from tgc.backends.base import pass_registry
        from tgc.manager import split_levels

        passes, stages = split_levels(passes, pass_registry())
    return Options(dtype=dtype or "f32", passes=passes, stages=stages, import_dirs=tuple(import_dirs), fp_strict=fp_strict,
                   autocast=autocast,
                   print_ir_before=print_before,
                   print_ir_after=print_after, print_ir_after_all=print_ir_after_all,
                   verify_each=verify_each, time_passes=time_passes, stats=stats, **extra)


def render_module(module, fmt: str, locs: bool) -> str:
    from tgc.ir.export import to_dot, to_json

    return {"text": lambda: print_module(module, locs), "dot": lambda: to_dot(module),
            "json": lambda: to_json(module)}[fmt]()


def lower(module, options: Options, emit):
    """Run the pipeline; with --time-passes, print the table to stderr."""
    result = pipeline.lower(module, options, emit)
    if options.time_passes:
        click.echo(format_pass_times(result.stats), err=True, nl=False)
    if options.stats:
        from tgc.opt.stats import format_table

        rows = [("input", result.initial)] + [(s.name, s.cost) for s in result.stats]
        click.echo(stats_sizes(module, options.rep_size) + format_table(rows), err=True, nl=False)
    return result


def stats_sizes(module, rep: int) -> str:
    """The line above a --stats table: the sizes its FLOPs and bytes are counted at."""
    symbolic = module.symbolic_dims()
    if not symbolic:
        return "sizes: the program's own (it has no symbolic dims)\n"
    return (f"sizes: {', '.join(f'{d} = {rep}' for d in symbolic)} (a symbolic dim counts as {rep}, "
            f"Options.rep_size; derived and fixed dims follow)\n")


def format_pass_times(stats) -> str:
    total = sum(s.seconds for s in stats) or 1e-12
    lines = ["===-------------------------------------------------------===",
             "                    tgc pass execution timing",
             "===-------------------------------------------------------===",
             f"  {'time (ms)':>10} {'%':>6}  {'ops before':>10} {'ops after':>10}  pass"]
    for s in stats:
        lines.append(f"  {s.seconds * 1e3:10.3f} {100 * s.seconds / total:5.1f}%  {s.ops_before:10d} {s.ops_after:10d}  {s.name}")
    lines.append(f"  {total * 1e3:10.3f} 100.0%  {'':10} {'':10}  total")
    return "\n".join(lines) + "\n"


class Commands(click.Group):
    """tgc's group of commands: a Ctrl-C while click reads the flags (a flag's check
    may load the backends) ends as one inside a command does, with "interrupted" and
    status 130 (`tgc.cli.interrupt`), not click's "Aborted!" and status 1."""

    def make_context(self, *args, **kwargs):
        with interrupted_exits():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with interrupted_exits():
            return super().invoke(ctx)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tgc.__version__, prog_name="tgc")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for internal errors (also TGC_DEBUG=1).")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Colour diagnostics (auto: on a terminal, unless NO_COLOR is set).")
def main(debug: bool, color: str) -> None:
    """tgc: compile tensor programs over named edges.

    \b
    Examples:
      tgc check examples/mlp.tg
      tgc dump-ir examples/mlp.tg --after elaborate
      tgc run examples/mlp.tg --random-inputs
    """
    import warnings

    from tgc.backends.cache import CacheWarning

    shown = warnings.showwarning

    def show(message, category, *args, **kwargs):   # tgc's own warnings as one plain line
        if issubclass(category, CacheWarning):
            click.echo(f"warning: {message}", err=True)
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = show


@main.command()
@click.argument("files", nargs=-1, required=True, type=SOURCE)
@click.option("--dtype", type=click.Choice(["f32", "f64"]), default="f32", show_default=True,
              help="The float type FILES are checked in, as `tgc run --dtype` would run them.")
@click.option("-Werror", "werror", is_flag=True, help="Treat warnings as errors.")
@click.option("-w", "no_warnings", is_flag=True, help="Print no warnings.")
@click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder).")
@handle_errors
def check(files: tuple[str, ...], dtype: str, werror: bool, no_warnings: bool, import_dirs=()) -> None:
    """Parse and check FILES; print nothing when they are correct.

    Warnings (unused inputs and bindings, statements an import skips) go to stderr; with
    -Werror they fail the check.

    \b
    Example:
      tgc check examples/mlp.tg examples/gpt.tg
    """
    from tgc.ir.collector import gc_paused

    failed = False
    with gc_paused():   # each program is freed once its warnings are out: the collector would find nothing
        for path in files:
            try:
                warnings = pipeline.check_program(path, Options(dtype=dtype, import_dirs=tuple(import_dirs))).warnings
            except CompileError as e:
                report(e.diagnostics())
                failed = True
                continue
            if not no_warnings or werror:
                report([replace(w, severity="error") if werror else w for w in warnings])
            failed = failed or (werror and bool(warnings))
    if failed:
        sys.exit(EXIT_USER)


@main.command("dump-ir")
@click.argument("file", type=SOURCE)
@click.option("--after", "after", metavar="PASS",
              help="Stop after PASS: 'elaborate' (straight from the front end), an IR pass, "
                   "or a lowering stage (fuse, layout, narrow, gemm_operands, implicit, accumulate, unsplit, epilogue, alias, pieces, group, plan).")
@click.option("--after-all", is_flag=True,
              help="Print the IR after the front end, after every pass and after every lowering stage.")
@click.option("--loc", "locs", is_flag=True, help="Print each op's source location.")
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "json"]), default="text", show_default=True,
              help="text: the IR (readable back by `tgc opt`); dot: Graphviz of the tensor network; json: for tools.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), help="Write here (atomically).")
@dims_option("Fix a symbolic dim first, as `tgc build -D` does", "defines")
@pipeline_options
@handle_errors
def dump_ir(file, after, after_all, locs, fmt, output, defines=(), backend="cpu", **opts) -> None:
    """Print FILE's IR after the pipeline (or after one pass).

    \b
    Examples:
      tgc dump-ir examples/mlp.tg --after elaborate
      tgc dump-ir examples/mlp.tg --after adjoint -o mlp.tgir
      tgc dump-ir examples/mlp.tg --format dot | dot -Tsvg > mlp.svg
      tgc dump-ir examples/mlp.tg --after plan --backend cuda
      tgc dump-ir examples/gpt2.tg --after plan -D layer=2 -D head=2 -D hd=16 -D t=16 -D vocab=50
    """
    from tgc.manager import run_passes
    from tgc.opt.dims import FixDims

    options = make_options(**opts, locs=locs)
    names, stage = _stages_until(after, options, backend)
    if fmt != "text" and (after_all or stage is not None):
        why = "--after-all" if after_all else f"--after {stage} (a lowering stage)"
        raise click.BadParameter(f"--format {fmt} prints one module of IR, not with {why}", param_hint="--format")
    loaded = pipeline.load_program(file, options)
    check_outputs([("the output", output)], sources(loaded.files))
    module = loaded.module
    if defines:
        try:
            module = run_passes(module, (FixDims.of(defines),), options)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=DIM_FLAGS) from None
    chunks: list[str] = []

    def collect(banner: str, text: str) -> None:
        chunks.append(f"// ----- {banner} -----\n{text}")

    if after_all:
        collect("IR after elaborate", print_module(module, locs))
    options = options.with_(passes=names, print_ir_after_all=after_all or options.print_ir_after_all)
    result = lower(module, options, collect if after_all else _emit_to_stderr)
    if stage is not None or (after_all and after is None):
        from tgc.ir.module import Module
        from tgc.lower.lowered import print_lowered

        low = lower_stages(result.module, options, collect if after_all else _emit_to_stderr, stage, backend)
        text = render_module(low, fmt, locs) if isinstance(low, Module) else print_lowered(low)   # --after emulate_low
    else:
        text = render_module(result.module, fmt, locs)
    write_output(output, "".join(chunks) if after_all else text)


def lower_stages(program, options: Options, emit, stop_after: str | None = None, backend: str = "cpu"):
    """Run `backend`'s lowering stages (with --time-passes or --stats, print their
    tables to stderr)."""
    from tgc.backends.base import get_backend, pass_registry
    from tgc.ir.module import Module
    from tgc.manager import run_lowering
    from tgc.registry import target

    be = get_backend(backend)
    if isinstance(program, Module):   # the program a backend compiles (--fp-strict f32: its f64 emulation)
        names = target(options)
        program, options = pipeline.target(program, options, emit)
        if stop_after in names:
            return program
    result = run_lowering(program, be.lowering_options(options), emit, be.lowering(), stop_after=stop_after,
                          known=pass_registry())
    if options.time_passes:
        click.echo(format_pass_times(result.stats), err=True, nl=False)
    if options.stats and result.stats:
        from tgc.opt.stats import format_table

        click.echo(stats_sizes(getattr(program, "module", program), options.rep_size)
                   + format_table([(s.name, s.cost) for s in result.stats if s.cost is not None], count="kernels"),
                   err=True, nl=False)
    return result.lowered


def _stages_until(after: str | None, options: Options, backend: str = "cpu") -> tuple[tuple[str, ...], str | None]:
    """The IR passes to run for `--after`, and the lowering stage to stop at (or None:
    no lowering; without --after, the last stage when -p names lowering stages)."""
    from tgc.backends.base import pass_registry
    from tgc.manager import parse_pass_spec
    from tgc.registry import PREPARE, pipeline as pass_names, stages, target

    known_passes = pass_registry()
    names = pass_names(options)
    plain = [parse_pass_spec(n, known_passes)[0] for n in names]
    stage_names = [parse_pass_spec(n, known_passes)[0] for n in stages(options, pipeline.lowering(backend))]
    lowering = list(target(options)) + list(PREPARE) + stage_names   # what runs after the IR pipeline, in order
    if after is None:
        return tuple(names), (lowering[-1] if options.stages and lowering else None)
    if after == "elaborate":
        return (), None
    known = ", ".join(("elaborate",) + tuple(known_passes))
    if after not in known_passes:
        raise click.BadParameter(f"unknown pass '{after}' (known: {known})"
                                 + did_you_mean(after, ("elaborate", *known_passes)), param_hint="--after")
    if known_passes[after].gives == "lowered" or (after in lowering and after not in plain):
        if after not in lowering:
            from tgc.backends.base import backend_names

            owners = [name for name in backend_names() if name != backend and after in pipeline.lowering(name)]
            hint = f"; it is a stage of --backend {', '.join(owners)}" if owners else ""
            raise click.BadParameter(f"lowering stage '{after}' is not in the stages of --backend {backend} "
                                     f"({', '.join(stage_names)}){hint}", param_hint="--after")
        return tuple(names), after
    if after not in plain:
        raise click.BadParameter(f"pass '{after}' is not in the pipeline ({', '.join(plain)})", param_hint="--after")
    return tuple(names[: plain.index(after) + 1]), None


@main.command(short_help="Run passes on IR or a lowered program; print the result.")
@click.argument("file", type=SOURCE)
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), help="Write here (atomically).")
@click.option("--loc", "locs", is_flag=True, help="Print each op's source location.")
@pipeline_options
@handle_errors
def opt(file, output, locs, backend="cpu", **opts) -> None:
    """Read IR or a lowered program (a .tgir file, a `dump-ir --after STAGE` dump, or -
    for stdin), run passes, print the result.

    On IR, without -p it runs the default pipeline (`tgc passes` lists it); -p may end
    with lowering stages, and the result is then the lowered program. On a lowered
    program it runs the lowering stages -p names, or without -p the default ones after
    the stage it was dumped after; it checks the program (`tgc.lower.verify`) and, with
    --verify-each, runs it and every stage's result with the lowered-program interpreter
    against its module's values. With an empty list (-p '') it only parses, verifies
    and reprints.

    \b
    Examples:
      tgc opt mlp.tgir -p adjoint,simplify -o mlp.opt.tgir
      tgc dump-ir mlp.tg --after fuse | tgc opt - -p 'layout,group{blocks=4}' --verify-each
    """
    from tgc.ir.parser import parse_module
    from tgc.lower.lowered import print_lowered
    from tgc.lower.text import is_lowered_text, parse_lowered

    check_outputs([("the output", output)], sources([file]))
    text = pipeline.read_text(file)
    name = "<stdin>" if file == "-" else file
    if is_lowered_text(text):
        _all_lowering_stages()   # loads the backends: their own kernels (the CPU's group) read back
        low = parse_lowered(text, name)
        if opts.get("dtype") not in (None, low.dtype):
            raise click.BadParameter(f"the lowered program is {low.dtype}", param_hint="--dtype")
        options = make_options(**{**opts, "dtype": low.dtype}, locs=locs)
        if options.passes:
            raise click.BadParameter(f"pass '{options.passes[0]}' works on the IR; this is a lowered program",
                                     param_hint="-p")
        if opts.get("passes") is not None and options.stages is None:
            options = options.with_(stages=())   # -p '': no stages
        if options.verify_each:
            from tgc.manager import PassError, _Checker

            checker = _Checker(low.module, options.verify_seed)
            if checker.reference is not None:
                try:
                    checker.check_lowered(low, "input")
                except PassError as e:
                    raise CompileError(str(e).replace("lowering stage 'input'", "the lowered program"),
                                       Loc(name, 1, 1)) from None
        write_output(output, print_lowered(lower_stages(low, options, _emit_to_stderr, backend=backend)))
        return
    options = make_options(**{**opts, "dtype": pipeline.float_type(file, opts.get("dtype"), text)}, locs=locs)
    module = parse_module(text, name)
    result = lower(module, options, _emit_to_stderr)
    if options.stages is not None:
        write_output(output, print_lowered(lower_stages(result.module, options, _emit_to_stderr, backend=backend)))
        return
    write_output(output, print_module(result.module, locs))


@main.command(short_help="List every pass, its options and the pipelines.")
def passes() -> None:
    """List every pass with its one-line description and options, the default
    pipeline, and the lowering stages that follow it for each backend (dump-ir --after
    and opt lower for their --backend, the CPU by default)."""
    from tgc.backends.base import backend_names, pass_registry
    from tgc.manager import pass_fields
    from tgc.registry import DEFAULT_PIPELINE, PREPARE, STRICT_PIPELINE, target

    known_passes = pass_registry()   # every backend's stages too
    lowerings = {name: pipeline.lowering(name) for name in backend_names()}

    width = max(len(n) for n in known_passes)
    for name, cls in known_passes.items():
        click.echo(f"{name:<{width}}  {cls.summary()}")
        for field, typ in pass_fields(cls).items():
            kind = " | ".join(getattr(t, "__name__", str(t)) for t in (typing.get_args(typ) or (typ,)))
            kind = kind.replace("NoneType", "none")
            click.echo(f"{'':<{width}}    {{{field}={kind}}}")
    click.echo(f"\ndefault pipeline: {','.join(DEFAULT_PIPELINE)}")
    click.echo(f"strict pipeline (--fp-strict): {','.join(STRICT_PIPELINE)}")
    click.echo(f"target, after the pipeline (--fp-strict, an f32 program): "
               f"{','.join(target(Options(dtype='f32', fp_strict=True)))}")
    click.echo(f"before every lowering: {','.join(PREPARE)}")
    for name, stages in lowerings.items():
        click.echo(f"lowering for {name} (dump-ir --backend {name} --after STAGE): {','.join(stages)}")


from tgc.cli.build import build  # noqa: E402
from tgc.cli.grad import grad  # noqa: E402
from tgc.cli.explain import explain  # noqa: E402
from tgc.cli.info import info  # noqa: E402
from tgc.cli.run import run  # noqa: E402

main.add_command(run)
main.add_command(grad)
main.add_command(build)
main.add_command(info)
main.add_command(explain)

