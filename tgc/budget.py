"""The memory budget planner: which saved values the backward pass recomputes (and in
which order the updates run) so that the workspace fits `Options.memory_budget` bytes.

`lower_within_budget(module, options, backend=)` runs the pipeline as `run_pipeline`
does, but stops before `adjoint` to decide (measuring each trial with the lowering of
the backend the program is compiled for: its stages and `lowering_options`):

1. **Order.** The step's kernels follow its roots depth first, so the update written
   first has its gradient computed first, and with it everything that gradient needs.
   When the budget is exceeded, the updates are also tried last-written first (as a
   backward pass goes: usually the last layer's first), and the order with the smaller
   workspace is kept. Every update reads the values before the step: no value changes.
2. **Saved values.** It differentiates the module once (the `adjoint` pass) and
   collects the values of the differentiated functions (the primal graphs under
   `grad`/`vjp`) that the derivative reads: what the forward pass keeps for the
   backward. Leaves (arguments, constants, draws), integer and scalar values, and what
   a written `checkpoint` already recomputes are not candidates.
3. **Ranking.** `checkpoint(v)` recomputes v's region (`tgc.autodiff.remat.add_region`:
   v and what exists only to compute it). A candidate frees the saved bytes in its
   region (at the sizes below) and costs the FLOPs of its region (each operation over
   its operands' points: an estimate); candidates are ranked greedily by bytes freed
   per FLOP, each next one counting only bytes no earlier one frees. Attention's
   probabilities are such a candidate: a [query, key] matrix per head that a softmax
   makes from the scores in a few FLOPs per element.
4. **Measured choice.** In rank order, each candidate is added to the chosen set
   (wrapped in `checkpoint(...)`, the marker remat reads in `adjoint`) if the program
   lowered with it (`plan`) has a smaller workspace (the sum of its slots, as
   `tgc explain` reports it), until the workspace fits; a second pass looks at the
   rest again (a choice changes what the others save). The estimate only orders the
   trials: every kept choice lowered the measured workspace. When the budget is not
   met, the smallest workspace found is kept and `MemoryPlan.met` is False: the
   callers warn with the best workspace reached (the build still succeeds).
5. **Loops.** The reverse loop of a `repeat`/`scan` keeps, by default, every value
   of each step that the backward step reads (`tgc.autodiff.loops`), stacked over
   the steps. Each differentiated loop that keeps such values is a candidate too,
   ranked first (a loop's saved values are per step, so they grow with its length):
   keep only each step's incoming carries and recompute the step in the backward
   loop (its body's results checkpointed, `tgc.autodiff.loops.checkpointed`). It is
   measured and kept like any candidate; `checkpoint` written inside a body applies
   per step in either form.

Sizes: the dims bound in `Options.dims`, each other symbolic dim at `Options.rep_size`
(64), as `tgc explain` takes them by default; the workspace scales with the batch, so a
budget is for those sizes.

Exact up to rounding: `checkpoint` and the order of the updates change the schedule,
never an operation (remat's recomputation is the same operations on the same values;
every update reads the values before the step), so results and derivatives are those
without a budget; the lowering fuses the checkpointed program into other kernels, which
may sum in another order (f32 results differ in the last bits). Terminates: one
differentiation, then at most 2 + 2n trial compilations of the pipeline's rest for n
candidates.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.values import Value, topo_order
from tgc.options import Options

ITEMSIZE = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "i32": 4, "c64": 8, "c128": 16}
PASSES = 2   # greedy passes over the ranked candidates
NOT_CANDIDATES = ("arg", "const", "size", "indicator", "random", "slot", "fold")


class MemoryBudgetWarning(UserWarning):
    """`tgc.compile` with a memory budget the planner could not meet: the program is
    built with the smallest workspace it found (the message says how large)."""


@dataclass
class Choice:
    """One value the backward pass recomputes instead of keeping."""
    what: str          # its operation, edges and source position
    bytes: int         # the saved bytes its recomputation frees (estimate, at the planner's sizes)
    flops: int         # the estimated FLOPs of recomputing it and what is recomputed with it
    edges: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"what": self.what, "bytes": self.bytes, "flops": self.flops, "edges": list(self.edges)}


@dataclass
class MemoryPlan:
    """What the planner chose, and the workspace before and after (bytes)."""
    budget: int
    dims: dict[str, int]
    before: int                      # the workspace without recomputation
    after: int                       # the workspace of the chosen program
    met: bool                        # after <= budget
    candidates: int                  # saved values it could recompute
    chosen: list[Choice] = field(default_factory=list)
    trials: int = 0                  # programs compiled to measure
    reversed_updates: bool = False   # the step computes the updates last-written first (a smaller workspace)
    primal: Module | None = None     # the program before its derivatives, the chosen checkpoints in it

    def as_dict(self) -> dict:
        return {"budget": self.budget, "dims": self.dims, "before": self.before, "after": self.after,
                "met": self.met, "candidates": self.candidates, "trials": self.trials,
                "reversed_updates": self.reversed_updates,
                "chosen": [c.as_dict() for c in self.chosen]}

    def summary(self) -> str:
        """One line: the budget, the workspace before and after, what is recomputed."""
        from tgc.explain import human

        dims = ", ".join(f"{d} = {n}" for d, n in self.dims.items())
        head = (f"memory budget {human(self.budget, 'B')}{f' (at {dims})' if dims else ''}: workspace "
                f"{human(self.before, 'B')}")
        if self.before <= self.budget:
            return head + " fits; nothing recomputed"
        head += f" -> {human(self.after, 'B')}"
        what = []
        if self.reversed_updates:
            what.append("updates computed last-written first")
        if self.chosen:
            what.append(f"recomputing {len(self.chosen)} of {self.candidates} saved values in the backward pass")
        head += ": " + ("; ".join(what) if what else f"nothing to gain ({self.candidates} saved values to recompute)")
        return head if self.met else head + f"; the budget is NOT met (best reached: {human(self.after, 'B')})"

    def lines(self) -> list[str]:
        from tgc.explain import human

        return [f"  recompute {c.what}: {human(c.bytes, 'B')}, ~{human(c.flops, 'FLOP')}" for c in self.chosen]


def lower_within_budget(module: Module, options: Options, emit=None, backend: str = "cpu"):
    """`run_pipeline(module, options)` with checkpoints chosen for `options.memory_budget`,
    each trial's workspace measured as `backend` lowers it: its PipelineResult, with
    `memory` set to the `MemoryPlan`."""
    from tgc.manager import run_pipeline
    from tgc.registry import pipeline

    names = pipeline(options)
    plain = options.with_(memory_budget=None)
    if "adjoint" not in names or not any(v.op in ("grad", "vjp") for v in module.values()):
        return _Trials(module, [], plain, options, emit, backend).plan(options.memory_budget)
    cut = names.index("adjoint")
    head = run_pipeline(module, plain.with_(passes=names[:cut]), emit)
    rest = plain.with_(passes=names[cut:])
    trials = _Trials(head.module, [], rest, options, emit, backend)
    before = trials.workspace(())
    if before > options.memory_budget and len(head.module.updates) > 1:
        reordered = _Trials(_updates_reversed(head.module), [], rest, options, emit, backend, reversed_updates=True)
        if reordered.workspace(()) < trials.workspace(()):
            trials = reordered
    trials.candidates = _candidates(trials.primal, options, trials.env)
    result = trials.plan(options.memory_budget, before)
    result.stats = head.stats + result.stats
    result.initial = head.initial
    return result


class _Trials:
    """The pipeline's rest run on `primal` with a set of candidates (indices into
    `candidates`) checkpointed, and the workspace of each such program, each set
    compiled once."""

    def __init__(self, primal: Module, candidates: list, rest: Options, options: Options, emit, backend: str,
                 reversed_updates: bool = False):
        self.primal, self.candidates, self.rest, self.options, self.emit = primal, candidates, rest, options, emit
        self.backend = backend
        self.reversed_updates = reversed_updates
        self.env = _sizes(primal, options)
        self.tried: dict[tuple[int, ...], tuple] = {}

    def __call__(self, chosen: tuple[int, ...]):
        from tgc.manager import run_pipeline

        if chosen not in self.tried:
            m = self.chosen_module(chosen)
            result = run_pipeline(m, self.rest, self.emit if not chosen else None)
            self.tried[chosen] = (result, _workspace(result.module, self.options, self.backend, self.env))
        return self.tried[chosen]

    def chosen_module(self, chosen: tuple[int, ...]) -> Module:
        return _with_checkpoints(self.primal, [self.candidates[i][0] for i in chosen]) if chosen else self.primal

    def workspace(self, chosen: tuple[int, ...]) -> int:
        return self(chosen)[1]

    def plan(self, budget: int, before: int | None = None):
        """Candidates in rank order, each kept if it lowers the measured workspace, until
        the workspace fits (module docstring, step 3); the result of the chosen set."""
        best = self.workspace(())
        before = best if before is None else before
        chosen: tuple[int, ...] = ()
        for _ in range(PASSES):   # a choice changes what the others save: look again at the rest
            progress = False
            for i in range(len(self.candidates)):
                if best <= budget:
                    break
                if i in chosen:
                    continue
                w = self.workspace(tuple(sorted(chosen + (i,))))
                if w < best:
                    chosen, best, progress = tuple(sorted(chosen + (i,))), w, True
            if best <= budget or not progress:
                break
        result, after = self(chosen)
        dims = {d: self.env[d] for d in self.primal.symbolic_dims()}
        result.memory = MemoryPlan(budget, dims, before, after, after <= budget, len(self.candidates),
                                   [self.candidates[i][1] for i in chosen], trials=len(self.tried),
                                   reversed_updates=self.reversed_updates,
                                   primal=self.chosen_module(chosen))
        return result


def _updates_reversed(m: Module) -> Module:
    """`m` with its updates listed last first: the kernels of the step follow the roots'
    order, so the last-written update's gradient (usually the last layer's) comes first,
    as a backward pass goes. Every update reads the values before the step, so the order
    changes no value."""
    return Module(dict(m.dims), dict(m.edges), dict(m.args), list(m.outputs), list(reversed(m.updates)),
                  list(m.facts))


def _sizes(module: Module, options: Options) -> dict[str, int]:
    given = dict(options.dims)
    return module.bind_dims({d: given.get(d, options.rep_size) for d in module.symbolic_dims()})


def _workspace(module: Module, options: Options, backend: str, env=None) -> int:
    """The workspace bytes of `module` lowered and planned as `backend` lowers it (its
    own stages: the CPU's loop groups' partial buffers, CUDA's row groups), as
    tgc.explain sums its slots."""
    from tgc.backends.base import get_backend, pass_registry
    from tgc.explain import explain
    from tgc.manager import lower_module

    be = get_backend(backend)
    # as the budgeted program lowers: without the CPU group's in-place outputs
    # (tgc.backends.cpu.group: the greedy choice of recomputes is measured without them)
    plain = options.with_(memory_budget=None, cpu=options.cpu.with_(group_in_place=False))
    low = lower_module(module, be.lowering_options(plain), stages=be.lowering(),
                       known=pass_registry())
    return explain(low, env if env is not None else _sizes(module, options))["workspace"]["bytes"]


def _candidates(module: Module, options: Options, env: dict[str, int]) -> list[tuple[Value, Choice]]:
    """The saved values (module docstring, step 1), ranked greedily (step 2)."""
    from tgc.autodiff.driver import Adjoint
    from tgc.autodiff.remat import add_region

    derivs = [v for v in module.values() if v.op in ("grad", "vjp")]
    if not derivs:
        return []
    primal = topo_order([d.operands[0] for d in derivs])
    in_primal = {id(v) for v in primal}
    users: dict[int, list[int]] = defaultdict(list)
    for v in primal:
        for o in v.operands:
            users[id(o)].append(id(v))
    inside = set()   # what a user's checkpoint already recomputes
    for v in primal:
        if v.op == "map" and v.attrs[0] in ("checkpoint", "recompute"):
            add_region(v.operands[0], users, set(), inside)
    differentiated = Adjoint().run(module, options.with_(memory_budget=None))
    read = {id(o) for v in differentiated.values() if id(v) not in in_primal for o in v.operands}
    read -= inside

    def size(v: Value) -> int:
        n = 1
        for e in v.edges:
            n *= env[module.edges[e]]
        return n

    def flops(v: Value) -> int:
        if v.op == "contract":   # every point of the operands' edges, a multiply-add per factor
            points = 1
            for e in {e for o in v.operands for e in o.edges} | set(v.edges):
                points *= env[module.edges[e]]
            return points * max(1, len(v.operands))
        return max([size(v)] + [size(o) for o in v.operands]) * max(1, len(v.operands) - 1)

    nbytes = {id(v): size(v) * ITEMSIZE.get(v.dtype, 4) for v in primal}
    cost = {id(v): 0 if v.op in NOT_CANDIDATES else flops(v) for v in primal}
    eligible = [v for v in primal if id(v) in read and v.op not in NOT_CANDIDATES and v.dtype in ITEMSIZE
                and v.dtype != "i32" and v.edges and not (v.op == "map" and v.attrs[0] in ("checkpoint", "recompute"))]
    regions = {}
    for v in eligible:
        r: set[int] = set()
        add_region(v, users, read, r)
        regions[id(v)] = r
    covered: set[int] = set()
    order: list[tuple[Value, Choice]] = []
    left = list(enumerate(eligible))
    while left:
        def score(item):
            i, v = item
            gain = sum(nbytes[r] for r in regions[id(v)] if r in read and r not in covered)
            return gain, sum(cost[r] for r in regions[id(v)]), i
        scored = [(score(it), it) for it in left]
        (gain, work, _), (i, v) = max(scored, key=lambda t: (t[0][0] / max(t[0][1], 1), t[0][0], -t[0][2]))
        if gain <= 0:
            break
        order.append((v, Choice(_describe(v), gain, work, tuple(v.edges))))
        covered |= regions[id(v)]
        left = [it for it in left if it[1] is not v]
    return _loop_candidates(primal, lambda e: env[module.edges[e]], size, flops) + order


def _loop_candidates(primal: list[Value], extent, size, flops) -> list[tuple[Value, Choice]]:
    """One candidate per differentiated loop whose reverse loop keeps values of its steps:
    keep only the incoming carries and recompute each step (`tgc.autodiff.loops.checkpointed`).
    It frees the kept values' bytes over all steps and costs the step's FLOPs per step."""
    from tgc.autodiff.loops import step_plan
    from tgc.autodiff.reverse import reverse_many

    out, seen = [], set()
    for v in primal:
        if v.op != "loop" or _loop_key(v) in seen:
            continue
        seen.add(_loop_key(v))
        body, edge, _, _ = v.attrs
        plan = step_plan(v, reverse_many)
        if not plan.kept:
            continue
        steps = extent(edge)
        freed = steps * sum(size(w) * ITEMSIZE.get(w.dtype, 4) for w in plan.kept)
        work = steps * sum(flops(w) for w in topo_order(list(body.results)) if w.op not in NOT_CANDIDATES + ("loopvar",))
        where = f" at {v.loc}" if v.loc is not None else ""
        out.append((v, Choice(f"the steps of the loop over '{edge}'{where} (keep only the carries)", freed, work,
                              (edge,))))
    return out


def _loop_key(v: Value) -> tuple:
    body, edge, reverse, _ = v.attrs
    return (body, edge, reverse) + tuple(map(id, v.operands))


def _describe(v: Value) -> str:
    op = v.attrs[0] if v.op in ("map", "reduce") else v.op
    where = f" at {v.loc}" if v.loc is not None else ""
    return f"{op} {v.dtype}[{', '.join(v.edges)}]{where}"


def _with_checkpoints(module: Module, chosen: list[Value]) -> Module:
    """`module` with every reader of a chosen value reading `checkpoint(value)` instead; a
    chosen loop's steps with their results checkpointed (the reverse loop keeps only the
    carries and recomputes each step)."""
    from tgc.autodiff.loops import checkpointed

    ids = {id(v) for v in chosen if v.op != "loop"}
    loops = {_loop_key(v) for v in chosen if v.op == "loop"}

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        if v.op == "loop" and _loop_key(v) in loops:   # every output of a chosen loop: its steps recomputed
            body, edge, reverse, out = v.attrs
            return V.loop(checkpointed(body), edge, ops, out, reverse, loc=v.loc)
        new = V.rebuild_same(v, ops) if any(a is not b for a, b in zip(ops, v.operands)) else v
        return V.map_("checkpoint", new, loc=v.loc) if id(v) in ids else new

    memo = V.rebuild(module.roots(), fn)
    return module.replace_values({k: v for k, v in memo.items()})
