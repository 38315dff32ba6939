"""The backends a backend test runs on: every registered one, so that a new backend
folder (tgc/backends/NAME, docs/backends.md) gets the backend tests without editing them.

- `backends(exclude=())`: every backend's name (`tgc.backends.base.backend_names`,
  read when a test module is collected), less `exclude`: for `pytest.mark.parametrize`
  or a fixture's `params`. A suite of many programs excludes a backend whose every
  build is costly where another test covers it (`EMULATED`: cuda-sim compiles C++ for
  each program), so that the suite's time does not grow with it.
- `require(backend)`: the test skipped, before anything is lowered or compiled, when
  the backend cannot run here (`Backend.unavailable()`: cuda without a GPU, cuda-sim
  without g++), with its reason; "interp" (the IR interpreter) always runs. Call it
  before `tgc run --backend` too.
- `compile_on(source, backend, **kw)`: `require`, then `tgc.compile`.
- `--backends-from DIR` (tests/conftest.py): backend folders in DIR are registered
  before collection, so every test parametrized here runs them too
  (tests/backends/test_toy_backend.py does so with its toy backend).
"""
from __future__ import annotations

import functools

import pytest

from tgc.backends.base import backend_names, get_backend

EMULATED = ("cuda-sim",)   # runs every program through g++ (seconds a build): its own tests cover it


def backends(exclude=()) -> list[str]:
    """Every registered backend's name but those in `exclude`."""
    return [name for name in backend_names() if name not in exclude]


@functools.cache
def _unavailable(backend: str) -> str | None:
    return None if backend == "interp" else get_backend(backend).unavailable()


def require(backend: str) -> None:
    """Skip the test, with the reason, when `backend` cannot run here."""
    why = _unavailable(backend)
    if why:
        pytest.skip(why)


def compile_on(source, backend: str, **kwargs):
    """`tgc.compile(source, backend=backend, **kwargs)`; a backend that cannot run here
    skips the test with its reason (`require`). Anything `compile` raises then, a
    `BackendUnavailable` too (CUDA: a program it does not support, a module that does
    not load), fails the test."""
    import tgc

    require(backend)
    return tgc.compile(source, backend=backend, **kwargs)

