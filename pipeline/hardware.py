"""What this machine computes well: the training dtype, the thread count and XNNPACK's GEMM row tile.

These defaults follow the machine instead of a number in conf/, because the same number is fast on one
machine and slow on another (a bf16 matmul is 9x slower than fp32 on an AVX2 CPU without avx512_bf16; XNNPACK's
fp32 GEMM takes 7 rows a pass on AVX-512 and 6 on AVX2, its 8da4w GEMM 8 and 3):

- `autocast: auto` (target.train, draft.train): bf16 where the device computes it natively (CUDA with bf16;
  a CPU with avx512_bf16 or AMX tiles whose kernels torch and oneDNN may use), fp32 elsewhere.
- `threads: null`: the cores this process may use (`os.sched_getaffinity`), shared among the jobs that run at
  once, and on the CPU the training and taps loops' `ThreadGovernor` moves between that count and one thread by the
  step times it measures: two OpenMP threads beside one busy process run 2-3x slower than one thread (every
  barrier waits for the thread whose core the neighbour holds), and no wait policy fixes both cases (libgomp's
  default spin-then-sleep is the one that lets one thread run clean once the count drops; PASSIVE halves a
  quiet machine's speed, ACTIVE keeps the idle thread spinning; `bench/lab/omp_wait.py`).
- `engine.exact: auto`: exact mode (runner.engine.ExactEngine) where a row's rounding can flip a token (the
  CUDA engine, a .pte whose target is 8da4w), and `engine.exact_width: auto` its call width, the GEMM's row tile.
- `export.default_chain: auto`: the default K at most DEFAULT_CHAIN (6) and, on XNNPACK, at most the rows its GEMM takes in
  one pass for the target's weights on this CPU minus one (`row_tile`), so the default window T = K+1 does
  not read the weights twice. It depends on export.* and this machine alone: no engine setting moves an export
  key. max_m itself stays 8 everywhere: one .pte serves K = 1..7 on every machine, a wider range costs the
  narrower windows nothing, and the adaptive policy knows each window's measured cost
  (runner.generate.measure_window_costs) before it tries one.
- `engine.default_chain: auto` (engine=cuda, which runs no .pte and has its own windows): min(DEFAULT_CHAIN,
  engine.max_m - 1), whatever the CPU.

`resolve` turns each `auto` into its value before any cache key is computed: a key and a stage's report hold
what was used, never `auto`, and an artifact built with `auto` on a bf16 machine is the one an explicit
`bfloat16` builds. The row tile is measured once per machine (a 4-linear XNNPACK program timed at M = 1..16,
about 7 s) and cached under `~/.cache/eagle3-pipeline/` (`$XDG_CACHE_HOME`), keyed by the CPU's model, its
flags, torch's capability and the executorch version. `python -m pipeline.hardware` prints what this machine
resolves to; `--probe` measures the tile again.

torch is imported inside the functions, so `python -m pipeline.hardware` and the config code load fast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

from models.threads import usable_cores

log = logging.getLogger(__name__)

AUTO = "auto"
MAX_PROBE_ROWS = 16
# A second pass over the rows reads the weights again: time(M) jumps by 1.5-2x. Within a pass it grows a few %.
TILE_JUMP = 1.3
# bf16 against fp32 matmul on a CPU without native bf16 (AVX2 + FMA, 4096x256 @ 256x768, one thread)
MEASURED_BF16_SLOWDOWN = "9x"
# The weights a row tile is measured for: a target's linears in fp32, or 8da4w (export.quant=8da4w_offsets).
WEIGHTS = ("fp32", "8da4w")


# ---------------------------------------------------------------------------------------------------------
# Threads


_governed: int | None = None  # the thread count `threads: null` chose (pipeline.app.set_threads); None: fixed


def govern_threads(n: int | None) -> None:
    """Let training loops move between n threads and one (`threads: null`), or keep the count fixed (None)."""
    global _governed
    _governed = n if n and n > 1 else None


class ThreadGovernor:
    """Runs a CPU loop (training, the taps' generation) at whichever of `threads` and one thread steps faster now.

    It keeps the last `trial` step times of each count (the first step after a switch is not counted: the
    pool wakes up in it); every `every` steps it tries the other count for `trial` steps and keeps the faster
    by the medians; the first trial follows the first `trial` + 1 steps. On a quiet machine that costs about
    (trial + 1) / every of the steps at the slower count; when a busy process appears or leaves, the loop
    follows within `every` steps. Disabled (a no-op) where the thread count is fixed by `threads` or one thread
    is all there is."""

    def __init__(self, device, every: int = 30, trial: int = 3, what: str = "training"):
        import torch

        self.torch = torch
        self.current = torch.get_num_threads()
        hi = _governed if str(device).startswith("cpu") else None
        self.options = (hi, 1) if hi else ()
        self.every, self.trial, self.what = every, trial, what
        self.times: dict[int, list[float]] = {n: [] for n in self.options}
        self.since, self.trying, self.switches = 0, False, 0
        if self.options:
            self._set(hi)
            self.since = max(0, every - trial - 1)  # the first trial comes early: a neighbour may be there already
        self.kept = self.current

    def tick(self, seconds: float) -> None:
        """Account one step of `seconds`; may change torch's thread count before the next."""
        if not self.options:
            return
        if self.since > 0:
            self.times[self.current] = (self.times[self.current] + [seconds])[-self.trial:]
        self.since += 1
        if self.trying and self.since > self.trial:
            self.trying = False
            med = {n: sorted(t)[len(t) // 2] for n, t in self.times.items() if t}
            best = min(med, key=med.get)
            if best != self.kept:
                other = next(n for n in med if n != best)
                log.info("%s: %d thread(s) now step faster (%.2f s against %.2f s at %d)", self.what, best,
                         med[best], med[other], other)
                self.kept = best
            self._set(best)
        elif not self.trying and self.since > self.every:
            self.trying = True
            self._set(next(n for n in self.options if n != self.current))

    def close(self) -> None:
        """Back to the governed count, so what runs after the loop starts where every loop starts."""
        if self.options:
            self._set(self.options[0])

    def _set(self, n: int) -> None:
        if n != self.current:
            self.torch.set_num_threads(n)
            self.current, self.switches = n, self.switches + 1
        self.since = 0


# ---------------------------------------------------------------------------------------------------------
# Training dtype


def cpu_capability() -> str:
    """torch's kernel capability on this CPU (`DEFAULT`, `AVX2`, `AVX512`; `ATEN_CPU_CAPABILITY` lowers it)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def native_bf16(device: str) -> tuple[bool, str]:
    """(whether `device` computes bf16 matmuls natively, why). On a CPU: avx512_bf16 or AMX tiles, with torch's
    capability at AVX512 and oneDNN not capped below avx512_core_bf16 (`ONEDNN_MAX_CPU_ISA`), since either cap
    makes the kernels emulate bf16 even where the CPU has it."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        ok = torch.cuda.is_bf16_supported()
        return ok, "the CUDA device computes bf16" if ok else "the CUDA device has no bf16"
    has = [name for name, yes in (("avx512_bf16", torch.cpu._is_avx512_bf16_supported()),
                                  ("AMX", torch.cpu._is_amx_tile_supported())) if yes]
    cap = cpu_capability()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if not has:
        return False, f"this CPU has neither avx512_bf16 nor AMX (torch capability {cap})"
    if cap != "AVX512":
        return False, f"the CPU has {'/'.join(has)}, but torch's kernels run at capability {cap}"
    if isa not in ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                   "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                   "AVX10_2_512_AMX_2"):
        return False, f"the CPU has {'/'.join(has)}, but ONEDNN_MAX_CPU_ISA={isa} keeps oneDNN below it"
    return True, f"this CPU has {'/'.join(has)} (torch capability {cap})"


_warned_bf16: set[str] = set()


def resolve_autocast(value, device: str, where: str) -> str | None:
    """The training matmul dtype for `value` (`auto`, `bfloat16`, or None = fp32) on `device`; logs the choice.
    An explicit bfloat16 where bf16 is not native is kept (the user asked for it) with one warning."""
    native, why = native_bf16(device)
    if value == AUTO:
        chosen = "bfloat16" if native else None
        log.info("%s=auto: %s (%s)", where, chosen or "fp32", why)
        return chosen
    if value == "bfloat16" and not native and where not in _warned_bf16:
        _warned_bf16.add(where)
        log.warning("%s=bfloat16 on a device without native bf16: %s; bf16 matmuls are emulated there (measured "
                    "%s slower than fp32 on an AVX2 CPU). %s=auto picks fp32 here.", where, why,
                    MEASURED_BF16_SLOWDOWN, where)
    return value


# ---------------------------------------------------------------------------------------------------------
# XNNPACK's row tile


def cpu_fingerprint() -> dict:
    """What decides XNNPACK's and torch's kernels on this machine."""
    from importlib.metadata import version

    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = " ".join(sorted(value.split()))
                break
    except OSError:
        pass
    return {"cpu": model, "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "capability": cpu_capability(), "executorch": version("executorch"), "machine": platform.machine()}


def tile_from_curve(ratios: list[float]) -> int:
    """The rows of one pass from time(M)/time(1) at M = 1..n: the last M before the first step up of more
    than TILE_JUMP. M = 1 is skipped (XNNPACK has a one-row kernel of its own, 8da4w's is much cheaper)."""
    for m in range(3, len(ratios) + 1):
        if ratios[m - 1] > TILE_JUMP * ratios[m - 2]:
            return m - 1
    return len(ratios)


def measure_row_tile(weights: str, reps: int = 10) -> dict:
    """Time XNNPACK's GEMM at M = 1..16 rows: 4 linears 1024 <-> 2048 (32 MB in fp32, more than the caches
    hold, as a model's weights are) in one program with a dynamic M, one thread; the best of reps x 3 calls
    per M. -> {"tile", "ratio_to_m1", "m1_ms", "seconds"}. Runs in a process of its own (`row_tile`): the
    runtime's threadpool may be sized only before a process's first program runs (runner.engine)."""
    import tempfile

    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime
    from torch import nn
    from torch.export import Dim, export

    from models.quantize import quantize_8da4w

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        chain = nn.Sequential(nn.Linear(1024, 2048, bias=False), nn.Linear(2048, 1024, bias=False),
                              nn.Linear(1024, 2048, bias=False), nn.Linear(2048, 1024, bias=False)).eval()
        if weights == "8da4w":
            quantize_8da4w(chain, 32)
        ep = export(chain, (torch.randn(1, 4, 1024),), dynamic_shapes=({1: Dim("M", min=1, max=MAX_PROBE_ROWS)},),
                    strict=False)
        buf = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
        with tempfile.TemporaryDirectory(prefix="row_tile_") as tmp:
            path = Path(tmp) / "probe.pte"
            path.write_bytes(buf)
            portable_lib._unsafe_reset_threadpool(1)  # a fresh process (see row_tile): nothing has run yet
            method = Runtime.get().load_program(path).load_method("forward")._method
            best = {m: float("inf") for m in range(1, MAX_PROBE_ROWS + 1)}
            for _ in range(reps):
                for m in best:
                    method.set_inputs([torch.randn(1, m, 1024)])
                    for _ in range(3):
                        s = time.perf_counter()
                        method.execute()
                        best[m] = min(best[m], time.perf_counter() - s)
    finally:
        torch.set_num_threads(threads)
    ratios = [round(best[m] / best[1], 3) for m in best]
    return {"tile": tile_from_curve(ratios), "ratio_to_m1": ratios, "m1_ms": round(best[1] * 1e3, 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "eagle3-pipeline" / "machine.json"


def row_tile(weights: str, *, probe: bool = False) -> dict:
    """This machine's row tile for `weights` (WEIGHTS: `fp32`, or `8da4w`): from the cache, or measured once and
    cached (atomically, under a file lock, so concurrent jobs measure once)."""
    from filelock import FileLock

    path = cache_file()
    fp = cpu_fingerprint()
    entry = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16] + f"/{weights}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=600):
        cached = json.loads(path.read_text()) if path.is_file() else {}
        if entry in cached and not probe:
            return cached[entry]
        log.info("measuring XNNPACK's GEMM row tile for %s weights on this CPU (%s, %s), once per machine",
                 weights, fp["cpu"], fp["capability"])
        result = {**_measure_in_subprocess(weights), **fp, "weights": weights,
                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        log.info("row tile %d rows (time(M)/time(1), M = 1..%d: %s; %.1f s)", result["tile"], MAX_PROBE_ROWS,
                 result["ratio_to_m1"], result["seconds"])
        cached[entry] = result
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
        return result


def _measure_in_subprocess(weights: str) -> dict:
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pipeline.hardware", "--measure", weights], capture_output=True,
                          text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measuring XNNPACK's row tile failed (exit {proc.returncode}); set export.default_chain to "
                           f"an int to skip it. Its output:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def has_executorch() -> bool:
    """Whether this environment can lower and run a .pte at all (the row tile is measured through it)."""
    import importlib.util

    return importlib.util.find_spec("executorch") is not None


def target_weights(export_quant: str) -> str:
    """The weights of the target's linears (WEIGHTS), which a verify window's GEMMs read: 8da4w_offsets quantises
    them, and 8da_file too (a GGUF's 4-bit tensors 8da4w, its 5- to 8-bit ones 8da8w: int8 per-row activations
    either way)."""
    return "8da4w" if export_quant in ("8da4w_offsets", "8da_file") else "fp32"


def target_row_tile(export_quant: str) -> dict | None:
    """`row_tile` of the target's weights under `export_quant`, or None where ExecuTorch is not installed: no .pte
    is lowered or run there (a GPU machine that trains a draft for a CPU .pte), so there is no tile to fit."""
    if not has_executorch():
        log.info("ExecuTorch is not installed here: no .pte is built or run, XNNPACK's row tile is not measured")
        return None
    return row_tile(target_weights(export_quant))


def resolve_default_chain(value, *, max_m: int, backend: str | None, quant: str | None) -> int:
    """A default K (export.default_chain; engine.default_chain with backend None): an int is kept; `auto` is
    min(DEFAULT_CHAIN, max_m - 1), and on XNNPACK also at most row tile - 1, so the default window T = K+1 is one
    pass of the GEMM over the target's weights on this CPU. Only the export's own keys and this machine decide it,
    so an export key never depends on which engine runs the program."""
    from pipeline.export_pte import DEFAULT_CHAIN

    if value != AUTO:
        return int(value)
    chain = min(DEFAULT_CHAIN, max_m - 1)
    tile = target_row_tile(quant) if backend == "xnnpack" else None
    if tile is not None:
        chain = max(1, min(chain, tile["tile"] - 1))
        log.info("export.default_chain=auto: K=%d (XNNPACK's %s GEMM takes %d rows a pass on this CPU, %s)", chain,
                 target_weights(quant), tile["tile"], tile["capability"])
    return chain


def resolve_exact(value, *, engine: str, quant: str) -> bool:
    """engine.exact: a bool is kept; `auto` is on where a row's rounding can flip a greedy token between
    K = 0 and K > 0: the CUDA engine (bf16 or INT4 GEMMs take other paths at other widths) and a .pte whose
    target is 8da4w (it rounds every linear's input to int8 per row). An fp32 target stays at T = 1 decode,
    where every eval checks losslessness anyway."""
    if value != AUTO:
        return bool(value)
    return engine == "cuda" or target_weights(quant) == "8da4w"


def resolve_exact_width(value, *, max_m: int, backend: str, quant: str, engine: str) -> int:
    """engine.exact_width: an int is kept; `auto` is max_m on the CUDA engine and where no .pte runs, elsewhere
    the rows XNNPACK's GEMM takes in one pass for the target's weights on this CPU (`row_tile`, at least 2, at most
    max_m): the exact K=0 then decodes at about the cost of one row, and K goes up to width - 1."""
    if value != AUTO:
        return int(value)
    tile = target_row_tile(quant) if engine != "cuda" and backend == "xnnpack" else None
    if tile is None:
        return max_m
    width = max(2, min(max_m, tile["tile"]))
    log.info("engine.exact_width=auto: %d rows (XNNPACK's %s GEMM takes %d rows a pass on this CPU, %s)", width,
             target_weights(quant), tile["tile"], tile["capability"])
    return width


AUTO_KEYS = ("target.train.autocast", "draft.train.autocast", "export.default_chain", "taps.target_quant")


def unresolved(cfg) -> list[str]:
    """The keys of AUTO_KEYS that still say `auto` (a cache key must never hold it)."""
    from omegaconf import OmegaConf

    return [k for k in AUTO_KEYS if OmegaConf.select(cfg, k, default=None) == AUTO]


def served_quant(cfg) -> str:
    """taps.target_quant=auto: the scheme the target's weights take in the program that serves the draft, or
    `none` where they stay float: engine.quant on the CUDA engine, export.quant's target part elsewhere (the .pte
    and eager engines run the exported program; `8da4w_draft` quantises the draft alone)."""
    from models.choices import SERVED_QUANTS

    eng, ec = cfg.get("engine"), cfg.get("export")
    quant = str(eng.quant) if eng is not None and str(eng.kind) == "cuda" else str(ec.quant) if ec is not None else ""
    return quant if quant in SERVED_QUANTS else "none"


def resolve(cfg) -> dict:
    """Replace every `auto` of the composed config by its value on this machine, in place; -> {key: value}
    of what was resolved (logged, and recorded in the job's result)."""
    from omegaconf import open_dict

    resolved = {}
    with open_dict(cfg):
        for group in ("target", "draft"):
            train = cfg.get(group, {}).get("train") if cfg.get(group) is not None else None
            if train is not None and "autocast" in train and train.autocast is not None:
                where = f"{group}.train.autocast"
                value = resolve_autocast(train.autocast, str(cfg.device), where)
                if train.autocast == AUTO:
                    resolved[where] = value
                train.autocast = value
        ec = cfg.get("export")
        if ec is not None and ec.get("default_chain") == AUTO:  # export.* and this machine alone
            ec.default_chain = resolved["export.default_chain"] = resolve_default_chain(
                AUTO, max_m=int(ec.max_m), backend=str(ec.backend), quant=str(ec.quant))
        tc = cfg.get("taps")
        if tc is not None and tc.get("target_quant") == AUTO:
            tc.target_quant = resolved["taps.target_quant"] = served_quant(cfg)
        eng = cfg.get("engine")
        if eng is not None:
            kind = str(eng.kind)
            if eng.get("default_chain") == AUTO:  # the CUDA engine's own windows: no CPU row tile applies
                eng.default_chain = resolved["engine.default_chain"] = resolve_default_chain(
                    AUTO, max_m=int(eng.max_m), backend=None, quant=None)
            # the .pte and eager engines run the exported program: its target's weights and windows decide
            quant = str(ec.quant) if ec is not None else "fp32"
            if eng.get("exact") == AUTO:
                eng.exact = resolved["engine.exact"] = resolve_exact(AUTO, engine=kind, quant=quant)
            if eng.get("exact") and eng.get("exact_width") == AUTO and ec is not None:
                eng.exact_width = resolved["engine.exact_width"] = resolve_exact_width(
                    AUTO, max_m=int(ec.max_m), backend=str(ec.backend), quant=quant, engine=kind)
    return resolved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="What this machine resolves the pipeline's `auto` defaults to.")
    ap.add_argument("--probe", action="store_true", help="measure the row tiles again (and update the cache)")
    ap.add_argument("--measure", choices=WEIGHTS, help=argparse.SUPPRESS)  # row_tile's subprocess
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_row_tile(args.measure)))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    fp = cpu_fingerprint()
    print(f"CPU: {fp['cpu']}, torch capability {fp['capability']}, {usable_cores()} usable cores")
    for device in ("cpu", "cuda"):
        native, why = native_bf16(device)
        print(f"autocast=auto on {device}: {'bfloat16' if native else 'fp32'} ({why})")
    for weights in WEIGHTS:
        t = row_tile(weights, probe=args.probe)
        curve = ", ".join(f"{r:.2f}" for r in t["ratio_to_m1"])
        print(f"XNNPACK row tile, {weights} weights: {t['tile']} rows "
              f"(time(M)/time(1), M = 1..{len(t['ratio_to_m1'])}: {curve}; measured {t['measured_at']})")
    print(f"cache: {cache_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
