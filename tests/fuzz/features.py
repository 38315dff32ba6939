"""Random programs of the features `gen.generate` never makes: `featured(seed, feature)`.

Each feature takes the program of `seed` (`gen.Gen(seed).program()`, unchanged, so every
seed of the plain generator keeps its program) and adds to it, drawing from a stream of
its own (`random.Random(seed * 7919 + 101 + k)`), with the generator's own productions
(`Gen.expr`, `Gen.focused`, ...) for the new expressions:

- `import`: the functions (and in half the programs the dims) go to `lib.tg` (which in
  half of those imports `dims.tg` in turn); the program imports it. Oracle: torch on
  the program as written (the front end joins the files).
- `dtypes`: declarations of `f32`, `bf16` and `f16` type in place of the float type,
  and conversions `f32(..) bf16(..) f16(..) f64(..)` around subexpressions, so mixed
  operands promote (docs/dtypes.md). Oracle: torch, each conversion the value rounded
  to its type (`torch_oracle`'s `to_*`); the bound is the narrowest type's (`tol`).
- `complex`: complex values built from real ones (`a + 1j * b`, `c128(a) * (0.5 + 1j)`,
  `c64(a)`), `* / + - conj exp sin cos sqrt log ^`, sums and products over an edge,
  and real results (`real imag abs angle`) and their gradients. Oracle: torch on the
  elaborated (real) module: independent of the optimizer and the backends, not of the
  front end's complex forms (tests/e2e/test_complex*.py check those against numpy).
- `assume`: inputs with facts (`assume x > 0`, `assume 0 <= y`, `assume x >= 0.5`,
  `assume sum[e](y) = 1`), which `random_inputs` meets and every backend checks
  (`check_assumptions`), read by forms the optimizer rewrites with them (`sqrt(x) *
  sqrt(x)`, `log(exp(x))`, `abs(x)`, `relu(x)`, `cross_entropy[e](z, y)` and its HVP).
  Oracle: torch, which ignores the facts.
- `fwd`: functions with exact `with vjp(g) = ..` and `with jvp(dx) = ..` rules, under
  forward mode and nested modes (`jvp`, `jvp(grad)`, `grad(jvp)`, `jvp(jvp)`, `vjp`).
  Oracle: torch on the program without those rules (the bodies differentiated by
  autograd: the rules are exact, so the values agree).
- `budget`: the program as it is, compiled under `Options.memory_budget` (a few bytes
  to a few KiB: the planner checkpoints what it can) with `checkpoint(..)` around some
  bindings. Oracle: torch.

`Featured.check(backends)` runs one through `harness.check`.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from fuzz.gen import Gen
from fuzz.nodes import Fn, Node, Program, Stmt, bin_, call, name, num, raw

FEATURES = ("import", "dtypes", "complex", "assume", "fwd", "budget")


@dataclass
class Featured:
    feature: str
    seed: int
    text: str
    bind: dict
    files: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    oracle_text: str | None = None
    tol: float = 0.0
    oracle_kind: str = "torch"

    def check(self, backends):
        from fuzz import harness

        return harness.check(self.text, self.bind, backends, self.seed, files=self.files or None,
                             options=self.options or None, oracle_text=self.oracle_text, tol=self.tol,
                             oracle_kind=self.oracle_kind)

    def source(self) -> str:
        """Every file, for a report: the program last."""
        parts = [f"# ---- {nm}\n{body}" for nm, body in self.files.items()]
        extra = f"# options: {self.options}\n" if self.options else ""
        return "".join(parts) + extra + self.text


def featured(seed: int, feature: str) -> Featured:
    """The program of `seed` with `feature` added (deterministic)."""
    g = Gen(seed)
    prog = g.program()
    g.r = random.Random(seed * 7919 + 101 + FEATURES.index(feature))
    return _MAKERS[feature](g, prog)


# ---- helpers ------------------------------------------------------------------------------

def _customs(g: Gen) -> set:
    return {f.name for f in g.fns if f.rule}


def _plain(g: Gen, node: Node) -> Node:
    """`node` with no call of a function with its own rule and no binding (names of bindings
    become declared tensors of their edges): safe under forward mode and the oracle's jvp."""
    customs = _customs(g)
    binds = {s.name for s in g.stmts if s.kind == "bind"}

    def walk(n: Node) -> Node:
        if n.op == "call" and n.attrs[0] in customs:
            return walk(n.kids[0])
        if n.op == "name" and n.attrs[0] in binds:
            return name(g.arg_with(n.edges, ("input", "param")), n.edges, 2.0)
        if n.op == "call" and n.attrs[0] in ("repeat", "scan"):
            return name(g.arg_with(n.edges, ("input", "param")), n.edges, 2.0)
        return n.with_kids([walk(k) for k in n.kids]) if n.kids else n

    return walk(node)


