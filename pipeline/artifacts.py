"""The file layouts stages hand each other, and their readers.

A stage reads an upstream artifact only through this module or models/ (`models.load_target` for the
target, `models.load_speculators` for the draft), never through another stage's module, so a stage's
internals can change without breaking its consumers.

- target: read with `models.load_target`, and its chat template (if any) with `models.text.load_chat_template`;
- taps: `taps.json` (the layout: source, per-split sequence and prompt lengths, tap layers, hidden and
  vocab size, dtype, end token ids, shard files per split) and safetensors shards holding TAPS_FIELDS;
- export: the program file PTE.

`load_engine(cfg, upstream)` builds the engine the `engine` group names (conf/engine/<kind>.yaml) over them,
through the one engine factory (runner.build.build_engine): the eval and serve stages load their engine here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

PTE = "model.pte"
TAPS_INDEX = "taps.json"
TAPS_SPLITS = ("train", "held_out", "long")  # long: train sequences at the lengths the draft serves
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


def engine_upstream(cfg) -> tuple[str, ...]:
    """The artifacts `load_engine` reads: the CUDA engine runs the target and draft artifacts themselves, in its
    own windows (engine.max_m etc.: no .pte); the other engines the export artifact too (eager: for its windows)."""
    return ("target", "draft") if cfg.engine.kind == "cuda" else ("target", "draft", "export")


def load_engine(cfg, upstream: dict):
    """The engine `cfg.engine` configures (its `auto` values resolved by pipeline.hardware), over the upstream
    artifacts, built by runner.build.build_engine: the options are the engine group's keys, as they are for
    `python -m runner` and `python -m runner.serve`. No export.* key reaches it: the .pte and eager engines
    read their windows off the exported program, the CUDA engine has its own."""
    from omegaconf import OmegaConf

    from runner.build import build_engine

    target = Path(upstream["target"].path)
    export = upstream.get("export")
    return build_engine(OmegaConf.to_container(cfg.engine, resolve=True), target=target,
                        draft=Path(upstream["draft"].path), tokenizer=target / "tokenizer.json",
                        pte=pte_path(export) if export is not None else None,
                        verified=True)  # the store re-hashed the artifact's files
