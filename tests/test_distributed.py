"""Data-parallel training steps (tgc.distributed): the split at the gradient boundary,
and runs over 1, 2 and 3 ranks against single-process training on the whole batch.

- The split: which values cross the ranks, that phase 2 no longer has the batch, and
  the errors for steps that cannot be split.
- In-process ranks (`tgc.distributed.run_ranks`, threads): params identical on every
  rank, equal to single-process training within f32 tolerance; equal and unequal shards.
- MPI: `mpirun -n 2` and `-n 3` (OpenMPI, mpi4py; skipped with a reason without them)
  run `tests/distributed_mpi_train.py`: the ranks agree bit for bit, match single-process
  training within f32 tolerance, and with `deterministic=True` (the gradients summed in
  rank order) match the in-process ranks bit for bit.
- The NCCL path on cuda-sim with in-process NCCL-like communicators.
- Overlap (small buckets, reduced while phase 1 runs) against `overlap=False`: the same
  bits, in-process, under MPI and on cuda-sim.
- One rank at fault, in-process and under `mpirun -n 2` (`tests/distributed_mpi_faults.py`):
  a bad call raises on every rank with nothing written and the next call runs; steps
  that differ refuse; a rank that dies makes the other fail after the timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import distributed as D
from tgc.ir.diag import CompileError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import distributed_cases as cases  # noqa: E402
import distributed_mpi_train as mpi_train  # noqa: E402

STEPS = 4


def _single(name: str, steps: int = STEPS) -> dict:
    """Single-process training on the whole batch: the oracle."""
    case = cases.CASES[name]
    prog = tgc.compile(case.path, options=tgc.Options(cpu=tgc.CpuOptions(threads=1)))
    state = case.init()
    losses = []
    for k in range(steps):
        losses.append(float(prog(**case.batch(k), **case.scalars(k), **state)[case.loss]))
    return {"losses": np.array(losses), **state}


def _local(n: int, spec: str, out: Path, kind: str = "mpi", backend: str = "cpu") -> list[dict]:
    """The spec trained on n in-process ranks; each rank's npz."""
    lock = threading.Lock()
    D.run_ranks(n, lambda comm: mpi_train.run(comm, spec, out, STEPS, lock, backend), kind=kind)
    return [dict(np.load(out / f"{spec}.rank{r}.npz")) for r in range(n)]


def _same_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks[1:]:
        for k in ranks[0]:
            assert np.array_equal(r[k], ranks[0][k]), k


def _close(got: dict, want: dict, rtol=2e-5, atol=2e-6) -> None:
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


# ---------------------------------------------------------------- the split

def _module(src_or_path: str):
    from tgc import pipeline

    if src_or_path.endswith(".tg"):
        return pipeline.load(src_or_path, tgc.Options())
    from tgc.frontend.elaborate import elaborate_source

    return elaborate_source(src_or_path, "<t>", tgc.Options()).module


def test_split_mlp_crosses_the_gradients_only():
    s = D.split_step(_module(cases.CASES["mlp"].path))
    assert sorted(s.boundary) == ["d_W1", "d_W2", "d_b1", "d_b2"]
    assert [o.name for o in s.grads.outputs] == ["loss", "correct", "probs", *s.boundary]
    assert not s.grads.updates and not s.apply.outputs
    assert "x" not in s.apply.args and "lr" in s.apply.args and "lr" not in s.grads.args
    assert "batch" not in s.apply.dims            # phase 2 binds no batch size
    assert {u.target for u in s.apply.updates} == {"W1", "b1", "W2", "b2"}


def test_split_adam_keeps_state_only_updates_in_phase_2():
    s = D.split_step(_module(cases.CASES["digits"].path))
    assert "step" in {u.target for u in s.apply.updates}
    assert len(s.boundary) == 6                   # K1, b1, K2, b2, W, b: one gradient each, read 3 times


BASE = """
dim batch
dim f = 3
input x[batch, f]
param W[f]
input lr
loss = mean[batch](sum[f](x * W) ^ 2)
out loss
"""


