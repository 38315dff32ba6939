"""The toy backend: the `lowered` backend's interpreter under another name, with a
lowering stage of its own (the neutral `narrow`: bf16/f16 values in 2-byte buffers,
which the neutral runtime then passes as 2-byte arrays), whose kernels count their
calls (`toy_calls`, which a `Program` forwards as any backend's own attribute), so a
test sees that its code, not another backend's, ran."""
from __future__ import annotations

from tgc.backends.lowered.backend import LoweredBackend, LoweredKernels
from tgc.lower.narrow import Narrow


class ToyBackend(LoweredBackend):
    name = "toy"
    stages = (Narrow,)

    def compile(self, module, low, options, artifacts=None) -> "ToyKernels":
        return ToyKernels(low, self.name)


class ToyKernels(LoweredKernels):
    toy_calls = 0

    def run(self, args: dict, outs: dict, env: dict, notify=None) -> int:
        self.toy_calls += 1
        return super().run(args, outs, env)
