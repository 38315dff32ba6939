"""`Program.run(..., notify=(marks, fn))`: fn(i, outputs) right after kernel i, in the
middle of the native call, and `Program.ready_after()`, the kernel after which each output
is final. A data-parallel step starts each bucket's allreduce there (tgc.distributed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.options import Options

from backends_util import backends, compile_on

ROOT = Path(__file__).parents[2]
MLP = ROOT / "examples/mlp.tg"

# the MLP's loss and its gradients, as outputs: gradients finish at different kernels
GRADS = (MLP.read_text().split("update")[0]
         + "out d_W1 = grad(loss, W1)\nout d_b1 = grad(loss, b1)\nout d_W2 = grad(loss, W2)\nout d_b2 = grad(loss, b2)\n")


def arrays(batch: int = 6) -> dict:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((batch, 13), dtype=np.float32),
            "y": np.eye(3, dtype=np.float32)[rng.integers(0, 3, batch)],
            "W1": 0.3 * rng.standard_normal((13, 64), dtype=np.float32), "b1": np.zeros(64, np.float32),
            "W2": 0.3 * rng.standard_normal((64, 3), dtype=np.float32), "b2": np.zeros(3, np.float32), "lr": 0.1}


@pytest.fixture(scope="module", params=backends())
def grads(request):
    """The program on every registered backend (one that cannot run here skips); a
    backend without native notification (`Kernels.notifies`) is told after the call."""
    return compile_on(GRADS, request.param)


def _snapshots(program, given: dict):
    """Run with every output's last kernel marked; (the result, what each output held
    when fn was told its kernel, the kernels fn was called with)."""
    ready = program.ready_after()
    seen, calls = {}, []

    def fn(i, outs):
        calls.append(i)
        for name, k in ready.items():
            if k == i:
                seen[name] = np.copy(outs[name])
    result = program.run(given, notify=(set(ready.values()), fn))
    return result, seen, calls, ready


def test_ready_after_names_the_last_writer(grads):
    ready = grads.ready_after()
    n = len(grads.lowered.kernels)
    assert set(ready) == {o.name for o in grads.outputs}
    assert all(0 <= k < n for k in ready.values())
    for name, k in ready.items():
        buf = next(b for b, x in grads.lowered.buffers.items() if x.kind == "out"
                   and grads.outputs[x.index].name == name)
        assert buf in grads.lowered.kernels[k].writes()
        assert not any(buf in later.writes() for later in grads.lowered.kernels[k + 1:])
    # the backward pass finishes the gradients at different kernels, the loss before them
    assert len({ready[g] for g in ("d_W1", "d_b1", "d_W2", "d_b2")}) > 1
    assert ready["loss"] < max(ready[g] for g in ("d_W1", "d_W2"))


def test_each_output_is_final_when_its_kernel_is_told(grads):
    """The checked call (the first) and the fast path (the second) alike: fn is called
    once per marked kernel, in order, and what an output holds then is its final value."""
    for _ in range(2):
        result, seen, calls, ready = _snapshots(grads, arrays())
        assert calls == sorted(set(ready.values()))
        for name in ready:
            assert np.array_equal(seen[name], result[name]), name


def test_fn_runs_in_the_middle_of_the_call():
    """An output that fn fills with NaN at an early kernel comes back finite and equal
    to a plain call's: the kernels that write it ran after fn. Without merged parallel
    regions: a kernel in one is told when its region ends (`Program.run`'s docstring)."""
    program = tgc.compile(GRADS, options=Options().with_(merge_regions=False))
    low = program.lowered
    ready = program.ready_after()
    early = min(ready.values())
    out_buf = {program.outputs[b.index].name: name for name, b in low.buffers.items() if b.kind == "out"}
    writers = {o: [i for i, k in enumerate(low.kernels) if out_buf[o] in k.writes()] for o in ready}
    later = [o for o, ks in writers.items() if min(ks) > early]
    assert later                             # a gradient the backward pass writes only later
    told = []

    def fn(i, outs):
        told.append(i)
        for o in later:
            outs[o][...] = np.nan
    result = program.run(arrays(), notify=({early}, fn))
    plain = program.run(arrays())
    assert told == [early]
    for o in later:
        assert not np.isnan(result[o]).any(), o
        assert np.array_equal(result[o], plain[o]), o


def test_results_are_the_plain_call_bits(grads):
    result, _, _, _ = _snapshots(grads, arrays())
    plain = grads.run(arrays())
    for k in plain:
        assert np.array_equal(result[k], plain[k]), k


def test_an_exception_in_fn_is_raised_after_the_call_and_cleared():
    program = tgc.compile(GRADS)
    told = []

    def fn(i, outs):
        told.append(i)
        raise RuntimeError("boom")
    marks = set(program.ready_after().values())
    with pytest.raises(RuntimeError, match="boom"):
        program.run(arrays(), notify=(marks, fn))
    assert told == [min(marks)]            # after the first failure, fn is not called again
    program.run(arrays())                  # the marks are cleared: a plain call calls nothing
    assert told == [min(marks)]


def test_bad_marks_and_forward_only_are_refused(grads):
    program = grads
    with pytest.raises(ValueError, match="kernel 100000 does not exist"):
        program.run(arrays(), notify=({100000}, lambda i, outs: None))
    with pytest.raises(ValueError, match="full call"):
        program.run(arrays(), updates=False, notify=({0}, lambda i, outs: None))


def test_without_native_notification_fn_is_called_after_the_call():
    """Outputs converted after the call (f32 under --fp-strict): fn is told after the
    whole call, with the final (converted) outputs, in order."""
    program = tgc.compile(GRADS, options=tgc.Options(fp_strict=True))
    result, seen, calls, ready = _snapshots(program, arrays())
    assert calls == sorted(set(ready.values()))
    for name in ready:
        assert seen[name].dtype == np.float32
        assert np.array_equal(seen[name], result[name]), name
