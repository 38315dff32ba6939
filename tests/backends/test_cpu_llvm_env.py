"""tgc.backends.cpu.llvm_env: pipeline levels, JIT, deterministic objects, linking."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from tgc.backends.cpu import llvm_env

SCALE = """
define void @scale(ptr noalias %out, ptr noalias %in, i64 %n) {
entry:
  %go = icmp sgt i64 %n, 0
  br i1 %go, label %loop, label %done
loop:
  %i = phi i64 [0, %entry], [%i1, %loop]
  %p = getelementptr float, ptr %in, i64 %i
  %v = load float, ptr %p
  %r = fmul float %v, 3.0
  %q = getelementptr float, ptr %out, i64 %i
  store float %r, ptr %q
  %i1 = add i64 %i, 1
  %more = icmp slt i64 %i1, %n
  br i1 %more, label %loop, label %done
done:
  ret void
}
"""
SIG = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.mark.parametrize('opt', [0, 1, 2, 3])
def test_jit_runs_at_every_level(opt):
    jm = llvm_env.jit(SCALE, opt)
    x = np.arange(1000, dtype=np.float32)
    y = np.empty_like(x)
    SIG(jm.address('scale'))(y.ctypes.data, x.ctypes.data, x.size)
    np.testing.assert_array_equal(y, 3 * x)
    with pytest.raises(KeyError):
        jm.address('missing')


def test_bad_opt_level():
    with pytest.raises(ValueError):
        llvm_env.optimize(SCALE, 4)


def test_object_bytes_are_deterministic():
    assert llvm_env.emit_object(SCALE, 3) == llvm_env.emit_object(SCALE, 3)
    assert llvm_env.emit_asm(SCALE, 2) == llvm_env.emit_asm(SCALE, 2)


def test_loop_vectorizes_to_host_width():
    asm = llvm_env.emit_asm(SCALE, 3)
    if llvm_env.has_feature('avx512f'):
        assert 'zmm' in asm
        # without prefer_512 the CPU's own tuning decides: 256-bit on parts that prefer it
        # (Zen 4, Intel servers), the same 512-bit code where it prefers 512 (Zen 5)
        own = llvm_env.emit_asm(SCALE, 3, prefer_512=False)
        assert 'zmm' not in own or own == asm
    elif llvm_env.has_feature('avx2'):
        assert 'ymm' in asm
    else:
        pytest.skip('host has neither AVX2 nor AVX-512')


@pytest.mark.skipif(shutil.which('cc') is None, reason='no C compiler to link a .so')
def test_object_links_into_shared_object(tmp_path):
    (tmp_path / 'k.o').write_bytes(llvm_env.emit_object(SCALE, 3))
    subprocess.run(['cc', '-shared', '-o', str(tmp_path / 'k.so'), str(tmp_path / 'k.o')],
                   check=True)
    lib = ctypes.CDLL(str(tmp_path / 'k.so'))
    x = np.arange(100, dtype=np.float32)
    y = np.empty_like(x)
    lib.scale(ctypes.c_void_p(y.ctypes.data), ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(100))
    np.testing.assert_array_equal(y, 3 * x)


def test_object_bytes_are_deterministic_across_processes():
    import hashlib
    import sys
    code = ('import hashlib, sys; from tgc.backends.cpu import llvm_env; '
            'sys.stdout.write(hashlib.sha256(llvm_env.emit_object(sys.stdin.read(), 3))'
            '.hexdigest())')
    root = str(__import__('pathlib').Path(__file__).resolve().parents[2])
    digest = subprocess.run([sys.executable, '-c', code], input=SCALE, capture_output=True,
                            text=True, check=True, cwd=root).stdout
    assert digest == hashlib.sha256(llvm_env.emit_object(SCALE, 3)).hexdigest()
