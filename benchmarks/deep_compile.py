"""Compile time against depth: deep programs written out by hand, without `repeat`/`scan`.

    python benchmarks/deep_compile.py [--only SHAPE[,SHAPE...]] [--depths 12,24,48,96,192]
                                      [--budget S] [--llvm] [--profile SHAPE:DEPTH]

A user who writes a 48-layer MLP or a 12-block GPT-2 as 48 or 12 statements (distinct
weights each) hands the compiler a program whose size grows with the depth; its
compile time must grow about linearly too. Each row compiles one generated program
(`SHAPES`, with its gradient or a training step) in this process, f32, from the source
text to the CPU backend's LLVM IR, and prints the seconds of each stage:

- `front`: parse and elaborate (`pipeline.load_program`, dims fixed);
- `ir`: the IR pipeline (optimization, autodiff: `pipeline.lower`);
- `lower`: the target passes and the lowering stages (`target`, `lower_module`);
- `codegen`: the LLVM IR of every unit (`codegen.generate_units_first_last`);
- `llvm` (with `--llvm`): LLVM's machine code from it (`llvm_env.emit_objects`, at
  `compile_jobs` units, each in a forked child: the children's CPU time), which the
  code cache skips on a second build.

The times are per-thread CPU time (`time.thread_time`), so that other processes on a
busy machine count less; `total` is their sum, `x` the ratio to the previous depth's
total (doubling the depth should at most about double it: <= 2.5). A shape stops at the
first depth whose total passes `--budget` seconds (default 60). `--profile SHAPE:DEPTH`
runs one row under cProfile and prints its 30 most expensive functions (cumulative).

The shapes (`SHAPES`, also what tests/opt/test_deep_compile.py builds):

| shape | a step |
|---|---|
| `residual` | `h_i = h_(i-1) + tanh(h_(i-1) @ W_i)` (distinct `W_i`), `grad(sum(h_n^2), W_i)` for every i and an SGD update |
| `residual_tied` | the same with one `W`, and `grad(loss, W)` |
| `tanh_chain` | `y_i = tanh(y_(i-1)) * 0.9 + x`, scalars per element, `grad(sum(y_n), x)` |
| `mlp` | `h_i = gelu(layernorm[d](h_(i-1) @ W_i + b_i, g_i, s_i))`, softmax cross-entropy, SGD on every parameter |
| `gpt2` | a pre-LN GPT-2 block written out per layer (causal attention in heads, GELU MLP), tied head, cross-entropy, SGD on every parameter |
| `elementwise` | `y_i` = one of `tanh`, `exp`-scaled, `sin`, product, quotient of `y_(i-1)` and `x`; 10 elementwise statements a step, `grad(sum(y_n), x)` |
| `sum_tree` | a balanced binary tree of sums of 4 * depth leaves `tanh(x * c_j)`, `grad(sum(root), x)` |
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def residual(n: int, tied: bool = False) -> str:
    """A residual chain written out: `h_i = h_(i-1) + tanh(h_(i-1) @ W_i)`."""
    ws = "param W[d, e: d]" if tied else "param " + ", ".join(f"W{i}[d, e: d]" for i in range(1, n + 1))
    body = [f"h{i} = h{i - 1} + tanh(h{i - 1} @ {'W' if tied else f'W{i}'})[e -> d]" for i in range(1, n + 1)]
    params = ["W"] if tied else [f"W{i}" for i in range(1, n + 1)]
    updates = [f"update {p} = {p} - lr * grad(loss, {p})" for p in params]
    return "\n".join(["dim b = 8, d = 16", "input h0[b, d], lr", ws, *body,
                      f"loss = sum(h{n} * h{n}) / size(b)", "out loss", *updates]) + "\n"


def residual_tied(n: int) -> str:
    return residual(n, tied=True)


def tanh_chain(n: int) -> str:
    """`y_i = tanh(y_(i-1)) * 0.9 + x` and the gradient of `sum(y_n)` with respect to x."""
    body = [f"y{i} = tanh(y{i - 1}) * 0.9 + x" for i in range(1, n + 1)]
    return "\n".join(["dim n = 3", "param x[n]", "y0 = x", *body, f"out y = y{n}",
                      f"out g = grad(sum(y{n}), x)"]) + "\n"


def mlp(n: int) -> str:
    """n hidden layers `h_i = gelu(layernorm(h_(i-1) @ W_i + b_i))`, cross-entropy, SGD."""
    lines = ["dim b = 16, d = 32, k = 10", "input x[b, d], y[b, k], lr", "param Wo[d, k], bo[k]"]
    params = []
    for i in range(1, n + 1):
        lines.append(f"param W{i}[d, e: d], b{i}[e], g{i}[d], s{i}[d]")
        params += [f"W{i}", f"b{i}", f"g{i}", f"s{i}"]
    lines.append("h0 = x")
    for i in range(1, n + 1):
        lines.append(f"h{i} = gelu(layernorm[d]((h{i - 1} @ W{i} + b{i})[e -> d], g{i}, s{i}))")
    lines += [f"loss = mean[b](cross_entropy[k](h{n} @ Wo + bo, y))", "out loss"]
    lines += [f"update {p} = {p} - lr * grad(loss, {p})" for p in params + ["Wo", "bo"]]
    return "\n".join(lines) + "\n"


def gpt2(n: int) -> str:
    """examples/gpt2.tg's block written out once per layer (no `repeat`), SGD on every param."""
    lines = ["dim batch = 2, head = 2, hd = 8, t = 8, vocab = 32",
             "dim c = head * hd, s = t, ff = 4 * c",
             "input ids: i32[batch, t], targets: i32[batch, t], lr",
             "param wte[vocab, c], wpe[t, c], lnf_w[c], lnf_b[c]"]
    names = ["ln1_w", "ln1_b", "ln2_w", "ln2_b", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",
             "wfc", "bfc", "wproj", "bproj"]
    shapes = {"ln1_w": "[c]", "ln1_b": "[c]", "ln2_w": "[c]", "ln2_b": "[c]", "wq": "[c, c2: c]",
              "wk": "[c, c2]", "wv": "[c, c2]", "wo": "[c2, c]", "bq": "[c2]", "bk": "[c2]", "bv": "[c2]",
              "bo": "[c]", "wfc": "[c, ff]", "bfc": "[ff]", "wproj": "[ff, c]", "bproj": "[c]"}
    params = ["wte", "wpe", "lnf_w", "lnf_b"]
    for i in range(n):
        lines.append("param " + ", ".join(f"{p}{i}{shapes[p]}" for p in names))
        params += [f"{p}{i}" for p in names]
    lines.append("x0 = wte[vocab = ids] + wpe")
    for i in range(n):
        def p(name):
            return f"{name}{i}"
        lines += [
            f"hh{i} = layernorm[c](x{i}, {p('ln1_w')}, {p('ln1_b')})",
            f"q{i} = (hh{i} @ {p('wq')} + {p('bq')})[c2 = hd*head + hd]",
            f"k{i} = (hh{i} @ {p('wk')} + {p('bk')})[c2 = hd*head + hd, t -> s]",
            f"v{i} = (hh{i} @ {p('wv')} + {p('bv')})[c2 = hd*head + hd, t -> s]",
            f"p{i} = softmax[s](dot[hd](q{i}, k{i}) / sqrt(size(hd)) - 1e9 * [s > t])",
            f"a{i} = x{i} + sum[s](p{i} * v{i}) @ [c2 = hd*head + hd] @ {p('wo')} + {p('bo')}",
            f"x{i + 1} = a{i} + gelu(layernorm[c](a{i}, {p('ln2_w')}, {p('ln2_b')}) @ {p('wfc')} + {p('bfc')})"
            f" @ {p('wproj')} + {p('bproj')}",
        ]
    lines += [f"logits = layernorm[c](x{n}, lnf_w, lnf_b) @ wte",
              "loss = -mean(log_softmax[vocab](logits)[vocab = targets])", "out loss"]
    lines += [f"update {q} = {q} - lr * grad(loss, {q})" for q in params]
    return "\n".join(lines) + "\n"


