"""The differential fuzzer of tgc: random well-typed .tg programs against a float64 oracle.

- `fuzz.nodes`: programs kept as structure (declarations, functions, statements, and
  expression trees), rendered to .tg text; the shrinker edits the structure, not text.
- `fuzz.gen`: `generate(seed)`, a random well-typed program covering LANGUAGE.md
  sections 3-9, with values kept in smooth, well-defined domains at normal inputs.
- `fuzz.harness`: `check(program)`, the torch oracle (`tests/torch_oracle.py`, run on
  the elaborated module, derivatives by torch.autograd) against each system under test
  (`interp-f64`, `cpu-f64`, `interp-f32`, `cpu-f32`) on the same seeded inputs.
- `fuzz.features`: `featured(seed, feature)`, the program of `seed` with imports, dtypes,
  complex values, `assume`, forward rules or a memory budget added (streams of their own).
- `fuzz.shrink`: `shrink(program, failure)`, greedy reduction to a minimal program
  that still shows the same kind of disagreement.

`scripts/fuzz` runs thousands of seeds (`--feature F`: of one feature); `tests/e2e/test_fuzz.py`
runs a seeded slice and every saved regression in `tests/fuzz/regressions/`;
`tests/e2e/test_fuzz_features.py` a slice of each feature.
"""