@pytest.mark.parametrize("src, message", [
    (BASE + "update W = W - lr * mean[batch](x)", "reads input 'x', which is split over the ranks"),
    (BASE.replace("dim batch", "dim batch = 4") + "update W = W - lr * grad(loss, W)", "dim 'batch' is fixed"),
    (BASE, "has no `update`"),
    (BASE + "update W = W - lr * size(batch) * grad(loss, W)", "reads the size of dim 'batch'"),
    (BASE.replace("param W[f]", "param W[f]\nparam Q[batch]") + "update Q = Q", "param 'Q' has the split edge"),
])
def test_split_refuses(src, message):
    with pytest.raises(CompileError, match=message):
        D.split_step(_module(src))


def test_split_needs_the_dim():
    with pytest.raises(CompileError, match="no dim 'rows'"):
        D.split_step(_module(BASE + "update W = W - lr * grad(loss, W)"), shard="rows")


def test_replicated_gradient_stays_in_phase_2():
    """A derivative of the params alone (a regularizer's) is computed on every rank."""
    src = BASE + "reg = sum[f](W * W)\nupdate W = W - lr * (grad(loss, W) + grad(reg, W))"
    s = D.split_step(_module(src))
    assert s.boundary == ["d_W"]
    assert any(v.op == "grad" for v in __import__("tgc").ir.values.topo_order([u.value for u in s.apply.updates]))


def test_api_is_documented():
    import inspect

    for name, member in vars(D.DataParallel).items():
        if name.startswith("_") and name != "__call__":
            continue
        doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(member)
        assert doc, name
    for name in ("compile", "split_step", "local_group", "run_ranks", "DataParallel", "LocalComm", "LocalNcclComm"):
        assert inspect.getdoc(getattr(D, name)), name


def test_compile_keywords_need_data_parallel():
    with pytest.raises(TypeError, match="shard"):
        tgc.compile(cases.CASES["mlp"].path, shard="batch")


def test_not_a_communicator():
    with pytest.raises(TypeError, match="no communicator"):
        tgc.compile(cases.CASES["mlp"].path, data_parallel=object())


# ---------------------------------------------------------------- in-process ranks

@pytest.mark.parametrize("name, n", [("mlp", 1), ("mlp", 2), ("mlp", 3), ("mlp13", 2), ("mlp13", 3), ("digits", 2)])
def test_local_ranks_match_single_process(tmp_path, name, n):
    ranks = _local(n, name, tmp_path)
    _same_on_every_rank(ranks)
    _close(ranks[0], _single(name))


def _same_bits(a: dict, b: dict, skip=("overlapped",)) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k not in skip:
            assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("name, n", [("mlp", 2), ("mlp13", 3), ("digits", 2)])
@pytest.mark.parametrize("det", ["", ":det"])
def test_overlap_is_the_serial_path_bit_for_bit(tmp_path, name, n, det):
    """Buckets of 1 KiB (several per step) reduced while phase 1 runs give the bits of
    the same buckets reduced after it, on every rank."""
    over = _local(n, f"{name}:small{det}", tmp_path)
    serial = _local(n, f"{name}:small:serial{det}", tmp_path)
    assert all(r["overlapped"] for r in over) and not any(r["overlapped"] for r in serial)
    assert over[0]["buckets"] > 1
    _same_on_every_rank(over)
    for a, b in zip(over, serial):
        _same_bits(a, b)
    _close(over[0], _single(name))


def test_buckets_fill_in_the_order_phase_1_finishes_them():
    case = cases.CASES["digits"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm, bucket_bytes=1024)
        state = case.init()
        for k in range(2):
            step(**step.shard_inputs(case.batch(k)), **case.scalars(k), **state)
        return step
    lock = threading.Lock()
    step = D.run_ranks(2, body)[0]
    ready = step.grads.ready_after()
    buckets = step.buckets
    assert len(buckets) > 1 and step.last_overlapped
    assert [b[2] for b in buckets] == sorted(b[2] for b in buckets)     # reduced in the order they fill
    for names, nbytes, at in buckets:
        assert at == max(ready[n] for n in names)
        assert nbytes <= 1024 or len(names) == 1
    assert sorted(n for b in buckets for n in b[0]) == sorted(step.reduced)


