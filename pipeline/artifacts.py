"""The file layouts stages hand each other, and their readers.

A stage reads an upstream artifact only through this module or models/ (`models.load_target` for the
target, `models.load_speculators` for the draft), never through another stage's module, so a stage's
internals can change without breaking its consumers.

- target: read with `models.load_target`, and its chat template (if any) with `models.text.load_chat_template`;
- taps: `taps.json` (the layout: source, per-split sequence and prompt lengths, tap layers, hidden and
  vocab size, dtype, end token ids, shard files per split) and safetensors shards holding TAPS_FIELDS;
- export: the program file PTE.

`load_engine(cfg, upstream)` reads them as the runtime runs them (`runtime.engine`): the eval and serve
stages load their engine through it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

PTE = "model.pte"
TAPS_INDEX = "taps.json"
TAPS_SPLITS = ("train", "held_out")
TAPS_FIELDS = ("ids", "taps", "final", "top1", "mask")


def pte_path(export_artifact) -> Path:
    return Path(export_artifact.path) / PTE


def taps_index(path) -> dict:
    """The taps artifact's layout (taps.json)."""
    return json.loads((Path(path) / TAPS_INDEX).read_text())


def load_taps(path, split: str) -> dict[str, torch.Tensor]:
    """All shards of a split, concatenated: ids/top1 int64, mask bool, taps/final in the stored dtype."""
    path = Path(path)
    if split not in TAPS_SPLITS:
        raise ValueError(f"taps split must be one of {TAPS_SPLITS}, got {split!r}")
    shards = [load_file(str(path / f)) for f in taps_index(path)["shards"][split]]
    if not shards:
        raise ValueError(f"{path}: no {split} shards")
    out = {k: torch.cat([s[k] for s in shards]) for k in TAPS_FIELDS}
    out["ids"], out["top1"] = out["ids"].long(), out["top1"].long()
    return out


ENGINES = ("pte", "eager", "cuda")
CUDA_QUANTS = ("none", "int4", "int4_g128")  # runtime.cuda_quant: the keys of runner.cuda_engine.QUANTS
CUDA_COMPILES = ("none", "inductor")  # runtime.cuda_compile: the dense cuda engine's widths through torch.compile


def engine_upstream(cfg) -> tuple[str, ...]:
    """The artifacts `load_engine` reads: the CUDA engine runs the target and draft artifacts themselves, in
    the windows export.* fixes (no .pte); the other engines the export artifact (eager: for its windows)."""
    return ("target", "draft") if cfg.runtime.get("engine") == "cuda" else ("target", "draft", "export")


def load_engine(cfg, upstream: dict):
    """The runner.engine.Engine that `runtime.engine` names, over the upstream artifacts, in exact mode when
    `runtime.exact` (resolved by pipeline.hardware) says so: the CUDA engine runs it itself, the others
    through runner.engine.ExactEngine. The CUDA engine's weights are `runtime.cuda_quant`'s, never
    `export.quant`'s (that one is the .pte's)."""
    from runner.engine import EagerEngine, ExactEngine, PteEngine

    rt = cfg.runtime
    engine = str(rt.engine)  # pipeline.validate refused any other, and cuda without a CUDA device
    if engine not in ENGINES:
        raise ValueError(f"runtime.engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if rt.get("exact") == "auto" or (rt.get("exact") and rt.get("exact_width") == "auto"):
        raise ValueError(f"runtime.exact={rt.get('exact')!r}, runtime.exact_width={rt.get('exact_width')!r}: "
                         "resolve `auto` first (pipeline.hardware.resolve)")
    if engine == "cuda":
        from pipeline.export_pte import windows
        from runner.cuda_engine import load_cuda_engine

        compile = str(rt.get("cuda_compile", "none"))
        if compile not in CUDA_COMPILES:
            raise ValueError(f"runtime.cuda_compile must be one of {', '.join(CUDA_COMPILES)}, got {compile!r}")
        return load_cuda_engine(upstream["target"].path, upstream["draft"].path, windows=windows(cfg.export),
                                device=rt.get("device") or "cuda", quant=str(rt.get("cuda_quant", "none")),
                                exact=bool(rt.exact), compile=compile)
    pte = PteEngine(pte_path(upstream["export"]), verified=True,  # the store re-hashed the artifact's files
                    tokenizer=Path(upstream["target"].path) / "tokenizer.json")
    if engine == "eager":
        from models import Speculator, load_speculators, load_target

        target = load_target(upstream["target"].path)
        m = pte.meta  # the same windows as the exported program
        pte = EagerEngine(Speculator(target, load_speculators(upstream["draft"].path, target)), max_m=m["max_m"],
                          default_chain=m["default_chain"], max_prefill_chunk=m["max_prefill_chunk"],
                          min_prefill_chunk=m["min_prefill_chunk"], device=rt.get("device") or "cpu",
                          manifest_hash=m["manifest_hash"])
    return ExactEngine(pte, int(rt.exact_width)) if rt.get("exact") else pte
