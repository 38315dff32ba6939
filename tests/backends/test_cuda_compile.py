"""Every kernel the CUDA backend generates for the examples and the corpus programs
compiles for sm_90 with nvcc, with zero warnings (as errors), in f32 and f64.

The modules of one float type are compiled as one translation unit (each program's
kernels under its own name prefix): two nvcc runs in all. Skipped, with the
reason, where nvcc is absent."""
import shutil
import subprocess
from pathlib import Path

import pytest

from tgc import driver
from tgc.backends.cuda import codegen
from tgc.backends.cuda.runtime import lower
from tgc.options import Options

ROOT = Path(__file__).parent.parent.parent
PROGRAMS = sorted((ROOT / "examples").glob("*.tg")) + sorted((ROOT / "tests/programs/good").glob("*.tg"))
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_program_compiles_for_sm90_without_warnings(dtype, tmp_path):
    options = Options(dtype=dtype)
    sources, kernels = [], 0
    for i, path in enumerate(PROGRAMS):
        module = driver.lower(driver.load(str(path), options), options).module
        cm = codegen.generate(lower(module, options), prefix=f"p{i}_")
        sources.append(f"// {path.name}\n{cm.source}")
        kernels += len(cm.kernel_names())
    cu = tmp_path / f"all_{dtype}.cu"
    cu.write_text("\n".join(sources))
    done = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-o",
                           str(tmp_path / "all.cubin"), str(cu)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.strip() == "", done.stderr[-3000:]
    assert kernels > 100 and (tmp_path / "all.cubin").stat().st_size > 0
