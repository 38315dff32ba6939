"""implicit: the CPU backend's lowering stage that turns a gather copy feeding GEMMs
(im2col: a 2-D convolution's window buffer) into implicit GEMMs. On unless
`options.cpu.implicit_gemm` is False: it saves the window's memory (the conv2d
benchmark's workspace 25.2 -> 6.4 MB) and its write and two reads, and packing the
window from the source (fgemm.py's `_Lanes`) costs less than the copy
(docs/optimization.md, "Implicit GEMMs").

`Lowered` -> `Lowered`, after `gemm_operands`. `fuse` makes a 2-D convolution's
window `x[h = ho + kh - 1, w = wo + kw - 1]` a loop kernel writing a buffer
[batch, cin, ho, kh, kw, wo] (9x the image: 18.9 MB for the conv2d benchmark) that
two GEMMs then read (the output and the kernel gradient). Here each such GEMM
becomes an `ImplicitGemm` holding the copy's loop (`gather`) and the product
(`gemm`): the code never writes the buffer; tgc's own f32 kernel (fgemm.py) packs
each block of the window operand straight from the copy's source, masked where the
copy's conditions say zero (the padding), so the big buffer and its write and two
reads disappear, and the product's K (cin x kh x kw) sums in one register tile.
The copy kernel goes when every reader of its buffer became implicit.

A copy `g` qualifies when it writes a temporary with no reduction, scatter,
epilogue or bounds, at the identity index over exactly its loops, in the program's
f32, its body a load of an f32 buffer at affine indices, masked or not; every reader
of its buffer is a real f32 GEMM without taps or shifts on that buffer that reads it
once and may run the own kernel (`gemm_dispatch.uses_own_gemm`), whose window operand is the
normalized product's B' with its columns contiguous or its A' with its K contiguous
(as `layout` stores the window buffer for BLAS); the source's innermost edge is read
at `run + c + ...` (`run`: the buffer's innermost loop) and no other source edge or
batch/tap edge of the product enters the index of `run` or the conditions in a way the
packer cannot follow: the source index of `run` steps by one element per element of
`run`, the conditions use no batch or tap edge of the product. Anything else stays
as it is.

Exact: the values are those of the copy followed by the product (the interpreter runs
exactly that); only the order of the product's sum may change, as a contraction's
may. Terminates: one pass over the kernels.

Split sums (`split_taps`). A product that sums over a tap edge (looped outside the
calls: a 2-D convolution's kernel gradient, summed over the images) has few rows and
columns for a long sum: cut into `options.cpu.gemm_tiles` tiles of its rows, every
tile packs the other operand (the transposed dy, for every image) again, once per
tile, so two threads pack all of it each. Such a product instead sums the tap edge
in `gemm_tiles` parts (`ImplicitGemm.parts`): part i adds the taps of its contiguous
range (ceil(taps / parts) each) over the whole product into its row of a partial
buffer `[#part, out edges]` (each part one task, one tile), and a loop kernel after it
adds the rows into `out`, in part order. Each thread then packs only its parts'
images. Chosen when the product has a single tap edge and nothing else that sums
outside the calls (no shifts, batch, `+=` or epilogue), each part sums at least two
taps, the product is large enough to be tiled at all (as `gemm.GemmGen.tile_limit`
would: at least `gemm_parallel_min_flops` flops, more than `blas_tile_mnk` per tile),
and the partial rows take at most `options.cpu.implicit_split_bytes` (0: never) at
known sizes. Not exact to the bit: every element's sum takes its terms part by part,
then the parts (f32), the same on any number of threads (the parts depend on the
sizes and options only).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tgc.ir.passes import Pass
from tgc.lower.lowered import Buffer, GemmKernel, Ix, Load, LoopKernel, Lowered, Mask, matrix_form, rename_buffers
from tgc.lower.text import KernelForm
from tgc.options import Options


PART_EDGE = "#part"   # the partial buffers' part edge (not a name of the language)


@dataclass
class ImplicitGemm:
    """A GEMM one of whose operands is the output of a gather loop (`gather`), which is
    never stored: the product's code packs that operand's blocks from the gather's
    source. `order` is the axis order the window buffer would have had (the product
    reads the operand as that matrix). Runs as the gather followed by the product."""
    gather: LoopKernel
    gemm: GemmKernel
    order: tuple[str, ...]
    note: str = ""
    # split sums (see the module): the tap edge summed in `parts` parts, part i into row i of
    # `partial` (a buffer [part_edge, ...], `part_edge` its first edge), which a loop kernel after
    # this one adds up; `gemm.out` is then one row of it (`row_buffer`, never a buffer of the
    # program, as the window is not); "" and 0: the product written whole into `gemm.out`
    partial: str = ""
    part_edge: str = ""
    parts: int = 0
    kind = "implicit"          # what `tgc explain` calls it (a class attribute)

    @property
    def window(self) -> str:
        return self.gather.out

    @property
    def source(self) -> str:
        return self.load().buf

    def load(self) -> Load:
        body = self.gather.body
        return body.arg if isinstance(body, Mask) else body

    def role(self) -> str:
        return "a" if self.gemm.a.buf == self.window else "b"

    def buffers_read(self) -> set[str]:
        return (self.gather.buffers_read() | self.gemm.buffers_read()) - {self.window}

    @property
    def target(self) -> str:
        """The buffer this kernel writes: `partial` when split, else the product's `out`."""
        return self.partial or self.gemm.out

    def row_buffer(self, low: Lowered) -> Buffer:
        """A split sum's `gemm.out`: one part's row of `partial` (never allocated)."""
        part = low.buffers[self.partial]
        order = tuple(part.order[1:])
        return Buffer(self.gemm.out, part.dtype, tuple(sorted(order)), "temp", order=order)

    def private(self, low: Lowered) -> dict[str, Buffer]:
        """The buffers only this kernel sees: its window, and a split sum's row."""
        out = {self.window: self.buffer(low.dtype)}
        if self.partial:
            out[self.gemm.out] = self.row_buffer(low)
        return out

    def part_range(self, part: int, taps: int) -> tuple[int, int]:
        """The taps [lo, hi) part `part` of `parts` sums (ceil(taps / parts) each, in order)."""
        chunk = -(-taps // self.parts)
        return min(taps, part * chunk), min(taps, (part + 1) * chunk)

    def writes(self) -> set[str]:
        return {self.target}

    def buffers_used(self) -> list[str]:
        names = [b for b in self.gemm.buffers_used() if b != self.window] + [self.source]
        if self.partial:
            names = [self.partial if b == self.gemm.out else b for b in names]
        return list(dict.fromkeys(names))

    def renamed(self, mapping):
        keep = {k: v for k, v in mapping.items() if k != self.window and not (self.partial and k == self.gemm.out)}
        return replace(self, gather=rename_buffers(self.gather, keep), gemm=rename_buffers(self.gemm, keep),
                       partial=keep.get(self.partial, self.partial))

    def can_retarget(self, low: Lowered, target: str, tmp: str) -> bool:
        """Never written in place of an update (plan's retargeting): conservative."""
        return False

    def buffer(self, dtype: str) -> Buffer:
        """The window buffer the product reads (never allocated)."""
        return Buffer(self.window, dtype, tuple(sorted(self.order)), "temp", order=self.order)

    def flops(self, extent, edge_size) -> int:
        n = 2
        for e in self.gemm.batch + self.gemm.m + self.gemm.n + self.gemm.k + self.gemm.taps:
            n *= edge_size(e)
        return n

    def interpret(self, it) -> None:
        """The gather into a window array, then the product, then the array is dropped.
        Split: each part's product over its taps alone (the window zero at the others:
        the interpreter sums in f64), rounded into its row of `partial`."""
        shape = [it.size(e) for e in self.order]
        it.arrays[self.window], it.order[self.window] = np.full(shape, np.nan, it.fp), self.order
        try:
            it.loop(self.gather, {})
            if not self.partial:
                it.gemm(self.gemm)
                return
            tap = self.gemm.taps[0]
            axis = list(self.order).index(tap)
            full = it.arrays[self.window]
            part_out = it.arrays[self.partial]
            rows = [slice(None)] * part_out.ndim
            at = list(it.order[self.partial]).index(self.part_edge)
            tmp = self.gemm.out
            out_order = tuple(e for e in it.order[self.partial] if e != self.part_edge)
            try:
                for i in range(self.parts):
                    lo, hi = self.part_range(i, full.shape[axis])
                    keep = np.zeros(full.shape[axis], bool)
                    keep[lo:hi] = True
                    shape1 = [1] * full.ndim
                    shape1[axis] = full.shape[axis]
                    it.arrays[self.window] = np.where(keep.reshape(shape1), full, np.zeros((), full.dtype))
                    it.arrays[tmp] = np.zeros([it.size(e) for e in out_order], part_out.dtype)
                    it.order[tmp] = out_order
                    it.gemm(self.gemm)
                    rows[at] = i
                    part_out[tuple(rows)] = it.arrays[tmp]
            finally:
                it.arrays.pop(tmp, None)
                it.order.pop(tmp, None)
        finally:
            del it.arrays[self.window], it.order[self.window]

    def verify(self, verifier, defined: set[str]) -> None:
        """The gather as a loop kernel and the product as a GEMM, with the window
        declared while they are checked."""
        low = verifier.low
        if self.window in low.buffers:
            raise verifier.fail(f"the implicit window '%{self.window}' is also a buffer")
        if sorted(self.order) != sorted(e for e, _ in self.gather.index):
            raise verifier.fail(f"the implicit window's order {', '.join(self.order)} does not name its edges")
        if self.partial:
            part = low.buffers.get(self.partial)
            if part is None or not part.order or part.order[0] != self.part_edge:
                raise verifier.fail(f"the split sum's partial buffer '%{self.partial}' is not declared "
                                    f"with its edge '{self.part_edge}' first")
            if self.gemm.out in low.buffers:
                raise verifier.fail(f"the split sum's row '%{self.gemm.out}' is also a buffer")
            if len(self.gemm.taps) != 1 or self.gemm.shifts or self.gemm.batch or self.gemm.acc or self.gemm.epilogue:
                raise verifier.fail("a split sum needs a product with one tap edge and no shifts, batch, += or epilogue")
            if low.size(self.part_edge) != self.parts or self.parts < 1:
                raise verifier.fail(f"the split sum's edge '{self.part_edge}' does not have its {self.parts} parts")
        private = self.private(low)
        low.buffers.update(private)
        try:
            verifier.loop(self.gather, defined, {}, set())
            verifier.gemm(self.gemm, defined | {self.window})
        finally:
            for name in private:
                del low.buffers[name]

    def text(self) -> str:
        split = f" parts {self.parts} into %{self.partial}" if self.partial else ""
        head = f"implicit %{self.window} order [{', '.join(self.order)}]{split}" + (f"    # {self.note}" if self.note else "")
        gather = self.gather.text().replace("\n      for", "\n          for")
        return f"{head}\n    {gather}\n    {self.gemm.text()}"


def read_implicit(reader, t) -> ImplicitGemm:
    """An `implicit ...` kernel of the lowered text (`reader`: `tgc.lower.text`'s walk)."""
    buf, order_t, *rest = t.children
    name = str(buf)[1:]
    if name in reader.low.buffers:
        raise reader.error(f"the implicit window '%{name}' is also a buffer", buf)
    order = reader.names(order_t)
    note = ""
    kernels = []
    parts, partial, part_edge = 0, "", ""
    for c in rest:
        if c.data == "note":
            note = reader.note(c)
        elif c.data == "implicit_split":
            n, pbuf = c.children
            parts, partial = int(n), str(pbuf)[1:]
            if partial not in reader.low.buffers or not reader.low.buffers[partial].order:
                raise reader.error(f"the partial buffer '%{partial}' is not declared", pbuf)
            part_edge = reader.low.buffers[partial].order[0]
        else:
            kernels.append(c)
    reader.low.buffers[name] = Buffer(name, reader.low.dtype, tuple(sorted(order)), "temp", order=order)
    row = None
    if partial:   # a split sum's product writes one row of the partial buffer: declared while read
        out_tok = kernels[1].children[0]
        row = str(out_tok)[1:]
        if row in reader.low.buffers:
            raise reader.error(f"the split sum's row '%{row}' is also a buffer", out_tok)
        part = reader.low.buffers[partial]
        reader.low.buffers[row] = Buffer(row, part.dtype, tuple(sorted(part.order[1:])), "temp",
                                         order=tuple(part.order[1:]))
    try:
        reader.meta_line = kernels[0].meta.line
        gather = reader.loop(kernels[0])
        reader.meta_line = kernels[1].meta.line
        gemm = reader.gemm(kernels[1])
    finally:
        del reader.low.buffers[name]
        if row is not None:
            del reader.low.buffers[row]
    return ImplicitGemm(gather, gemm, order, note, partial, part_edge, parts)


# a gather loop whose output (the window, never stored) one GEMM reads
IMPLICIT_FORM = KernelForm("implicit", r"""
implicit: "implicit" BUF "order" "[" names "]" implicit_split? note _NL loop gemm
implicit_split: "parts" INT "into" BUF
""", read_implicit)


@dataclass(frozen=True)
class Implicit(Pass[Lowered, Lowered]):
    """GEMMs reading a gather copy's output pack it from the copy's source."""

    name = "implicit"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("implicit")
        make_implicit(out, options)
        split_taps(out, options)
        return out


def _window_ok(low: Lowered, g: LoopKernel) -> bool:
    """Whether loop kernel `g` is a gather copy the packer can read (see the module)."""
    if g.reduce or g.scatter or g.epilogue is not None or g.bounds or low.dtype != "f32":
        return False
    buf = low.buffers.get(g.out)
    if buf is None or buf.kind != "temp" or buf.dtype != "f32" or buf.order is None:
        return False
    if tuple(buf.order) != tuple(g.loops) or any(ix != Ix.var(e) for e, ix in g.index):
        return False
    body = g.body
    conds = body.conds if isinstance(body, Mask) else ()
    load = body.arg if isinstance(body, Mask) else body
    if not isinstance(load, Load) or low.buffers[load.buf].dtype != "f32" or low.buffers[load.buf].order is None:
        return False
    src = low.buffers[load.buf]
    if not g.loops or not src.order:   # a scalar copied or broadcast (`update m = lr`): no window
        return False
    run = g.loops[-1]
    index = dict(load.index)
    for e, ix in index.items():
        if any(not isinstance(a, str) or not isinstance(c, int) for a, c in ix.terms):
            return False
        if e != src.order[-1] and run in ix.vars():
            return False
    if index[src.order[-1]].coef(run) != 1:
        return False
    for c in conds:
        if any(not isinstance(a, str) or not isinstance(k, int) for a, k in c.ix.terms) or c.op not in (">=", "<"):
            return False
        if c.ix.coef(run) not in (0, 1, -1):   # the packer bounds the lanes where a condition holds
            return False
        if not _fits_i32(low, c.ix):   # the packer's tables hold condition values as i32 lanes
            return False
    return True


def _fits_i32(low: Lowered, ix: Ix) -> bool:
    """Whether every value of `ix` over its variables' fixed ranges is an i32."""
    if not isinstance(ix.const, int):
        return False
    bound = abs(ix.const)
    for v, k in ix.terms:
        n = low.size(v)
        if not isinstance(n, int):
            return False
        bound += abs(k) * max(n - 1, 0)
    return bound < 1 << 30


def _reader_ok(low: Lowered, k, window: str, g: LoopKernel, options: Options) -> bool:
    from tgc.backends.cpu.gemm_dispatch import uses_own_gemm

    if not isinstance(k, GemmKernel) or k.cplx is not None or k.taps and any(
            t in _cond_vars(g) for t in k.taps):
        return False
    if (k.a.buf == window) == (k.b.buf == window) or k.shifts or k.out == window:
        return False
    if not uses_own_gemm(low, k, options, window=True):
        return False
    role = "a" if k.a.buf == window else "b"
    view = k.a if role == "a" else k.b
    if any(v != e for v, e in view.edges):
        return False    # the product sees the window's own edges (renames: not needed so far)
    if any(e in _cond_vars(g) for e in k.batch):
        return False
    order = tuple(low.buffers[window].order)
    # the other operand in the product's edge names (its view may rename its buffer's edges)
    fa = matrix_form(order if role == "a" else k.a.view_order(low.buffers[k.a.buf].order), k.m, k.k)
    fb = matrix_form(order if role == "b" else k.b.view_order(low.buffers[k.b.buf].order), k.k, k.n)
    fc = matrix_form(low.buffers[k.out].order, k.m, k.n)
    if None in (fa, fb, fc):
        return False
    flip = not fc[2]
    # the normalized product's A' must have K contiguous (the own kernel's broadcasts)
    a_k_unit = fa[2] if not flip else not fb[2]
    if not a_k_unit:
        return False
    if not flip:   # window = A (A' rows, K contiguous) or B (B' rows, N contiguous)
        return fa[2] if role == "a" else fb[2]
    # flipped: A' = B^T, B' = A^T
    return (not fb[2]) if role == "b" else (not fa[2])


def _cond_vars(g: LoopKernel) -> set[str]:
    return {v for c in (g.body.conds if isinstance(g.body, Mask) else ()) for v in c.ix.vars()}


def make_implicit(low: Lowered, options: Options) -> None:
    """In place: see the module's docstring."""
    if not options.cpu.implicit_gemm:
        return
    readers: dict[str, list[int]] = {}
    for i, k in enumerate(low.kernels):
        for r in k.buffers_read():
            readers.setdefault(r, []).append(i)
    replaced: dict[int, ImplicitGemm] = {}
    dropped: set[int] = set()
    for i, g in enumerate(low.kernels):
        if not isinstance(g, LoopKernel) or not _window_ok(low, g):
            continue
        users = readers.get(g.out, [])
        if not users or any(j in replaced for j in users) or not all(_reader_ok(low, low.kernels[j], g.out, g, options) for j in users):
            continue
        for j in users:
            replaced[j] = ImplicitGemm(g, low.kernels[j], tuple(low.buffers[g.out].order),
                                       note="window packed from its source")
        dropped.add(i)
        del low.buffers[g.out]
    if replaced:
        low.kernels = [replaced.get(j, k) for j, k in enumerate(low.kernels) if j not in dropped]


def split_parts(low: Lowered, k: ImplicitGemm, options: Options) -> int:
    """How many parts implicit GEMM `k`'s tap sum is split into (see the module); 0: none."""
    cpu = options.cpu
    g = k.gemm
    parts = cpu.gemm_tiles
    if k.partial or parts < 2 or cpu.implicit_split_bytes <= 0:
        return 0
    if len(g.taps) != 1 or g.shifts or g.batch or g.acc or g.epilogue or g.cplx is not None:
        return 0
    sizes = [low.size(e) for e in g.m + g.n + g.k + g.taps]
    if not all(isinstance(n, int) for n in sizes):
        return 0
    taps = low.size(g.taps[0])
    if taps < 2 * parts:   # each part sums at least two taps
        return 0
    out = 1
    for e in g.m + g.n:
        out *= low.size(e)
    mnk = out
    for e in g.k:
        mnk *= low.size(e)
    # tiled at all (`gemm.GemmGen.tile_limit`): not cold, and each tile above blas_tile_mnk
    if 2 * mnk * taps < cpu.gemm_parallel_min_flops or mnk // parts <= cpu.blas_tile_mnk:
        return 0
    if parts * out * 4 > cpu.implicit_split_bytes:
        return 0
    return parts


def split_taps(low: Lowered, options: Options) -> None:
    """In place: implicit GEMMs whose tap sum `split_parts` cuts write partial rows,
    which a loop kernel after each adds into the product's `out` (see the module)."""
    kernels = []
    for k in low.kernels:
        parts = split_parts(low, k, options) if isinstance(k, ImplicitGemm) else 0
        if not parts:
            kernels.append(k)
            continue
        dst = low.buffers[k.gemm.out]
        taken = [e for e in low.edges if e == PART_EDGE or e.startswith(PART_EDGE + ".")]
        edge = next((e for e in taken if low.edges[e] == parts), None) \
            or (f"{PART_EDGE}.{len(taken)}" if taken else PART_EDGE)
        low.edges[edge] = parts
        name = low.fresh("p")
        order = (edge,) + tuple(dst.order)
        low.buffers[name] = Buffer(name, dst.dtype, tuple(sorted(order)), "temp", order=order)
        index = tuple((e, Ix.var(e)) for e in dst.edges)
        full = tuple(sorted(index + ((edge, Ix.var(edge)),), key=lambda t: t[0]))
        sizes = {e: low.size(e) for e in order}
        row = name + "_row"   # never a stem + number of `fresh`
        kernels.append(replace(k, gemm=replace(k.gemm, out=row), partial=name, part_edge=edge, parts=parts,
                               note=(k.note + "; " if k.note else "") + f"taps summed in {parts} parts"))
        kernels.append(LoopKernel(dst.name, index, tuple(dst.order) + (edge,), sizes, Load(name, full), "sum",
                                  (edge,), note="add partial sums"))
    low.kernels = kernels
