"""The garbage collector is paused while a program compiles (`tgc.ir.collector`)."""
from __future__ import annotations

import gc

import tgc
from tgc import pipeline
from tgc.ir.collector import gc_paused


def test_pauses_nest_and_restore_the_collector():
    was = gc.isenabled()
    gc.enable()
    try:
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()   # the outer pause still holds
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled()       # off before: left off
    finally:
        (gc.enable if was else gc.disable)()


def test_the_backend_compiles_with_the_collector_paused(monkeypatch):
    from tgc.backends.base import get_backend

    seen = []
    backend = type(get_backend("cpu"))
    original = backend.compile

    def compile(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(backend, "compile", compile)
    monkeypatch.setenv("TGC_CACHE", "off")   # compiled here, not found in the cache
    was = gc.isenabled()
    gc.enable()
    try:
        program = tgc.compile("dim i = 3\ndim j = 4\nparam W[i, j]\ninput x[j]\nout y = sum[i](tanh(W @ x))\n")
        assert seen == [False]
        assert gc.isenabled()          # on again after
        assert program is not None
    finally:
        (gc.enable if was else gc.disable)()
    assert pipeline.compile_module.__wrapped__ is not None   # the decorator wraps the function
