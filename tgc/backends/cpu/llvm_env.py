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
  * JIT-compiles a module into a live MCJIT engine, or loads object files into one,
  * compiles the modules of one program at once in forked processes
    (`emit_objects`), where an LLVM assertion cannot take the process down (a module
    whose compile dies is compiled again without the vectorizers), and
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
import faulthandler
import functools
import os
import signal
import threading
import warnings

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


def optimize(module, opt: int = 3, tm: llvm.TargetMachine | None = None,
             vectorize: bool = True) -> llvm.ModuleRef:
    """Run the O``opt`` pipeline (loop + SLP vectorization on, unless ``vectorize`` is
    False) over ``module`` for ``tm`` (default: the host JIT machine); returns the
    optimised ModuleRef, which is ``module`` itself when a ModuleRef was given."""
    if opt not in (0, 1, 2, 3):
        raise ValueError(f'opt level must be 0..3, got {opt!r}')
    ref = parse(module)
    tm = tm or target_machine(opt)
    ref.triple = tm.triple
    ref.data_layout = str(tm.target_data)
    pto = llvm.create_pipeline_tuning_options(speed_level=opt)
    pto.loop_vectorization = vectorize
    pto.slp_vectorization = vectorize
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


class ObjectJit(JitModule):
    """Machine code loaded from object files (e.g. from the on-disk cache); symbols
    one object leaves undefined are resolved in the others."""

    def __init__(self, objs: list[bytes], prefer_512: bool = True):
        tm = target_machine(0, prefer_512=prefer_512)
        self.module = parse('target triple = "%s"' % llvm.get_process_triple())
        self.engine = llvm.create_mcjit_compiler(self.module, tm)
        for obj in objs:
            self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self.engine.finalize_object()
        _LIVE_ENGINES[id(self.engine)] = self.engine


def jit_objects(objs: list[bytes], *, prefer_512: bool = True) -> JitModule:
    """Load the object files of one program (`emit_objects`) into one engine."""
    return ObjectJit(list(objs), prefer_512)


def jit(llvm_ir_text, opt: int = 3, *, prefer_512: bool = True) -> JitModule:
    """Optimise and JIT-compile IR text (or an ``llvmlite.ir.Module``)."""
    return JitModule(parse(llvm_ir_text), opt, prefer_512)


def _compiled(llvm_ir_text, opt, for_object, prefer_512, vectorize=True):
    tm = target_machine(opt, for_object=for_object, prefer_512=prefer_512)
    return tm, optimize(parse(llvm_ir_text), opt, tm, vectorize)


def emit_object(llvm_ir_text, opt: int = 3, *, prefer_512: bool = True, vectorize: bool = True) -> bytes:
    """ELF object code (PIC) for the optimised module; link with ``cc -shared``."""
    tm, ref = _compiled(llvm_ir_text, opt, True, prefer_512, vectorize)
    with _codegen_level(opt):
        return tm.emit_object(ref)


class LLVMCrash(RuntimeError):
    """LLVM died (an assertion or a fault) compiling a module, with and without the
    vectorizers: an internal compiler error, reported without taking the process down."""


def usable_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def emit_objects(texts: list, opt: int = 3, *, jobs: int = 1,
                 prefer_512: bool = True) -> list[bytes]:
    """Object code of each module, the same bytes as `emit_object` gives for it.
    A module may be given as a function that returns its text (a child calls its own:
    printing a module's IR is Python work too).

    Each module is compiled in a forked child process, up to `jobs` at once, and the
    children send their object code back through a pipe. llvmlite serializes every
    LLVM call of a process behind one lock, so threads cannot share the work;
    processes can. And LLVM's own assertions abort the process they run in (its loop
    vectorizer asserts on some loops tgc generates): a child that dies of such a signal
    (abort, segfault, bus error, illegal instruction) is tried once more without the
    vectorizers, and if that dies too, `LLVMCrash` is raised here, where the caller
    reports it. A child that failed otherwise (a Python exception, or killed from
    outside) says nothing about LLVM: this process compiles that module itself, with
    the same settings, so the outcome (the code, or the real exception) is the one a
    process without fork gets. The fork happens while this thread holds llvmlite's
    lock, so no other thread of the process is inside LLVM at that moment (a child
    never inherits LLVM mid-call). Without fork, this process compiles every module
    itself. Children are always reaped."""
    made: dict[int, str] = {}

    def text(i):   # a function's text is made once
        if i not in made:
            made[i] = texts[i]() if callable(texts[i]) else texts[i]
        return made[i]

    lock = _llvm_lock()
    if not hasattr(os, "fork") or lock is None:
        return [emit_object(text(i), opt, prefer_512=prefer_512) for i in range(len(texts))]
    objs: list[bytes | None] = [None] * len(texts)
    todo = [(i, True) for i in range(len(texts))]   # (module, vectorize)
    children: list[tuple[int, int, int, bool]] = []   # (pid, read end, module index, vectorize)
    try:
        while todo or children:
            while todo and len(children) < max(jobs, 1):
                i, vec = todo.pop(0)
                with lock, warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)   # 3.12+: fork of a threaded process
                    try:
                        pid, fd, _ = _fork_compile(texts[i], i, opt, prefer_512, vec)
                    except OSError:   # no more processes or pipes: this process compiles it
                        objs[i] = emit_object(text(i), opt, prefer_512=prefer_512, vectorize=vec)
                        continue
                children.append((pid, fd, i, vec))
            if not children:
                continue
            pid, fd, i, vec = children[0]
            children[0] = (pid, -1, i, vec)   # its pipe is _collect's to close; the clean-up below still stops it
            objs[i], crashed = _collect(pid, fd)   # reaps the child
            children.pop(0)
            if objs[i] is None and not crashed:
                objs[i] = emit_object(text(i), opt, prefer_512=prefer_512, vectorize=vec)
            elif objs[i] is None:
                if not vec:
                    raise LLVMCrash(f"LLVM crashed compiling part {i + 1} of {len(texts)} of the program, "
                                    "with and without vectorization")
                todo.insert(0, (i, False))
        return objs
    finally:
        for pid, fd, _, _ in children:   # only on an exception: stop and reap what is left
            _stop(pid, fd)


