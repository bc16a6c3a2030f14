"""The C++ compiler driver: one ExecuTorch kernel source in, one shared library out, built once per source, flags
and executorch wheel.

`kernel_library(source)` compiles `source` with the compiler the machine has ($CXX, else g++, else c++) against the
executorch wheel's headers and libraries (torch's headers after them) into the user's cache
(`$XDG_CACHE_HOME/eagle3-pipeline`, else `~/.cache/eagle3-pipeline`), as `lib<stem>-<key>.so`, where the key
hashes the source, the flags, the wheel's path and its version.py: a changed source, flag or wheel builds a new
library and an unchanged one is never compiled again. The library is written atomically (compiled in a temporary
directory, then renamed into place), so a crash leaves no half-written library. Which op a library holds and when
it is loaded into the runtime is its caller's (models.exact_sdpa); only the build lives here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC", "-std=c++17",
         "-DET_USE_THREADPOOL")


def executorch_root() -> Path:
    return Path(importlib.util.find_spec("executorch").submodule_search_locations[0])


def kernel_library(source: Path) -> Path:
    """The compiled kernel for this source, these flags and this executorch, built once into the user's
    cache (written atomically: a crash leaves no half-written library)."""
    et = executorch_root()
    torch_include = Path(torch.__file__).parent / "include"
    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + str(et).encode()
                         + (et / "version.py").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3-pipeline"
    path = cache / f"lib{source.stem}-{key}.so"
    if path.is_file():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError(f"native.compiler: building the ExecuTorch kernel {source} needs a C++ compiler "
                           "(g++ or $CXX); none was found on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / path.name
        cmd = [compiler, *FLAGS, f"-I{et / 'include'}", f"-I{et / 'include/executorch/runtime/core/portable_type/c10'}",
               f"-idirafter{torch_include}", str(source), f"-L{et / 'lib'}", "-lexecutorch",
               "-lexecutorch_threadpool", f"-Wl,-rpath,{et / 'lib'}", "-o", str(built)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"native.compiler: compiling {source.name} failed ({' '.join(cmd)}):\n"
                               f"{done.stderr[-3000:]}")
        built.replace(path)
    return path
