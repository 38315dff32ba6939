"""Which kernel a GEMM cell's tiles may run, decided from the lowered program and the
options before any code is generated: tgc's own f32 kernel (`uses_own_gemm`,
fgemm.py), the bf16 kernel (`bf16_product`, `bf16_kinds`: gemm_bf16.py), the packing
small-tile helper (`packs_b`: gemm_small.py), one call of the own kernel for the
products of a batch sharing B' (`shared_b_batch`) or for all taps (`taps_in_one_call`;
both gemm_taps.py). `GemmGen` (gemm.py) makes the calls these allow, and codegen
compiles only the kernels they name. `operand_forms` reads each operand's and the
result's matrix form, which every decision starts from.
"""
from __future__ import annotations

from tgc.backends.cpu.fgemm import MAX_TAPS
from tgc.lower.lowered import GemmKernel, Lowered, matrix_form
from tgc.options import Options

OWN_COLS = 64     # the own kernel's block of columns (4 vectors of 16)


def uses_own_gemm(low: Lowered, k: GemmKernel, options: Options, window: bool = False) -> bool:
    """Whether GEMM `k`'s large tiles may run tgc's own f32 kernel (fgemm.py) rather
    than cblas: a real f32 product of f32 operands whose A' (the normalized product's
    left operand) has its K contiguous, or its rows (`options.cpu.own_gemm_transposed_a`,
    not a product with taps: the kernel packs such an A' panel by panel),
    `options.cpu.own_gemm` "on", or "auto" where the host has AVX-512 (the kernel's
    16-lane vectors). A tile then goes to it when
    it has at least `own_gemm_min_rows` rows of C' and two blocks of columns (2 x
    OWN_COLS), whatever its depth, with a B' of at most `own_gemm_tall_max_b_bytes`
    (its packing of B' is paid once per panel of `own_gemm_panel_rows` rows, its row
    panels keep A' in L2; fgemm.py: the attention projections' weight gradient, 384 x
    384 x 1024 with A' transposed, is two tiles of 192 rows: own 151-159 GFLOP/s
    against OpenBLAS's 138 on one thread); or when it has at least
    `own_gemm_min_cols` columns of C', or sums at least
    `own_gemm_min_depth` terms over at least one block of columns (OWN_COLS; a
    narrower tile wastes lanes: 64 x 48 x 704 134 / 167), and its B' has at most `own_gemm_max_b_bytes` (it stays in L2
    while its blocks are packed; OpenBLAS streams a larger one from memory better),
    or its A' has K contiguous and its columns are one block (at most OWN_COLS): then
    each K block of B' is packed once per row panel, whatever B''s size (attention's
    P v and dS k at s keys, 128 x 64 x s tiles with A' read from L3: own 134-155
    GFLOP/s, OpenBLAS 94-113, at s = 4096 and 8192); or its A' has its rows contiguous,
    its columns are exactly one block and it has at least `own_gemm_min_rows` rows
    (`own_gemm_tall_transposed`, off by default: attention's dk = dS^T q and dv = P^T dy in a stream
    step, s x 64 x 128 tiles; s = 512 .. 8192, operands from L3, the sum over the
    causal runs' keys: own 3.09-3.28 ms, OpenBLAS 3.94, `benchmarks/attention_pair.py`).
    Measured on the 2-core Xeon (AVX-512; one thread, minimum of 20 calls, GFLOP/s
    own / OpenBLAS; `benchmarks/gemm_peak.py`, docs/optimization.md): the nanoGPT
    products 704 x 192 x 48 191 / 156, 1024 x 384 x 65 205 / 170, 24 x 256 x 256 x
    64 185 / 147, 512 x 384 x 384 210 / 191, 512 x 1536 x 384 193 / 182, 512 x 384
    x 1536 196-203 / 176-184; but 178 x 64 x 64 96 / 171, 64 x 192 x 64 108 / 168
    (few rows: the packing of B' is not paid back), with B' of 4.7 MB and more (width
    768's MLP) 1024 x 1536 x 768 339 / 372 on 2 threads, 1024 x 3072 x 768 168 / 194,
    1024 x 768 x 3072 with B' transposed 171 / 183 (B' read again per panel of 256
    rows; groups of 1024 columns through all of K did not help), 1024 x 65 x
    384 with B' transposed 134 / 147 (a second block of one column): those stay with
    OpenBLAS. With A' transposed (its rows contiguous; packed, load 9): attention's
    24 x 256 x 256 x 64 146 / 127, 384 x 384 x 1024 161 / 160, 768 x 768 x 1024
    150 / 155, but 384 x 65 x 1024 87 / 123 (`GemmGen.own_tile` sends such a tile
    only when its columns fill whole blocks or at least two).
    On the 2-core Zen 5 (one thread, min of 200 calls of one product, its
    operands in cache; GFLOP/s own / OpenBLAS): 64 x 1024 x 288 (conv2d's output per
    image) 183 / 166, 96 x 1024 x 64 182 / 144, 288 x 64 x 1024 with B' transposed
    (conv2d's kernel gradient) 207-220 / 179-193, 178 x 64 x 1024 199 / 160, 178 x
    192 x 256 202 / 172; but with 64 terms 178 x 64 x 64 133 / 202, 64 x 192 x 64
    130 / 205, and 1024^3 179 / 181. Inside conv2d, whose output product reads a
    1.2 MB window per image from memory, OpenBLAS was faster (11.1 against 12.9
    Mcycles), hence the bound on B'. What the layout fixes (contiguity; C' columns
    and K of fixed size) is checked here, so a program whose products can never run
    the kernel does not compile it; the tile sizes at run time."""
    mode = options.cpu.own_gemm
    if mode == "off" or k.cplx is not None or low.dtype != "f32":
        return False
    if any(low.buffers.get(n) is None or low.buffers[n].dtype != "f32" for n in (k.a.buf, k.b.buf)):
        return False
    if any(k.rounded):   # a bf16 GEMM rounding f32 operands as it packs (gemm_operands)
        return False
    if window:   # an implicit GEMM (implicit.py checks its operands): any shape
        return mode == "on" or _has_avx512()
    f = operand_forms(low, k)
    flip = not f["c"][2]
    if not a_k_contiguous(low, k) and (k.taps or not options.cpu.own_gemm_transposed_a):
        return False   # (the taps form reads A' in place)
    cols, depth = _fixed_count(low, f["c"][1] if not flip else f["c"][0]), _fixed_count(low, f["a"][1])
    rows = _fixed_count(low, f["c"][0] if not flip else f["c"][1])
    cpu = options.cpu
    tall = not (rows is not None and rows < cpu.own_gemm_min_rows or cols is not None and cols < 2 * OWN_COLS)
    if cpu.own_gemm_tall_transposed and not a_k_contiguous(low, k) and cols == OWN_COLS and not (
            rows is not None and rows < cpu.own_gemm_min_rows):
        tall = True   # a tall tile of one block of columns, A' transposed: whatever its depth (`own_tile`)
    if not tall and cols is not None and cols < cpu.own_gemm_min_cols and (
            cols < OWN_COLS or depth is not None and depth < cpu.own_gemm_min_depth):
        return False
    return mode == "on" or _has_avx512()