def _small_edges(g: Gen, k=None) -> frozenset:
    E = g.edge_set(k)
    while g.elems(E) > 48 and E:
        E = frozenset(sorted(E)[1:])
    return E


def _out(g: Gen, nm: str, node: Node) -> None:
    g.stmts.append(Stmt("out", nm, node))


# ---- import -------------------------------------------------------------------------------

def _import(g: Gen, prog: Program) -> Featured:
    r = g.r
    files = {}
    move_dims = r.random() < 0.5 and prog.dims
    lib_dims = list(prog.dims) if move_dims else []
    main_dims = [] if move_dims else list(prog.dims)
    lib = Program(lib_dims, {}, [], list(prog.fns), [], {})
    lib_text = lib.render()
    if move_dims and r.random() < 0.5:   # two levels: the dims in a file of their own
        files["dims.tg"] = Program(lib_dims, {}, [], [], [], {}).render()
        lib_text = 'import "dims.tg"\n' + Program([], {}, [], list(prog.fns), [], {}).render()
    files["lib.tg"] = lib_text
    main = Program(main_dims, prog.aliases, prog.decls, [], prog.stmts, prog.bind, prog.seed)
    text = main.render()
    lines = text.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    text = "".join(lines[:at]) + 'import "lib.tg"\n' + "".join(lines[at:])
    return Featured("import", g.seed, text, dict(prog.bind), files=files)


# ---- dtypes -------------------------------------------------------------------------------

_NO_WRAP = ("fold", "rand", "randn", "grad", "jvp", "vjp", "repeat", "scan", "size")


def _dtypes(g: Gen, prog: Program) -> Featured:
    r = g.r
    types = r.choice([("f32",), ("bf16",), ("f16",), ("f32", "bf16"), ("f32", "f16", "bf16")])
    for d in prog.decls:
        if d.dtype is None and d.name != "lr" and r.random() < 0.4:
            d.dtype = r.choice(types)
    convs = types + ("f64",)

    def wrap(n: Node, depth: int) -> Node:
        kids = n.kids
        if n.op == "call" and n.attrs[0] in _NO_WRAP:
            # a derivative's variable stays a name; its function and seeds may be converted
            kids = [wrap(k, depth + 1) if i != 1 or n.attrs[0] not in ("grad", "jvp", "vjp") else k
                    for i, k in enumerate(kids)] if n.attrs[0] in ("grad", "jvp", "vjp") else kids
            return n.with_kids(kids)
        n = n.with_kids([wrap(k, depth + 1) for k in kids]) if kids else n
        if n.op in ("bin", "call", "neg", "eops") and r.random() < 0.2:
            return call(r.choice(convs), [n], edges=n.edges, scale=n.scale, sparse=n.sparse)
        return n

    for s in prog.stmts:
        if s.expr is not None:
            s.expr = wrap(s.expr, 0)
    narrow = [t for t in ("bf16", "f16") if any(d.dtype == t for d in prog.decls) or f"{t}(" in prog.render()]
    tol = 0.01 if narrow else 1e-3
    return Featured("dtypes", g.seed, prog.render(), dict(prog.bind), tol=tol,
                    oracle_kind="interp0" if narrow else "torch")


# ---- complex ------------------------------------------------------------------------------

