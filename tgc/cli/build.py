"""`tgc build`: native artifacts for Makefile-driven builds (gcc-style flags)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import click

from tgc import pipeline
from tgc.cli.errors import SOURCE, handle_errors, report
from tgc.cli.flags import AUTOCAST, DIM_FLAGS, FP_STRICT, MEMORY_BUDGET, dims_option, report_memory
from tgc.cli.outputs import check_outputs, sources
from tgc.fsutil import is_special, write_all_atomic
from tgc.ir.collector import gc_paused
from tgc.options import Options

SUFFIX = {"so": ".so", "obj": ".o", "llvm": ".ll", "asm": ".s", "ir": ".tgir", "h": ".h", "cu": ".cu", "ptx": ".ptx",
          "cubin": ".cubin"}
BINARY = ("so", "obj", "cubin")   # never to standard output


class Targets(click.Choice):
    """The backends that build files (`tgc.backends.base.build_targets`), listed when
    asked for: `tgc --help` imports no backend."""

    def __init__(self) -> None:
        super().__init__([])

    @property
    def choices(self):
        from tgc.backends.base import build_targets

        return build_targets()

    @choices.setter
    def choices(self, value) -> None:
        pass


def default_output(source: str, emit: str) -> str:
    stem = Path(source).stem if source != "-" else "a"
    return f"lib{stem}.so" if emit == "so" else stem + SUFFIX.get(emit, "." + emit)


class _BuildCommand(click.Command):
    """`tgc build`: an -O flag other than -O0..-O3 is a usage error that names it
    (click alone reads `-O7` as an unknown option `-O`)."""

    LEVELS = ("-O0", "-O1", "-O2", "-O3")

    def parse_args(self, ctx, args):
        takes_value = {o for p in self.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        for before, arg in zip([None, *args], args):
            if arg == "--":
                break
            if arg.startswith("-O") and arg not in self.LEVELS and before not in takes_value:
                raise click.UsageError(f"no such option: {arg} (the optimization levels are "
                                       f"{', '.join(self.LEVELS)})", ctx)
        return super().parse_args(ctx, args)


@click.command(cls=_BuildCommand, short_help="Compile FILE to a native library, object, assembly or CUDA module.")
@click.argument("file", type=SOURCE)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Output file (default: libNAME.so, NAME.o, ...).")
@click.option("-O0", "opt_level", flag_value=0,
              help="LLVM's optimization level for the generated code: -O0 none (tgc's own passes always run).")
@click.option("-O1", "opt_level", flag_value=1, help="LLVM's -O1.")
@click.option("-O2", "opt_level", flag_value=2, default=True, help="LLVM's -O2 (default).")
@click.option("-O3", "opt_level", flag_value=3, help="LLVM's -O3.")
@dims_option("Fix a symbolic dim at build time; the code specializes to it", "defines")
@click.option("--dtype", type=click.Choice(["f32", "f64"]),
              help="The float type (default: f32, or a .tgir file's own).")
@click.option("--target", type=Targets(), default="cpu", show_default=True,
              help="The backend to build for, by name. cpu: native code for this machine; cuda: a CUDA module "
                   "for NVIDIA GPUs and its JSON manifest beside it (-o model.cubin: model.json; docs/cuda.md).")
@click.option("--emit", metavar="KIND",
              help="What to write. Any target: ir (tgc IR after the pipeline). cpu: so (default): shared "
                   "library + NAME.h; obj: object file; llvm/asm: LLVM IR/assembly; h: the C header only. "
                   "cuda: cubin (default), ptx (both through nvcc) or cu (the CUDA C source).")
@click.option("--arch", default="sm_90", show_default=True, metavar="SM",
              help="With --target cuda: the GPU architecture nvcc compiles for (CudaOptions.arch).")
@click.option("--blas", type=click.Choice(["none", "system", "numpy"]), default="none", show_default=True,
              help="The BLAS a .so links for its products (GEMMs). none: no BLAS; they run tgc's own "
                   "loops, or a BLAS the caller passes to NAME_init_blas (see NAME.h): the library "
                   "needs only libc and libgomp, so it runs wherever it is copied (the default, for "
                   "that). system: the system's CBLAS (-lopenblas, -lcblas or -lblas; Debian/Ubuntu: "
                   "libopenblas-dev), a NEEDED entry found in the system's library path. numpy: numpy's "
                   "bundled OpenBLAS, through a RUNPATH into this Python environment: the library fails "
                   "to load once that environment moves or goes.")
@click.option("-MD", "md", is_flag=True,
              help="Write a depfile beside the output, named as gcc names it: the output's suffix replaced by .d "
                   "(-o libmlp.so: libmlp.d). None beside a device or FIFO, where -MF names one.")
@click.option("-MF", "mf", type=click.Path(dir_okay=False), help="Write the depfile here (implies -MD).")
@click.option("-MT", "mt", multiple=True, metavar="TARGET",
              help="Target of the depfile rule, written as given (repeatable; default: the output, escaped for make).")
@click.option("-MP", "mp", is_flag=True, help="Add a phony target for every dependency.")
@click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder).")
@FP_STRICT
@AUTOCAST
@MEMORY_BUDGET
@handle_errors
def build(file, output, opt_level, defines, dtype, emit, blas, md, mf, mt, mp, import_dirs=(), fp_strict=False,
          autocast=None, target="cpu", arch="sm_90", memory_budget=None) -> None:
    """Compile FILE to native code: for this machine's CPU, or another --target.

    Every output is written atomically: a failed or interrupted build leaves no
    new file, and an older one untouched. The same inputs and flags give
    byte-identical outputs. A device or FIFO output (-o /dev/null) is written into,
    with nothing beside it (no header, manifest or -MD depfile). No output may be a
    file the build reads (-o naming the source, an import, by any path).

    \b
    Examples:
      tgc build examples/mlp.tg -o libmlp.so          # also writes mlp.h
      tgc build model.tg -o libmodel.so -MD -MP -D batch=32 -O3
      tgc build model.tg --emit asm -o model.s
      tgc build model.tg --blas=system -o libmodel.so   # links -lopenblas
      tgc build model.tg --target cuda -o model.cubin   # also writes model.json
    """
    from tgc.backends.base import get_backend
    from tgc.ir.printer import print_module
    from tgc.manager import run_passes
    from tgc.opt.dims import FixDims
    from tgc.progress import status

    backend = get_backend(target)
    emit = emit or backend.emits[0]
    if emit not in backend.emits + ("ir",):
        raise click.BadParameter(f"--emit {emit} is not an output of --target {target} "
                                 f"(it writes: {', '.join(backend.emits + ('ir',))})", param_hint="--emit")
    output = output or default_output(file, emit)
    if output == "-" and emit in BINARY:
        raise click.BadParameter(f"a binary output (--emit {emit}) cannot go to standard output", param_hint="-o")
    options = Options(dtype=pipeline.float_type(file, dtype), opt_level=opt_level, import_dirs=tuple(import_dirs),
                      fp_strict=fp_strict, autocast=autocast,
                      memory_budget=memory_budget).with_(blas=blas, arch=arch)
    loaded = pipeline.load_program(file, options)
    report(loaded.widened)   # a type held narrower than it is named: said wherever it is built
    with _flag_errors():
        companions = {} if emit == "ir" else backend.companions(output, emit)
    beside = output == "-" or not is_special(output)   # a device or FIFO (/dev/null): nothing goes beside it
    if not beside:
        companions = {}
    depfile = mf or (str(Path(output).with_suffix(".d")) if md and beside else None)
    if depfile and output == "-" and not (mf and mt):
        raise click.BadParameter("a depfile of an output to standard output needs -MF and -MT", param_hint="-o")
    check_outputs([("the output", output), *companions.items(), ("the depfile", depfile)], sources(loaded.files),
                  hint="-o/-MF")
    try:
        module = run_passes(loaded.module, (FixDims.of(defines),), options)
        if not module.symbolic_dims():   # every size known: arrays over the size limit are the -D values' fault
            module.bind_dims({})
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=DIM_FLAGS) from None
    with status("compiling"), gc_paused():
        lowered = pipeline.lower(module, options, backend=target)
    report_memory(lowered.memory)
    with status("compiling"), gc_paused():
        if emit == "ir":
            files = {output: print_module(lowered.module).encode()}
        else:
            compiled, opts = pipeline.target(lowered.module, options)   # what tgc.compile compiles
            low = pipeline.lower_module(compiled, opts, target)
            with _flag_errors():
                files = backend.build(compiled, low, opts, emit, output, Path(file).name)
            files = {path: data for path, data in files.items() if path == output or path in companions.values()}
    if depfile:
        from tgc.depfile import compiler_dependencies, format_depfile

        deps = _on_disk(loaded.files) + compiler_dependencies(not pipeline.is_ir_file(file))
        # a file name's bytes as they are (Python keeps those that are not UTF-8 as surrogates)
        files[depfile] = format_depfile(list(mt), [output] if not mt else [], deps, mp).encode("utf-8", "surrogateescape")
    if output == "-":
        click.echo(files.pop("-").decode(), nl=False)
    write_all_atomic({path: (data, 0o755 if path.endswith(".so") else 0o644) for path, data in files.items()})


@contextmanager
def _flag_errors():
    """A backend's ValueError "--flag: why" (flags it cannot honour) as a usage error of that flag."""
    try:
        yield
    except ValueError as e:
        flag, sep, why = str(e).partition(": ")
        if not (sep and flag.startswith("-") and " " not in flag):
            raise
        raise click.BadParameter(why, param_hint=flag) from None


def _on_disk(files: list[str]) -> list[str]:
    """The files a program was read from, without standard input."""
    return [f for f in files if f not in ("-", "<stdin>")]