EDGE_ROWS = 4     # rows of the edge block (`edge_vecs`): 4 x 5 takes 20 accumulators, 5 B vectors, 1 broadcast


def edge_vecs(low: Lowered, k: GemmKernel, options: Options) -> int:
    """The vectors of 16 columns of the own kernel's edge block for product `k`'s tiles
    (0: none): `options.cpu.own_gemm_edge_vecs` where it exceeds `own_gemm_vecs` and the
    normalized product's columns Q have a fixed count of which some tile's share (Q,
    or Q halved and rounded up, as `GemmGen.tiles` cuts it) is more than one block of
    the kernel (16 x own_gemm_vecs) and at most 16 x edge_vecs columns. Such a tile
    (`GemmGen.call_own`) runs an EDGE_ROWS x edge_vecs register block over all of its
    columns in one pass, not a 6 x 4 block and an 8 x 2 one whose 32 columns hold its
    few last (nanoGPT-char's logits: 65 columns, 1024 x 65 x 384 with B' transposed
    50% of the FMA peak with 6 x 4 and 8 x 2, 62% with 4 x 5 (5 x 5 60, 3 x 5 56;
    OpenBLAS 52); 384 x 65 x 1024 with A' transposed 33 / 54, OpenBLAS 49; 1024 x
    80 x 384 59 / 73, but 1024 x 64 x 384 70 / 58: one thread, `time.thread_time`
    minima of 30 alternated calls, load 8.5). A symbolic Q compiles no edge block
    (another kernel to compile, for a shape the program may never see)."""
    cpu = options.cpu
    if cpu.own_gemm_edge_vecs <= cpu.own_gemm_vecs or not uses_own_gemm(low, k, options):
        return 0
    f = operand_forms(low, k)
    q = _fixed_count(low, f["c"][1] if f["c"][2] else f["c"][0])
    low_cols, high_cols = 16 * cpu.own_gemm_vecs, 16 * cpu.own_gemm_edge_vecs
    while q is not None and q > low_cols:
        if q <= high_cols:
            return cpu.own_gemm_edge_vecs
        q = (q + 1) // 2
    return 0