def test_one_process_and_one_bucket_take_the_single_call():
    case = cases.CASES["mlp"]

    def body(comm, **kw):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm, **kw)
        state = case.init()
        for k in range(2):
            step(**step.shard_inputs(case.batch(k)), **case.scalars(k), **state)
        return step.last_overlapped, len(step.buckets)
    lock = threading.Lock()
    assert D.run_ranks(1, lambda c: body(c, bucket_bytes=1024))[0][0] is False      # one process
    assert D.run_ranks(2, lambda c: body(c))[0] == (False, 1)                          # one bucket
    assert D.run_ranks(2, lambda c: body(c, bucket_bytes=1024, overlap=False))[0][0] is False
    assert D.run_ranks(2, lambda c: body(c, bucket_bytes=1024))[0][0] is True
    with pytest.raises(TypeError, match="overlap= takes True or False"):
        tgc.compile(case.path, data_parallel=D.local_group(1)[0], overlap="yes")


def test_new_shapes_plan_the_buckets_again():
    """A gradient whose size follows a symbolic dim other than the batch's: a call with
    another size finds the buckets unfit during phase 1, reduces after it with buckets
    planned anew, and overlaps again on the next call; every result as without overlap."""
    src = BASE.replace("dim f = 3", "dim f") + "update W = W - lr * grad(loss, W)"
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((8, f), dtype=np.float32) for f in (3, 3, 5, 5)]

    def body(comm, overlap):
        with lock:
            step = tgc.compile(src, data_parallel=comm, bucket_bytes=4, overlap=overlap)
        got = []
        for x in xs:
            W = np.linspace(0.5, 1.5, x.shape[1], dtype=np.float32)
            res = step(**step.shard_inputs({"x": x}), W=W, lr=0.1)
            got.append((res["loss"], W.copy(), step.last_overlapped, len(step.buckets)))
        return got
    lock = threading.Lock()
    over = D.run_ranks(2, lambda c: body(c, True))
    serial = D.run_ranks(2, lambda c: body(c, False))
    assert [g[2] for g in over[0]] == [False, True, True, True]    # the third call: unfit, reduced after
    assert [g[3] for g in over[0]] == [2, 2, 2, 2]
    for a, b in zip(over, serial):
        for (la, Wa, _, _), (lb, Wb, _, _) in zip(a, b):
            assert np.array_equal(la, lb) and np.array_equal(Wa, Wb)
    x = xs[2]
    W = np.linspace(0.5, 1.5, 5, dtype=np.float32)
    g = 2 * (x @ W)[:, None] * x
    np.testing.assert_allclose(over[0][2][1], W - 0.1 * g.mean(0), rtol=1e-5)


def test_one_rank_is_the_plain_step_bit_for_bit(tmp_path):
    """With one rank nothing is reduced: the split step gives the fused step's bits on
    the MLP (its gradients are f32 in both)."""
    ranks = _local(1, "mlp", tmp_path)
    want = _single("mlp")
    for k in want:
        assert np.array_equal(ranks[0][k], want[k]), k


def test_shard_inputs_and_outputs():
    """Each rank gets contiguous rows; the loss comes back averaged over the ranks (by
    rows), the per-row outputs as this rank's rows."""
    src = BASE.replace("out loss", "out loss\nout r[batch] = sum[f](x * W)") + "update W = W - lr * grad(loss, W)"
    x = np.arange(15, dtype=np.float32).reshape(5, 3) / 10

    def body(comm):
        with lock:
            step = tgc.compile(src, data_parallel=comm)
        mine = step.shard_inputs({"x": x})
        W = np.ones(3, np.float32)
        res = step(**mine, W=W, lr=0.0)
        return mine["x"], res
    lock = threading.Lock()
    out = D.run_ranks(2, body)
    assert np.array_equal(out[0][0], x[:2]) and np.array_equal(out[1][0], x[2:])
    full = float(np.mean(x.sum(1) ** 2))
    for xs, res in out:
        np.testing.assert_allclose(res["loss"], full, rtol=1e-6)
        np.testing.assert_allclose(res["r"], xs.sum(1), rtol=1e-6)


def test_sums_are_summed_not_averaged():
    src = BASE.replace("out loss", "out loss\nout s = sum(x)") + "update W = W - lr * grad(loss, W)"
    x = np.arange(21, dtype=np.float32).reshape(7, 3)

    def body(comm):
        with lock:
            step = tgc.compile(src, data_parallel=comm, sums=("s",))
        return step(**step.shard_inputs({"x": x}), W=np.ones(3, np.float32), lr=0.0)["s"]
    lock = threading.Lock()
    assert D.run_ranks(3, body) == [float(x.sum())] * 3
    with pytest.raises(ValueError, match="no output 'nope'"):
        tgc.compile(src, data_parallel=D.local_group(1)[0], sums=("nope",))


