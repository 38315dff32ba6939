"""The input-name checks every caller shares (tgc.ir.input_checks): the whole set, a
required subset (a data-parallel step), and a suggestion for a misspelt name (`tgc run`)."""
from __future__ import annotations

import pytest

from tgc.ir.input_checks import EvalError, check_known, check_names


def test_every_input_is_required_unless_a_subset_is_named():
    with pytest.raises(EvalError, match=r"^missing input 'a' \(the program takes: a, b\)$"):
        check_names(["a", "b"], ["b"])
    check_names(["a", "b"], ["b"], required={"b"})
    with pytest.raises(EvalError, match=r"^missing input 'a' \(the program takes: a, b\)$"):
        check_names(["a", "b"], [], required={"a"})
    with pytest.raises(EvalError, match=r"^unexpected input 'c' \(the program takes: a, b\)$"):
        check_names(["a", "b"], ["b", "c"], required={"b"})


def test_an_unexpected_name_may_suggest_the_closest_input():
    with pytest.raises(EvalError, match=r"^unexpected input 'W11' \(the program takes: W1, b1\)$"):
        check_known(["W1", "b1"], ["W11"])
    with pytest.raises(EvalError, match=r"^unexpected input 'W11' \(the program takes: W1, b1\); did you mean 'W1'\?$"):
        check_known(["W1", "b1"], ["W11"], suggest=True)
    with pytest.raises(EvalError, match=r"^unexpected input 'zzz' \(the program takes: W1, b1\)$"):
        check_known(["W1", "b1"], ["zzz"], suggest=True)


def test_a_program_of_many_inputs_lists_a_few_and_counts_the_rest():
    # a 24-layer model written out with AdamW states takes 1,300 inputs: a message that
    # listed them all was 18 kB long; it names the first ones, the count, and how many
    # are missing
    names = [f"w{i}" for i in range(1000)]
    with pytest.raises(EvalError) as e:
        check_names(names, names[:10])
    msg = str(e.value)
    assert msg.startswith("missing input 'w10' (and 989 more; the program takes 1000: w0, w1, ")
    assert msg.endswith(", w15, ...)") and len(msg) < 300
    with pytest.raises(EvalError, match=r"^unexpected input 'zz' \(the program takes 1000: w0, w1, .*w15, \.\.\.\)$"):
        check_known(names, ["zz"])
