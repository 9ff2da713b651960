"""Build the host codecs' compiled kernels (``mcrdl_core/compress/codec_kernels.c``).

Run ``python -m mcrdl_core.tools.build_codecs`` once after installing (``make install``
does): it compiles with ``$CC``, else ``cc``, else ``gcc``, into ``codec_kernels.so``
next to the source, a plain shared library (no Python headers) that
``mcrdl_core.compress.native`` loads with ctypes. Without it the codecs run their
NumPy/torch code: the same bytes, slower. The flags keep the float arithmetic exactly
IEEE's: no contraction into fused multiply-adds, no fast-math.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..compress.native import SOURCE, TARGET
from .compile import compile_into, main


def compiler() -> str | None:
    """The C compiler to build with, or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(quiet: bool = False, out: Path = TARGET) -> Path:
    """Compile the library into ``out`` (where ``native`` loads it from by default);
    return its path. Raises RuntimeError with the compiler's output if it cannot."""
    cc = compiler()
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler found ({'CC=' + cc if cc else 'cc, gcc or $CC'}): "
                           "install one (e.g. apt install gcc) or set CC; without the "
                           "kernels the codecs run their NumPy path")
    return compile_into(lambda tmp: [
        cc, "-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC", "-Wall",
        "-Wextra", str(SOURCE), "-o", tmp], SOURCE, Path(out), quiet)


if __name__ == "__main__":
    main(build)