def test_results_are_not_overwritten_and_errors_are_clear():
    case = cases.CASES["mlp"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm)
        state = case.init()
        first = step(**step.shard_inputs(case.batch(0)), **state, lr=0.1)["loss"]
        kept = float(first)
        step(**step.shard_inputs(case.batch(1)), **state, lr=0.1)
        assert float(first) == kept                       # a later call leaves an earlier result alone
        with pytest.raises(tgc.EvalError, match="missing input 'lr'"):
            step(**step.shard_inputs(case.batch(1)), **state)
        with pytest.raises(tgc.EvalError, match="unexpected input 'z'"):
            step(**step.shard_inputs(case.batch(1)), **state, lr=0.1, z=1.0)
        return True
    lock = threading.Lock()
    assert D.run_ranks(2, body) == [True, True]


def test_forward_only_is_local():
    def body(comm):
        with lock:
            step = tgc.compile(cases.CASES["mlp"].path, data_parallel=comm)
        state = cases.CASES["mlp"].init()
        b = cases.CASES["mlp"].batch(0)
        return step(**b, **state, updates=False)["loss"]
    lock = threading.Lock()
    got = D.run_ranks(2, body)
    plain = tgc.compile(cases.CASES["mlp"].path)
    want = plain(**cases.CASES["mlp"].batch(0), **cases.CASES["mlp"].init(), updates=False)["loss"]
    assert got[0] == got[1] == want


# ---------------------------------------------------------------- one rank at fault

def _single_on(name: str, steps) -> dict:
    """Single-process training on the whole batches of `steps` only (the others skipped)."""
    case = cases.CASES[name]
    prog = tgc.compile(case.path, options=tgc.Options(cpu=tgc.CpuOptions(threads=1)))
    state = case.init()
    for k in steps:
        prog(**case.batch(k), **case.scalars(k), **state)
    return state


@pytest.mark.parametrize("bad", ["x", "lr"])
def test_a_bad_call_on_one_rank_raises_on_every_rank(bad):
    """Rank 1's call is wrong once (a batch one feature short: phase 1's input; a
    learning rate that is not a scalar: phase 2's) and the loop skips it: every rank
    raises, none writes a param, and the following steps go on in step, as training
    on the other batches."""
    case = cases.CASES["mlp"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm, options=tgc.Options(cpu=tgc.CpuOptions(threads=1)))
        state = case.init()
        errors = []
        for k in range(4):
            mine = {**step.shard_inputs(case.batch(k)), **case.scalars(k)}
            if k == 1 and step.rank == 1:
                mine[bad] = mine["x"][:, :-1] if bad == "x" else np.full(2, 0.1, np.float32)
            before = {n: v.copy() for n, v in state.items()}
            try:
                step(**mine, **state)
            except tgc.EvalError as e:
                errors.append((k, str(e)))
                assert all(np.array_equal(state[n], before[n]) for n in state)     # nothing written
        return errors, state
    lock = threading.Lock()
    (errors0, state0), (errors1, state1) = D.run_ranks(2, body, timeout=120)
    assert [k for k, _ in errors0] == [k for k, _ in errors1] == [1]
    want = "has shape (6, 12), expected (6, 13)" if bad == "x" else "input 'lr' has 1 axes, expected 0"
    assert errors1[0][1].startswith(f"input '{bad}'") and want in errors1[0][1]      # its own error
    assert errors0[0][1].startswith("data parallel: rank 1 cannot run this step: ") and want in errors0[0][1]
    assert "no param was written" in errors0[0][1]
    _same_on_every_rank([state0, state1])
    _close(state0, _single_on("mlp", [0, 2, 3]))


GATHER = """
dim batch
dim v = 5
input ids: i32[batch]
param E[v]
input lr
loss = mean[batch](E[v = ids] ^ 2)
out loss
update E = E - lr * grad(loss, E)
"""


