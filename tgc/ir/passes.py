"""What a pass is: a small named object that maps a module to a module.

A pass is a frozen dataclass subclassing `Pass`, with a class-level `name` and a
one-line docstring; its fields are its options. `run` must be a pure function of
the module (it may build new values; it never mutates values, which are shared).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tgc.ir.module import Module
from tgc.options import Options


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = ""
    rounds: ClassVar[bool] = False   # changes values by design (autocast): --verify-each re-bases after it

    def run(self, module: Module, options: Options) -> Module:
        raise NotImplementedError

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