def a_k_contiguous(low: Lowered, k: GemmKernel) -> bool:
    """Whether the normalized product's A' has its K contiguous (else its rows are:
    the own kernel packs such an A' panel by panel, fgemm._pack_a_transposed)."""
    f = operand_forms(low, k)
    return f["a"][2] if f["c"][2] else not f["b"][2]


def _has_avx512() -> bool:
    from tgc.backends.cpu.llvm_env import has_feature

    return has_feature("avx512f")


def operand_forms(low: Lowered, k: GemmKernel) -> dict:
    """Each operand's and the result's `matrix_form` (in its buffer's order)."""
    ab, bb, cb = (low.buffers[n] for n in (k.a.buf, k.b.buf, k.out))
    va, vb, vc = (k.matrix_order(o) for o in (k.a.view_order(ab.order), k.b.view_order(bb.order),
                                              k.out_view().view_order(cb.order) if k.prefix else cb.order))
    fa, fb, fc = (matrix_form(o, r, c) if o is not None else None
                  for o, r, c in ((va, k.m, k.k), (vb, k.k, k.n), (vc, k.m, k.n)))
    for form, what in ((fa, f"operand {va}"), (fb, f"operand {vb}"), (fc, "result")):
        if form is None:
            raise ValueError(f"internal: GEMM {what} is not a matrix")
    return {"a": fa, "b": fb, "c": fc}


def bf16_product(low: Lowered, k: GemmKernel) -> bool:
    """Whether `k` is a bf16 product (the `gemm_operands` stage chose it): each operand
    a bf16 buffer, or an f32 one rounded to bf16 as it is read (`k.rounded`)."""
    return k.cplx is None and all(low.buffers[v.buf].dtype == "bf16" or r for v, r in zip((k.a, k.b), k.rounded))


def bf16_kinds(low: Lowered, k: GemmKernel) -> set[tuple[bool, bool]]:
    """The bf16 kernels (`rounds` per operand of the normalized product) `k` calls."""
    if not bf16_product(low, k):
        return set()
    flip = not operand_forms(low, k)["c"][2]
    return {tuple(reversed(k.rounded)) if flip else tuple(k.rounded)}


def packs_b(low: Lowered, k: GemmKernel) -> bool:
    """Whether the product's small tiles pack B' (its columns are not contiguous):
    which small-tile helper it calls (see `GemmGen.operands`)."""
    f = operand_forms(low, k)
    return f["a"][2] if not f["c"][2] else not f["b"][2]