def test_an_id_out_of_range_on_one_rank_raises_on_every_rank():
    """The ids are checked before any communication too (Program.check)."""
    def body(comm):
        with lock:
            step = tgc.compile(GATHER, data_parallel=comm)
        E = np.arange(5, dtype=np.float32)
        got = []
        for k, ids in enumerate(([0, 1, 2, 3], [0, 1, 2, 7], [4, 4, 4, 4])):
            try:
                step(**step.shard_inputs({"ids": np.array(ids, np.int32)}), E=E, lr=0.1)
                got.append(E.copy())
            except tgc.EvalError as e:
                got.append(str(e))
        return got
    lock = threading.Lock()
    r0, r1 = D.run_ranks(2, body, timeout=120)
    assert "rank 1 cannot run this step: gather index out of range: 'ids'[batch=1] = 7" in r0[1]
    assert r1[1].startswith("gather index out of range")
    E = np.arange(5, dtype=np.float32)
    for ids in ([0, 1, 2, 3], [4, 4, 4, 4]):
        g = np.zeros(5)
        np.add.at(g, ids, 2 * E[ids] / 4)
        E = (E - 0.1 * g).astype(np.float32)
    for r in (r0, r1):
        np.testing.assert_allclose(r[2], E, rtol=1e-6)


def test_ranks_with_different_programs_refuse_the_step():
    """A param of another size on rank 1: both ranks raise DataParallelError before
    the first call's broadcast (which would have sent 3 values to a rank expecting 4)."""
    def body(comm):
        f = 3 + comm.Get_rank()
        with lock:
            step = tgc.compile(BASE.replace("dim f = 3", f"dim f = {f}") + "update W = W - lr * grad(loss, W)",
                               data_parallel=comm)
        W = np.full(f, 0.5 + comm.Get_rank(), np.float32)
        with pytest.raises(D.DataParallelError, match="rank 1 compiled another step than rank 0"):
            step(x=np.ones((2, f), np.float32), W=W, lr=0.1)
        return W
    lock = threading.Lock()
    W0, W1 = D.run_ranks(2, body, timeout=120)
    assert np.all(W0 == 0.5) and np.all(W1 == 1.5)


def test_ranks_binding_other_sizes_refuse_the_step():
    """A dim that is not split must have one size on every rank (the gradients' size
    follows it): a call where they differ raises on every rank; the next one runs."""
    src = BASE.replace("dim f = 3", "dim f") + "update W = W - lr * grad(loss, W)"

    def body(comm):
        with lock:
            step = tgc.compile(src, data_parallel=comm)
        f = 3 + 2 * comm.Get_rank()
        with pytest.raises(tgc.EvalError, match="bind different sizes .* rank 0 f=3, rank 1 f=5"):
            step(x=np.ones((2, f), np.float32), W=np.ones(f, np.float32), lr=0.1)
        W = np.ones(4, np.float32)
        return step(x=np.ones((2, 4), np.float32), W=W, lr=0.1)["loss"], W
    lock = threading.Lock()
    (l0, W0), (l1, W1) = D.run_ranks(2, body, timeout=120)
    assert l0 == l1 == 16.0 and np.array_equal(W0, W1)
    np.testing.assert_allclose(W0, 1 - 0.1 * 8, rtol=1e-6)    # d loss / d W = 2 * 4 * x


def test_a_rank_that_stops_makes_the_others_fail_in_time():
    """Rank 1 stops calling after one step: rank 0's next step raises DataParallelError
    after `Options.collective_timeout`, and every later call at once."""
    case = cases.CASES["mlp"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm, options=tgc.Options(collective_timeout=0.5))
        state = case.init()
        step(**step.shard_inputs(case.batch(0)), **case.scalars(0), **state)
        if comm.Get_rank() == 1:
            return None
        start = time.monotonic()
        with pytest.raises(D.DataParallelError, match=r"rank 0 waited 0.5 s for the other ranks .*"
                                                      r"Options.collective_timeout"):
            step(**step.shard_inputs(case.batch(1)), **case.scalars(1), **state)
        waited = time.monotonic() - start
        with pytest.raises(D.DataParallelError, match="cannot run again"):
            step(**step.shard_inputs(case.batch(1)), **case.scalars(1), **state)
        return waited
    lock = threading.Lock()
    waited, _ = D.run_ranks(2, body, timeout=120)
    assert 0.5 <= waited < 10


