"""The machine a measurement runs on: its load before, after and during (CPU time other processes took, from
/proc), its CPU's name and the versions of the packages being compared. A benchmark records these beside its
numbers, so a reader can tell a slow row from a busy machine.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process, its threads and its children that ended and
    were waited for) from /proc: a benchmark that runs its systems as child processes counts them as its own."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle and iowait
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return busy, sum(int(x) for x in own[11:15])  # utime + stime + cutime + cstime


def load_snapshot() -> dict:
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    busy, own = cpu_jiffies()
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "uptime": up, "loadavg": list(os.getloadavg()),
            "nproc": int(nproc) if nproc.isdigit() else os.cpu_count(), "_busy": busy, "_own": own,
            "_wall": time.monotonic()}


def load_between(before: dict, after: dict) -> dict:
    """CPU time others took between two snapshots, in cores (busy jiffies of the machine minus ours)."""
    hz = os.sysconf("SC_CLK_TCK")
    wall = after["_wall"] - before["_wall"]
    machine = (after["_busy"] - before["_busy"]) / hz
    own = (after["_own"] - before["_own"]) / hz
    return {"wall_s": round(wall, 1), "machine_busy_cores": round(machine / wall, 2),
            "this_process_cores": round(own / wall, 2), "other_processes_cores": round((machine - own) / wall, 2)}


def public(snapshot: dict) -> dict:
    return {k: v for k, v in snapshot.items() if not k.startswith("_")}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("executorch", "transformers", "llama-cpp-python", "gguf", "torchao"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out
