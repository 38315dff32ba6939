"""An unknown name in a program names the closest one in scope ("did you mean"):
tensors, edges, dims, functions, update targets, names inside a function body."""
import pytest

from tgc.frontend.elaborate import elaborate_source
from tgc.ir.diag import CompileError, did_you_mean
from tgc.options import Options

HEAD = "dim batch = 3, n = 4\ninput x[batch]\nparam weights[batch]\n"


@pytest.mark.parametrize("body,message", [
    ("out y = sum[batch](wieghts * x)", "unknown name 'wieghts'; did you mean 'weights'?"),
    ("out y = sum[bach](weights * x)", "unknown edge 'bach'; did you mean 'batch'?"),
    ("out y = tanhh(x)", "unknown function 'tanhh'; did you mean 'tanh'?"),
    ("out y = x\nout weight", "unknown name 'weight'; did you mean 'weights'?"),
    ("input z[bacth]\nout y = x + z", "unknown edge 'bacth' (declare it with `dim bacth` or give its size as "
                                      "`bacth: DIM`); did you mean 'batch'?"),
    ("input z[i: bacth]\nout y = z", "unknown dim 'bacth'; did you mean 'batch'?"),
    ("dim m = bacth * 2\nout y = x", "unknown dim 'bacth'; did you mean 'batch'?"),
    ("update wieghts = weights - 1\nout y = x", "cannot update: unknown name 'wieghts'; did you mean 'weights'?"),
    ("fn sq(value) = valeu * value\nout y = sq(x)", "unknown name 'valeu'; did you mean 'value'?"),
    ("fn sq(value) = value * value\nout y = sqq(x)", "unknown function 'sqq'; did you mean 'sq'?"),
    ("fn sq(value) = tanhh(value)\nout y = x", "unknown function 'tanhh'; did you mean 'tanh'?"),
    ("out y = x * size(bathc)", "did you mean 'batch'?"),
])
def test_unknown_names_suggest_the_closest_in_scope(body, message):
    with pytest.raises(CompileError) as e:
        elaborate_source(HEAD + body + "\n", "t.tg", Options())
    assert message in e.value.message, e.value.message
    assert e.value.loc is not None and e.value.loc.line >= 4


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(CompileError) as e:
        elaborate_source(HEAD + "out y = x * zz\n", "t.tg", Options())
    assert e.value.message == "unknown name 'zz'"
    assert did_you_mean("zz", ["x", "weights"]) == ""
    assert did_you_mean("W11", ["W1", "W2", "b1"]) == "; did you mean 'W1'?"