def test_broadcast_checks_that_the_ranks_send_the_same_params():
    """`step.broadcast` with other names on rank 1: EvalError on both ranks, nothing
    sent; with the same names, rank 0's values (an f64 array on rank 1 included)."""
    case = cases.CASES["mlp"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm)
        state = {k: v + comm.Get_rank() for k, v in case.init().items()}
        with pytest.raises(tgc.EvalError, match=r"broadcast different params or shapes: rank 0 W1\(13, 64\), W2.*, rank 1 W1\(13, 64\);"):
            step.broadcast(state if comm.Get_rank() == 0 else {"W1": state["W1"]})
        if comm.Get_rank() == 1:
            state["b2"] = state["b2"].astype(np.float64)
        step.broadcast(state)
        return state
    lock = threading.Lock()
    r0, r1 = D.run_ranks(2, body, timeout=120)
    assert r1["b2"].dtype == np.float64
    for k, v in case.init().items():
        assert np.array_equal(r0[k], v) and np.array_equal(r1[k], v), k


def test_broadcast_refuses_a_stride_0_param_on_every_rank():
    """`step.broadcast` into a stride-0 view on rank 1 (each element the same memory:
    rank 0's values would collapse to the last one) is the EvalError a single-process
    update target gets, raised on both ranks before anything is sent."""
    case = cases.CASES["mlp"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm)
        state = {k: v + comm.Get_rank() for k, v in case.init().items()}
        if comm.Get_rank() == 1:
            state["b2"] = _stride_0(state["b2"])
        with pytest.raises(tgc.EvalError) as info:
            step.broadcast(state)
        return str(info.value), {k: np.array(v) for k, v in state.items()}
    lock = threading.Lock()
    (m0, s0), (m1, s1) = D.run_ranks(2, body, timeout=120)
    assert m1.startswith("'b2' is set to rank 0's value in place (a broadcast), but its elements share memory"), m1
    assert m0.startswith("data parallel: rank 1 cannot run this step: " + m1), m0
    for k, v in case.init().items():   # nothing was sent
        assert np.array_equal(s1[k], (_stride_0(v + 1) if k == "b2" else v + 1)), k


def _read_only(a):
    a.flags.writeable = False
    return a


def _stride_0(a):   # one element for all of them: a broadcast into it keeps only the last value
    return np.lib.stride_tricks.as_strided(a[:1], a.shape, (0,) * a.ndim)


@pytest.mark.parametrize("spoil, message", [
    (_read_only, "'b2' is set to rank 0's value in place (a broadcast), but the array is read-only"),
    (_stride_0, "'b2' is set to rank 0's value in place (a broadcast), but its elements share memory"),
])
def test_a_first_call_that_cannot_take_rank_0s_params_raises_on_every_rank(spoil, message):
    """The first call writes rank 0's params into every rank's arrays: a read-only one
    or a stride-0 view (numpy's as_strided, torch's `expand`) on rank 1 is refused
    before the ranks agree (not half-way through the broadcasts), by the check a
    single-process call makes of its update targets (input_checks.check_writable)."""
    case = cases.CASES["mlp"]

    def body(comm):
        with lock:
            step = tgc.compile(case.path, data_parallel=comm)
        state = case.init()
        if comm.Get_rank() == 1:
            state["b2"] = spoil(state["b2"])
        try:
            step(**step.shard_inputs(case.batch(0)), **case.scalars(0), **state)
        except (TypeError, tgc.EvalError) as e:
            return type(e).__name__, str(e)
    lock = threading.Lock()
    (k0, m0), (k1, m1) = D.run_ranks(2, body, timeout=120)
    assert (k0, k1) == ("EvalError", "EvalError")
    assert m1.startswith(message), m1
    assert m0.startswith("data parallel: rank 1 cannot run this step: " + m1)


def test_a_first_call_with_a_param_that_is_no_array_is_a_type_error():
    case = cases.CASES["mlp"]
    step = tgc.compile(case.path, data_parallel=D.local_group(1)[0])
    state = case.init()
    state["b2"] = state["b2"].tolist()
    with pytest.raises(TypeError, match="'b2' must be a writable array: the broadcast sets it to rank 0's value "
                                        "in place, not list"):
        step(**step.shard_inputs(case.batch(0)), **case.scalars(0), **state)


def test_collective_timeout_is_checked():
    with pytest.raises(ValueError, match="collective_timeout: seconds"):
        tgc.compile(cases.CASES["mlp"].path, data_parallel=D.local_group(1)[0],
                    options=tgc.Options(collective_timeout=0))


# ---------------------------------------------------------------- MPI

