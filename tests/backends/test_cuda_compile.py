"""Every kernel the CUDA backend generates for the examples and the corpus programs
compiles for sm_90 with nvcc, with zero warnings (as errors): every program in f32,
and in f64 the programs whose kernels differ most (GEMMs and attention, gathers and
scatters, every elementwise function, convolutions and pooling, updates): the f64
text differs only in `tgc_t` and the header's overloads, and nvcc takes ~20 s of CPU
for all programs.

The modules of one float type are compiled as one translation unit (each program's
kernels under its own name prefix): two nvcc runs in all. Skipped, with the
reason, where nvcc is absent."""
import shutil
import subprocess
from pathlib import Path

import pytest

from tgc import pipeline
from tgc.backends.cuda import codegen
from tgc.backends.cuda.runtime import lower
from tgc.options import Options

from marks import sized_by_themselves

ROOT = Path(__file__).parent.parent.parent
PROGRAMS = sorted(sized_by_themselves((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "tests/programs/good").glob("*.tg"))
NVCC = shutil.which("nvcc")
F64_PROGRAMS = ["gpt.tg", "014_gather.tg", "016_functions.tg", "010_conv_stride_pad.tg", "039_conv2d_pool.tg",
                "028_updates.tg", "019_softmax_family.tg"]


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_program_compiles_for_sm90_without_warnings(dtype, tmp_path):
    options = Options(dtype=dtype)
    sources, kernels = [], 0
    programs = PROGRAMS if dtype == "f32" else [p for p in PROGRAMS if p.name in F64_PROGRAMS]
    assert len(programs) >= len(F64_PROGRAMS)
    for i, path in enumerate(programs):
        module = pipeline.lower(pipeline.load(str(path), options), options).module
        cm = codegen.generate(lower(module, options), prefix=f"p{i}_")
        sources.append(f"// {path.name}\n{cm.source}")
        kernels += len(cm.kernel_names())
    cu = tmp_path / f"all_{dtype}.cu"
    cu.write_text("\n".join(sources))
    done = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-o",
                           str(tmp_path / "all.cubin"), str(cu)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.strip() == "", done.stderr[-3000:]
    assert kernels > (100 if dtype == "f32" else 50) and (tmp_path / "all.cubin").stat().st_size > 0


def _libnvrtc():
    """NVRTC (what CuPy's RawModule compiles with): the `nvidia-cuda-nvrtc` wheel's
    library on sys.path, or the system's; None if neither is there."""
    import ctypes
    import ctypes.util
    import sys

    for entry in sys.path:
        lib = Path(entry) / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
        if lib.is_file():
            return ctypes.CDLL(str(lib))
    found = ctypes.util.find_library("nvrtc")
    return ctypes.CDLL(found) if found else None


NVRTC = _libnvrtc()


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_modules_compile_with_nvrtc_as_cupy_would(dtype):
    """The runtime compiles with NVRTC, which has no libc headers and fewer builtins
    than nvcc: the modules must compile there too, with an empty log."""
    import ctypes

    options = Options(dtype=dtype)
    for name in ("examples/gpt.tg", "tests/programs/good/014_gather.tg", "tests/programs/good/016_functions.tg",
                 "tests/programs/good/039_conv2d_pool.tg"):
        module = pipeline.lower(pipeline.load(str(ROOT / name), options), options).module
        source = codegen.generate(lower(module, options)).source
        prog = ctypes.c_void_p()
        assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"module.cu", 0, None, None) == 0
        opts = [b"--std=c++17", b"-arch=sm_90"]
        rc = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
        assert rc == 0 and not log.value.strip(), f"{name}: {log.value.decode()[:2000]}"
