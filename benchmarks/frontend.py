"""Front-end scaling: `tgc check` on generated programs of many statements.

    python benchmarks/frontend.py [--statements N] [--only SHAPE[,SHAPE...]] [--repeat N] [--timeout S]

Each shape is a program of N statements (default 10^5) written to a temporary file and
checked by `tgc check` in a fresh process; the row is its wall time, Python start-up
and `import tgc` included, with stderr (the warnings of unused bindings) discarded,
the least of `--repeat` runs (default 1), and the CPU time (user + system) of that
run: on a busy machine the wall time grows with the other load, the CPU time less.
The target is under 10 s per shape at 10^5 statements on the 2-core reference machine:
the front end's work per statement must not grow with the program (issue 19, item 5).
`benchmarks/run.py --only check` runs the same rows. `SHAPES` is also what
tests/frontend/test_frontend_scaling.py counts the front end's work on.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 10.0


def chain_mul(n: int) -> str:
    """v_i = v_(i-1) * 1.5: each product's left side is the previous product."""
    body = [f"v{i} = v{i - 1} * 1.5" for i in range(1, n + 1)]
    return "\n".join(["input v0", *body, f"out v{n}"]) + "\n"


def chain_add(n: int) -> str:
    body = [f"v{i} = v{i - 1} + 1.5" for i in range(1, n + 1)]
    return "\n".join(["input v0", *body, f"out v{n}"]) + "\n"


def chain_matmul(n: int) -> str:
    """Alternating products with two matrices, summing a shared edge each time."""
    body = [f"v{i} = v{i - 1} @ {'A' if i % 2 else 'B'}" for i in range(1, n + 1)]
    last = "[m]" if n % 2 else "[k]"
    return "\n".join(["dim k = 4, m = 3", "input v0[k]", "param A[k, m], B[m, k]", *body,
                      f"out v{n}{last}"]) + "\n"


def chain_calls(n: int) -> str:
    """Inlined calls of a user function and of prelude functions along a chain."""
    body = [f"v{i} = f(v{i - 1})" if i % 2 else f"v{i} = softmax[k](v{i - 1})" for i in range(1, n + 1)]
    return "\n".join(["dim k = 4", "fn f(a) = tanh(a) * 0.5 + a", "input v0[k]", *body, f"out v{n}"]) + "\n"


def independent(n: int) -> str:
    """n unrelated products of one input: n warnings of an unused binding."""
    body = [f"y{i} = x * {i}.5" for i in range(n)]
    return "\n".join(["input x", *body, f"out y{n - 1}"]) + "\n"


def wide_sum(n: int) -> str:
    """Scaled sums that each reuse the last four values: a DAG with sharing, not a chain."""
    body = []
    for i in range(1, n + 1):
        terms = " + ".join(f"v{j}" for j in range(max(0, i - 4), i))
        body.append(f"v{i} = ({terms}) * 0.25")
    return "\n".join(["input v0", *body, f"out v{n}"]) + "\n"


SHAPES = {"chain-mul": chain_mul, "chain-add": chain_add, "chain-matmul": chain_matmul,
          "chain-calls": chain_calls, "independent": independent, "wide-sum": wide_sum}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def check_time(shape: str, n: int, timeout: float, repeat: int = 1) -> dict:
    """`tgc check` of the shape at n statements in a fresh process, `repeat` times:
    the least wall seconds, the CPU seconds of that run, and the status."""
    text = SHAPES[shape](n)
    row = {"shape": shape, "statements": n, "bytes": len(text)}
    with tempfile.TemporaryDirectory(prefix="tgc-frontend-") as tmp:
        path = Path(tmp) / f"{shape}.tg"
        path.write_text(text)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        for _ in range(repeat):
            cpu0, t0 = _children_cpu(), time.perf_counter()
            try:
                p = subprocess.run([sys.executable, "-m", "tgc.cli", "check", str(path)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
            except subprocess.TimeoutExpired:
                return {"shape": shape, "statements": n, "error": f"over {timeout:.0f} s"}
            wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
            if p.returncode != 0:
                return {**row, "error": f"exit {p.returncode}"}
            if "wall_s" not in row or wall < row["wall_s"]:
                row.update(wall_s=wall, cpu_s=cpu)
    return row


def label(n: int) -> str:
    """check-1e5 for 100000 statements, check-25000 otherwise."""
    mantissa, _, exp = f"{n:.0e}".partition("e")
    return f"check-{mantissa}e{int(exp)}" if float(f"{n:.0e}") == n else f"check-{n}"


def check_times(n: int = 100_000, shapes=None, timeout: float = 120.0, out=print, repeat: int = 1) -> list[dict]:
    rows = []
    for shape in shapes or SHAPES:
        row = check_time(shape, n, timeout, repeat)
        rows.append(row)
        if "error" in row:
            out(f"  {label(n)} {shape:<13} n/a ({row['error']})")
        else:
            ok = "yes" if row["wall_s"] < TARGET_S else "NO "
            out(f"  {label(n)} {shape:<13} {row['wall_s']:6.2f} s  {ok}  ({row['bytes'] / 1e6:.1f} MB, "
                f"CPU {row['cpu_s']:.2f} s)", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--statements", type=int, default=100_000)
    ap.add_argument("--only", help="comma-separated shapes: " + ", ".join(SHAPES))
    ap.add_argument("--repeat", type=int, default=1, help="runs per shape; the least wall time is shown")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    shapes = args.only.split(",") if args.only else None
    unknown = set(shapes or ()) - set(SHAPES)
    if unknown:
        ap.error(f"--only: unknown shape(s) {', '.join(sorted(unknown))}")
    if args.repeat < 1:
        ap.error("--repeat: at least 1")
    print(f"# tgc check, {args.statements} statements per program, fresh process each, least of "
          f"{args.repeat}; target < {TARGET_S:.0f} s", flush=True)
    check_times(args.statements, shapes, args.timeout, repeat=args.repeat)


if __name__ == "__main__":
    main()
