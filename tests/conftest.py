"""Fixtures shared by the tests: the optimization tests run every pass with --verify-each.

The helpers live in `passes_util` (importable by the test modules); `verified` is its
`optimize`: run passes through `run_pipeline(..., Options(verify_each=True))`.
"""
import pytest

from passes_util import optimize


@pytest.fixture
def verified():
    """`optimize(module, passes)`, every pass checked by the float64 interpreter."""
    return optimize
