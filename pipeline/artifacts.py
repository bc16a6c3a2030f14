"""The file layouts stages hand each other, and their readers.

A stage reads an upstream artifact only through this module or models/ (`models.load_target` for the
target, `models.load_speculators` for the draft), never through another stage's module, so a stage's
internals can change without breaking its consumers.

- target: read with `models.load_target`, and its chat template (if any) with `models.gguf.load_chat_template`;
- taps: `taps.json` (the layout: source, per-split sequence and prompt lengths, tap layers, hidden and
  vocab size, dtype, end token ids, shard files per split) and safetensors shards holding TAPS_FIELDS;
- export: the program file PTE.
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
