"""What a pass is: a small named object that maps a program to a program.

A pass is a frozen dataclass subclassing `Pass`, with a class-level `name` and a
one-line docstring; its fields are its options (`-p 'group{blocks=8}'` sets them;
`tgc passes` lists them). `run` must be a pure function of its input (it may build
new values; it never mutates values, which are shared). `takes` and `gives` say
which level it reads and writes: "module" (the IR) or "lowered" (the lowered
program, `tgc.lower.lowered`); the pass manager (`tgc.manager`) runs both kinds, and
checks that each pass of a list reads what the one before it gives. A pass that
gives a program of another float type than it reads (`emulate_f32`: an f32 program
as its f64 emulation) says so with `float_type`; the passes after it, the lowering
and the backend then run with that type. A pass whose options can be wrong for the
program it is given (`fix_dims{sizes=k=3}` where there is no dim `k`) says why in
`options_error`: a usage error, not a failure inside `run`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from tgc.options import Options

In = TypeVar("In")
Out = TypeVar("Out")

LEVELS = ("module", "lowered")


@dataclass(frozen=True)
class Pass(Generic[In, Out]):
    name: ClassVar[str] = ""
    rounds: ClassVar[bool] = False   # changes values by design (autocast): --verify-each re-bases after it
    takes: ClassVar[str] = "module"  # the level it reads (LEVELS)
    gives: ClassVar[str] = "module"  # the level it writes

    def run(self, ir: In, options: Options) -> Out:
        raise NotImplementedError

    def options_error(self, ir: In) -> str | None:
        """Why this pass's options (a user's `-p` text) cannot apply to `ir`, or None;
        the pass manager reports it as a pass-list error (a usage error) before `run`
        (a pass given as an object, by code, runs and raises its own errors)."""
        return None

    def float_type(self, options: Options) -> str:
        """The float type of the program `run` gives, for one of type `options.dtype`."""
        return options.dtype

    @classmethod
    def summary(cls) -> str:
        """The docstring's first paragraph on one line (`tgc passes` lists it)."""
        return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
