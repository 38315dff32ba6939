"""What a compiled step does with time and memory: `tgc explain`.

`explain(low, env)` reads a planned lowered program (after `plan`) with every
symbolic dim bound (`env`) and returns, as plain data (JSON-ready):

- the kernels in execution order, each with its FLOPs and the bytes of the distinct
  buffers it reads and writes (each counted once per kernel: a lower bound of its
  memory traffic, exact for kernels that stream each operand once; a loop over an
  edge counts its step's kernels once per step, `kernel_bytes`), their sum the bytes
  a call moves, and, given the
  CPU backend's options, whether it runs serially or in a parallel region
  (`tgc.backends.cpu.codegen.thread_plan`);
- the workspace: its slots and their bytes, and which temporaries share each slot;
- memory over time: before each kernel, the bytes of the temporaries alive from
  their first write to their last read (as `plan` assigns slots; a loop whose steps
  run on the threads, given the CPU options, holds its step's once per thread), the
  peak, and what is alive at the peak; arguments and outputs are the caller's arrays
  and are listed apart; the workspace the CPU code allocates (`allocated_bytes`);
- the save/recompute decisions: the kernels that recompute a `checkpoint(x)` for
  the backward pass (`tgc.autodiff.remat`; `plan` runs each just before its first
  reader); every other value a later kernel reads is kept. With a memory budget the
  caller adds the planner's choices (`memory_budget`, `tgc.budget`);
- per differentiated loop (`repeat`, `scan`), what each step keeps for the backward
  pass (`loop_steps`): the reverse loop of `tgc.autodiff.loops` keeps what the
  backward step reads (the incoming carries and the step's values), or, where the
  memory planner chose it (or the step's results are checkpointed), only the incoming
  carries, recomputing the step from them; with the bytes that costs. A loop the backend
  unrolls (`unroll`) is a program written out: its steps' values are the forward
  pass's own, and the backward pass keeps them as it keeps any value.

FLOPs are `tgc.lower.cost.kernel_flops`'s (one per arithmetic operation at every
point of a loop nest; a GEMM is 2 m n k per batch index and tap).

`format_explain` lays the report out as text; `timeline_svg` draws the live bytes per
kernel as an SVG bar chart (no dependency), and `timeline_png` the same with
matplotlib when it is installed.
"""
from __future__ import annotations

from tgc.lower.cost import kernel_flops
from tgc.opt.stats import BYTES
from tgc.lower.lowered import GemmKernel, LoopKernel, Lowered, StepLoop
from tgc.ir.sizes import size_eval
from tgc.ir.values import topo_order

ITEMSIZE = BYTES


