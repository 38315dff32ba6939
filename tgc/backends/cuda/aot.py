"""`tgc build --target cuda`: the CUDA module of a program as a file (`.cu` source,
`.ptx` or `.cubin` through nvcc) and a JSON manifest beside it, from which a host
program with the CUDA driver API can run it.

The manifest says everything the Python runtime (`runtime.CudaKernels` under `tgc.runtime.program.Program`) knows:
the symbolic dims (kernel parameters, in order), the arguments and outputs (ABI
order, shapes as size expressions of the dims), every buffer (kind, dtype, axis
order, workspace slot), the workspace (slots of `max(sizes)` bytes, each at a
256-byte aligned offset), the checks, and the launches in order: for a kernel, its
name, its buffer parameters, its work items (a size expression; a grid-stride loop:
any grid works, 256 threads per block), and for a reduction its one-block-per-output
variant with the reduced size above which to use it; for a GEMM cell, its operands'
views and edge groups (the host plans the strided batched cuBLAS call from the
layouts, as `gemm.plan_looped` does); a cell on two bf16 or two f16 operands has
`ex`: their types, the f32 output and `CUBLAS_COMPUTE_32F` of its
`cublasGemmStridedBatchedEx` call; a cell that adds into its output (`gemm %c += a @ b`)
has `"beta": 1.0` (the call's beta, 0 where absent), and one into the leading block of
longer edges of its output `"prefix"` (product edge -> output edge: the output's strides,
the product's extents); for a loop over an edge (kind steps), its trip count, direction,
bound buffers, the step's buffers and launches and the carries' copy launches, which the
host runs for each index. bf16/f16 buffers (and arguments and outputs held
in them) have dtype bf16 or f16: 16-bit elements (bfloat16 bits, IEEE half). Every kernel's parameters are its buffers, then
each dim as `long long`, then `int* err` (the error word: nonzero after the checks
means the check of that number failed).

The bytes depend only on the program, the options and nvcc's version (nvcc's output
does not depend on the file's folder): builds are reproducible.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from tgc import __version__
from tgc.backends.base import BackendUnavailable
from tgc.backends.cuda import codegen
from tgc.backends.cuda.options import CudaOptions
from tgc.backends.cuda.runtime import WS_ALIGN
from tgc.lower.lowered import Lowered
from tgc.ir.sizes import size_str
from tgc.options import Options

EMITS = ("cu", "ptx", "cubin")


def build(low: Lowered, options: Options, emit: str) -> tuple[bytes, bytes]:
    """(the module as `emit`, the manifest as JSON bytes) of the lowered program `low`
    (the CUDA backends' lowering of a module after the IR pipeline and the target
    passes, `tgc.pipeline.target`: under --fp-strict, an f32 program is its f64
    emulation, and `options` say f64), for the GPU architecture `options.cuda.arch`."""
    arch = options.cuda.arch
    cm = codegen.generate(low, cuda=options.cuda)
    if emit == "cu":
        data = cm.source.encode()
    else:
        data = _nvcc(cm.source, emit, arch, options.fp_strict)
    return data, manifest(low, cm, emit, arch, options.cuda)


def _nvcc(source: str, emit: str, arch: str, strict: bool) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BackendUnavailable(f"--emit {emit} needs nvcc (the CUDA toolkit), which is not installed; "
                                 f"--emit cu writes the CUDA source")
    with tempfile.TemporaryDirectory(prefix="tgc-cuda-") as tmp:
        cu, out = Path(tmp) / "module.cu", Path(tmp) / f"module.{emit}"
        cu.write_text(source)
        cmd = [nvcc, f"-{emit}", f"-arch={arch}", "--std=c++17"] + (["--fmad=false"] if strict else [])
        done = subprocess.run(cmd + ["-o", str(out), str(cu)], capture_output=True, text=True)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["?"])[0]
            if "arch" in done.stderr and "not defined" in done.stderr or "Unsupported gpu architecture" in done.stderr:
                raise BackendUnavailable(f"nvcc does not know the architecture '{arch}': {first}")
            raise RuntimeError(f"internal: the generated CUDA module does not compile:\n{done.stderr[-4000:]}")
        return out.read_bytes()


def manifest(low: Lowered, cm: codegen.CudaModule, emit: str, arch: str, cuda: CudaOptions | None = None) -> bytes:
    cuda = cuda or CudaOptions()
    m = low.module
    targets = {u.target for u in m.updates}

    def spec(name: str, edges, kind: str, dtype: str, **extra) -> dict:
        return {"name": name, "kind": kind, "dtype": dtype, "edges": list(edges),
                "shape": [size_str(m.size(e)) for e in edges], **extra}

    out_type = {b.index: b.dtype for b in low.buffers.values() if b.kind == "out"}
    args = [spec(a.name, a.order, a.kind, low.buffers[a.name].dtype if a.name in low.buffers
                 else "i32" if a.dtype == "i32" else low.dtype, updated=a.name in targets)
            for a in m.args.values()]
    outs = [spec(o.name, o.order, "output", out_type.get(j, low.dtype)) for j, o in enumerate(m.outputs)]
    buffers = _buffers(low)
    launches = _launches(low, cm.launches, cuda)
    doc = {
        "tgc": __version__, "format": emit, "arch": arch, "dtype": low.dtype,
        "dims": list(cm.dims), "block": (cuda or CudaOptions()).block_threads,
        "kernel_params": "buffers (in each launch's order), then each dim as long long, then int* err",
        "args": args, "outputs": outs, "buffers": buffers,
        "workspace": {"align": WS_ALIGN, "slots": [[size_str(s) for s in sizes] for sizes in low.slots]},
        "checks": [{"number": i + 1, "buffer": c.buf, "size": size_str(c.size), "note": c.note}
                   for i, c in enumerate(low.checks)],
        "launches": launches,
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _buffers(low: Lowered) -> list[dict]:
    """Every buffer of `low` (the program or a loop's step): kind, dtype, axis order and
    shape, and its ABI index or workspace slot."""
    buffers = []
    for b in low.buffers.values():
        order = b.order if b.order is not None else b.edges
        entry = {"name": b.name, "kind": b.kind, "dtype": b.dtype, "order": list(order),
                 "shape": [size_str(low.size(e)) for e in order]}
        if b.kind in ("arg", "out"):
            entry["index"] = b.index
        if b.slot is not None:
            entry["slot"] = b.slot
        buffers.append(entry)
    return buffers


def _launches(low: Lowered, launches: list, cuda: CudaOptions) -> list[dict]:
    """The manifest's entries of `launches` (of program `low`: the whole program, or a
    loop's step, whose buffers and slots are its own; `cuda`: the settings the kernels
    were generated with)."""
    out = []
    for x in launches:
        if x.kind == "steps":
            k, step = x.loop, x.loop.step
            outs = sorted((b for b in step.buffers.values() if b.kind == "out"), key=lambda b: b.index)
            out.append({
                "kind": "steps", "edge": k.edge, "trip": size_str(k.trip), "reverse": k.reverse,
                "run": "for i in 0 .. trip - 1 (trip - 1 .. 0 when reverse): the step's launches on its own "
                       "buffers (args, outputs: the bound buffers, a stacked one at i * the slice's bytes; "
                       "temps: slot_base + slot of the enclosing program's workspace), then the carry launches",
                "args": [{"step": n, "buffer": b.buf, "stacked": b.stacked} for n, b in zip(step.module.args, k.args)],
                "outs": [{"step": sb.name, "buffer": b.buf, "stacked": b.stacked} for sb, b in zip(outs, k.outs)],
                "carries": k.carries, "slot_base": k.slot_base,
                "step": {"buffers": _buffers(step), "launches": _launches(step, x.body, cuda)},
                "carry": _launches(low, x.carry, cuda)})
            continue
        if x.kind == "gemm":
            k = x.gemm
            out.append({"kind": "gemm", "out": k.out,
                        "a": {"buffer": k.a.buf, "edges": {v: b for v, b in k.a.edges}},
                        "b": {"buffer": k.b.buf, "edges": {v: b for v, b in k.b.edges}},
                        "batch": list(k.batch), "m": list(k.m), "n": list(k.n), "k": list(k.k),
                        **({"complex": {"conj": list(k.cplx), "alpha": k.alpha}} if k.cplx is not None else {}),
                        **({"beta": 1.0} if k.acc else {}),
                        **({"prefix": {p: b for p, b in k.prefix}} if k.prefix else {}),
                        **({"ex": {"a": ta, "b": tb, "out": "f32", "compute": "CUBLAS_COMPUTE_32F"}}
                           if (ta := low.buffers[k.a.buf].dtype) in ("bf16", "f16")
                           and (tb := low.buffers[k.b.buf].dtype) else {})})
            continue
        entry = {"kind": x.kind, "kernel": x.name, "buffers": list(x.bufs),
                 "items": " * ".join(f"({size_str(s)})" for s in x.total) or "1"}
        if x.kind == "rows":
            entry["items"] = " * ".join(f"({size_str(s)})" for s in x.total) or "1"
            entry["warp_kernel"] = x.warp
            entry["row_length"] = " * ".join(f"({size_str(s)})" for s in x.inner) or "1"
            entry["kernel_block"] = (f"threads of `kernel`: the fewest power of two t >= 32 with t >= "
                                     f"{cuda.row_block_min} and t * {cuda.row_regs} >= row_length, at most the "
                                     f"largest power of two <= {cuda.row_block_max} (CudaOptions.row_block)")
            entry["writes"] = list(x.writes)
        if x.kind == "flash":   # attention's chain: one block per tile of rows (tgc.backends.cuda.flashgen)
            rows = size_str(x.total[-1])
            entry["items"] = " * ".join([f"({size_str(s)})" for s in x.total[:-1]] + [f"ceil(({rows}) / {x.inner[0]})"])
            entry["block"] = "one block of any size per item (128 threads on a GPU)"
            entry["writes"] = list(x.writes)
        if x.slots:   # a row group's column sums: its launch writes the partials, its `_cols` launch adds them
            entry["column_partials"] = {
                "rows": " * ".join(f"({size_str(s)})" for s in x.slots[0]) or "1",
                "columns": " * ".join(f"({size_str(s)})" for s in x.slots[1]) or "1",
                "slots": f"min(ceil(rows / {x.slots[3]}), ceil({x.slots[4]} / columns))",
                "scratch": f"{x.slots[2]} * slots * columns doubles ('{codegen.COL_SCRATCH}', the last buffer), "
                           "written by the row group's launch and added in slot order by the next, its _cols kernel"}
        if x.wide:   # an f32 scatter-add's f64 form
            entry["wide_kernels"] = {
                "kernel": x.wide, **({"round": x.wide_round} if x.wide_round else {}),
                "terms": " * ".join(f"({size_str(s)})" for s in x.terms) or "1",
                "elements": " * ".join(f"({size_str(s)})" for s in x.elems) or "1",
                "when": f"terms > {cuda.wide_scatter_terms} * elements (CudaOptions.wide_scatter_terms), instead "
                        "of `kernel`",
                "scratch": f"elements doubles ('{codegen.COL_SCRATCH}'): the zero kernel's only buffer, the add "
                           "kernel's parameter after the buffers; the round kernel (a thread per element) "
                           "takes the output and the scratch and runs after the add kernel"}
        if x.row:
            entry["row_kernel"] = x.row
            entry["reduced"] = " * ".join(f"({size_str(s)})" for s in x.red)
        if x.col:
            entry["column_kernels"] = {
                "tiles": x.col, "sum": x.col_sum, "tile": codegen.COL_TILE,
                "chunks": f"max(1, min(ceil(reduced / {codegen.COL_ROWS}), ceil({codegen.COL_BLOCKS} / "
                          f"ceil(items / {codegen.COL_TILE}))))",
                "grid": "ceil(items / tile) * chunks blocks (or fewer: a grid-stride loop); the runtime takes "
                        "these instead of row_kernel when reduced >= 128 (CudaOptions.row_min)",
                "scratch": "chunks * items doubles, the parameter after the buffers; "
                           "the sum kernel (a thread per item) runs after the tiles when chunks > 1"}
        out.append(entry)
    return out