def _mpi_reason() -> str | None:
    """Why the MPI tests cannot run here, or None. mpi4py is imported in a child (MPI_Init
    is not for the test process)."""
    if shutil.which("mpirun") is None:
        return "mpirun (OpenMPI) is not installed (apt-get install openmpi-bin libopenmpi-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    try:
        r = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True,
                           timeout=120, env=_mpi_env())
    except subprocess.TimeoutExpired:
        return "mpi4py's MPI_Init did not return within 120 s"
    if r.returncode != 0:
        return f"mpi4py does not load its MPI library: {r.stderr.strip().splitlines()[-1:]}"
    return None


def _mpi_env() -> dict:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))


MPI_REASON = _mpi_reason()
needs_mpi = pytest.mark.skipif(MPI_REASON is not None, reason=MPI_REASON or "")
SPECS = ["mlp", "mlp:det", "mlp13", "mlp13:det", "digits",
         "mlp13:small", "mlp13:small:serial", "digits:small", "digits:small:serial"]


def _mpirun(n: int, out: Path) -> None:
    env = _mpi_env()
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable,
           str(HERE / "distributed_mpi_train.py"), str(out), *SPECS, "--steps", str(STEPS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def warm_cache():
    """The programs compiled once here, so that the ranks find them in tgc's cache."""
    for name in ("mlp", "digits"):
        tgc.compile(cases.CASES[name].path, data_parallel=D.local_group(1)[0], options=tgc.Options(cpu=tgc.CpuOptions(threads=1)))


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_mpi_ranks(tmp_path, n, warm_cache):
    _mpirun(n, tmp_path)
    (tmp_path / "local").mkdir()
    for spec in SPECS:
        ranks = [dict(np.load(tmp_path / f"{spec}.rank{r}.npz")) for r in range(n)]
        _same_on_every_rank(ranks)
        _close(ranks[0], _single(spec.split(":")[0]))
        if spec.endswith(":det"):    # the sum in rank order: the in-process ranks' bits
            local = _local(n, spec, tmp_path / "local")
            for k in local[0]:
                assert np.array_equal(ranks[0][k], local[0][k]), (spec, k)
        if spec.endswith(":small"):  # overlapped: MPI's own sums, the bits of the serial path's
            serial = [dict(np.load(tmp_path / f"{spec}:serial.rank{r}.npz")) for r in range(n)]
            assert all(r["overlapped"] and r["buckets"] > 1 for r in ranks), spec
            for a, b in zip(ranks, serial):
                _same_bits(a, b)


FAULTS = ["bad-batch", "mismatch", "killed"]


@pytest.fixture(scope="module")
def fault_reports(tmp_path_factory, warm_cache) -> tuple[Path, str]:
    """`tests/distributed_mpi_faults.py` with every case, under `mpirun -n 2
    --enable-recovery` (one run: the killed rank last). A hang fails after 120 s."""
    out = tmp_path_factory.mktemp("faults")
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", "--enable-recovery", sys.executable,
           str(HERE / "distributed_mpi_faults.py"), str(out), *FAULTS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_mpi_env())
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun: the ranks hung ({(e.stdout or b'')[-2000:]!r})")
    return out, proc.stdout[-3000:] + proc.stderr[-3000:]


def _reports(fault_reports, case: str) -> dict:
    """Each surviving rank's report of `case`."""
    out, log = fault_reports
    reports = {r: json.loads((out / f"{case}.rank{r}.json").read_text())
               for r in range(2) if (out / f"{case}.rank{r}.json").exists()}
    assert reports, log
    return reports


@needs_mpi
def test_mpi_a_bad_batch_on_one_rank_is_skipped_on_every_rank(fault_reports):
    """Rank 1 passes a batch one feature short and catches the EvalError, as a loop
    that skips bad batches does: rank 0 raises EvalError too (naming rank 1 and why),
    no param is written, and the next steps run on both ranks in step."""
    reports = _reports(fault_reports, "bad-batch")
    (kind0, msg0), = reports[0]["errors"]
    (kind1, msg1), = reports[1]["errors"]
    assert kind0 == kind1 == "EvalError"
    assert msg1 == "input 'x' has shape (6, 12), expected (6, 13) ([batch=6, features=13])"
    assert msg0.startswith("data parallel: rank 1 cannot run this step: " + msg1)
    params = [{k: np.array(v, np.float32) for k, v in reports[r]["params"].items()} for r in range(2)]
    _same_on_every_rank(params)
    _close(params[0], _single_on("mlp", [0, 2, 3]))


