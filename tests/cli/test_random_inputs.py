"""`tgc run --random-inputs`: an input used as a cross_entropy target gets one-hot rows."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner

from tgc.cli import main
from tgc.cli.run import cross_entropy_targets

ROOT = Path(__file__).parents[2]


def test_cross_entropy_targets_are_found_in_the_source(tmp_path):
    assert cross_entropy_targets(str(ROOT / "examples/mlp.tg")) == {"y": "classes"}
    assert cross_entropy_targets(str(ROOT / "examples/hvp.tg")) == {"y": "c"}
    assert cross_entropy_targets(str(ROOT / "examples/layernorm.tg")) == {}
    src = tmp_path / "p.tg"
    # by keyword, nested in other calls; not a binding, not an own cross_entropy
    src.write_text("dim b, c = 4\ninput z[b, c]\ninput t[b, c]\ninput u[b, c]\n"
                   "out l = mean[b](cross_entropy[c](z, target=t))\nout m = sum(u)\n")
    assert cross_entropy_targets(str(src)) == {"t": "c"}
    src.write_text("dim b, c = 4\ninput z[b, c]\ninput t[b, c]\nfn cross_entropy[e](a, b) = sum[e](a * b)\n"
                   "out l = sum(cross_entropy[c](z, t))\n")
    assert cross_entropy_targets(str(src)) == {}
    src.write_text("syntax error (\n")
    assert cross_entropy_targets(str(src)) == {}


def test_random_targets_are_one_hot(tmp_path):
    out = tmp_path / "o.npz"
    src = tmp_path / "p.tg"
    src.write_text("dim batch, seq\ndim classes = 5\ninput x[batch, seq, classes]\n"
                   "input y[classes, batch, seq]\ninput w[batch, seq, classes]\n"
                   "out y\nout w\nout loss = mean(cross_entropy[classes](x, y))\n")
    r = CliRunner().invoke(main, ["run", str(src), "--random-inputs", "--dim", "batch=7", "--dim", "seq=3",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    with np.load(out) as a:
        y, w = a["y"], a["w"]
    assert y.shape == (7, 3, 5) and set(np.unique(y)) <= {0.0, 1.0}   # out y: [batch, seq, classes]
    np.testing.assert_array_equal(y.sum(axis=2), np.ones((7, 3)))     # one 1 along classes per row
    assert len(np.unique(y.argmax(axis=2))) > 1
    assert len(np.unique(w)) > 2                                      # other inputs stay noise
