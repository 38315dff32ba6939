"""Whether this machine links the system OpenBLAS (`tgc build --blas=system`), for the tests
that need it to skip with a reason where it is absent (`.ci/run` installs it as root)."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest


@functools.cache
def links_system_openblas() -> bool:
    """A C program calling cblas_sgemm and cblas_cgemm from <cblas.h> links with -lopenblas."""
    if shutil.which("cc") is None:
        return False
    probe = "#include <cblas.h>\nint main(void) { return cblas_sgemm == 0 || cblas_cgemm == 0; }\n"
    p = subprocess.run(["cc", "-x", "c", "-", "-o", os.devnull, "-lopenblas"], input=probe,
                       capture_output=True, text=True)
    return p.returncode == 0


NO_SYSTEM_BLAS = ("needs the system OpenBLAS with cblas.h (Debian/Ubuntu: apt-get install "
                  "libopenblas-dev; .ci/run installs it as root)")
needs_openblas = pytest.mark.skipif(not links_system_openblas(), reason=NO_SYSTEM_BLAS)