@needs_mpi
def test_mpi_ranks_with_different_programs_refuse_the_step(fault_reports):
    """Rank 1 compiled a program whose param has another size: both ranks raise
    DataParallelError before anything is sent, and keep their params."""
    reports = _reports(fault_reports, "mismatch")
    for r in range(2):
        (kind, msg), = reports[r]["errors"]
        assert kind == "DataParallelError" and "rank 1 compiled another step than rank 0" in msg
        assert reports[r]["params"]["W"] == [0.5 * (1 + r)] * (3 + r)


@needs_mpi
def test_mpi_a_killed_rank_makes_the_other_fail_in_time(fault_reports):
    """Rank 1 is killed (SIGKILL) between two steps; mpirun --enable-recovery lets rank 0
    live on (as when a node is lost). Rank 0's next step raises DataParallelError after
    the 3 s of Options.collective_timeout, instead of waiting forever."""
    reports = _reports(fault_reports, "killed")
    assert list(reports) == [0]
    (kind, msg), = reports[0]["errors"]
    assert kind == "DataParallelError" and "waited 3 s for the other ranks" in msg
    assert 3.0 <= reports[0]["seconds"] < 30


@pytest.mark.slow
@needs_mpi
def test_mpi_example_trains(tmp_path):
    """`mpirun -n 2 python examples/train_sort_gpt.py --data-parallel`, a few steps."""
    script = HERE.parent / "examples" / "train_sort_gpt.py"
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, str(script),
           "--data-parallel", "--quick", "--no-torch", "--threads", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("data parallel: 2 processes") == 1          # rank 0 prints, rank 1 does not
    assert "held-out exact-sequence accuracy after 12 steps" in proc.stdout
    params = tgc.load_params(tmp_path / "params.safetensors", tgc.compile(script.with_suffix(".tg")))
    assert float(params["step"]) == 12.0


# ---------------------------------------------------------------- NCCL on cuda-sim

@pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
@pytest.mark.parametrize("n", [1, 2])
def test_nccl_path_on_cuda_sim(tmp_path, n):
    ranks = _local(n, "mlp13", tmp_path, kind="nccl", backend="cuda-sim")
    _same_on_every_rank(ranks)
    _close(ranks[0], _single("mlp13"), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
def test_nccl_overlap_on_cuda_sim(tmp_path):
    """cuda-sim's launches notify too: small buckets reduced while phase 1 runs, the
    serial path's bits."""
    over = _local(2, "mlp13:small", tmp_path, kind="nccl", backend="cuda-sim")
    serial = _local(2, "mlp13:small:serial", tmp_path, kind="nccl", backend="cuda-sim")
    assert all(r["overlapped"] for r in over) and over[0]["buckets"] > 1
    for a, b in zip(over, serial):
        _same_bits(a, b)
    _close(over[0], _single("mlp13"), rtol=1e-4, atol=1e-5)


def test_nccl_communicator_needs_a_cuda_backend():
    with pytest.raises(ValueError, match="needs backend 'cuda'"):
        tgc.compile(cases.CASES["mlp"].path, data_parallel=D.local_group(1, "nccl")[0])


def _nccl_gpu() -> bool:
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- no CuPy, no NCCL, no driver, no device
        return False


@pytest.mark.skipif(not _nccl_gpu(), reason="needs CuPy with NCCL and an NVIDIA GPU (benchmarks/gpu_check.sh runs it)")
def test_nccl_on_a_gpu_single_rank():
    """The NCCL path on a real GPU: one rank (NCCL over one device), the batch reduced
    through ncclAllReduce, against single-process training on the CPU."""
    import cupy
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    case = cases.CASES["mlp13"]
    step = tgc.compile(case.path, backend="cuda", data_parallel=comm)
    state = {k: cupy.asarray(v) for k, v in case.init().items()}
    for k in range(STEPS):
        step(**step.shard_inputs(case.batch(k)), **case.scalars(k), **state)
    got = {k: cupy.asnumpy(v) for k, v in state.items()}
    _close(got, {k: v for k, v in _single("mlp13").items() if k != "losses"}, rtol=1e-4, atol=1e-5)
