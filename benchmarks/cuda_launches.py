"""Launches per call of the CUDA backends' modules (deterministic, no GPU needed):
for each benchmark workload and example, the launch list's length with and without
the `rowgroup` stage, how many of its launches are row groups, and how many kernels
have a float4 loop.

    python benchmarks/cuda_launches.py
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from tgc import pipeline  # noqa: E402
from tgc.backends.cuda import codegen  # noqa: E402
from tgc.backends.cuda.runtime import lower  # noqa: E402
from tgc.options import Options  # noqa: E402


def main() -> None:
    paths = sorted((HERE / "workloads").glob("*.tg")) + [HERE.parent / "examples" / n for n in ("gpt.tg", "layernorm.tg")]
    print(f"{'program':<26}{'launches':>9}{'no groups':>10}{'row groups':>11}{'float4 loops':>13}")
    for path in paths:
        o = Options(dtype="f32")
        m = pipeline.lower(pipeline.load(str(path), o), o).module
        on = codegen.generate(lower(m, o))
        off = codegen.generate(lower(m, o.with_(row_groups=False)))
        name = f"{path.parent.name}/{path.name}"
        print(f"{name:<26}{len(on.launches):>9}{len(off.launches):>10}"
              f"{sum(x.kind == 'rows' for x in on.launches):>11}{on.source.count('TGC_SIM_COUNT(0)'):>13}")


if __name__ == "__main__":
    main()
