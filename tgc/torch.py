"""A compiled program as a PyTorch autograd function.

    import tgc, tgc.torch
    f = tgc.torch.function(tgc.compile("model.tg"))
    out = f(x=x, W=W)                   # {output name: torch tensor}
    out["loss"].backward()              # W.grad from tgc's own derivative program

`function(program)` returns a callable that takes torch CPU tensors (or anything
`numpy.asarray` takes) by argument name and returns the program's outputs as torch
tensors. Through PyTorch's autograd the outputs are differentiable with respect to
every float argument: the backward pass runs a second compiled program, the
vector-Jacobian product of the outputs (`vjp(output, x, cotangent)` summed over the
outputs, derived symbolically by tgc), built on first use and kept. Tensors reach tgc
without a copy (`Tensor.numpy()` on detached CPU tensors); results come back without
one (`torch.from_numpy`). The program's `update`s are not applied here (the forward-
only call): with autograd, PyTorch's optimizer updates the parameters. The backward
pass is differentiable once: a derivative of its gradients (taken with
`create_graph=True`) is an error, never a silent zero; write higher orders in .tg
(`grad` nests).

PyTorch is an optional dependency of this module alone; importing it without PyTorch
installed raises ImportError with the reason. A compiled program also takes torch CPU
tensors directly, updated ones included (written in place, through DLPack): see
`Program.run`.
"""
from __future__ import annotations

import threading

import numpy as np

try:
    import torch
except ImportError as e:   # pragma: no cover - exercised only without torch
    raise ImportError("tgc.torch needs PyTorch (pip install torch); tgc itself does not") from e

from tgc.ir.input_checks import check_names
from tgc.runtime.program import Program


def function(program: Program):
    """The callable `f(**tensors) -> {output: tensor}` that runs `program` forward and
    its derived vector-Jacobian product backward inside PyTorch's autograd."""
    return _Function(program)


class _Function:
    def __init__(self, program: Program):
        self.program = program
        self.forward_program = program.without_updates()
        self.names = [s.name for s in program.inputs]
        self.float_names = {s.name for s in program.inputs if s.dtype != "i32"}
        self.outputs = [s.name for s in self.forward_program.outputs]
        self.cotangents = _vjp_names(program)   # output -> its cotangent argument
        self._vjp = None
        self._lock = threading.Lock()
        self.__doc__ = f"tgc program: ({', '.join(self.names)}) -> ({', '.join(self.outputs)})"

    def __call__(self, **tensors) -> dict:
        check_names(self.names, tensors, TypeError, "argument")   # a Python call's own error
        outs = _Autograd.apply(self, *[tensors[n] for n in self.names])
        return dict(zip(self.outputs, outs))

    def vjp_program(self) -> Program:
        """The compiled backward program: inputs, then one cotangent per output;
        outputs d_NAME for every float argument (built on first use)."""
        with self._lock:
            if self._vjp is None:
                self._vjp = _build_vjp(self.program)
            return self._vjp


class _Autograd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: _Function, *tensors):
        arrays = {n: _numpy(t) for n, t in zip(fn.names, tensors)}
        out = fn.program.run(arrays, updates=False)
        ctx.fn = fn
        ctx.shapes = [np.shape(out[o]) for o in fn.outputs]
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else _tensor(np.array(t))
                                for t in tensors])
        return tuple(_tensor(out[o]) for o in fn.outputs)

    @staticmethod
    def backward(ctx, *grads):
        with torch.no_grad():
            out = _Autograd._backward(ctx, grads)
        sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not sources:
            return out
        return (None, *_underivable(list(out[1:]), sources))

    @staticmethod
    def _backward(ctx, grads):
        fn: _Function = ctx.fn
        saved = ctx.saved_tensors
        vjp, cotangent = fn.vjp_program(), fn.cotangents
        arrays = {n: _numpy(t) for n, t in zip(fn.names, saved)}
        for o, g, spec, shape in zip(fn.outputs, grads, fn.forward_program.outputs, ctx.shapes):
            arrays[cotangent[o]] = np.zeros(shape, _float(spec.dtype)) if g is None else _numpy(g)
        taken = {s.name for s in vjp.inputs}
        res = vjp.run({k: v for k, v in arrays.items() if k in taken})
        out = []
        for n, need in zip(fn.names, ctx.needs_input_grad[1:]):
            key = f"d_{n}"
            out.append(_as_type(_tensor(res[key]), saved[fn.names.index(n)].dtype) if need and key in res else None)
        return (None, *out)


def _underivable(grads: list, sources: list) -> list:
    """`grads` as tensors whose own derivative is an error (create_graph=True, then a
    derivative of them), not constants, which would drop the second-order terms
    silently: each comes from a node that depends on `sources` (the tensors that
    require grad) and raises when a derivative reaches it. PyTorch's
    `once_differentiable` guards only when a cotangent requires grad, not for a scalar
    loss's constant 1, and so not here."""
    return [None if g is None else _Once.apply(g, *sources) for g in grads]


class _Once(torch.autograd.Function):
    """`g`, linked to `sources`; its derivative is an error."""

    @staticmethod
    def forward(ctx, g, *sources):
        return g.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("tgc.torch.function is differentiable once: write a higher "
                           "derivative in .tg (grad and jvp nest)")


def _float(dtype: str) -> np.dtype:
    return np.dtype(np.float64 if dtype == "f64" else np.float32)


def _numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise ValueError(f"tgc's CPU programs take CPU tensors, not {t.device.type} ones")
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:   # numpy has no bfloat16: its bits, as ml_dtypes' bfloat16 (what a program takes)
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)


def _tensor(a) -> "torch.Tensor":
    """A result as a torch tensor, without a copy: a bf16 array (ml_dtypes') as a bf16 tensor."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _as_type(g: "torch.Tensor", dtype) -> "torch.Tensor":
    """A gradient in its argument's float type (a bf16 param's gradient as bf16, as
    PyTorch's own are); a complex one as it is."""
    return g.to(dtype) if dtype.is_floating_point and g.dtype != dtype and g.dtype.is_floating_point else g


def _vjp_names(program: Program) -> dict[str, str]:
    """Output name -> the name of its cotangent argument in the backward program."""
    module = program._origin[0]
    taken = set(module.args) | set(module.edges) | set(module.dims) | {o.name for o in module.outputs}
    names = {}
    for o in program.without_updates().outputs:
        base, n, name = f"g_{o.name}", 1, f"g_{o.name}"
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        names[o.name] = name
    return names


def _build_vjp(program: Program) -> Program:
    """Compile sum over outputs of vjp(output, x, g_output), for every float argument x."""
    from tgc import pipeline
    from tgc.ir import values as V
    from tgc.ir.module import Arg, Module, Output

    module, options = program._origin
    forward = pipeline.forward_only(module)
    names = _vjp_names(program)
    m = Module(dict(module.dims), dict(module.edges), dict(module.args))
    cot = {}
    for o in forward.outputs:
        m.args[names[o.name]] = Arg(names[o.name], "input", o.value.dtype, o.order)
        cot[o.name] = V.arg(names[o.name], o.value.dtype, o.order)
    for a in module.args.values():
        if a.dtype == "i32":
            continue
        x = V.arg(a.name, a.dtype, a.order)
        terms = [V.vjp(o.value, x, cot[o.name]) for o in forward.outputs if o.value.dtype != "i32"]
        if terms:
            m.outputs.append(Output(f"d_{a.name}", terms[0] if len(terms) == 1 else V.add(terms), a.order))
    return pipeline.compile_module(pipeline.lower(m, options, backend=program.backend).module, options, program.backend)