def elementwise(n: int) -> str:
    """10 n elementwise statements on one vector, the gradient of the last one's sum."""
    ops = ["tanh(y{j})", "y{j} * 0.5 + x", "sin(y{j})", "y{j} * x", "y{j} / (1 + x * x)",
           "exp(y{j} * 0.1)", "y{j} - x * 0.25", "sqrt(y{j} * y{j} + 1)", "y{j} * y{j} * 0.1", "log(1 + y{j} * y{j})"]
    body = [f"y{i} = " + ops[(i - 1) % len(ops)].format(j=i - 1) for i in range(1, 10 * n + 1)]
    return "\n".join(["dim n = 64", "param x[n]", "y0 = x", *body, f"out y = y{10 * n}",
                      f"out g = grad(sum(y{10 * n}), x)"]) + "\n"


def sum_tree(n: int) -> str:
    """A balanced binary tree of sums over 4 n leaves `tanh(x * c_j)`."""
    leaves = 4 * n
    lines = ["dim n = 64", "param x[n]"]
    level = []
    for j in range(leaves):
        lines.append(f"s0_{j} = tanh(x * {1 + j / leaves:.6f})")
        level.append(f"s0_{j}")
    depth = 0
    while len(level) > 1:
        depth += 1
        nxt = []
        for j in range(0, len(level) - 1, 2):
            lines.append(f"s{depth}_{j // 2} = {level[j]} + {level[j + 1]}")
            nxt.append(f"s{depth}_{j // 2}")
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    lines += [f"out r = {level[0]}", f"out g = grad(sum({level[0]}), x)"]
    return "\n".join(lines) + "\n"


