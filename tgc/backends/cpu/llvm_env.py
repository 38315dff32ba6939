"""The CPU backend's door to LLVM (llvmlite 0.50 / LLVM 22).

One place that
  * initialises llvmlite once (``initialize_native_target``/``_asmprinter``; the old
    ``llvm.initialize()`` raises on this version),
  * builds TargetMachines for the host CPU (its name and feature string, so loops
    vectorize to the host's widest registers: 512-bit on AVX-512 machines; on Intel
    server parts LLVM's tuning prefers 256-bit vectors, which ``prefer_512=True``,
    the default, overrides with ``-prefer-256-bit``),
  * runs the new-pass-manager O0..O3 pipeline with loop and SLP vectorization on,
    and generates machine code for the same level: below O3 without loop strength
    reduction, a machine-code pass that took a fifth of code generation time on
    tgc's kernels and did not change their speed (O3 keeps it),
  * JIT-compiles a module into a live MCJIT engine, and
  * emits object files (``reloc='pic'``, ``codemodel='default'``: linkable into a
    ``.so``) and assembly text.

Everything takes the optimisation level explicitly; nothing here is configured by
module state. LLVM's command-line options are process-wide, so the one a level
changes is set only while tgc generates code (under a lock) and put back after:
other users of llvmlite in the process see LLVM's defaults. Output is
deterministic: the same IR text gives the same object bytes.

Engines are kept alive for the life of the process (a registry holds them), so an
address handed out never dangles even when its ``JitModule`` is dropped; a caller
that knows no address of a module is still in use may ``close()`` it to free the
code.
"""

import contextlib
import functools
import threading

import llvmlite.binding as llvm
import llvmlite.ir as ir


@functools.cache
def _target() -> llvm.Target:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_default_triple()


@functools.cache
def host_cpu() -> tuple[str, str]:
    """(cpu name, comma-separated feature string) of the machine we run on."""
    _target()
    try:
        features = llvm.get_host_cpu_features().flatten()
    except RuntimeError:
        features = ''
    return llvm.get_host_cpu_name(), features


def has_feature(name: str) -> bool:
    """Whether the host CPU has an LLVM feature, e.g. ``'avx512f'``."""
    return f'+{name}' in host_cpu()[1].split(',')


def target_machine(opt: int = 3, for_object: bool = False,
                   prefer_512: bool = True) -> llvm.TargetMachine:
    """A fresh host TargetMachine (fresh because an MCJIT engine takes ownership of
    the one it is built with). ``for_object`` selects PIC code for shared objects;
    otherwise the settings are those of the JIT. ``prefer_512`` lets the vectorizers
    use 512-bit registers on AVX-512 CPUs whose LLVM tuning prefers 256 bits
    (Intel server parts such as Sapphire/Emerald Rapids)."""
    cpu, features = host_cpu()
    if prefer_512 and has_feature('avx512f'):
        features += ',-prefer-256-bit'
    if for_object:
        return _target().create_target_machine(
            cpu=cpu, features=features, opt=opt, reloc='pic', codemodel='default')
    return _target().create_target_machine(cpu=cpu, features=features, opt=opt)


# (LLVM option, its value while generating code below O3, LLVM's default)
_BELOW_O3 = (('disable-lsr', 'true', 'false'),)
_FLAGS_LOCK = threading.RLock()


@contextlib.contextmanager
def _codegen_level(opt: int):
    """LLVM's process-wide code generation options for level ``opt``, for the
    duration of the block (machine code is generated when a module is emitted or
    when an engine finalizes it)."""
    flags = _BELOW_O3 if opt < 3 else ()
    with _FLAGS_LOCK:
        for name, value, _ in flags:
            llvm.set_option('tgc', f'-{name}={value}')
        try:
            yield
        finally:
            for name, _, default in flags:
                llvm.set_option('tgc', f'-{name}={default}')


