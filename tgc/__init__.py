"""tgc: a compiler for tensor programs whose axes are named edges.

    import tgc
    prog = tgc.compile("model.tg", dtype="f32")       # or .tg source text, IR text, a Module
    result = prog(x=x, W=W)                            # {output: array, ..., update target: array}
"""
from __future__ import annotations

__version__ = "0.1.0"


def compile(source, backend: str = "cpu", dtype: str = "f32", dims=None, options=None):
    """Compile a program to native code; returns a callable `tgc.runtime.Program`.

    `source`: a path to a `.tg` or `.tgir` file, `.tg` source text, IR text (as
    `tgc dump-ir` prints it), or a `tgc.ir.module.Module`. `dims` ({name: size})
    fixes symbolic dims at build time; dims left symbolic are bound at each call
    from the inputs' shapes, so one build serves every batch size.
    """
    import os
    import re

    from tgc import driver
    from tgc.ir.module import Module
    from tgc.options import Options

    if backend != "cpu":
        raise ValueError(f"backend '{backend}' is not available (have: cpu)")
    options = (options or Options()).with_(dtype=dtype, dims=tuple(sorted((dims or {}).items())))
    if isinstance(source, Module):
        module = source
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                              and source.endswith((".tg", ".tgir"))):
        module = driver.load(os.fspath(source), options)
    elif re.search(r"^\s*(%\w+\s*=|out\s+\S+\s*=\s*%)", source, re.M):
        from tgc.ir.parser import parse_module

        module = parse_module(source, "<ir>")
    else:
        from tgc.frontend import compile_source

        module = compile_source(source, "<source>", options)
    module = driver.fix_dims(module, dims or {})
    from tgc.runtime import build

    return build(driver.lower(module, options.with_(dims=())).module, options.with_(dims=()))
