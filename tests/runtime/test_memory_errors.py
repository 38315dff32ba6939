"""A call whose arrays do not fit in memory is an EvalError, never a MemoryError.

Sizes under the 2^62 limit (tgc.ir.sizes) can still be more than any machine has:
a broadcast view whose dense copy is that large, or outputs of that size from small
inputs. The call refuses before anything runs, so nothing is written. The sizes here
(hundreds of TiB) exceed a 64-bit process's address space, so the allocation fails at
once on any machine, whatever its overcommit policy."""
import numpy as np
import pytest

import tgc
from tgc.ir.interp import EvalError


def test_a_huge_broadcast_input_is_an_eval_error():
    p = tgc.compile("dim batch\ndim f = 3\ninput x[batch, f]\nparam W[f]\nout s = sum(x @ W)\n"
                    "update W = W * 2\n")
    W = np.ones(3, np.float32)
    huge = np.broadcast_to(np.float32(1), (2 ** 46, 3))   # 768 TiB once dense
    with pytest.raises(EvalError, match="not enough memory.*nothing was written"):
        p(x=huge, W=W)
    assert np.array_equal(W, np.ones(3, np.float32))
    r = p(x=np.ones((2, 3), np.float32), W=W)      # the program still works afterwards
    assert float(r["s"]) == 6.0 and np.array_equal(W, np.full(3, 2, np.float32))


def test_huge_outputs_from_small_inputs_are_an_eval_error():
    p = tgc.compile("dim a\ninput x[a], y[b: a], z[c: a], w[d: a]\nout o[a, b, c, d] = x * y * z * w\n")
    n = 2 ** 12                                  # o: 2^48 elements, 1 PiB
    v = np.ones(n, np.float32)
    with pytest.raises(EvalError, match="not enough memory"):
        p(x=v, y=v, z=v, w=v)
    small = np.arange(1, 3, dtype=np.float32)
    o = p(x=small, y=small, z=small, w=small)["o"]
    assert o.shape == (2, 2, 2, 2) and o[1, 1, 1, 1] == 16.0


def test_a_huge_complex_input_is_an_eval_error():
    p = tgc.compile("dim n\ninput z: c128[n]\nout s = real(sum(z))\n", dtype="f64")
    huge = np.broadcast_to(np.complex64(1), (2 ** 45,))   # complex64 in: copied as f64 pairs, 512 TiB
    with pytest.raises(EvalError, match="not enough memory"):
        p(z=huge)


@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu", "cuda-sim"])
def test_an_index_expression_past_int64_at_the_call_sizes_is_an_eval_error(backend):
    """`x[t = 2^40 s + 3]` with a symbolic `s`: the front end cannot bound the index, and
    at s = 2^23 + 1 it passes 2^63, where the native code's int64 index wrapped into range
    (a segfault on the CPU and cuda-sim). The call refuses such sizes before anything
    runs; small sizes still run (every index but s = 0 out of range: 0)."""
    p = tgc.compile("dim n\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 1099511627776*s + 3] + z\n",
                    backend=backend)
    n = 2 ** 23 + 2
    with pytest.raises(EvalError, match="index expression over \\[s\\].*past 2\\^62"):
        p(x=np.broadcast_to(np.float32(1), (n,)), z=np.broadcast_to(np.float32(0), (n,)))
    y = p(x=np.arange(5, dtype=np.float32), z=np.ones(5, np.float32))["y"]
    np.testing.assert_array_equal(y, [4, 1, 1, 1, 1])


@pytest.mark.parametrize("backend", ["interp", "cuda-sim"])
def test_an_ir_index_past_int64_at_fixed_sizes_is_an_eval_error(backend):
    """IR text is not checked by the front end: an indicator `t = 2^62 s` over s < 3
    reaches 2^63 (cuda-sim read x[1] for s = 2, where every index but s = 0 is out of
    range). The call refuses it."""
    ir = tgc.compile("dim n = 3\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 2*s] + z\n", backend="interp").ir()
    assert "indicator[t = 2*s]" in ir
    p = tgc.compile(ir.replace("2*s", "4611686018427387904*s"), backend=backend)
    with pytest.raises(EvalError, match="past 2\\^62"):
        p(x=np.arange(1, 4, dtype=np.float32), z=np.zeros(3, np.float32))