def shared_b_batch(low: Lowered, k: GemmKernel, options: Options) -> tuple[str, ...]:
    """The batch edges of an accumulating product whose tasks each take the whole of,
    so that one call of the own kernel (fgemm: products sharing B) runs the
    products along them on one packed B': the edges B' does not depend on (not in
    its buffer, not in its shifts), where every shift they move clips K (never a
    tile's rows or columns), the batch has fixed sizes and fewer than
    `options.cpu.gemm_batch_tasks` indices (a product tiled by rows and columns), and the own kernel may run it.
    Without it, a 1-D convolution's kernel gradient (5 taps of 64 x 64 x 1024 per
    signal, the input transposed as B') packs each signal 5 times, 40% of its time on
    one thread. Each call's K blocks are cut to each product's range, so where they
    fall depends on the sizes only, never on the thread count."""
    if not k.zeroes() or not uses_own_gemm(low, k, options) or not a_k_contiguous(low, k):
        return ()   # (the kernel packs a transposed A' only for one product per call)
    f = operand_forms(low, k)
    packed = _packed_role(f)
    view = k.b if packed == "b" else k.a
    order = low.buffers[view.buf].order
    reads = {ve for ve, be in view.edges if be in order}
    reads |= {atom for role, _, ix in k.shifts if role == packed for atom, _ in ix.terms}
    edges = tuple(e for e in k.batch if e not in reads)
    if not edges:
        return ()
    if any(e != f["a"][1][0] and any(atom in edges for atom, _ in ix.terms) for _, e, ix in k.shifts):
        return ()
    count = _fixed_count(low, k.batch)
    return edges if count is not None and count < options.cpu.gemm_batch_tasks else ()


def _packed_role(forms: dict) -> str:
    """The operand ('a' | 'b') that is B' of the normalized product (A^T when C
    holds M innermost)."""
    return "b" if forms["c"][2] else "a"




def taps_in_one_call(low: Lowered, k: GemmKernel, options: Options) -> bool:
    """Whether the own kernel may run all taps of product `k` in one call (its
    `taps` form: each block of rows keeps its accumulators across the taps, so C is
    read and written once, not once per tap, and never zeroed first): a product
    the own kernel may run, with at most MAX_TAPS taps of fixed sizes, B''s
    columns contiguous, every shift moving B''s columns or K (never A''s rows, which
    the kernel reads in place), and not one `shared_b_batch` takes. A 1-D
    convolution's output (5 taps of 64 terms) and a 2-D one's input gradient (3)."""
    if not k.taps or not uses_own_gemm(low, k, options) or shared_b_batch(low, k, options):
        return False
    f = operand_forms(low, k)
    flip = not f["c"][2]
    if not (f["b"][2] if not flip else not f["a"][2]):   # B' has its columns contiguous
        return False
    packed = _packed_role(f)
    cols = f["c"][1] if not flip else f["c"][0]
    if any(not (role == packed and e == cols[0] or e == f["a"][1][0]) for role, e, _ in k.shifts):
        return False
    count = _fixed_count(low, k.taps)
    return count is not None and count <= MAX_TAPS


def _fixed_count(low: Lowered, edges) -> int | None:
    """The number of indices of `edges`, or None when a size is symbolic."""
    count = 1
    for e in edges:
        size = low.size(e)
        if not isinstance(size, int):
            return None
        count *= size
    return count


def rows_and_cols(low: Lowered, k: GemmKernel) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(P, Q) of the normalized product (`gemm.GemmGen`): the result's outer and
    contiguous edge groups, in memory order."""
    rows, cols, cols_inner = operand_forms(low, k)["c"]
    return (tuple(rows), tuple(cols)) if cols_inner else (tuple(cols), tuple(rows))


def tile_epilogue(low: Lowered, k, options: Options) -> bool:
    """Whether the CPU runs `k`'s epilogue (`tgc.lower.epilogue`) on each tile right
    after its product (gemm_epilogue.py): `options.cpu.gemm_epilogue`, a real product
    (not bf16) without batch edges (a task is a tile of rows), taps or shifts, whose P
    has one or two edges (a loop group's split loops). The CPU's `group` writes out the
    others as loops after the GEMM."""
    if not isinstance(k, GemmKernel) or not k.epilogue or k.batch or k.cplx is not None or k.taps or k.shifts:
        return False
    if not options.cpu.gemm_epilogue or bf16_product(low, k):
        return False
    try:
        rows, _ = rows_and_cols(low, k)
    except ValueError:
        return False
    return 1 <= len(rows) <= 2
