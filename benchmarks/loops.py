"""Cold compile time by depth, and step time of `repeat` against the unrolled program.

    python benchmarks/loops.py [--depths 2,32] [--width 48] [--step-layers 6] [--step-width 128] [--calls 10]
    python benchmarks/loops.py --depths '' --calls 0 --unrolled-depths 6,12,24,48 [--stages]

The model is the sorting GPT's shape (pre-LayerNorm blocks: causal attention with heads
of 16, a GELU MLP of 4x the width; token and positional embeddings, a final LayerNorm
and a linear head; one SGD step of every param), its blocks' params stacked on a
`layer` edge and applied with `repeat[layer](block, ...)`. Compile time is one
`tgc.compile` (CPU backend, f32) with an empty code cache in a fresh process; the
ratio of the deepest to the shallowest is what the loop form is for. The step time
compares the loop form with the same model written out layer by layer, their calls
interleaved. The machine is shared: repeat, and read medians and minima.

`--unrolled-depths` compiles the model written out block by block (no `repeat`) and
trained by AdamW with global-norm clipping (`source(..., adamw=True)`), cold, at each
depth: how compile time grows with the length of a program. `--stages` adds, per depth,
the CPU seconds (`time.thread_time`) of each stage of one compile in a fresh process:
the front end, each IR pass, each lowering stage, the verifiers, generating LLVM IR in
Python, and LLVM's parsing, optimization and object emission, every module in that
process one after another (a plain compile runs LLVM on the modules in forked
processes at once, so its wall time is less than the sum).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HEAD = """dim batch = 8, n = 6, t = 2 * n - 1, s = t, vocab = 3
dim c = {width}, head = {heads}, hd = c / head, ff = 4 * c
dim layer = {layers}
input ids: i32[batch, t], target: i32[batch, t]
input lr
param wte[vocab, c], wpe[t, c], lnf_w[c], lnf_b[c], lm_head[c, vocab]
fn block(x, ln1_w, ln1_b, wq, wk, wv, wo, ln2_w, ln2_b, wfc, bfc, wproj, bproj) {{
  y = layernorm[c](x, ln1_w, ln1_b)
  qh = (y @ wq)[c2 = hd*head + hd]
  kh = (y @ wk)[c2 = hd*head + hd, t -> s]
  vh = (y @ wv)[c2 = hd*head + hd, t -> s]
  p = softmax[s](dot[hd](qh, kh) / sqrt(size(hd)) - 1e9 * [s > t])
  a = x + (sum[s](p * vh) @ [c2 = hd*head + hd]) @ wo
  h = gelu(layernorm[c](a, ln2_w, ln2_b) @ wfc + bfc)
  return a + h @ wproj + bproj
}}
"""
KINDS = [("ln1_w", "c"), ("ln1_b", "c"), ("wq", "c, c2: c"), ("wk", "c, c2"), ("wv", "c, c2"),
         ("wo", "c2, c"), ("ln2_w", "c"), ("ln2_b", "c"), ("wfc", "c, ff"), ("bfc", "ff"),
         ("wproj", "ff, c"), ("bproj", "c")]
TAIL = """logits = layernorm[c](x, lnf_w, lnf_b) @ lm_head
loss = mean[batch, t](cross_entropy[vocab](logits, [vocab = target]))
out loss
"""
# AdamW (betas 0.9, 0.95), gradients clipped to a global norm of 1, as in examples/gpt2.tg
ADAMW = """input wd
state step
tt = max(step, 0) + 1
update step = tt
gnorm = sqrt(sum[p in params](sum(grad(loss, p) ^ 2)))
clip = min(1, 1 / (gnorm + 1e-6))
for p in params {
  state m.p, v.p
  g  = clip * grad(loss, p)
  mn = 0.9 * m.p + 0.1 * g
  vn = 0.95 * abs(v.p) + 0.05 * g * g
  update m.p = mn
  update v.p = vn
  update p = p - lr * ((mn / (1 - 0.9 ^ tt)) / (sqrt(vn / (1 - 0.95 ^ tt)) + 1e-8) + wd * p)
}
"""


def source(layers: int, width: int, loop: bool, adamw: bool = False) -> str:
    """The model's text: `layers` blocks as `repeat` over stacked params (`loop`) or
    written out one by one, trained by one SGD step, or by AdamW (`adamw`)."""
    heads = width // 16
    text = HEAD.format(width=width, heads=heads, layers=layers)
    names = [k for k, _ in KINDS]
    if loop:
        text += "".join(f"param {k}[layer, {e}]\n" for k, e in KINDS)
        text += "x0 = wte[vocab = ids] + wpe\n"
        text += f"x = repeat[layer](block, x0, {', '.join(names)})\n"
        params = names
    else:
        params = []
        for i in range(layers):
            for k, e in KINDS:
                e = e.replace("c2: c", "c2") if i or not e.endswith("c2: c") else e
                text += f"param l{i}_{k}[{e}]\n"
                params.append(f"l{i}_{k}")
        text += "x0 = wte[vocab = ids] + wpe\n"
        prev = "x0"
        for i in range(layers):
            text += f"x{i + 1} = block({prev}, {', '.join(f'l{i}_{k}' for k in names)})\n"
            prev = f"x{i + 1}"
        text += f"x = {prev}\n"
        if "c2: c" not in text:
            raise AssertionError("the edge c2 is declared nowhere")
    text += TAIL
    if adamw:
        return text + ADAMW
    for p in params + ["wte", "wpe", "lnf_w", "lnf_b", "lm_head"]:
        text += f"update {p} = {p} - lr * grad(loss, {p})\n"
    return text


def cold_compile(text: str) -> float:
    """Seconds of one tgc.compile in a fresh process with an empty code cache."""
    with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile("w", suffix=".tg") as f:
        f.write(text)
        f.flush()
        code = ("import sys, time, tgc; t = time.perf_counter(); "
                "tgc.compile(sys.argv[1], backend='cpu', dtype='f32'); print(time.perf_counter() - t)")
        out = subprocess.run([sys.executable, "-c", code, f.name], capture_output=True, text=True, check=True,
                             env={**os.environ, "TGC_CACHE_DIR": cache})
        return float(out.stdout.strip().splitlines()[-1])


def stage_times(text: str) -> dict[str, float]:
    """CPU seconds of each stage of one `tgc.compile` of `text` in this process (the
    module docstring), by wrapping the functions that run them; "total" is the whole."""
    from collections import defaultdict

    import tgc
    from tgc import manager, pipeline
    from tgc.backends.cpu import codegen, llvm_env

    clock = time.thread_time
    spent: dict[str, float] = defaultdict(float)

    def timed(owner, attr: str, key: str) -> None:
        fn = getattr(owner, attr)

        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += clock() - t
        setattr(owner, attr, wrapper)

    depth = [0]
    run_one = manager._run_one

    def one(p, ir, options):   # a lowering stage recurses into loops' steps: count the outermost
        depth[0] += 1
        t = clock()
        try:
            return run_one(p, ir, options)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent[("lower: " if p.takes == "lowered" else "pass: ") + p.name] += clock() - t

    def objects(texts, opt=3, *, jobs=1, prefer_512=True):   # the modules one after another, here
        out = []
        for t in texts:
            c = clock()
            t = t() if callable(t) else t
            spent["codegen: LLVM IR (Python)"] += clock() - c
            out.append(llvm_env.emit_object(t, opt, prefer_512=prefer_512))
        return out

    manager._run_one = one
    llvm_env.emit_objects = objects
    timed(pipeline, "load_source", "front end")
    timed(manager, "verify", "verify (IR)")
    timed(manager, "verify_lowered", "verify (lowered)")
    timed(codegen, "generate_units_first_last", "codegen: LLVM IR (Python)")
    timed(llvm_env, "parse", "LLVM: parse")
    timed(llvm_env, "optimize", "LLVM: optimize")
    timed(llvm_env.llvm.TargetMachine, "emit_object", "LLVM: emit object")
    t = clock()
    tgc.compile(text, backend="cpu", dtype="f32")
    out = dict(spent, total=clock() - t)
    out["LLVM: optimize"] -= out.get("LLVM: parse", 0.0)   # optimize parses its text first
    return out


def stages_in_fresh_process(layers: int, width: int) -> dict[str, float]:
    """`stage_times` of the unrolled AdamW model in a fresh process with the code cache off."""
    out = subprocess.run([sys.executable, __file__, "--stages-child", str(layers), "--width", str(width)],
                         capture_output=True, text=True, check=True, env={**os.environ, "TGC_CACHE": "off"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_stages(table: dict[int, dict[str, float]]) -> None:
    depths = sorted(table)
    names = list(dict.fromkeys(k for d in depths for k in table[d]))
    print("CPU seconds by stage (unrolled, AdamW):")
    print(f"  {'stage':<30}" + "".join(f"{d:>9}" for d in depths))
    for name in names:
        print(f"  {name:<30}" + "".join(f"{table[d].get(name, 0.0):9.2f}" for d in depths))


def prepared(text: str):
    """The compiled CPU program of `text` (f32) and arguments for it, called once."""
    import tgc

    prog = tgc.compile(text, backend="cpu", dtype="f32")
    rng = np.random.default_rng(0)
    m = prog.module
    args = {}
    for name, a in m.args.items():
        shape = [int(m.size(e)) for e in a.order]
        args[name] = (rng.integers(0, 3, shape).astype(np.int32) if a.dtype == "i32"
                      else (rng.standard_normal(shape) * 0.05).astype(np.float32))
    args["lr"] = np.float32(1e-3)
    prog(**args)
    return prog, args


def step_times(texts: dict[str, str], calls: int) -> dict[str, list[float]]:
    """Seconds of each call of each program, the programs' calls interleaved (a load
    that comes and goes on a shared machine falls on both alike)."""
    progs = {key: prepared(text) for key, text in texts.items()}
    times: dict[str, list[float]] = {key: [] for key in texts}
    for _ in range(calls):
        for key, (prog, args) in progs.items():
            t = time.perf_counter()
            prog(**args)
            times[key].append(time.perf_counter() - t)
    return times


def median(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="2,32", help="layer counts to compile cold ('' for none)")
    ap.add_argument("--width", type=int, default=48)
    ap.add_argument("--step-layers", type=int, default=6)
    ap.add_argument("--step-width", type=int, default=128)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--unrolled-depths", default="",
                    help="block counts to compile cold written out block by block, with AdamW (e.g. 6,12,24,48)")
    ap.add_argument("--stages", action="store_true", help="with --unrolled-depths: CPU seconds by compile stage")
    ap.add_argument("--stages-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    if args.stages_child is not None:
        print(json.dumps(stage_times(source(args.stages_child, args.width, loop=False, adamw=True))))
        return
    result: dict = {"compile_s": {}, "unrolled_compile_s": {}, "unrolled_stages_s": {}}
    for d in (int(x) for x in args.depths.split(",") if x):
        result["compile_s"][d] = cold_compile(source(d, args.width, loop=True))
        print(f"cold compile, {d} layers (repeat): {result['compile_s'][d]:.2f} s", flush=True)
    depths = sorted(result["compile_s"])
    if len(depths) > 1:
        print(f"ratio {depths[-1]} / {depths[0]} layers: {result['compile_s'][depths[-1]] / result['compile_s'][depths[0]]:.2f}")
    for d in (int(x) for x in args.unrolled_depths.split(",") if x):
        result["unrolled_compile_s"][d] = cold_compile(source(d, args.width, loop=False, adamw=True))
        print(f"cold compile, {d} blocks written out (AdamW): {result['unrolled_compile_s'][d]:.2f} s", flush=True)
        if args.stages:
            result["unrolled_stages_s"][d] = stages_in_fresh_process(d, args.width)
    if result["unrolled_stages_s"]:
        print_stages(result["unrolled_stages_s"])
    if args.calls <= 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    times = step_times({key: source(args.step_layers, args.step_width, loop)
                        for key, loop in (("repeat", True), ("unrolled", False))}, args.calls)
    for key, ts in times.items():
        result[key] = ts
        print(f"step, {args.step_layers} layers of width {args.step_width}, {key}: "
              f"min {min(ts) * 1e3:.2f} ms, median {median(ts) * 1e3:.2f} ms", flush=True)
    print(f"repeat / unrolled: {median(times['repeat']) / median(times['unrolled']):.2f} (medians), "
          f"{min(times['repeat']) / min(times['unrolled']):.2f} (minima)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