def _complex(g: Gen, prog: Program) -> Featured:
    r = g.r
    for k in range(r.randint(1, 3)):
        E = _small_edges(g)
        x = g.arg_with(E, ("input", "param"))
        a = call("tanh", [_plain(g, g.focused(x, E, 1))], edges=E)
        b = call(r.choice(["tanh", "sin", "erf"]), [_plain(g, g.expr(E, 1))], edges=E)
        w = r.choice(["c128", "c64"])
        z = r.choice([
            raw(f"({a.render()} + 1j * {b.render()})", E),
            raw(f"({w}({a.render()}) * (0.5 + 1j) + {b.render()})", E),
            raw(f"({w}({a.render()}) - 0.25j * {w}({b.render()}))", E),
        ])
        zs = z.render()
        for _ in range(r.randint(1, 3)):
            op = r.randrange(11)
            if op == 0:
                zs = f"conj({zs})"
            elif op == 1:
                zs = f"({zs} * {zs})"
            elif op == 2:
                zs = f"exp(0.5 * {zs})"
            elif op == 3:
                zs = f"({zs} / ({zs} * conj({zs}) + 1))"
            elif op == 4:
                zs = f"sin({zs})" if r.random() < 0.5 else f"cos({zs})"
            elif op == 5:
                zs = f"sqrt({zs} + 2)"
            elif op == 6:
                zs = f"log({zs} + 3)"
            elif op == 7:
                n = r.choice([2, 3, -1])
                zs = f"(({zs}) + 3) ^ -1" if n < 0 else f"({zs}) ^ {n}"
            elif op == 8:
                zs = f"({zs} + {r.choice(['1j', '2', '0.5 - 0.5j'])} * {b.render()})"
            elif op == 9 and E:
                e = r.choice(sorted(E))
                zs = f"(({zs}) - mean[{e}]({zs}))"
            else:
                zs = f"({zs} * {r.choice(['c64', 'c128'])}({call('cos', [_plain(g, g.expr(E, 0))], edges=E).render()}))"
        real = r.choice([f"real({zs})", f"imag({zs})", f"abs({zs} + 3)", f"angle(0.1 * {zs} + 1)",
                         f"real({zs} * conj({zs}))"])
        nm = f"zc{k}"
        g.stmts.append(Stmt("bind", nm, raw(real, E)))
        g.stmts.append(Stmt("out", nm))
        if r.random() < 0.6 and g.args[x][1] in ("param", "input"):
            _out(g, f"gz{k}", raw(f"grad(sum({nm} * {nm}), {x})", g.args[x][0]))
        if E and r.random() < 0.3:
            e = r.choice(sorted(E))
            _out(g, f"sz{k}", raw(f"abs(sum[{e}]({zs}) + 3)", E - {e}))
    text = prog.render()
    # c64 parts are f32 values (rounded where the oracle computes in float64): f32's bound
    return Featured("complex", g.seed, text, dict(prog.bind), tol=1e-3 if "c64(" in text else 0.0)


# ---- assume -------------------------------------------------------------------------------

def _assume(g: Gen, prog: Program) -> Featured:
    r = g.r
    facts = []
    for k in range(r.randint(1, 3)):
        E = _small_edges(g)
        xp = g.declare(r.choice(["input", "param"]), E, prefix="xp")
        lo = r.choice(["0", "0", "0.5", "1"])
        rel = r.choice([">", ">="]) if lo == "0" else ">="
        facts.append(r.choice([f"assume {xp} {rel} {lo}", f"assume {lo} {'<' if rel == '>' else '<='} {xp}"]))
        form = r.choice([f"sqrt({xp}) * sqrt({xp})", f"log(exp({xp}))", f"sqrt({xp} * {xp})", f"abs({xp})",
                         f"relu({xp})", f"max({xp}, 0)", f"{xp} / {xp}", f"sqrt({xp}) ^ 2", f"exp(log({xp}))",
                         f"min({xp}, 0)", f"sign({xp})", f"log({xp} + 1)", f"abs({xp}) - {xp}",
                         f"{xp} ^ 0.5 * {xp} ^ 0.5"])
        if lo != "0":
            form = r.choice([form, f"log({xp})", f"max({xp}, 0.25)", f"abs({xp} - 0.25)", f"1 / {xp}"])
        F = _small_edges(g, r.choice([0, 1, 2]))
        if not g.fits(E | F):
            F = frozenset()
        other = _plain(g, g.expr(F, 1))
        node = raw(f"({form}) * {call('tanh', [other], edges=F).render()}", E | F)
        nm = f"ha{k}"
        g.stmts.append(Stmt("bind", nm, node))
        g.stmts.append(Stmt("out", nm))
        if r.random() < 0.5:
            _out(g, f"ga{k}", raw(f"grad(sum({nm}), {xp})", E))
    if r.random() < 0.6:   # a distribution over an edge
        E = _small_edges(g, r.choice([1, 2]))
        if E:
            e = r.choice(sorted(E))
            y = g.declare("input", E, prefix="yd")
            facts += [f"assume sum[{e}]({y}) = 1", f"assume {y} >= 0"]
            W = g.arg_with(E, ("param",))
            z = _plain(g, g.focused(W, E, 1))
            _out(g, "ce", raw(f"sum(cross_entropy[{e}]({z.render()}, {y}))", ()))
            _out(g, "gce", raw(f"grad(sum(cross_entropy[{e}]({z.render()}, {y})), {W})", E))
            V = g.arg_with(E, ("input",))
            _out(g, "hce", raw(f"jvp(grad(sum(cross_entropy[{e}]({z.render()}, {y})), {W}), {W}, {V})", E))
            _out(g, "sy", raw(f"sum[{e}]({y}) * {name(W).render()}", E))
    text = prog.render()
    lines = text.splitlines(keepends=True)
    # the facts after the declarations
    at = max(i for i, line in enumerate(lines) if re.match(r"(input|param|state|dim) ", line)) + 1
    text = "".join(lines[:at]) + "".join(f + "\n" for f in facts) + "".join(lines[at:])
    return Featured("assume", g.seed, text, dict(prog.bind), options={"check_assumptions": True})


