"""The backends a backend test runs on: every registered one, so that a new backend
folder (tgc/backends/NAME, docs/backends.md) gets the backend tests without editing them.

- `backends(exclude=())`: every backend's name (`tgc.backends.base.backend_names`,
  read when a test module is collected), less `exclude`: for `pytest.mark.parametrize`
  or a fixture's `params`. A suite of many programs excludes a backend whose every
  build is costly where another test covers it (`EMULATED`: cuda-sim compiles C++ for
  each program), so that the suite's time does not grow with it.
- `compile_on(source, backend, **kw)`: `tgc.compile`, or the test skipped with the
  reason a backend that cannot run here gives (`BackendUnavailable`: cuda without a
  GPU, cuda-sim without g++).
- `skip_unavailable(result, backend)`: the same for `tgc run --backend` through the
  command line, which exits with status 3 and the reason.
- `--backends-from DIR` (tests/conftest.py): backend folders in DIR are registered
  before collection, so every test parametrized here runs them too
  (tests/backends/test_toy_backend.py does so with its toy backend).
"""
from __future__ import annotations

import pytest

from tgc.backends.base import BackendUnavailable, backend_names

EMULATED = ("cuda-sim",)   # runs every program through g++ (seconds a build): its own tests cover it


def backends(exclude=()) -> list[str]:
    """Every registered backend's name but those in `exclude`."""
    return [name for name in backend_names() if name not in exclude]


def compile_on(source, backend: str, **kwargs):
    """`tgc.compile(source, backend=backend, **kwargs)`; a backend that cannot run here
    skips the test with its reason."""
    import tgc

    try:
        return tgc.compile(source, backend=backend, **kwargs)
    except BackendUnavailable as e:
        pytest.skip(str(e))


def skip_unavailable(result, backend: str) -> None:
    """Skip the test when `tgc ... --backend backend` (a click `Result`) said that the
    backend cannot run here (status 3, as for a failed call, with the backend's
    `BackendUnavailable` message, which names it)."""
    last = (result.output.strip().splitlines() or [""])[-1]
    if result.exit_code == 3 and last.startswith(f"error: backend '{backend}'"):
        pytest.skip(last.removeprefix("error: "))