def survives_in_child(fn, timeout: float = 60.0) -> bool | None:
    """Whether ``fn()`` returns (any exception counts as failure) in a forked child
    without being killed by a signal (LLVM aborts or segfaults on damaged object
    files) or running past ``timeout`` seconds; None where this platform cannot
    fork. The fork happens under llvmlite's lock, as in `emit_objects`."""
    import select

    lock = _llvm_lock()
    if not hasattr(os, "fork") or lock is None:
        return None
    read, write = os.pipe()
    with lock, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            os.close(read)
            os.close(write)
            return None
        if pid == 0:
            status = 1
            try:
                os.close(read)
                global _FLAGS_LOCK
                _FLAGS_LOCK = threading.RLock()
                with contextlib.suppress(OSError):   # LLVM's messages, if any, are not ours to print
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
                fn()
                status = 0
            finally:
                os._exit(status)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout)   # readable at EOF: the child ended
    finally:
        os.close(read)
    if not ready:
        _stop(pid, -1)
        return False
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _llvm_lock():
    """llvmlite's process-wide lock around LLVM calls (None if this llvmlite has none)."""
    lib = getattr(getattr(llvm, 'ffi', None), 'lib', None)
    return getattr(lib, '_lock', None)


def _fork_compile(text, index: int, opt: int, prefer_512: bool, vectorize: bool = True) -> tuple[int, int, int]:
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        raise
    if pid == 0:   # the child: compile, send, leave without running any of the parent's exit code
        status = 1
        try:
            os.close(read)
            # LLVM reports a failed assertion on stderr before it aborts: the parent retries
            # the module (or raises LLVMCrash), so the user sees one error, not LLVM's
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            faulthandler.disable()   # (a test runner's, writing to its own copy of stderr)
            # another thread of the parent may have held this lock at the fork: the
            # child, which has only this thread, starts with its own
            global _FLAGS_LOCK
            _FLAGS_LOCK = threading.RLock()
            obj = emit_object(text() if callable(text) else text, opt, prefer_512=prefer_512, vectorize=vectorize)
            with os.fdopen(write, 'wb') as out:
                out.write(obj)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    return pid, read, index


def _collect(pid: int, fd: int) -> tuple[bytes | None, bool]:
    """The child's object code (or None if it did not finish cleanly), and whether
    it died of a signal that LLVM's own failures raise (an assertion's abort, a
    segfault...), as opposed to a Python exception or a kill from outside. Interrupted
    while reading (Ctrl-C), it leaves the child to the caller's clean-up, which kills
    it before reaping it: waiting for it here could hang, since a child whose object
    code outgrows the pipe's buffer blocks writing, and closing this end does not end
    the write while a later child's inherited copy of it is open."""
    with os.fdopen(fd, 'rb') as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0 and data:
        return data, False
    return None, -code in _CRASH_SIGNALS


_CRASH_SIGNALS = frozenset(int(getattr(signal, n)) for n in ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE")
                           if hasattr(signal, n))


def _stop(pid: int, fd: int) -> None:
    """Kill a child whose result is no longer wanted, and reap it."""
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)


def emit_asm(llvm_ir_text, opt: int = 3, for_object: bool = True, *,
             prefer_512: bool = True) -> str:
    """Assembly text of the optimised module, for the object (default) or JIT machine."""
    tm, ref = _compiled(llvm_ir_text, opt, for_object, prefer_512)
    with _codegen_level(opt):
        return tm.emit_assembly(ref)