SHAPES = {"residual": residual, "residual_tied": residual_tied, "tanh_chain": tanh_chain, "mlp": mlp,
          "gpt2": gpt2, "elementwise": elementwise, "sum_tree": sum_tree}


def stages(src: str, llvm: bool = False, dtype: str = "f32") -> dict:
    """The per-thread CPU seconds of each stage of compiling `src` for the CPU backend,
    with the garbage collector paused throughout, as `tgc.compile` and `tgc build` run
    (`tgc.ir.collector`)."""
    from tgc.ir.collector import gc_paused

    with gc_paused():
        return _stages(src, llvm, dtype)


def _stages(src: str, llvm: bool, dtype: str) -> dict:
    from tgc import pipeline
    from tgc.backends.cpu import codegen, llvm_env
    from tgc.options import Options

    options = Options().with_(dtype=dtype)
    out = {}
    t = time.thread_time()
    loaded = pipeline.load_source(src, "cpu", dtype, None, options, lookup=False)
    out["front"] = time.thread_time() - t
    t = time.thread_time()
    mod = pipeline.lower(loaded.module, loaded.options).module
    out["ir"] = time.thread_time() - t
    t = time.thread_time()
    compiled, opts = pipeline.target(mod, loaded.options)
    low = pipeline.lower_module(compiled, opts, "cpu")
    out["lower"] = time.thread_time() - t
    t = time.thread_time()
    jobs = opts.cpu.compile_jobs or llvm_env.usable_cores()
    first, rest = codegen.generate_units_first_last(low, opts, objects_entry=True, units=jobs, fingerprint="0" * 64)
    texts = [unit() for unit in [first] + rest]   # each unit's text (emit_objects makes it in its child)
    out["codegen"] = time.thread_time() - t
    if llvm:   # (in child processes: their CPU time, and this thread's)
        t, kids = time.thread_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        llvm_env.emit_objects(texts, max(opts.opt_level, 1), jobs=jobs)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out["llvm"] = (time.thread_time() - t + after.ru_utime - kids.ru_utime + after.ru_stime - kids.ru_stime)
    out["total"] = sum(out.values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--depths", default="12,24,48,96,192")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--llvm", action="store_true")
    ap.add_argument("--profile", default=None, metavar="SHAPE:DEPTH")
    args = ap.parse_args(argv)
    if args.profile:
        import cProfile
        import pstats

        shape, depth = args.profile.split(":")
        src = SHAPES[shape](int(depth))
        prof = cProfile.Profile()
        prof.enable()
        res = stages(src, args.llvm)
        prof.disable()
        print({k: round(v, 2) for k, v in res.items()})
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return 0
    names = ["front", "ir", "lower", "codegen"] + (["llvm"] if args.llvm else [])
    print(f"{'shape':14} {'depth':>5} " + " ".join(f"{n:>8}" for n in names) + f" {'total':>8} {'x':>5}")
    for shape in args.only.split(","):
        prev = None
        for depth in (int(d) for d in args.depths.split(",")):
            res = stages(SHAPES[shape](depth), args.llvm)
            ratio = f"{res['total'] / prev:5.2f}" if prev else "     "
            print(f"{shape:14} {depth:5d} " + " ".join(f"{res[n]:8.2f}" for n in names)
                  + f" {res['total']:8.2f} {ratio}", flush=True)
            prev = res["total"]
            if res["total"] > args.budget:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
