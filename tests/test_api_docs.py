"""The public API is importable from `tgc` and documented: every public name, and every
public method and property of `Program`, has a docstring, so `help(tgc)` reads well."""
from __future__ import annotations

import inspect
import pydoc

import tgc


def test_public_names_are_importable_and_documented():
    for name in tgc.__all__:
        value = getattr(tgc, name)
        if name != "__version__":
            assert inspect.getdoc(value), name
    assert tgc.Program is tgc.runtime.program.Program and tgc.Options is tgc.options.Options
    assert set(tgc.__all__) <= set(dir(tgc))


def test_program_members_are_documented():
    for name, member in vars(tgc.Program).items():
        if name.startswith("_") and name not in ("__call__", "__str__", "__init__"):
            continue
        if name == "__init__":
            continue
        doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(member)
        assert doc, name
    for name in ("__call__", "run", "inputs", "outputs", "ir", "plan", "without_updates"):
        assert name in vars(tgc.Program), name


def test_help_renders():
    text = pydoc.render_doc(tgc, renderer=pydoc.plaintext)
    for name in ("compile(", "class Program", "save_params(", "load_params(", "class Options", "updates=False"):
        assert name in text, name
