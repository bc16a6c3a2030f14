"""Threads: how many cores this process may use, and OpenMP's default team for the threads torch does not set.

A .pte runs its XNNPACK kernels on ExecuTorch's own pool, while the llama custom ops inside the program open OpenMP
regions from whichever thread runs them, with that thread's team size: for a thread torch never set, OMP_NUM_THREADS
as it was when torch first loaded libgomp (all cores when unset). A second team of spinning threads beside the
pool's makes a verify call several times slower on a 2-core machine (docs/design.md §2, "Why torch runs at one
thread while a program runs"). So every package that can start a process sets the default to one before torch loads
(`openmp_default`, called by pipeline/ and runner/ at import), the main thread gets its count explicitly
(`torch.set_num_threads`: what training runs at), and a .pte call runs with the calling thread at one too
(runner.engine.PteEngine). This module imports no torch, so it can run first.
"""

from __future__ import annotations

import os
import sys


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def openmp_default() -> None:
    """OMP_NUM_THREADS=1 if torch has not loaded yet (libgomp reads it once, then); a no-op after."""
    if "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = "1"