def _lanes_bytes(low: Lowered, slots: list[dict], options) -> int:
    """The workspace the CPU code takes past the slots for a loop whose steps run on the
    threads (`codegen.parallel_step_loops`): lanes - 1 copies of the slots from the
    step's first on (each rounded up to 64 bytes, as the code aligns them); 0 without
    options or such a loop."""
    if options is None:
        return 0
    from tgc.backends.cpu.codegen import ALIGN, parallel_step_loops

    found = parallel_step_loops(low, options.cpu)
    if not found:
        return 0
    rounded = [-(-s["bytes"] // ALIGN) * ALIGN for s in slots]
    return (options.cpu.step_lanes() - 1) * max(sum(rounded[sb:]) for _, sb in found)


def explain(low: Lowered, env: dict[str, int], options=None) -> dict:
    """The report of the planned program `low` at the dims `env` (every symbolic dim bound).
    With the CPU backend's `options` (`tgc.options.Options`), each kernel also says
    whether it runs on one thread or in a parallel region (`threads`)."""
    size = {e: size_eval(low.size(e), env) for b in low.buffers.values() for e in b.edges}

    def nbytes(name: str) -> int:
        b = low.buffers[name]
        n = ITEMSIZE[b.dtype]
        for e in b.edges:
            n *= size[e]
        return n

    def extent(k, v) -> int:
        return size_eval(k.sizes[v], env)

    lanes = {}
    if options is not None:   # a loop whose steps run on the threads: each lane holds its own step's temporaries
        from tgc.backends.cpu.codegen import parallel_step_loops
        lanes = {id(k): options.cpu.step_lanes() for k, _ in parallel_step_loops(low, options.cpu)}
    liveness = Liveness(low, lanes)
    first, last = liveness.first, liveness.last
    kernels = []
    plans = None
    if options is not None:
        from tgc.backends.cpu.codegen import thread_plans
        plans = thread_plans(low, {**_fixed_dims(low), **env}, options)
    for i, k in enumerate(low.kernels):
        used = k.buffers_used()
        kernels.append({"index": i, "kind": _kind(k), "text": k.text().splitlines()[0],
                        "flops": kernel_flops(k, extent, lambda e: size_eval(low.size(e), env)),
                        "bytes": kernel_bytes(low, k, env) if isinstance(k, StepLoop) else
                        sum(nbytes(n) for n in used)})
        if plans is not None:
            kernels[-1]["threads"] = plans[i]
        if i in liveness.steps:   # the step's own temporaries live while it runs
            kernels[-1]["step_peak"] = liveness.steps[i].peak_bytes(env)
            if id(k) in lanes:   # ... on each lane
                kernels[-1]["lanes"] = lanes[id(k)]
    live = liveness.live_bytes(env)
    peak = max(live, default=-1)
    peak_kernel = live.index(peak) if live else None
    alive = [] if peak_kernel is None else sorted(liveness.alive(peak_kernel), key=lambda n: (-nbytes(n), n))
    slots = [{"slot": s, "bytes": max([size_eval(x, env) for x in sizes] + [0]),
              "buffers": [n for n, b in low.buffers.items() if b.slot == s]} for s, sizes in enumerate(low.slots)]
    lanes_bytes = _lanes_bytes(low, slots, options)
    report = {
        "dtype": low.dtype,
        "dims": dict(sorted(env.items())),
        "kernels": kernels,
        "flops": sum(k["flops"] for k in kernels),
        "bytes": sum(k["bytes"] for k in kernels),
        "arguments_bytes": sum(nbytes(n) for n, b in low.buffers.items() if b.kind == "arg"),
        "outputs_bytes": sum(nbytes(n) for n, b in low.buffers.items() if b.kind == "out"),
        "workspace": {"bytes": sum(s["bytes"] for s in slots), "slots": slots,
                      "lanes_bytes": lanes_bytes,
                      # what the CPU code allocates (`tgc_workspace_bytes`): the slots, each rounded up to
                      # 64 bytes, and the lanes' copies
                      "allocated_bytes": sum(-(-s["bytes"] // 64) * 64 for s in slots) + lanes_bytes},
        "live_bytes": live,
        "peak": {"bytes": max(peak, 0), "kernel": peak_kernel,
                 "buffers": [{"name": n, "edges": list(low.buffers[n].edges), "dtype": low.buffers[n].dtype,
                              "bytes": nbytes(n), "from": first[n], "to": last[n]} for n in alive]},
        "recompute": [{"kernel": k["index"], "text": k["text"]} for k, lk in zip(kernels, low.kernels)
                      if lk.note == "recompute"],
        "recompute_note": _recompute_note(low),
    }
    if options is not None:
        report["regions"] = _regions(low, {**_fixed_dims(low), **env}, options)
    return report


def _regions(low: Lowered, env: dict, options) -> dict:
    """Parallel regions one call starts (`codegen.region_count`), with consecutive
    loop kernels merged into one region (`backends/cpu/regions.py`) and without."""
    from dataclasses import replace

    from tgc.backends.cpu.codegen import region_count

    count, warm, barriers = region_count(low, env, options)
    alone, alone_warm, _ = region_count(low, env, replace(options, cpu=replace(options.cpu, merge_regions=False)))
    return {"per_call": count, "when_warm": warm, "barriers": barriers,
            "unmerged": alone, "unmerged_when_warm": alone_warm}


def kernel_bytes(low: Lowered, k, env: dict[str, int]) -> int:
    """The bytes kernel `k` of `low` moves at the dims `env`: each buffer it reads or
    writes once (a lower bound of its memory traffic, exact for a kernel that streams
    each buffer once), and a loop's (`StepLoop`) every step's kernels' (its trip times
    one step's): the program's bytes moved per call are the sum over its kernels."""
    if isinstance(k, StepLoop):
        step = k.step
        return size_eval(k.trip, env) * sum(kernel_bytes(step, s, env) for s in step.kernels)
    total = 0
    for name in k.buffers_used():
        b = low.buffers[name]
        n = ITEMSIZE[b.dtype]
        for e in b.edges:
            n *= size_eval(low.size(e), env)
        total += n
    return total


class Liveness:
    """Which temporaries of the planned program `low` are alive during each kernel:
    from their first write to their last read, as `plan` assigns slots (and, for a
    `StepLoop`, its step's own, alive while it runs). Found once from the kernels;
    `live_bytes(env)` and `peak_bytes(env)` evaluate the buffers' symbolic sizes at
    the dims `env`, without lowering anything again (`tgc.runtime.specialize` asks
    it at each new shape signature). `lanes` maps a `StepLoop` (by id, at any depth)
    whose steps run on the threads (`codegen.parallel_step_loops`) to its lane count:
    while it runs, each lane holds its own step's temporaries (its copy of the step's
    slots, `codegen._ModuleGen.call_steps_parallel`), so its step's peak counts that
    many times."""

    def __init__(self, low: Lowered, lanes: dict[int, int] | None = None):
        self.low = low
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        for i, k in enumerate(low.kernels):
            for name in k.buffers_used():
                name = low.storage(name)   # an alias is its buffer's bytes (tgc.lower.alias)
                if low.buffers[name].kind == "temp":
                    self.first.setdefault(name, i)
                    self.last[name] = i
        self.lanes = {i: (lanes or {}).get(id(k), 1) for i, k in enumerate(low.kernels) if isinstance(k, StepLoop)}
        self.steps = {i: Liveness(k.step, lanes) for i, k in enumerate(low.kernels) if isinstance(k, StepLoop)}

    def live_bytes(self, env: dict[str, int]) -> list[int]:
        """The bytes of the temporaries alive during each kernel, at the dims `env`."""
        low, size = self.low, {}

        def nbytes(name: str) -> int:
            b = low.buffers[name]
            n = ITEMSIZE[b.dtype]
            for e in b.edges:
                if e not in size:
                    size[e] = size_eval(low.size(e), env)
                n *= size[e]
            return n

        change = [0] * (len(low.kernels) + 1)   # a sweep: each temporary's bytes from its first to its last kernel
        for name, i in self.first.items():
            n = nbytes(name)
            change[i] += n
            change[self.last[name] + 1] -= n
        live, total = [], 0
        for i in range(len(low.kernels)):
            total += change[i]
            live.append(total + (self.lanes[i] * self.steps[i].peak_bytes(env) if i in self.steps else 0))
        return live

    def alive(self, i: int) -> list[str]:
        """The temporaries alive during kernel `i`."""
        return [n for n in self.first if self.first[n] <= i <= self.last[n]]

    def peak_bytes(self, env: dict[str, int]) -> int:
        """The most bytes of temporaries alive at once, at the dims `env` (0: none)."""
        return max(self.live_bytes(env), default=0)

    def largest_unfixed(self, env: dict[str, int]) -> int:
        """The most elements of one temporary (of the program or of a step) whose size
        depends on a symbolic dim, at the dims `env` (0: none): what `stream`, which
        blocks only edges of known size, may block once the dims are fixed."""
        low, most = self.low, 0
        for name in self.first:
            edges = low.buffers[name].edges
            if all(isinstance(low.size(e), int) for e in edges):
                continue
            n = 1
            for e in edges:
                n *= size_eval(low.size(e), env)
            most = max(most, n)
        return max([most] + [step.largest_unfixed(env) for step in self.steps.values()])


def _fixed_dims(low: Lowered) -> dict:
    return {d: s for d, s in low.module.dims.items() if isinstance(s, int)}


def loop_steps(module, env: dict[str, int], unrolled: bool) -> list[dict]:
    """What each step of every differentiated loop of `module` (the program before its
    derivatives: `grad`/`vjp` values still in it) keeps for the backward pass, at the
    dims `env`: the reverse loop's plan (`tgc.autodiff.loops.step_plan`): the incoming
    carries it keeps, the step's values it keeps (both stacked over the steps, with
    their bytes in all), and how many of the step's values it computes again. `keep`
    is "carries" when only carries are kept (the step is recomputed: the memory
    planner's choice under a budget, or a `checkpoint` of the step's results), else
    "values". `unrolled`: the backend runs the loops unrolled."""
    from tgc.autodiff.loops import step_plan
    from tgc.autodiff.reverse import reverse_many

    under = [v.operands[0] for v in module.values() if v.op in ("grad", "vjp")]
    loops: dict[tuple, dict] = {}

    def nbytes(dtype: str, edges) -> int:
        n = ITEMSIZE[dtype]
        for e in edges:
            n *= size_eval(module.size(e), env)
        return n

    for v in topo_order(under):
        if v.op != "loop":
            continue
        body, edge, reverse, _ = v.attrs
        key = (body, edge, reverse, tuple(id(o) for o in v.operands))
        if key in loops:
            continue
        plan = step_plan(v, reverse_many)
        steps = size_eval(module.size(edge), env)
        kept = [{"what": "carry", "edges": list(body.params[k].edges), "dtype": body.params[k].dtype,
                 "bytes": steps * nbytes(body.params[k].dtype, body.params[k].edges)} for k in plan.carries]
        kept += [{"what": w.attrs[0] if w.op in ("map", "reduce") else w.op, "edges": list(w.edges),
                  "dtype": w.dtype, "bytes": steps * nbytes(w.dtype, w.edges)} for w in plan.kept]
        loops[key] = {"edge": edge, "steps": steps, "unrolled": unrolled,
                      "keep": "values" if plan.kept else "carries", "kept": kept,
                      "bytes": sum(k["bytes"] for k in kept), "recomputed_values": plan.recomputed}
    return list(loops.values())


def _stacked_for_reverse(module, env: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Per loop edge: how many values forward loops stack for the reverse loops of `module`
    to read, and their bytes in all."""
    read: dict[str, dict[int, object]] = {}
    for v in module.values():
        if v.op != "loop":
            continue
        body, edge = v.attrs[0], v.attrs[1]
        for k in range(body.carries, body.carries + body.slices):
            o = v.operands[k]
            if o.op == "loop" and o.attrs[1] == edge and o.attrs[2] != v.attrs[2] and o.attrs[3] >= o.attrs[0].carries:
                read.setdefault(edge, {})[id(o)] = o
    out = {}
    for edge, got in read.items():
        total = 0
        for o in got.values():
            n = ITEMSIZE[o.dtype]
            for e in o.edges:
                n *= size_eval(module.size(e), env)
            total += n
        out[edge] = (len(got), total)
    return out


def kept_after_stream(before, after, env: dict[str, int], loops: list[dict]) -> None:
    """Each of `loops` (`loop_steps`'s report) with what forward loops stack for reverse
    loops in the optimized program `after` where that is less than in `before` (the
    program before `stream` ran at these sizes): a reverse loop that computes the step's
    large values again in its step, which then streams them (tgc.opt.stream_loops),
    reads fewer values stacked by the forward loop. Adds `stacked` (values, bytes) of
    `before` and `stacked_optimized` of `after`."""
    was, now = _stacked_for_reverse(before, env), _stacked_for_reverse(after, env)
    for lp in loops:
        edge = lp["edge"]
        if not lp["unrolled"] and edge in was and edge in now and now[edge][0] < was[edge][0]:
            lp["stacked"], lp["stacked_optimized"] = list(was[edge]), list(now[edge])


def _loop_lines(loops: list[dict]) -> list[str]:
    """`loop_steps`'s report in words."""
    lines = []
    for lp in loops:
        head = f"  loop over '{lp['edge']}' ({lp['steps']} steps): "
        carries = [k for k in lp["kept"] if k["what"] == "carry"]
        carry = ", ".join(f"{k['dtype']}[{', '.join(k['edges'])}]" for k in carries)

        def plan(keep: str, recompute: str) -> str:
            if lp["keep"] == "carries":
                return (f"{keep} each step's incoming carry ({carry}, {human(lp['bytes'], 'B')} in all) and "
                        f"{recompute} the step's other {lp['recomputed_values']} values from it")
            what = ([f"each step's incoming carry ({carry})"] if carries else []) \
                + [f"{len(lp['kept']) - len(carries)} values each step computes"]
            return (f"{keep} {' and '.join(what)} ({human(lp['bytes'], 'B')} in all) and {recompute} "
                    f"{lp['recomputed_values']} of the step's values")
        if lp["unrolled"]:
            lines.append(head + "unrolled for this backend, so each step's values are the forward pass's and "
                         "the backward pass keeps them as it keeps any value (checkpoint(x) in the step "
                         f"recomputes x); run as a loop it would {plan('keep', 'recompute')}")
        else:
            lines.append(head + f"the backward pass {plan('keeps', 'recomputes')}")
        if "stacked_optimized" in lp:
            (n0, b0), (n1, b1) = lp["stacked"], lp["stacked_optimized"]
            lines.append(f"    at these sizes the forward loop stacks {n1} values for the reverse loop "
                         f"({human(b1, 'B')} in all) instead of {n0} ({human(b0, 'B')}): the reverse step "
                         "computes the others again, by blocks (tgc.opt.stream_loops)")
    return lines


def _recompute_note(low: Lowered) -> str:
    """The save/recompute decisions in words (autodiff/remat.py, plan's sinking)."""
    again = [f"k{i}" for i, k in enumerate(low.kernels) if k.note == "recompute"]
    if not again and any(v.op == "map" and v.attrs[0] == "recompute" for v in low.module.values()):
        return ("checkpointed values are recomputed inside the backward kernels that read them "
                "(cheap enough to inline); every other value a later kernel reads is kept")
    from tgc.ir.sizes import size_str

    from tgc.lower.lowered import step_loops

    streams = [f"k{i} {k.note} ({size_str(k.trip)} steps)" for i, k in enumerate(low.kernels)
               if isinstance(k, StepLoop) and k.note.startswith("streams")]
    for i, k in enumerate(low.kernels):   # the blocks inside a loop's step (a `repeat` and its reverse loop)
        inner = [s for _, s in step_loops(k.step) if s.note.startswith("streams")] if isinstance(k, StepLoop) else []
        if inner:
            streams.append(f"in k{i}'s step, {len(inner)} loops: {inner[0].note.split(':')[0]}")
    if streams:   # tgc.opt.stream: each block's values recomputed from the inputs, forward and backward alike
        return "recompute by blocks: " + "; ".join(streams)
    if not again:
        return ("no recomputation: every value a later kernel reads is kept "
                "(checkpoint(x) makes the backward pass recompute x)")
    return (f"{len(again)} kernels recompute checkpointed values for the backward pass, each just before "
            f"its first reader ({', '.join(again)}); every other value a later kernel reads is kept")


def _kind(k) -> str:
    return "gemm" if isinstance(k, GemmKernel) else "loop" if isinstance(k, LoopKernel) else k.kind


def human(n: float, unit: str) -> str:
    """1234567 -> '1.23 M' + unit."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:g} {unit}"


def format_explain(report: dict, name: str) -> str:
    dims = ", ".join(f"{d} = {n}" for d, n in report["dims"].items()) or "no symbolic dims"
    index = max([len(f"k{k['index']}") for k in report["kernels"]] + [4])   # the columns fit every row
    kind = max([len(k["kind"]) for k in report["kernels"]] + [len("kind")])
    threads = all("threads" in k for k in report["kernels"]) and report["kernels"]
    width = max([len(k["threads"]) for k in report["kernels"]] + [len("threads")]) if threads else 0
    column = (lambda text: f"  {text:<{width}}") if threads else (lambda text: "")
    lines = [f"{name} ({report['dtype']}; {dims})"]
    if report.get("program") == "generic":
        lines.append("program: generic, for every size (calls repeated with these sizes run its specialization: "
                     "--specialized)")
    elif report.get("program") == "specialized":
        lines.append("program: specialized to these sizes (what calls repeated with them run)")
    first = report.get("first_call")
    if first is not None:
        at = first["specialize_at_bytes"]
        bound = "specialize_at_bytes unset" if at is None else f"specialize_at_bytes {human(at, 'B')}"
        work = first.get("generic_work")
        at_work = first.get("specialize_first_work")
        if work is not None:
            saved = "" if first.get("specialized_work") is None else \
                f", the specialization {human(first['specialized_work'], 'FLOP+B')}"
            does = f"; one call does {human(work, 'FLOP+B')}{saved}, specialize_first_work {human(at_work, 'FLOP+B')}"
        else:
            does = ""
        if first["runs"] == "specialized" and first.get("reason") == "work":
            lines.append(f"a first call with these sizes runs the specialization, built before it: it saves that "
                         f"call's compile{does}")
        elif first["runs"] == "specialized":
            lines.append(f"a first call with these sizes runs the specialization, built before it: the generic "
                         f"program would hold {human(first['generic_peak'], 'B')} of temporaries ({bound}), "
                         f"the specialization {human(first['specialized_peak'], 'B')}")
        else:
            held = "" if first["specialized_peak"] is None else \
                f", the specialization {human(first['specialized_peak'], 'B')}: not half"
            lines.append(f"a first call with these sizes runs the generic program: it holds "
                         f"{human(first['generic_peak'], 'B')} of temporaries ({bound}{held}{does})")
    lines += ["", "kernels, in order:",
              f"  {'#':<{index}}  {'kind':<{kind}}  {'FLOPs':>10}  {'bytes':>10}  {'live during':>11}"
              f"{column('threads')}  what"]
    for k, live in zip(report["kernels"], report["live_bytes"]):
        lines.append(f"  {'k' + str(k['index']):<{index}}  {k['kind']:<{kind}}  {human(k['flops'], 'FLOP'):>10}"
                     f"  {human(k['bytes'], 'B'):>10}  {human(live, 'B'):>11}{column(k.get('threads', ''))}"
                     f"  {k['text'][:90]}")
    ws = report["workspace"]
    if threads:
        lines += ["", _threads_note(report["kernels"])]
    regions = report.get("regions")
    if regions is not None:
        lines.append(f"parallel regions per call: at most {regions['per_call']} ({regions['when_warm']} of them only "
                     f"right after another) with {regions['barriers']} barriers in them; {regions['unmerged']} "
                     f"({regions['unmerged_when_warm']}) if each kernel started its own (consecutive kernels share "
                     "one region: CpuOptions.merge_regions)")
    lines += ["", f"total: {len(report['kernels'])} kernels, {human(report['flops'], 'FLOP')}, "
              f"{human(report['bytes'], 'B')} moved (each buffer once per kernel that reads or writes it, "
              f"a loop's once per step)",
              f"caller's arrays: arguments {human(report['arguments_bytes'], 'B')}, "
              f"outputs {human(report['outputs_bytes'], 'B')}",
              f"workspace: {human(ws['bytes'], 'B')} in {len(ws['slots'])} slots"
              + (f" (and {human(ws['lanes_bytes'], 'B')} more for the steps of a loop on the threads: each lane's "
                 "copy of the step's slots)" if ws.get("lanes_bytes") else "")]
    for s in ws["slots"]:
        lines.append(f"  slot {s['slot']}: {human(s['bytes'], 'B')}, shared by {', '.join('%' + b for b in s['buffers'])}")
    peak = report["peak"]
    if peak["kernel"] is None:
        lines.append("peak: no temporaries")
    else:
        k = report["kernels"][peak["kernel"]]
        on = (f" (its step's {human(k['step_peak'], 'B')} on each of {k['lanes']} threads)" if k.get("lanes")
              else f" (its step's {human(k['step_peak'], 'B')})" if k.get("step_peak") else "")
        lines.append(f"peak: {human(peak['bytes'], 'B')} of temporaries alive at k{peak['kernel']}{on}:")
        for b in peak["buffers"]:
            lines.append(f"  %{b['name']} {b['dtype']}[{', '.join(b['edges'])}] {human(b['bytes'], 'B')}"
                         f" (k{b['from']} .. k{b['to']})")
    lines.append(f"save/recompute: {report['recompute_note']}")
    lines += _loop_lines(report.get("loops", []))
    budget = report.get("memory_budget")
    if budget is not None:   # --memory-budget: what the planner chose (tgc.budget)
        lines.append(f"{budget['summary']}")
        lines += budget["lines"]
    return "\n".join(lines) + "\n"


def _threads_note(kernels: list) -> str:
    """The thread plan in words: how many kernels run serially, how many may run in a
    parallel region (each kernel that does is one region)."""
    count = {t: sum(k["threads"] == t for k in kernels) for t in ("serial", "parallel", "parallel when warm")}
    return (f"threads: {count['serial']} kernels serial (too small to gain from threads), {count['parallel']} parallel, "
            f"{count['parallel when warm']} parallel only right after another region (CpuOptions.parallel_min_work, "
            "gemm_parallel_min_flops and their _warm forms); while other processes hold the cores, "
            "parallel kernels run serially too (CpuOptions.contention_memory_cycles)"
            + ("; loops with their steps on the threads (each step's kernels on one thread): "
               f"{sum(k['threads'] == 'steps on the threads' for k in kernels)} "
               "(CpuOptions.parallel_steps_min_cycles)" if any(k["threads"] == "steps on the threads" for k in kernels)
               else ""))


def timeline_svg(report: dict, title: str) -> str:
    """Live temporary bytes before each kernel as bars, the peak's bar in another colour."""
    live = report["live_bytes"]
    w, h, pad = 900, 300, 40
    top = max(live + [1])
    bar = (w - 2 * pad) / max(len(live), 1)
    peak = report["peak"]["kernel"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="12">', f'<text x="{pad}" y="20">{_escape(title)}: live temporaries per kernel '
             f'(peak {human(top, "B")} at k{peak})</text>']
    for i, b in enumerate(live):
        bh = (h - 2 * pad) * b / top
        colour = "#c0392b" if i == peak else "#2e86c1"
        parts.append(f'<rect x="{pad + i * bar:.2f}" y="{h - pad - bh:.2f}" width="{max(bar - 0.5, 0.5):.2f}" '
                     f'height="{bh:.2f}" fill="{colour}"><title>k{i}: {human(b, "B")}</title></rect>')
    parts.append(f'<text x="{pad}" y="{h - 12}">kernel 0 .. {len(live) - 1}</text></svg>')
    return "\n".join(parts) + "\n"


def timeline_png(report: dict, title: str, path: str) -> None:
    """The same chart as a PNG, through matplotlib (ImportError when it is absent)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = report["live_bytes"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    colours = ["#c0392b" if i == report["peak"]["kernel"] else "#2e86c1" for i in range(len(live))]
    ax.bar(range(len(live)), live, color=colours, width=1.0)
    ax.set_xlabel("kernel")
    ax.set_ylabel("live temporaries (bytes)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