def parse(module) -> llvm.ModuleRef:
    """A verified ModuleRef from IR text, an ``llvmlite.ir.Module`` or a ModuleRef."""
    if isinstance(module, llvm.ModuleRef):
        return module
    if isinstance(module, ir.Module):
        module = str(module)
    _target()
    ref = llvm.parse_assembly(module)
    ref.verify()
    return ref


def optimize(module, opt: int = 3, tm: llvm.TargetMachine | None = None) -> llvm.ModuleRef:
    """Run the O``opt`` pipeline (loop + SLP vectorization on) over ``module`` for
    ``tm`` (default: the host JIT machine); returns the optimised ModuleRef, which is
    ``module`` itself when a ModuleRef was given."""
    if opt not in (0, 1, 2, 3):
        raise ValueError(f'opt level must be 0..3, got {opt!r}')
    ref = parse(module)
    tm = tm or target_machine(opt)
    ref.triple = tm.triple
    ref.data_layout = str(tm.target_data)
    pto = llvm.create_pipeline_tuning_options(speed_level=opt)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(ref, pb)
    ref.verify()
    return ref


_LIVE_ENGINES: dict[int, llvm.ExecutionEngine] = {}


class JitModule:
    """A compiled module living in its own MCJIT engine."""

    def __init__(self, module: llvm.ModuleRef, opt: int, prefer_512: bool = True):
        tm = target_machine(opt, prefer_512=prefer_512)
        self.module = optimize(module, opt, tm)
        with _codegen_level(opt):
            self.engine = llvm.create_mcjit_compiler(self.module, tm)
            self.engine.finalize_object()
        _LIVE_ENGINES[id(self.engine)] = self.engine

    def close(self) -> None:
        """Free the machine code; every address from this module becomes invalid."""
        engine = _LIVE_ENGINES.pop(id(self.engine), None)
        if engine is not None:
            engine.close()

    def address(self, name: str) -> int:
        """Entry address of the function ``name``; KeyError if it is not defined."""
        if id(self.engine) not in _LIVE_ENGINES:
            raise RuntimeError('JIT module was closed')
        addr = self.engine.get_function_address(name)
        if not addr:
            raise KeyError(f'no function {name!r} in JIT module')
        return addr

    @property
    def optimized_ir(self) -> str:
        return str(self.module)


class ObjectJit(JitModule):
    """Machine code loaded from an object file (e.g. from the on-disk cache)."""

    def __init__(self, obj: bytes, prefer_512: bool = True):
        tm = target_machine(0, prefer_512=prefer_512)
        self.module = parse('target triple = "%s"' % llvm.get_process_triple())
        self.engine = llvm.create_mcjit_compiler(self.module, tm)
        self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self.engine.finalize_object()
        _LIVE_ENGINES[id(self.engine)] = self.engine


def jit_object(obj: bytes, *, prefer_512: bool = True) -> JitModule:
    """Load an object file that `emit_object` produced into this process."""
    return ObjectJit(obj, prefer_512)


def jit(llvm_ir_text, opt: int = 3, *, prefer_512: bool = True) -> JitModule:
    """Optimise and JIT-compile IR text (or an ``llvmlite.ir.Module``)."""
    return JitModule(parse(llvm_ir_text), opt, prefer_512)


def _compiled(llvm_ir_text, opt, for_object, prefer_512):
    tm = target_machine(opt, for_object=for_object, prefer_512=prefer_512)
    return tm, optimize(parse(llvm_ir_text), opt, tm)


def emit_object(llvm_ir_text, opt: int = 3, *, prefer_512: bool = True) -> bytes:
    """ELF object code (PIC) for the optimised module; link with ``cc -shared``."""
    tm, ref = _compiled(llvm_ir_text, opt, True, prefer_512)
    with _codegen_level(opt):
        return tm.emit_object(ref)


def emit_asm(llvm_ir_text, opt: int = 3, for_object: bool = True, *,
             prefer_512: bool = True) -> str:
    """Assembly text of the optimised module, for the object (default) or JIT machine."""
    tm, ref = _compiled(llvm_ir_text, opt, for_object, prefer_512)
    with _codegen_level(opt):
        return tm.emit_assembly(ref)
