"""Build the torch frontend's compiled tensor facts (``facts.cpp``) against the installed
torch.

Run ``python -m mcrdl_torch.build`` once after installing (``make install`` does): it
compiles with the C++ compiler of the environment (``$CXX``, else ``c++``/``g++`` on
PATH) against torch's headers and libraries and writes ``tensor_facts`` next to this
file. Without it (no compiler, a failed build, or a module built for another torch)
the frontend reads the same facts from Python (``facts.py``): the same results, about
1 µs more per two-tensor call. ``mcrdl info`` says which is in use. The module is
written under a temporary name and renamed into place (``tools.compile``).
"""
from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

from mcrdl_core.tools.compile import compile_into, main

SOURCE = Path(__file__).with_name("facts.cpp")


def target() -> Path:
    """Where the built module goes: next to this file, named for this Python."""
    return SOURCE.with_name("tensor_facts" + sysconfig.get_config_var("EXT_SUFFIX"))


def compiler() -> str | None:
    """The C++ compiler to build with, or None if there is none."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def command(cxx: str, out: str) -> list[str]:
    """The compile-and-link command: torch's include and library folders, its C++ ABI
    flag, and its version recorded in the module."""
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libdirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f'-DMCRDL_TORCH_VERSION="{torch.__version__}"',
            *(f"-I{d}" for d in includes), str(SOURCE), "-o", out,
            *(f"-L{d}" for d in libdirs), *(f"-Wl,-rpath,{d}" for d in libdirs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def build(quiet: bool = False) -> Path:
    """Compile the module; return its path. Raises RuntimeError with the compiler's
    output if it cannot."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX); the torch "
                           "frontend reads tensor facts from Python instead")
    return compile_into(lambda tmp: command(cxx, tmp), SOURCE, target(), quiet)


if __name__ == "__main__":
    main(build)
