"""Random well-typed .tg programs from a seed: `generate(seed) -> nodes.Program`.

The generator is type-directed: `Gen.expr(E, depth)` builds an expression whose edge
set is exactly `E`, choosing a production (elementwise op, contraction, reduction,
rename, reindex, gather, indicator, prelude or user function, derivative) and asking
for the operands' edge sets that make the result `E`. When no declared tensor has the
edges a leaf needs, it declares a new input or param with them. So every program
elaborates; `tests/e2e/test_fuzz.py` checks that it does, for many seeds.

Covered (LANGUAGE.md sections 3-9): symbolic, literal and derived dims (`c / head`,
`n - k + 1`, `p + q`), edge aliases `i: n`, input/param/state/scalar/i32 declarations,
`+ - * / ^`, unary minus, the six comparisons, every elementwise primitive, `stop`,
`size(e)`, `@`, `sum/mean/max/min` with and without edges, renames and swaps,
reindexing (slices, shifts, windows, strides with padding, flips, splits,
concatenation), gathers with i32 ids, indicators (`[s <= t]`, `[i = j]`,
`[t = s + k]`, merges), every prelude function, user functions (one-line and block
forms, edge parameters, defaults, keyword arguments), `grad` of scalars and
Jacobians, `jvp`, `vjp` (batched too), nested derivatives, `out` with and without an
explicit ABI order, and `update`; in about a quarter of the programs (chosen by a
stream of their own, so the others are generated as before) `repeat[l](step, init,
xs)` and `scan[l](...)` over a dim `l` (literal or symbolic), with a step function of the carry and
one stacked argument.

The extensions (about half the programs, chosen and drawn by a stream of their own,
`Gen.xr`, so the others are generated exactly as before): steps with two or three
stacked arguments and a loop inside the step (`repeat[m]` or `mean[m](scan[m](...))`
over an inner step), or a gather by an i32 stacked argument; integer indicators of section 11 (scatter-adds `msg @ [v = dst]`
and `sum[e](msg * [v = dst])`, segment means, segment max/min, segment softmax, plain
products with `[v = dst]`); big sizes (a third of them: edges up to about 20, values
up to 400 elements); `checkpoint`; copy tensors `[c = a = b]`; indicators with
offsets (`[s < t + 1]`); functions with their own `with vjp(g)` rule; a dim `p * q`
split and merged; binding names with a prime (`h2'`); random draws (`rand`, `randn`,
`fold`, `dropout`: in half of these programs, by a stream of their own); and `for t in LIST { ... }`
blocks of section 12 (per-param `state mo.t`, `sum[t in LIST](...)`, `[t in ...]`).

Never made here: several tensors in one declaration and statements over several lines.
`import`, element types (f32, bf16, f16 declarations, conversions, complex values),
`assume`, `with jvp(...)` rules and `--memory-budget` are added to these programs by
`fuzz.features` (each with the oracle it needs), leaving `generate(seed)` as it is.

Values stay in smooth, well-defined domains at standard normal inputs, so the
float64 answer is well defined and differentiable: `log` and `sqrt` see a positive
form (`u * u + c`, `exp(u)`, ...), divisors are bounded away from zero, a real power
has a positive base, `exp` and `sin` see bounded arguments (a rough magnitude bound,
`Node.scale`, is tracked), and kinked functions (`abs`, `relu`, two-argument
`max`/`min`) get an offset where their operand may hold exact zeros (`Node.sparse`:
padding, masks, steps), so no derivative is taken at a kink. Sizes are 1..6; about one
dim in seven has size 1 (`ONE`), the head split and the window may too.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import random

from fuzz.nodes import Decl, Fn, Node, Program, Stmt, bin_, call, eops, name, neg, num, raw

MAX_ELEMS = 48          # a generated value has at most this many elements
MAX_EDGES = 3
ONE = 0.15              # the chance that a dim has size 1
BOUND = 4.0             # beyond this estimated magnitude, squash before exp/sin/pow


class Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.seed = seed
        self.dims: list[tuple[str, str | None]] = []
        self.dim_size: dict[str, int] = {}
        self.dim_key: dict[str, object] = {}
        self.edge_dim: dict[str, str] = {}
        self.aliases: dict[str, str] = {}
        self.bind: dict[str, int] = {}
        self.decls: list[Decl] = []
        self.args: dict[str, tuple] = {}         # float arg -> (edges, kind)
        self.ids: dict[frozenset, str] = {}
        self.pool: list[tuple[str, frozenset, float, bool, frozenset]] = []  # name, edges, scale, sparse, deps
        self.fns: list[Fn] = []
        self.fn_meta: dict[str, tuple] = {}      # name -> (has edge param, keeps edge, n required, default name)
        self.stmts: list[Stmt] = []
        self.counter = itertools.count()
        self.focus: list[str] = []
        self.n_deriv = 0
        self.deriv_nest = 0
        self.ties = self.r.random() < 0.15       # kinks and ties left in, at their conventions
        self.split = None                        # (c, head, hd) dims
        self.loops = random.Random(seed * 7919 + 17).random() < 0.25   # repeat/scan in this program
        self.step: str | None = None             # the step function of repeat/scan
        self.concat = None                       # (w, p, q) dims
        # the extensions (LANGUAGE.md sections 11-12, and forms of 2-9 the rest never makes):
        # about half the programs, chosen and drawn by a stream of their own, so the other
        # programs are generated exactly as before
        self.xr = random.Random(seed * 7919 + 41)
        self.ext = self.xr.random() < 0.5
        if self.ext and not self.loops:
            self.loops = self.xr.random() < 0.3
        # big sizes (edges of up to ~20: vector remainders, tiles, blocked products) in about
        # a third of the extended programs, by a stream of their own
        self.br = random.Random(seed * 7919 + 67)
        self.big = self.ext and self.br.random() < 0.3
        self.max_elems = 400 if self.big else MAX_ELEMS
        self.inner: str | None = None            # the inner step of a nested loop (dim `m`)
        self.nstacked = 1                        # stacked arguments of the step
        self.loop_ids = False                    # the step gathers by an i32 stacked argument
        self.prod_dims = None                    # (p, q) of the dim `pq = p * q`
        # random draws (section 11) in about half the extended programs, by a stream of their own
        self.draws = self.ext and random.Random(seed * 7919 + 53).random() < 0.5
        self.key_arg: str | None = None

    @contextlib.contextmanager
    def extension(self):
        """Draw from the extensions' stream inside the block."""
        r = self.r
        self.r = self.xr
        try:
            yield
        finally:
            self.r = r

    # ---- dims and edges -------------------------------------------------------------

    def setup_dims(self):
        r = self.r
        for d in r.sample(["b", "n"], r.choice([0, 1, 1, 2])):
            n = self.dim_of(2, 4)
            self.dims.append((d, None))
            self.dim_size[d], self.dim_key[d], self.bind[d] = n, d, n
        lits = r.sample(["p", "q", "r"], r.randint(2, 3))
        for d in lits:
            n = self.dim_of(2, 5)
            self.dims.append((d, str(n)))
            self.dim_size[d], self.dim_key[d] = n, n
        if r.random() < 0.35:   # c = head * hd, written hd = c / head
            head, hd = r.choice([(2, 2), (2, 3), (3, 2), (1, 4), (4, 1), (1, 1)])
            self.dims.append(("c", str(head * hd)))
            self.dims.append(("head", str(head)))
            self.dims.append(("hd", "c / head"))
            for d, n in (("c", head * hd), ("head", head), ("hd", hd)):
                self.dim_size[d], self.dim_key[d] = n, n
            self.split = ("c", "head", "hd")
        if r.random() < 0.35:   # o = L - k + 1, the valid positions of a window
            base = r.choice([d for d, _ in self.dims])
            k = self.dim_of(2, max(2, min(3, self.dim_size[base])))
            if base not in self.bind:
                k = min(k, self.dim_size[base])   # a fixed dim of size 1 takes windows of 1
            if base in self.bind and self.bind[base] < k:
                self.bind[base] = self.dim_size[base] = k
            self.dims.append(("k", str(k)))
            self.dim_size["k"], self.dim_key["k"] = k, k
            self.dims.append(("o", f"{base} - k + 1"))
            self.dim_size["o"] = self.dim_size[base] - k + 1
            self.dim_key["o"] = self.dim_size["o"] if base not in self.bind else "o"
        if r.random() < 0.3 and len(lits) >= 2:  # w = p + q, for concatenation
            a, b = lits[0], lits[1]
            self.dims.append(("w", f"{a} + {b}"))
            self.dim_size["w"] = self.dim_size[a] + self.dim_size[b]
            self.dim_key["w"] = self.dim_size["w"]
            self.concat = ("w", a, b)
        for d, _ in self.dims:
            self.edge_dim[d] = d
        names = ["i", "j", "u", "v2", "z"]
        for d in r.sample([d for d, _ in self.dims], min(2, len(self.dims))):
            for _ in range(r.randint(1, 2)):
                if names:
                    e = names.pop(0)
                    self.aliases[e] = d
                    self.edge_dim[e] = d

    def dim_of(self, lo: int, hi: int) -> int:
        """A dim's size: one of lo..hi, or 1 (an edge of size 1: a batch of one, one head,
        a kernel of size 1) with probability ONE."""
        n = 1 if self.r.random() < ONE else self.r.randint(lo, hi)
        if self.big and n > 1:
            n = n * self.br.choice([2, 3, 4]) + self.br.choice([0, 1, 3])
        return n

    def size(self, e: str) -> int:
        return self.dim_size[self.edge_dim[e]]

    def key(self, e: str):
        return self.dim_key[self.edge_dim[e]]

    def elems(self, edges) -> int:
        return math.prod(self.size(e) for e in edges)

    def fits(self, edges) -> bool:
        return len(edges) <= MAX_EDGES + 1 and self.elems(edges) <= self.max_elems

    def edge_set(self, k: int | None = None, avoid=frozenset(), keep=frozenset()) -> frozenset:
        r = self.r
        k = r.choice([0, 1, 1, 2, 2, 3]) if k is None else k
        pool = [e for e in self.edge_dim if e not in avoid and e not in keep]
        r.shuffle(pool)
        out = set(keep)
        for e in pool:
            if len(out) >= k + len(keep):
                break
            if self.fits(out | {e}) and len(out | {e}) <= MAX_EDGES:
                out.add(e)
        return frozenset(out)

    def fresh_edges(self, n: int, avoid) -> list[str]:
        """Up to n edges outside `avoid`, keeping avoid + them small enough."""
        cands = [e for e in self.edge_dim if e not in avoid]
        self.r.shuffle(cands)
        out = []
        for e in cands:
            if len(out) == n:
                break
            if self.fits(set(avoid) | set(out) | {e}):
                out.append(e)
        return out

    # ---- declarations ---------------------------------------------------------------

    def declare(self, kind: str, edges, prefix=None) -> str:
        prefix = prefix or {"input": "x", "param": "W", "state": "m"}[kind]
        nm = f"{prefix}{next(self.counter)}"
        order = sorted(edges)
        self.r.shuffle(order)
        self.decls.append(Decl(kind, nm, tuple(order)))
        self.args[nm] = (frozenset(edges), kind)
        self.pool.append((nm, frozenset(edges), 2.0, False, frozenset([nm])))
        return nm

    def ids_for(self, edges: frozenset) -> str:
        if edges in self.ids and self.r.random() < 0.7:
            return self.ids[edges]
        nm = f"ids{next(self.counter)}"
        order = sorted(edges)
        self.r.shuffle(order)
        self.decls.append(Decl("input", nm, tuple(order), "i32"))
        self.ids[edges] = nm
        return nm

    def arg_with(self, edges: frozenset, kinds=("input", "param", "state")) -> str:
        have = [n for n, (e, k) in self.args.items() if e == edges and k in kinds]
        if have and self.r.random() < 0.75:
            return self.r.choice(have)
        return self.declare(self.r.choice([k for k in kinds if k != "state"] or ["state"]), edges)

    # ---- safe forms -----------------------------------------------------------------

    def bounded(self, u: Node) -> Node:
        if u.scale <= BOUND:
            return u
        f = self.r.choice(["tanh", "erf", "sin", "tanh"])
        return call(f, [u], edges=u.edges, scale=1.0, sparse=u.sparse)

    def unkink(self, u: Node) -> Node:
        """u shifted off exact zeros where it may hold them (a kink's tie); not in a ties program."""
        if not u.sparse or self.ties:
            return u
        return bin_("+", u, num(self.r.choice([0.25, 0.375, 0.625])), sparse=False)

    def positive(self, u: Node) -> Node:
        """A positive form of u, at least about 0.1, smooth in u."""
        r = self.r
        c = r.choice([0.5, 1, 2])
        k = r.randrange(6)
        b = self.bounded(u)
        if k == 0:
            return bin_("+", bin_("*", u, u), num(c), sparse=False, scale=u.scale ** 2 + c)
        if k == 1:
            return call("exp", [b], edges=u.edges, scale=math.exp(b.scale), sparse=False)
        if k == 2:
            return bin_("+", call("softplus", [u], edges=u.edges, scale=u.scale + 1), num(0.125), sparse=False)
        if k == 3:
            return call("sqrt", [bin_("+", bin_("*", u, u), num(c))], edges=u.edges, scale=u.scale + 2)
        if k == 4:
            return bin_("+", call("cos", [b], edges=u.edges), num(2), sparse=False, scale=3)
        return bin_("+", call("abs", [self.unkink(u)], edges=u.edges, scale=u.scale), num(c), sparse=False,
                    scale=u.scale + c)

    # ---- leaves ---------------------------------------------------------------------

    def leaf(self, E: frozenset) -> Node:
        r = self.r
        if self.focus:
            x = self.focus[-1]
            xe = self.args[x][0]
            dep = [p for p in self.pool if p[1] == E and x in p[4]]
            if dep and r.random() < 0.6:
                p = r.choice(dep)
                return name(p[0], p[1], p[2], p[3])
            if xe <= E and r.random() < 0.7:
                xn = name(x, xe, 2.0)
                if xe == E:
                    return xn
                other = self.leaf_plain(E)
                return bin_(r.choice("+*"), xn, other, edges=E)
        return self.leaf_plain(E)

    def leaf_plain(self, E: frozenset) -> Node:
        r = self.r
        if not E and r.random() < 0.35:
            if r.random() < 0.25:
                e = r.choice(list(self.edge_dim))
                return raw(f"size({e})", (), scale=self.size(e))
            return num(r.choice([0.5, 2, 3, 0.25, 1.5, 0.125, 0.75]))
        if not E and r.random() < 0.05:
            return num(r.choice([0, 1]))
        have = [p for p in self.pool if p[1] == E]
        if have and (r.random() < 0.65 or len(self.args) > 10):
            p = r.choice(have)
            return name(p[0], p[1], p[2], p[3])
        # a rename of a tensor with the same sizes
        for p in r.sample(self.pool, len(self.pool)):
            mp = self.rename_map(p[1], E)
            if mp is not None and r.random() < 0.5:
                items = [("rename", a, b) for a, b in mp.items()]
                return eops(name(p[0], p[1], p[2], p[3]), items, E, sparse=p[3])
        kind = r.choice(["input", "input", "param"])
        return name(self.declare(kind, E), E, 2.0)

    def rename_map(self, have: frozenset, want: frozenset):
        """A rename (at most two edges, none onto a kept edge) that takes `have` to `want`."""
        if have == want or len(have) != len(want):
            return None
        src, dst = sorted(have - want), sorted(want - have)
        if len(src) > 2:
            return None
        for perm in itertools.permutations(dst):
            if all(self.key(a) == self.key(b) for a, b in zip(src, perm)):
                return dict(zip(src, perm))
        return None

    # ---- expressions ----------------------------------------------------------------

    def expr(self, E, depth: int) -> Node:
        E = frozenset(E)
        if depth <= 0:
            return self.leaf(E)
        prods = [(self.p_unary, 5), (self.p_binary, 6), (self.p_contract, 3), (self.p_reduce, 3),
                 (self.p_rename, 2), (self.p_reindex, 3), (self.p_gather, 1.5), (self.p_indicator, 2),
                 (self.p_prelude, 3), (self.p_user, 1.5 if self.fn_meta else 0), (self.p_deriv, 1.5),
                 (self.p_leaf, 2), (self.p_masked, 1.5), (self.p_dup, 1.5),
                 (self.p_loop, 2 if self.step else 0),   # last: a zero weight draws as before
                 (self.p_scatter, 2 if self.ext else 0), (self.p_misc, 1.5 if self.ext else 0),
                 (self.p_random, 1.5 if self.draws else 0)]
        fns = [f for f, _ in prods]
        weights = [w for _, w in prods]
        for _ in range(8):
            f = self.r.choices(fns, weights)[0]
            node = f(E, depth)
            if node is not None:
                assert node.edges == E, (f.__name__, node.render(), sorted(node.edges), sorted(E))
                return node
        return self.leaf(E)

    def p_leaf(self, E, d):
        return self.leaf(E)

    def p_unary(self, E, d):
        r = self.r
        u = self.expr(E, d - 1)
        k = r.choice(["exp", "log", "sqrt", "tanh", "erf", "sin", "cos", "abs", "sign", "neg", "stop",
                      "relu", "sigmoid", "softplus", "gelu", "gelu_erf", "silu", "pow2", "pow3", "powr"])
        if k == "exp":
            b = self.bounded(u)
            return call("exp", [b], edges=E, scale=math.exp(b.scale))
        if k in ("log", "sqrt"):
            p = self.positive(u)
            return call(k, [p], edges=E, scale=max(1.0, math.log(p.scale + 1)) if k == "log" else math.sqrt(p.scale))
        if k in ("tanh", "erf", "sigmoid"):
            return call(k, [u], edges=E, scale=1.0, sparse=u.sparse)
        if k in ("sin", "cos"):
            return call(k, [self.bounded(u)], edges=E, scale=1.0, sparse=u.sparse)
        if k == "abs":
            return call("abs", [self.unkink(u)], edges=E, scale=u.scale + 1)
        if k == "sign":
            return call("sign", [u], edges=E, scale=1.0, sparse=True)
        if k == "neg":
            return neg(u)
        if k == "stop":
            return call("stop", [u], edges=E, scale=u.scale, sparse=u.sparse)
        if k == "relu":
            return call("relu", [self.unkink(u)], edges=E, scale=u.scale + 1, sparse=True)
        if k in ("softplus", "gelu_erf", "silu"):
            return call(k, [u], edges=E, scale=u.scale + 1)
        if k == "gelu":
            return call(k, [self.bounded(u)], edges=E, scale=BOUND + 1)
        if k in ("pow2", "pow3"):
            b = self.bounded(u)
            n = 2 if k == "pow2" else 3
            return bin_("^", b, num(n), edges=E, scale=b.scale ** n, sparse=u.sparse)
        # a real power of a positive base
        base = self.positive(self.bounded(u))
        ex = self.r.choice([num(0.5), num(1.5), neg(num(0.5)), self.bounded(self.expr(frozenset(), 0))])
        return bin_("^", base, ex, edges=E, scale=max(base.scale, 1) ** 2, sparse=False)

    def split_edges(self, E, overlap=True):
        A, B = set(), set()
        for e in sorted(E):
            c = self.r.randrange(3 if overlap else 2)
            if c == 0:
                A.add(e)
            elif c == 1:
                B.add(e)
            else:
                A.add(e)
                B.add(e)
        return frozenset(A), frozenset(B)

    def p_binary(self, E, d):
        r = self.r
        A, B = self.split_edges(E)
        k = r.choice(["+", "-", "*", "/", "^", "max", "min", "where", "cmp", "cmp"])
        a = self.expr(A, d - 1)
        if k == "where" and r.random() < 0.3:
            return self.guarded(a, E, d)
        if k == "where":
            C1, C2 = self.split_edges(E)
            c = self.compare(C1, C2, d - 1)
            b = self.expr(B, d - 1)
            return call("where", [c, a, b], edges=E, scale=max(a.scale, b.scale), sparse=True)
        b = self.expr(B, d - 1)
        if k in "+-":
            return bin_(k, a, b, edges=E)
        if k == "*":
            if a.scale * b.scale > 50:
                a = self.bounded(a)
            return bin_("*", a, b, edges=E, scale=a.scale * b.scale)
        if k == "/":
            den = self.positive(b)
            if r.random() < 0.3:
                den = neg(den)
            return bin_("/", a, den, edges=E, scale=a.scale * 3)
        if k == "^":
            base = self.positive(self.bounded(a))
            return bin_("^", base, self.bounded(b), edges=E, scale=max(base.scale, 1.5) ** BOUND)
        if k in ("max", "min"):
            a, b = self.unkink(a), self.unkink(b)
            if not self.ties and (a.render() == b.render() or (a.sparse and b.sparse)):
                b = bin_("+", b, num(0.1875), sparse=False)
            if r.random() < 0.2 and not a.sparse and A == E:
                return call(k, [num(r.choice([0, 0.5])), a], edges=E, scale=a.scale + 1, sparse=True)
            return call(k, [a, b], edges=E, scale=max(a.scale, b.scale), sparse=True)
        return self.compare(A, B, d - 1, a, b)

    def guarded(self, a: Node, E, d) -> Node:
        """A singular function on the side of a `where` that is taken, its argument made safe
        on the other side too: `where(a > 0, sqrt(where(a > 0, a, 1)), b)`."""
        r = self.r
        f = r.choice(["sqrt", "log", "recip", "pow"])
        op = r.choice([">", "<"])
        cond = bin_(op, a, num(0), sparse=True)
        safe = call("where", [cond, a if op == ">" else neg(a), num(1)], edges=a.edges, scale=a.scale + 1)
        if f == "recip":
            inner = bin_("/", num(1), safe, scale=10.0)
        elif f == "pow":
            inner = bin_("^", call("abs", [safe], edges=a.edges), num(0.5), scale=a.scale)
        else:
            inner = call(f, [safe], edges=a.edges, scale=a.scale + 2)
        other = self.expr(frozenset(e for e in sorted(E) if r.random() < 0.5) | (E - a.edges), d - 1)
        return call("where", [cond, inner, other], edges=E, scale=max(inner.scale, other.scale), sparse=True)

    def compare(self, A, B, d, a=None, b=None):
        r = self.r
        a = self.expr(A, d) if a is None else a
        b = self.expr(B, d) if b is None else b
        op = r.choice(["<", "<=", ">", ">=", "==", "!="])
        if op in ("==", "!="):   # equal on a set of positive measure: compare signs
            a = call("sign", [a], edges=a.edges, sparse=True)
            b = call("sign", [b], edges=b.edges, sparse=True)
        return bin_(op, a, b, scale=1.0, sparse=True)

    def p_contract(self, E, d):
        r = self.r
        C = self.fresh_edges(r.choice([1, 1, 2]), E)
        if not C:
            return None
        C = frozenset(C)
        form = r.choice(["@", "@", "sum", "dot"])
        if form == "@":
            A, B = self.split_edges(E, overlap=False)
        else:
            A, B = self.split_edges(E)
        if not self.fits(A | B | C):
            return None
        a, b = self.expr(A | C, d - 1), self.expr(B | C, d - 1)
        scale = a.scale * b.scale * self.elems(C)
        if form == "@":
            return bin_("@", a, b, edges=E, scale=scale)
        if form == "dot" and len(C) == 1:
            return call("dot", [a, b], edge_args=sorted(C), edges=E, scale=scale, sparse=a.sparse or b.sparse)
        return call("sum", [bin_("*", a, b)], edge_args=sorted(C), edges=E, scale=scale,
                    sparse=a.sparse or b.sparse)

    def p_reduce(self, E, d):
        r = self.r
        C = self.fresh_edges(r.choice([1, 1, 2]), E)
        if not C:
            return None
        u = self.expr(E | frozenset(C), d - 1)
        k = r.choice(["sum", "mean", "max", "min"])
        if k in ("max", "min") and u.sparse and r.random() < 0.6 and not self.ties:
            k = "sum"
        scale = u.scale * (self.elems(C) if k == "sum" else 1)
        if not E and r.random() < 0.5:
            return call(k, [u], edges=E, scale=scale, sparse=u.sparse)
        return call(k, [u], edge_args=C, edges=E, scale=scale, sparse=u.sparse)

    def p_rename(self, E, d):
        r = self.r
        same = [(a, b) for a in sorted(E) for b in sorted(E) if a < b and self.key(a) == self.key(b)]
        if same and r.random() < 0.5:
            a, b = r.choice(same)
            u = self.expr(E, d - 1)
            return eops(u, [("rename", a, b), ("rename", b, a)], E, sparse=u.sparse)
        opts = [(e, f) for e in sorted(E) for f in self.edge_dim if f not in E and self.key(e) == self.key(f)]
        if not opts:
            return None
        e, f = r.choice(opts)
        u = self.expr((E - {e}) | {f}, d - 1)
        return eops(u, [("rename", f, e)], E, sparse=u.sparse)

    def p_reindex(self, E, d):
        r = self.r
        k = r.choice(["window", "slice", "slice", "shift", "split", "concat"])
        if k == "window":
            if len(E) < 2:
                return None
            s, kk = r.sample(sorted(E), 2)
            t = self.fresh_edges(1, E)
            if not t:
                return None
            t = t[0]
            base = (E - {s, kk}) | {t}
            rel = r.choice([f"{s} + {kk}", f"2*{s} + {kk} - 1", f"{s} + {kk} + 1", f"{kk} + {s}"])
            u = self.expr(base, d - 1)
            return eops(u, [("reindex", t, rel)], E)
        if k == "slice":
            if not E:
                return None
            s = r.choice(sorted(E))
            t = self.fresh_edges(1, E)
            if not t:
                return None
            t = t[0]
            n = self.size(t)
            rel = r.choice([f"{s} + 1", f"{s} - 1", f"{s}", f"2*{s}", f"2*{s} + 1", "flip"])
            if rel == "flip":
                rel = f"size({t}) - 1 - {s}"
                if not isinstance(self.key(t), str) and r.random() < 0.5:
                    rel = f"{n - 1} - {s}"
            base = (E - {s}) | {t}
            items = [("reindex", t, rel)]
            # sometimes a rename applied together with it
            others = [(e, f) for e in sorted(E - {s}) for f in self.edge_dim
                      if f not in E and f != t and self.key(e) == self.key(f)]
            if others and r.random() < 0.3:
                e, f = r.choice(others)
                base = (base - {e}) | {f}
                items.append(("rename", f, e))
            u = self.expr(base, d - 1)
            return eops(u, items, E)
        if k == "shift":
            if not E:
                return None
            t = r.choice(sorted(E))
            u = self.expr(E, d - 1)
            return eops(u, [("reindex", t, r.choice([f"{t} + 1", f"{t} - 1", f"{t} + 2"]))], E)
        if k == "split" and self.split:
            c, head, hd = self.split
            if head in E and hd in E and c not in E:
                u = self.expr((E - {head, hd}) | {c}, d - 1)
                return eops(u, [("reindex", c, r.choice([f"hd*{head} + {hd}", f"{head} + head*{hd}"]))], E,
                            sparse=u.sparse)
            if c in E and head not in E and hd not in E and self.fits(E | {head, hd}):
                u = self.expr((E - {c}) | {head, hd}, d - 1)
                return bin_("@", u, raw(f"[{c} = hd*{head} + {hd}]", {c, head, hd}, sparse=True),
                            edges=E, sparse=u.sparse)
            return None
        if k == "concat" and self.concat:
            w, p, q = self.concat
            if w in E and p not in E and q not in E:
                a = self.expr((E - {w}) | {p}, d - 1)
                b = self.expr((E - {w}) | {q}, d - 1)
                return bin_("+", eops(a, [("reindex", p, w)], E), eops(b, [("reindex", q, f"{w} - size({p})")], E),
                            edges=E, sparse=True)
        return None

    def p_masked(self, E, d):
        """Causal masks: `where([s <= t], u, -inf)` under softmax/max/logsumexp, or `u * [s <= t]`
        under max/min (every row keeps s = 0, so no row is all -inf)."""
        r = self.r
        if not E:
            return None
        t = r.choice(sorted(E))
        k = r.choice(["softmax", "max", "logsumexp", "mulmax"])
        if k == "softmax":
            others = [s for s in sorted(E) if s != t]
            if not others:
                return None
            s = r.choice(others)
            u = self.expr(E, d - 1)
            w = call("where", [raw(f"[{s} <= {t}]", {s, t}), u, neg(raw("inf"))], edges=E, sparse=True)
            return call("softmax", [w], [s], edges=E, scale=1.0, sparse=True)
        s = self.fresh_edges(1, E)
        if not s:
            return None
        s = s[0]
        u = self.expr(E | {s}, d - 1)
        ind = raw(f"[{s} <= {t}]", {s, t})
        if k == "mulmax":
            return call(r.choice(["max", "min"]), [bin_("*", u, ind, edges=E | {s})], [s], edges=E,
                        scale=u.scale, sparse=True)
        w = call("where", [ind, u, neg(raw("inf"))], edges=E | {s}, sparse=True)
        return call(k, [w], [s], edges=E, scale=u.scale + 2, sparse=True)

    def p_dup(self, E, d):
        """One value used twice: renamed copies of it (`X[a -> i] - X[a -> j]`), or itself."""
        r = self.r
        pairs = [(a, b) for a in sorted(E) for b in sorted(E) if a < b and self.key(a) == self.key(b)]
        if pairs and r.random() < 0.7:
            e1, e2 = r.choice(pairs)
            src = [f for f in self.edge_dim if f not in E and self.key(f) == self.key(e1)]
            if src:
                f = r.choice(src)
                u = self.expr((E - {e1, e2}) | {f}, d - 1)
                op = r.choice("+-*")
                return bin_(op, eops(u, [("rename", f, e1)], (E - {e2}), sparse=u.sparse),
                            eops(u, [("rename", f, e2)], (E - {e1}), sparse=u.sparse), edges=E)
        u = self.expr(E, d - 1)
        k = r.randrange(4)
        if k == 0:
            return bin_("-", u, u, edges=E, sparse=True)
        if k == 1:
            return bin_("-", u, call("stop", [u], edges=E), edges=E, sparse=True)
        if k == 2:
            b = self.bounded(u)
            return bin_("*", b, call("stop", [b], edges=E), edges=E, scale=b.scale ** 2)
        return bin_("+", u, bin_("*", num(0), u), edges=E, sparse=u.sparse)

    def featured(self) -> Node | None:
        """A binding that uses the split or concatenation dims, which random edge sets rarely hit."""
        r = self.r
        if self.split and r.random() < 0.8:
            c, head, hd = self.split
            E = frozenset([head, hd]) | (self.edge_set(1, avoid={c, head, hd}) if r.random() < 0.4 else frozenset())
            if self.fits(E | {c}):
                for _ in range(10):
                    n = self.p_reindex(E, 2)
                    if n is not None and "hd*" in n.render():
                        return n
        if self.concat:
            w = self.concat[0]
            for _ in range(10):
                n = self.p_reindex(frozenset([w]), 2)
                if n is not None and "size(" in n.render():
                    return n
        return None

    def p_scatter(self, E, d):
        """Integer indicators (LANGUAGE.md section 11): a scatter-add `msg @ [v = dst]` or
        `sum[e](msg * [v = dst])`, a segment mean, a segment max/min (an empty segment's
        -inf/inf clipped by a two-argument max/min), a segment softmax
        `w / (w @ [v = dst])[v = dst]` with `w = exp(s - max[e](where([v = dst], s, -inf))[v = dst])`,
        and a plain product with `[v = dst]`. `dst: i32[e]`; `e` is the edge list, `v` the nodes."""
        r = self.r
        k = r.choice(["add", "add", "sum", "mean", "max", "softmax", "ind"])
        if k == "softmax":
            if not E:
                return None
            e = r.choice(sorted(E))
            v = self.fresh_edges(1, E)
            if not v or not self.fits(E | {v[0]}):
                return None
            v = v[0]
            ids = self.ids_for(frozenset([e]))
            ind = raw(f"[{v} = {ids}]", {v, e}, sparse=True)
            sc = self.bounded(self.expr(E, d - 1))
            mx = call("max", [call("where", [ind, sc, neg(raw("inf"))], edges=E | {v})], [e], edges=(E - {e}) | {v})
            w = call("exp", [bin_("-", sc, eops(mx, [("gather", v, ids)], E))], edges=E, scale=1.0)
            den = eops(bin_("@", w, ind, edges=(E - {e}) | {v}), [("gather", v, ids)], E)
            return bin_("/", w, den, edges=E, scale=1.0, sparse=False)
        if k == "ind":
            if len(E) < 2:
                return None
            v, e = r.sample(sorted(E), 2)
            ids = self.ids_for(frozenset([e]))
            u = self.expr(E, d - 1)
            return bin_("*", u, raw(f"[{v} = {ids}]", {v, e}, sparse=True), edges=E, sparse=True)
        if not E:
            return None
        v = r.choice(sorted(E))
        e = self.fresh_edges(1, E)
        if not e or not self.fits((E - {v}) | {e[0]}) or not self.fits(E | {e[0]}):
            return None
        e = e[0]
        ids = self.ids_for(frozenset([e]))
        ind = raw(f"[{v} = {ids}]", {v, e}, sparse=True)
        M = (E - {v}) | {e}
        msg = self.expr(M, d - 1)
        if k == "add":
            return bin_("@", msg, ind, edges=E, scale=msg.scale * self.size(e), sparse=True)
        if k == "sum":
            return call("sum", [bin_("*", msg, ind, edges=E | {e})], [e], edges=E, scale=msg.scale * self.size(e),
                        sparse=True)
        if k == "mean":
            tot = call("sum", [call("where", [ind, msg, num(0)], edges=E | {e})], [e], edges=E)
            cnt = call("sum", [ind], [e], edges={v})
            return bin_("/", tot, bin_("+", cnt, num(1)), edges=E, scale=msg.scale, sparse=True)
        f, inf, clip = r.choice([("max", neg(raw("inf")), neg(num(3))), ("min", raw("inf"), num(3))])
        seg = call(f, [call("where", [ind, msg, inf], edges=E | {e})], [e], edges=E)
        return call(f, [seg, clip], edges=E, scale=max(msg.scale, 3), sparse=True)

    def p_misc(self, E, d):
        """Forms the other productions never make: `checkpoint(x)`, a copy tensor
        `x @ [c = a = b]`, an indicator with an offset `x * [s < t + 1]`, a custom
        derivative's call, a dim `p * q` split with `[pq = q*p + q]`."""
        r = self.r
        k = r.choice(["checkpoint", "copy", "offset", "custom", "custom", "prod"])
        if k == "checkpoint":
            u = self.expr(E, d - 1)
            return call("checkpoint", [u], edges=E, scale=u.scale, sparse=u.sparse)
        if k == "copy":
            same = [(a, b) for a in sorted(E) for b in sorted(E) if a < b and self.key(a) == self.key(b)]
            if not same:
                return None
            a, b = r.choice(same)
            src = [c for c in self.edge_dim if c not in E and self.key(c) == self.key(a) and c not in ("l", "m")]
            if not src:
                return None
            c = r.choice(src)
            u = self.expr((E - {a, b}) | {c}, d - 1)
            return bin_("@", u, raw(f"[{c} = {a} = {b}]", {a, b, c}, sparse=True), edges=E, sparse=True)
        if k == "offset":
            if len(E) < 2:
                return None
            s, t = r.sample(sorted(E), 2)
            rel = r.choice([f"{s} < {t} + 1", f"{s} + 1 <= {t}", f"{s} >= {t} - 1", f"2*{s} <= {t} + 1"])
            u = self.expr(E, d - 1)
            return bin_("*", u, raw(f"[{rel}]", {s, t}, sparse=True), edges=E, sparse=True)
        if k == "custom":
            cs = [f for f in self.fns if f.name.startswith("c")]
            if not cs:
                return None
            u = self.bounded(self.expr(E, d - 1))
            return call(r.choice(cs).name, [u], edges=E, scale=BOUND, sparse=u.sparse)
        if k == "prod" and "pq" in self.dim_size:
            if "pq" in E:
                p_, q_ = self.prod_dims
                if p_ in E or q_ in E:
                    return None
                u = self.expr((E - {"pq"}) | {p_, q_}, d - 1) if self.fits((E - {"pq"}) | {p_, q_}) else None
                if u is None:
                    return None
                return bin_("@", u, raw(f"[pq = {q_}*{p_} + {q_}]", {"pq", p_, q_}, sparse=True), edges=E,
                            sparse=u.sparse)
            p_, q_ = self.prod_dims
            if p_ in E and q_ in E and self.fits((E - {p_, q_}) | {"pq"}):
                u = self.expr((E - {p_, q_}) | {"pq"}, d - 1)
                return eops(u, [("reindex", "pq", f"{q_}*{p_} + {q_}")], E, sparse=u.sparse)
        return None

    def p_random(self, E, d):
        """Random draws (LANGUAGE.md section 11): `u + rand[E](key)`, `u * randn[E](fold(key, n))`,
        `dropout[E](u, key, p)`, with `key` an i32 scalar input."""
        r = self.r
        if not E:
            return None
        if self.key_arg is None:
            self.key_arg = f"key{next(self.counter)}"
            self.decls.append(Decl("input", self.key_arg, (), "i32"))
        key = self.key_arg if r.random() < 0.5 else f"fold({self.key_arg}, {r.randint(1, 9)})"
        es = sorted(E)
        r.shuffle(es)
        k = r.choice(["rand", "randn", "dropout", "dropout"])
        u = self.expr(E, d - 1)
        if k == "dropout":
            p = r.choice([0.1, 0.25, 0.5])
            return call("dropout", [u, raw(key), num(p)], es, edges=E, scale=u.scale / (1 - p), sparse=True)
        draw = raw(f"{k}[{', '.join(es)}]({key})", E, scale=3.0 if k == "randn" else 1.0)
        op = r.choice("+*")
        return bin_(op, u, draw, edges=E, scale=u.scale * 3 if op == "*" else u.scale + 3)

    def p_gather(self, E, d):
        r = self.r
        if not E:
            return None
        G = frozenset(r.sample(sorted(E), r.choice([1, 1, 2]) if len(E) > 1 else 1))
        v = self.fresh_edges(1, E)
        if not v:
            return None
        v = v[0]
        shared = frozenset(e for e in sorted(G) if r.random() < 0.3)
        T = (E - G) | shared | {v}
        if not self.fits(T):
            return None
        table = self.expr(T, d - 1)
        ids = self.ids_for(G)
        return eops(table, [("gather", v, ids)], E, sparse=True)

    def p_indicator(self, E, d):
        r = self.r
        k = r.choice(["mask", "eye", "rename", "conv"])
        if k == "mask" and len(E) >= 2:
            s, t = r.sample(sorted(E), 2)
            op = r.choice(["<=", "<", ">=", "!="])
            u = self.expr(E, d - 1)
            return bin_("*", u, raw(f"[{s} {op} {t}]", {s, t}, sparse=True), edges=E, sparse=True)
        if k == "eye":
            same = [(a, b) for a in sorted(E) for b in sorted(E) if a < b and self.key(a) == self.key(b)]
            if not same:
                return None
            a, b = r.choice(same)
            u = self.expr(E, d - 1)
            return bin_("*", u, raw(f"[{a} = {b}]", {a, b}, sparse=True), edges=E, sparse=True)
        if k == "rename":
            opts = [(e, f) for e in sorted(E) for f in self.edge_dim if f not in E and self.key(e) == self.key(f)]
            if not opts:
                return None
            e, f = r.choice(opts)
            u = self.expr((E - {e}) | {f}, d - 1)
            return bin_("@", u, raw(f"[{f} = {e}]", {e, f}, sparse=True), edges=E, sparse=u.sparse)
        if k == "conv" and len(E) >= 2:
            s, kk = r.sample(sorted(E), 2)
            t = self.fresh_edges(1, E)
            if not t:
                return None
            u = self.expr((E - {s, kk}) | {t[0]}, d - 1)
            return bin_("@", u, raw(f"[{t[0]} = {s} + {kk}]", {t[0], s, kk}, sparse=True), edges=E, sparse=True)
        return None

    def p_prelude(self, E, d):
        r = self.r
        k = r.choice(["softmax", "log_softmax", "logsumexp", "layernorm", "rmsnorm", "cross_entropy", "mse",
                      "attention", "dot"])
        if k in ("softmax", "log_softmax", "layernorm", "rmsnorm"):
            if not E:
                return None
            e = r.choice(sorted(E))
            x = self.expr(E, d - 1)
            if k == "softmax":
                return call(k, [x], [e], edges=E, scale=1.0)
            if k == "log_softmax":
                return call(k, [x], [e], edges=E, scale=x.scale * 2 + 3)
            w = self.expr(self.edge_set(r.randint(0, 2), keep=frozenset()) & E, d - 2)
            args, kw = [x, w], [None, None]
            if k == "layernorm":
                args.append(self.expr(frozenset(s for s in sorted(E) if r.random() < 0.5), d - 2))
                kw.append(None)
            if r.random() < 0.3:
                args.append(num(r.choice([0.001, 0.01, 0.5])))
                kw.append("eps" if r.random() < 0.6 else None)
            return call(k, args, [e], kw=kw, edges=E, scale=3 * w.scale + (args[2].scale if k == "layernorm" else 0))
        if k in ("logsumexp", "cross_entropy"):
            e = self.fresh_edges(1, E)
            if not e:
                return None
            x = self.expr(E | {e[0]}, d - 1)
            if k == "logsumexp":
                return call(k, [x], e, edges=E, scale=x.scale + 2)
            tgt = self.expr(frozenset(s for s in sorted(E) if r.random() < 0.5) | {e[0]}, d - 1)
            return call(k, [x, tgt], e, edges=E, scale=(x.scale * 2 + 3) * tgt.scale * self.size(e[0]))
        if k == "mse":
            if E:
                return None
            a = self.expr(self.edge_set(), d - 1)
            b = self.expr(self.edge_set(k=1, keep=frozenset()) & a.edges if r.random() < 0.5 else a.edges, d - 1)
            return call("mse", [a, b], scale=(a.scale + b.scale) ** 2)
        if k == "attention":
            se = self.fresh_edges(2, E)
            if len(se) < 2:
                return None
            s, e = se
            Q = frozenset(x for x in sorted(E) if r.random() < 0.7)
            K = frozenset(x for x in sorted(E) if r.random() < 0.3)
            V = E - Q - K | frozenset(x for x in sorted(E) if r.random() < 0.3)
            if not (self.fits(Q | {e}) and self.fits(K | {s, e}) and self.fits(V | {s})):
                return None
            q, kk, v = self.expr(Q | {e}, d - 1), self.expr(K | {s, e}, d - 1), self.expr(V | {s}, d - 1)
            return call("attention", [q, kk, v], [s, e], edges=E, scale=v.scale)
        if k == "dot":
            e = self.fresh_edges(1, E)
            if not e:
                return None
            A, B = self.split_edges(E)
            a, b = self.expr(A | {e[0]}, d - 1), self.expr(B | {e[0]}, d - 1)
            return call("dot", [a, b], e, edges=E, scale=a.scale * b.scale * self.size(e[0]))
        return None

    # ---- user functions ---------------------------------------------------------------

    def make_fns(self):
        r = self.r
        for i in range(r.choice([0, 1, 1, 2])):
            fname = f"f{next(self.counter)}"
            has_e = r.random() < 0.5
            nparams = r.randint(1, 2)
            params = [f"a{j}" for j in range(nparams)]
            default = r.random() < 0.4
            plist = [(p, None) for p in params]
            if default:
                plist.append(("s", num(r.choice([0.5, 2, 0.25]))))
            leaves = [name(p, scale=BOUND) for p in params] + ([name("s", scale=2)] if default else [])
            body = self.fn_body(leaves, 2)
            if not any(n.op == "name" and n.attrs[0] == "a0" for n in body.walk()):
                body = bin_(r.choice("+*"), body, leaves[0], scale=body.scale * BOUND)  # the result has a0's edges
            binds, block = [], r.random() < 0.4
            keeps = True
            if has_e:
                if r.random() < 0.5:
                    body = call(r.choice(["sum", "mean", "max"]) if not body.sparse else "sum", [body], ["e"],
                                scale=body.scale * 6)
                    keeps = False
                else:
                    body = bin_("-", body, call("mean", [body], ["e"]), scale=body.scale * 2)
            if block:
                binds = [("y0", body)]
                y0 = name("y0", scale=body.scale)
                if keeps:
                    body = bin_("*", y0, self.fn_body(leaves[:1], 1), scale=body.scale * BOUND)
                else:  # the parameters keep edge e: the result must not
                    body = bin_("+", call("tanh", [y0]), y0, scale=body.scale + 1)
            self.fns.append(Fn(fname, ("e",) if has_e else (), plist, binds, body, block))
            self.fn_meta[fname] = (has_e, keeps, nparams, "s" if default else None, body.scale)

    def make_step(self):
        """The step of the loops: `fn sN(h, w) = tanh(BODY + (h + 0.5 * w))`, BODY elementwise in h
        and w (w's edges a subset of h's), so the result has h's edges and is bounded;
        and the loop dim `l`, a literal or (in half the programs with loops) symbolic."""
        n = self.r.randint(1, 3)
        if random.Random(self.seed * 7919 + 29).random() < 0.5:   # symbolic, bound at the call (a stream of its own)
            self.dims.append(("l", None))
            self.dim_size["l"], self.dim_key["l"], self.bind["l"] = n, "l", n
        else:
            self.dims.append(("l", str(n)))
            self.dim_size["l"], self.dim_key["l"] = n, n
        self.edge_dim["l"] = "l"
        leaves = [name("h", scale=1.0), name("w", scale=BOUND)]
        body = bin_("+", self.bounded(self.fn_body(leaves, 2)), bin_("+", leaves[0], bin_("*", num(0.5), leaves[1])))
        params = [("h", None), ("w", None)]
        if self.ext:
            with self.extension():
                body = self.extend_step(body, params)
        self.step = f"s{next(self.counter)}"
        self.fns.append(Fn(self.step, (), params, [], call("tanh", [body]), False))

    def extend_step(self, body: Node, params: list) -> Node:
        """Extensions of the step (its own stream): one or two more stacked arguments `sa2`,
        `sa3` (each a bounded term of the body), and in some programs a loop inside the step,
        over a literal dim `m`: `0.5 * repeat[m](tN, h, su)` or `0.5 * mean[m](scan[m](tN, h, su))`,
        `su` a further stacked argument with the edge `m`, tN an inner step of the same form;
        in some programs (a stream of their own) a gather by an i32 stacked argument,
        `0.25 * te[gv = ti]`, `ti` the step's slice of `ids: i32[l]`."""
        r = self.r
        self.nstacked = r.choice([1, 1, 2, 3])
        h = name("h", scale=1.0)
        for j in range(2, self.nstacked + 1):
            a = name(f"sa{j}", scale=BOUND)
            params.append((f"sa{j}", None))
            t = self.bounded(self.fn_body([h, a], 2))
            body = bin_("+", body, bin_("*", num(r.choice([0.25, 0.5])), bin_(r.choice("+*"), t, a)))
        gr = random.Random(self.seed * 7919 + 71)   # i32 stacked arguments: a stream of their own
        if gr.random() < 0.35:
            k = gr.randint(2, 4)
            self.dims.append(("gv", str(k)))
            self.dim_size["gv"], self.dim_key["gv"] = k, k
            self.edge_dim["gv"] = "gv"
            self.loop_ids = True
            params += [("te", None), ("ti", None)]
            body = bin_("+", body, bin_("*", num(0.25), eops(name("te"), [("gather", "gv", "ti")], ())))
        if r.random() < 0.45:
            k = self.dim_of(2, 3)
            self.dims.append(("m", str(k)))
            self.dim_size["m"], self.dim_key["m"] = k, k
            self.edge_dim["m"] = "m"
            g, v = name("hh", scale=1.0), name("vv", scale=BOUND)
            ib = bin_("+", self.bounded(self.fn_body([g, v], 2)), bin_("+", g, bin_("*", num(0.5), v)))
            self.inner = f"t{next(self.counter)}"
            self.fns.append(Fn(self.inner, (), [("hh", None), ("vv", None)], [], call("tanh", [ib]), False))
            params.append(("su", None))
            if r.random() < 0.5:
                loop = call("repeat", [name(self.inner), h, name("su")], ["m"])
            else:
                loop = call(r.choice(["mean", "sum"]), [call("scan", [name(self.inner), h, name("su")], ["m"])],
                            ["m"])
            body = bin_("+", body, bin_("*", num(0.5), loop))
        return body

    def p_loop(self, E, d):
        """repeat[l](step, init, xs) with E's edges, or scan[l](...) when E has `l`."""
        r = self.r
        carry = frozenset(E - {"l"})
        sub = frozenset(e for e in sorted(carry) if r.random() < 0.6) | {"l"}
        if not self.fits(sub):
            return None
        if self.inner and "m" in carry or self.loop_ids and "gv" in carry:
            return None
        init = self.bounded(self.expr(carry, d - 1))
        xs = self.bounded(self.expr(sub, d - 1))
        form = "scan" if "l" in E else "repeat"
        args = [name(self.step), init, xs]
        if self.nstacked > 1 or self.inner or self.loop_ids:
            with self.extension():
                for j in range(2, self.nstacked + 1):
                    args.append(self.bounded(self.expr(self.stacked_edges(carry, {"l"}), d - 1)))
                if self.loop_ids:   # a table per step and its id: `te[gv = ti]` in the step
                    args.append(self.bounded(self.expr(self.stacked_edges(carry, {"l", "gv"}), d - 1)))
                    args.append(name(self.ids_for(frozenset(["l"]))))
                if self.inner:
                    args.append(self.bounded(self.expr(self.stacked_edges(carry, {"l", "m"}), d - 1)))
        return call(form, args, ["l"], edges=E, scale=1.0, sparse=any(a.sparse for a in args[1:]))

    def stacked_edges(self, carry, loop_edges) -> frozenset:
        """A stacked argument's edges: some of the carry's, and the loop edges, small enough."""
        sub = [e for e in sorted(carry) if self.r.random() < 0.5]
        while sub and not self.fits(frozenset(sub) | loop_edges):
            sub.pop(self.r.randrange(len(sub)))
        return frozenset(sub) | frozenset(loop_edges)

    def fn_body(self, leaves, depth) -> Node:
        r = self.r
        if depth <= 0:
            return r.choice(leaves + [num(0.5)]) if r.random() < 0.9 else num(2)
        k = r.choice(["un", "bin", "bin", "leaf"])
        if k == "leaf":
            return r.choice(leaves)
        if k == "un":
            u = self.fn_body(leaves, depth - 1)
            f = r.choice(["tanh", "sin", "exp", "log", "sqrt", "softplus", "neg", "sq"])
            if f == "neg":
                return neg(u)
            if f in ("log", "sqrt"):
                return call(f, [self.positive(u)], scale=3)
            if f == "sq":
                b = self.bounded(u)
                return bin_("^", b, num(2), scale=b.scale ** 2)
            if f in ("exp", "sin"):
                b = self.bounded(u)
                return call(f, [b], scale=math.exp(b.scale))
            return call(f, [u], scale=u.scale + 1)
        a, b = self.fn_body(leaves, depth - 1), self.fn_body(leaves, depth - 1)
        op = r.choice(["+", "-", "*", "/"])
        if op == "/":
            return bin_("/", a, self.positive(b), scale=a.scale * 3)
        if op == "*" and a.scale * b.scale > 30:
            a = self.bounded(a)
        return bin_(op, a, b)

    def p_user(self, E, d):
        r = self.r
        fname = r.choice([f.name for f in self.fns if f.name in self.fn_meta])
        has_e, keeps, nreq, default, scale = self.fn_meta[fname]
        edge_args = None
        if has_e:
            if keeps:
                if not E:
                    return None
                e = r.choice(sorted(E))
                argE = E
            else:
                es = self.fresh_edges(1, E)
                if not es:
                    return None
                e = es[0]
                argE = E | {e}
            edge_args = [e]
            args = [self.bounded(self.expr(argE, d - 1)) for _ in range(nreq)]
        else:
            args = [self.bounded(self.expr(E, d - 1))]
            args += [self.bounded(self.expr(frozenset(x for x in sorted(E) if r.random() < 0.5), d - 1))
                     for _ in range(nreq - 1)]
        kw = [None] * len(args)
        if default and r.random() < 0.5:
            args.append(num(r.choice([1.5, 0.75])))
            kw.append("s" if r.random() < 0.5 else None)
        return call(fname, args, edge_args, kw, edges=E, scale=scale, sparse=any(a.sparse for a in args))

    # ---- derivatives ------------------------------------------------------------------

    def focused(self, x: str, E, d) -> Node:
        self.focus.append(x)
        try:
            return self.expr(E, d)
        finally:
            self.focus.pop()

    def scalar_of(self, x: str, d) -> Node:
        r = self.r
        xe = self.args[x][0]
        dep = [p for p in self.pool if not p[1] and x in p[4] and not self.focus]
        if dep and r.random() < 0.4:
            p = r.choice(dep)
            return name(p[0], scale=p[2])
        F = self.edge_set(r.randint(0, 1), keep=xe) if self.fits(xe) else xe
        u = self.focused(x, F, d)
        k = r.choice(["sum", "mean", "sumsq", "at"])
        if k == "sumsq" or (k == "at" and not F):
            b = self.bounded(u)
            return call("sum", [bin_("*", b, b)], scale=self.elems(F) * b.scale ** 2)
        if k == "at":
            v = self.expr(F, max(d - 2, 0))
            return bin_("@", u, v, edges=(), scale=u.scale * v.scale * self.elems(F))
        return call(k, [u], scale=u.scale * self.elems(F))

    def p_deriv(self, E, d):
        r = self.r
        if self.n_deriv >= 4 or self.deriv_nest >= 2 or d < 1:
            return None
        self.n_deriv += 1
        self.deriv_nest += 1
        try:
            return self._deriv(E, d)
        finally:
            self.deriv_nest -= 1

    def _deriv(self, E, d):
        r = self.r
        k = r.choice(["grad", "grad", "jac", "jvp", "vjp", "hvp"])
        small = max(d - 1, 1)
        if k == "grad" or (k == "hvp" and not E and r.random() < 0.5):
            x = self.arg_with(E)
            f = self.scalar_of(x, small)
            return call("grad", [f, name(x, E)], edges=E, scale=f.scale * 2 + 1)
        if k == "hvp":
            x = self.arg_with(E, ("param", "state", "input"))
            L = self.scalar_of(x, small)
            V = self.expr(E, 0)
            form = r.randrange(3)
            if form == 0:
                g = call("grad", [L, name(x, E)], edges=E)
                inner = bin_("@", g, V, edges=()) if E else bin_("*", g, V)
                return call("grad", [inner, name(x, E)], edges=E, scale=L.scale * 4 + 1)
            if form == 1:
                return call("jvp", [call("grad", [L, name(x, E)], edges=E), name(x, E), V], edges=E,
                            scale=L.scale * 4 + 1)
            return call("grad", [call("jvp", [L, name(x, E), V]), name(x, E)], edges=E, scale=L.scale * 4 + 1)
        if k == "jac":
            if len(E) < 2:
                return None
            X = frozenset(r.sample(sorted(E), r.randint(1, len(E) - 1)))
            x = self.arg_with(X)
            f = self.focused(x, E - X, small)
            return call("grad", [f, name(x, X)], edges=E, scale=f.scale * 2 + 1)
        if k == "jvp":
            B = frozenset()
            if E and r.random() < 0.3:
                B = frozenset([r.choice(sorted(E))])
            X = self.edge_set(r.randint(0, 2), avoid=B)
            if not self.fits(X | B):
                return None
            x = self.arg_with(X)
            f = self.focused(x, E - B, small)
            dx = self.expr(X | B, max(small - 1, 0))
            return call("jvp", [f, name(x, X), dx], edges=E, scale=(f.scale * 2 + 1) * dx.scale)
        if k == "vjp":
            X = frozenset(e for e in sorted(E) if r.random() < 0.7)
            B = E - X
            F = self.edge_set(r.randint(0, 2), avoid=B)
            if not self.fits(F | B):
                return None
            x = self.arg_with(X)
            f = self.focused(x, F, small)
            v = self.expr(F | B, max(small - 1, 0))
            return call("vjp", [f, name(x, X), v], edges=E, scale=(f.scale * 2 + 1) * v.scale * self.elems(F))
        return None

    # ---- the program --------------------------------------------------------------------

    def deps(self, node: Node) -> frozenset:
        out = set()
        for n in node.walk():
            if n.op == "name":
                for p in self.pool:
                    if p[0] == n.attrs[0]:
                        out |= p[4]
        return frozenset(out)

    def program(self) -> Program:
        r = self.r
        self.setup_dims()
        lr = None
        if r.random() < 0.6:
            lr = "lr"
            self.decls.append(Decl("input", "lr", ()))
            self.args["lr"] = (frozenset(), "input")
            self.pool.append(("lr", frozenset(), 2.0, False, frozenset(["lr"])))
        for _ in range(r.randint(1, 3)):
            self.declare(r.choice(["input", "param", "param", "state"]), self.edge_set())
        self.make_fns()
        if self.ext:
            with self.extension():
                self.make_ext_decls()
        if self.loops:
            self.make_step()
        for i in range(r.randint(1, 5)):
            E = self.edge_set()
            node = self.expr(E, r.choice([1, 2, 2, 3, 3, 4]))
            nm = f"h{i}" + ("'" if self.ext and self.xr.random() < 0.3 else "")   # a name with a prime
            self.stmts.append(Stmt("bind", nm, node))
            self.pool.append((nm, E, node.scale, node.sparse, self.deps(node)))
        feat = self.featured()
        if feat is not None:
            self.stmts.append(Stmt("bind", "hf", feat))
            self.pool.append(("hf", feat.edges, feat.scale, feat.sparse, self.deps(feat)))
            if r.random() < 0.7:
                self.stmts.append(Stmt("out", "hf"))
        params = [n for n, (e, k) in self.args.items() if k in ("param", "state")]
        loss, loss_deps = None, frozenset()
        if params and r.random() < 0.6:
            W = r.choice(params)
            loss = self.scalar_of(W, 2)
            self.stmts.append(Stmt("bind", "loss", loss))
            self.pool.append(("loss", frozenset(), loss.scale, loss.sparse, self.deps(loss)))
            loss_deps = self.deps(loss)
            loss = "loss"
        nout = 0
        binds = [s for s in self.stmts if s.kind == "bind"]
        for j in range(r.randint(1, 3)):
            k = r.choice(["bind", "new", "new", "grad"])
            if k == "bind":
                s = r.choice(binds)
                E = sorted(self.pool_edges(s.name))
                if any(t.kind == "out" and t.name == s.name for t in self.stmts):
                    continue
                order = tuple(r.sample(E, len(E))) if E and r.random() < 0.5 else None
                self.stmts.append(Stmt("out", s.name, None, order))
                nout += 1
                continue
            if k == "grad" and loss:
                W = r.choice([w for w in params if w in loss_deps] or params)
                E = self.args[W][0]
                node = call("grad", [name(loss), name(W, E)], edges=E)
            else:
                E = self.edge_set()
                node = self.expr(E, r.randint(1, 3))
            order = tuple(r.sample(sorted(E), len(E))) if E and r.random() < 0.4 else None
            self.stmts.append(Stmt("out", f"o{j}", node, order))
            nout += 1
        for W in r.sample(params, min(len(params), r.choice([0, 1, 1, 2]))):
            E = self.args[W][0]
            k = r.choice(["sgd", "ema", "any"])
            if k == "sgd" and loss and (W in loss_deps or r.random() < 0.2):
                step = call("grad", [name(loss), name(W, E)], edges=E)
                lrn = name("lr") if lr else num(0.1)
                node = bin_("-", name(W, E), bin_("*", lrn, step))
            elif k == "ema":
                node = bin_("+", bin_("*", num(0.9), name(W, E)), bin_("*", num(0.1), self.expr(E, 2)))
            else:
                node = self.expr(frozenset(e for e in sorted(E) if r.random() < 0.7), 2)
            if r.random() < 0.25:
                self.stmts.append(Stmt("out", W, None, None))
            self.stmts.append(Stmt("update", W, node))
            nout += 1
        if self.ext and loss and self.xr.random() < 0.5:
            with self.extension():
                self.for_block(loss, lr)
        # every binding that nothing reads is an output (dead code would test nothing)
        used = {n.attrs[0] for st in self.stmts if st.expr is not None for n in st.expr.walk() if n.op == "name"}
        used |= {st.name for st in self.stmts if st.kind == "out"}
        for st in list(self.stmts):
            if st.kind == "bind" and st.name not in used:
                E = sorted(self.pool_edges(st.name))
                order = tuple(r.sample(E, len(E))) if E and r.random() < 0.3 else None
                self.stmts.append(Stmt("out", st.name, None, order))
        customs = {f.name for f in self.fns if f.rule}
        binds = {st.name: st.expr for st in self.stmts if st.kind == "bind"}

        def calls_custom(node: Node, seen: set) -> bool:
            for n in node.walk():
                if n.op == "call" and n.attrs[0] in customs:
                    return True
                if n.op == "name" and n.attrs[0] in binds and n.attrs[0] not in seen:
                    seen.add(n.attrs[0])
                    if calls_custom(binds[n.attrs[0]], seen):
                        return True
            return False

        if customs and any(n.op == "call" and n.attrs[0] == "jvp" and calls_custom(n.kids[0], set())
                           for st in self.stmts if st.expr is not None for n in st.expr.walk()):
            # forward mode through a function with only a vjp rule is an error (its jvp rule
            # is not given): such a program calls the functions' argument instead
            self.stmts = [Stmt(st.kind, st.name, _strip_calls(st.expr, customs), st.order) if st.expr is not None
                          else st for st in self.stmts]
        return Program(self.dims, self.aliases, self.decls, self.fns, self.stmts, self.bind, self.seed)

    def make_ext_decls(self):
        """The extensions' declarations: a dim `pq = p * q` (split and merged by `p_misc`) and
        functions with their own derivative (`with vjp(g) = ...`): exact ones, and a clipping
        rule that is not the body's derivative (the oracle applies the rule too)."""
        r = self.r
        lits = [d for d, x in self.dims if x is not None and x.isdigit() and d in ("p", "q", "r")]
        self.prod_dims = None
        if len(lits) >= 2 and r.random() < 0.5:
            a, b = r.sample(lits, 2)
            if self.dim_size[a] * self.dim_size[b] <= 16:
                self.dims.append(("pq", f"{a} * {b}"))
                self.dim_size["pq"] = self.dim_key["pq"] = self.dim_size[a] * self.dim_size[b]
                self.edge_dim["pq"] = "pq"
                self.prod_dims = (a, b)
        rules = [("tanh(a0) * 0.5 + a0", "with vjp(g) = g * (1.5 - 0.5 * tanh(a0) ^ 2)"),
                 ("a0 * a0 * 0.25 + sin(a0)", "with vjp(g) = g * (0.5 * a0 + cos(a0))"),
                 ("softplus(a0)", "with vjp(g) = g * sigmoid(a0)"),
                 ("a0 * 1.5", "with vjp(g) = max(-1, min(1, g)) * 1.5")]
        for _ in range(r.choice([0, 1, 1, 2])):
            body, rule = r.choice(rules)
            fname = f"c{next(self.counter)}"
            self.fns.append(Fn(fname, (), [("a0", None)], [], raw(body), False, rule))

    def for_block(self, loss: str, lr):
        """`for t in LIST { ... }` (LANGUAGE.md section 12) over the params no other update
        writes: per-param states `mo.t`, a gradient clipped by the norm over the list
        (`sum[t in LIST](...)`), and `[t in ...]` weight decay."""
        r = self.r
        updated = {s.name for s in self.stmts if s.kind == "update"}
        params = [n for n, (e, k) in self.args.items() if k == "param"]
        free = [w for w in params if w not in updated]
        if not free:
            return
        if len(free) == len(params) and r.random() < 0.5:
            listed, names = "params", free
        else:
            names = r.sample(free, r.randint(1, len(free)))
            listed = ", ".join(names)
        clip = "1"
        if r.random() < 0.6:
            self.stmts.append(Stmt("bind", "gn", raw(f"sqrt(sum[t in {listed}](sum(grad({loss}, t) ^ 2)) + 1)")))
            self.pool.append(("gn", frozenset(), 2.0, False, frozenset()))
            clip = "min(1, 2 / gn)"
        decay = ", ".join(r.sample(names, r.randint(1, len(names))))
        lrn = lr or "0.1"
        body = [f"  g = {clip} * grad({loss}, t)"]
        if r.random() < 0.7:
            body = ["  state mo.t"] + body + ["  mn = 0.9 * mo.t + 0.1 * g", "  update mo.t = mn"]
            step = "mn"
        else:
            step = "g"
        body.append(f"  update t = t - {lrn} * ({step} + 0.01 * [t in {decay}] * t)")
        self.stmts.append(Stmt("raw", "\n".join([f"for t in {listed} {{"] + body + ["}"])))

    def pool_edges(self, nm):
        for p in self.pool:
            if p[0] == nm:
                return p[1]
        raise KeyError(nm)


def _strip_calls(node: Node, names: set) -> Node:
    """`node` with every call of a function in `names` replaced by its (one) argument."""
    if node.op == "call" and node.attrs[0] in names:
        return _strip_calls(node.kids[0], names)
    return node.with_kids([_strip_calls(k, names) for k in node.kids]) if node.kids else node


def generate(seed: int) -> Program:
    """The random program of `seed` (deterministic)."""
    return Gen(seed).program()