# ---- forward mode with rules -------------------------------------------------------------

_RULES = [  # (params, body, vjp rule, jvp rule): exact derivatives
    (("a0",), "a0 * a0 * a0", "g * 3 * a0 * a0", "3 * a0 * a0 * d0"),
    (("a0",), "tanh(a0) + 0.5 * a0", "g * (1.5 - tanh(a0) ^ 2)", "(1.5 - tanh(a0) ^ 2) * d0"),
    (("a0",), "a0 * sin(a0)", "g * (sin(a0) + a0 * cos(a0))", "(sin(a0) + a0 * cos(a0)) * d0"),
    (("a0",), "softplus(a0)", "g * sigmoid(a0)", "sigmoid(a0) * d0"),
    (("a0", "a1"), "a0 * a1 + a0", "(g * (a1 + 1), g * a0)", "(a1 + 1) * d0 + a0 * d1"),
]


def _fwd(g: Gen, prog: Program) -> Featured:
    r = g.r
    mine = []
    for k, i in enumerate(r.sample(range(len(_RULES)), r.randint(1, 3))):
        ps, body, vjp, jvp = _RULES[i]
        fname = f"fj{k}"
        ds = ", ".join(f"d{j}" for j in range(len(ps)))
        block = r.random() < 0.3
        if block:   # the block form: the clauses see the body's binding
            f = Fn(fname, (), [(p, None) for p in ps], [("t0", raw(body))], raw("t0"), True,
                   f"with vjp(g) = {vjp} with jvp({ds}) = {jvp}")
        else:
            f = Fn(fname, (), [(p, None) for p in ps], [], raw(body), False,
                   f"with vjp(g) = {vjp} with jvp({ds}) = {jvp}")
        prog.fns.append(f)
        mine.append((fname, len(ps)))
    for k in range(r.randint(1, 3)):
        X = _small_edges(g, r.choice([0, 1, 1, 2]))
        x = g.arg_with(X, ("input", "param"))
        F = _small_edges(g, r.choice([0, 1]))
        if not g.fits(X | F):
            F = frozenset()
        E = X | F
        inner = call("tanh", [_plain(g, g.focused(x, E, 1))], edges=E)
        fname, n = r.choice(mine)
        args = [inner] + [call("cos", [_plain(g, g.focused(x, E, 0))], edges=E) for _ in range(n - 1)]
        f = call(fname, args, edges=E)
        unary = [m for m, n1 in mine if n1 == 1]
        if unary and r.random() < 0.5:   # one rule's result through another
            f = call(r.choice(unary), [bin_("*", num(0.5), f)], edges=E)
        fs = f.render()
        dx = _plain(g, g.expr(X, 0)).render()
        dx2 = _plain(g, g.expr(X, 0)).render()
        form = r.randrange(5)
        if form == 0:
            node = raw(f"jvp({fs}, {x}, {dx})", E)
        elif form == 1:
            node = raw(f"jvp(grad(sum({fs}), {x}), {x}, {dx})", X)
        elif form == 2:
            node = raw(f"grad(sum(jvp({fs}, {x}, {dx}) * {fs}), {x})", X)
        elif form == 3:
            node = raw(f"jvp(jvp({fs}, {x}, {dx}), {x}, {dx2})", E)
        else:
            node = raw(f"vjp({fs}, {x}, {_plain(g, g.expr(E, 0)).render()})", X)
        _out(g, f"fw{k}", node)
    text = prog.render()
    ruled = {nm for nm, _ in mine}
    oracle = Program(prog.dims, prog.aliases, prog.decls,
                     [Fn(f.name, f.edge_params, f.params, f.binds, f.ret, f.block, "") if f.name in ruled else f
                      for f in prog.fns], prog.stmts, prog.bind, prog.seed).render()
    return Featured("fwd", g.seed, text, dict(prog.bind), oracle_text=oracle)


# ---- memory budgets -----------------------------------------------------------------------

def _budget(g: Gen, prog: Program) -> Featured:
    r = g.r
    for s in prog.stmts:
        if s.kind == "bind" and r.random() < 0.3:
            s.expr = call("checkpoint", [s.expr], edges=s.expr.edges, scale=s.expr.scale, sparse=s.expr.sparse)
    budget = r.choice([1, 64, 512, 2048, 8192, 65536])
    return Featured("budget", g.seed, prog.render(), dict(prog.bind), options={"memory_budget": budget})


_MAKERS = {"import": _import, "dtypes": _dtypes, "complex": _complex, "assume": _assume, "fwd": _fwd,
           "budget": _budget}
