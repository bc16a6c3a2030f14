"""The export stage: the target and draft artifacts lowered into ONE model.pte (see pipeline/export_pte.py).

Artifact: `model.pte` and the manifest report (max_m, default_chain, prefill chunk range, backend, quant,
manifest_hash, the pairing facts behind it, .pte size, timings, ops outside the delegate per method, and the
target's KV cache: `ring_slots` of its windowed layers, `kv_cache_bytes` {sliding, global}).

Order of work, so that every refusal comes before the minutes of lowering:
1. the export config alone (backend, quant, max_m in [2, max_seq_len], default_chain in [1, max_m-1], prefill
   chunk range not straddling the dispatch threshold; `min_prefill_chunk: null` means max_m + 1), and
   `export.max_seq_len` (the program's caches) within the context the target was trained for where it claims
   one: the cache is the export's, so a longer one re-exports and never retrains;
2. the pairing: the draft artifact must have been built for THIS target artifact when its manifest names
   one, and its weights must fit the target (hidden size, vocab, tap layers, d2t/t2d and the frozen
   embedding, checked by models.load_speculators);
3. lowering (export_pte), one method at a time with progress, each lowered method kept in the stage's
   scratch dir until the artifact is stored, so a killed export lowers again only what it had not finished.

The manifest hash baked into the .pte (`get_manifest_hash`) is sha256 over the canonical JSON of
`pairing_facts`: the sha256 of every file of the target artifact (config, weights, tokenizer.json) and of
the draft artifact (config, weights with d2t/t2d), the tap layers and the d2t table; the report keeps
both, and the eval stage refuses a .pte whose hash differs from its artifact's report.

Only `export.*` enters the key (besides the upstream keys): `runtime.chain` never re-exports.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from models.gguf import read_weight_types
from pipeline.artifacts import PTE
from pipeline.export_pte import check_export_args, export_pte, windows
from pipeline.store import building, hash_tree, scratch_dir

log = logging.getLogger(__name__)

SCHEMA_VERSION = 10  # 2: get_sliding_window is a required constant method; 3: the llama_ops / fc-norm graph;
# 4: target_verify_exact (exact mode); 5: an int4 target's groups carry offsets; 7: the exact call attends
# through eagle3::exact_sdpa (6 was a matmul attention, tried and dropped); 8: draft_chain_<k>; 9: export.quant's
# schemes named for what they are (get_quant and the report say fp32, 8da4w_draft, 8da4w_offsets); 10: windowed
# layers on ring caches (eagle3::exact_sdpa takes the ring)
UPSTREAM = ("target", "draft")
CONFIG_KEYS = ("export",)


def estimate_bytes(cfg: DictConfig, upstream: dict) -> int:
    """From the float32 weights of the target (T) and the draft (D), as their safetensors files hold them: the
    .pte holds at most both (the shared table once; int4 is smaller), and the scratch dir one lowered file per
    method, each up to 4x its model's weights (the delegate's copy and the pre-lowering graph's, base64 in exir's
    serde; measured 2.4-3.9x on the tiny test pair): 13 T + 5 D in all."""
    size = lambda art: sum(f.stat().st_size for f in Path(art.path).glob("*.safetensors"))  # noqa: E731
    return 13 * size(upstream["target"]) + 5 * size(upstream["draft"])


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    ec = cfg.export
    target_art, draft_art = upstream["target"], upstream["draft"]
    args = dict(windows(ec), backend=str(ec.backend), quant=str(ec.quant),
                group_size=int(ec.get("group_size", 32)), draft_chains=ec.get("draft_chains", True))
    max_m, max_seq_len = args["max_m"], int(ec.max_seq_len)
    check_export_args(max_seq_len=max_seq_len, **args)
    context = json.loads((Path(target_art.path) / "config.json").read_text()).get("context_length")
    if context is not None and max_seq_len > context:
        raise ValueError(f"export.max_seq_len={max_seq_len} exceeds the {context} positions the target was trained "
                         f"for (its context_length): positions past it are not the model's; lower export.max_seq_len")

    check_lineage(target_art, draft_art)
    speculator = load_pair(Path(target_art.path), Path(draft_art.path), max_seq_len)
    facts = pairing_facts(Path(target_art.path), Path(draft_art.path), speculator)
    manifest_hash = hash_facts(facts)
    log.info("export %s/%s: target %s + draft %s, max_m=%d (K in [1, %d]), manifest hash %s", args["backend"],
             args["quant"], target_art.key[:12], draft_art.key[:12], max_m, max_m - 1, manifest_hash[:16])

    scratch = scratch_dir() if building() else None  # lowered methods: a killed export resumes from them
    report = export_pte(speculator, out_path=Path(out) / PTE, manifest_hash=manifest_hash, scratch=scratch,
                        weight_types=read_weight_types(target_art.path), **args)
    report["pairing"] = facts
    return report


# --- pairing -----------------------------------------------------------------------------------------
def check_lineage(target_art, draft_art) -> None:
    """A draft artifact whose manifest names a target (upstream or report) must name this one."""
    named = {
        "manifest upstream.target": (draft_art.manifest.get("upstream") or {}).get("target"),
        "report.target_key": (draft_art.manifest.get("report") or {}).get("target_key"),
    }
    for where, key in named.items():
        if key is not None and key != target_art.key:
            raise ValueError(f"export: the draft artifact {draft_art.path} was built for target {key} ({where}), "
                             f"but the target artifact is {target_art.key}; re-run the draft stage for this target")


def load_pair(target_dir: Path, draft_dir: Path, max_seq_len: int | None = None):
    """(models.Speculator) from a target artifact and a draft artifact, both with caches of `max_seq_len`
    positions (None: the target artifact's), refusing a draft that does not fit."""
    from models import Speculator, load_speculators, load_target

    target = load_target(target_dir, max_seq_len=max_seq_len)
    try:
        draft = load_speculators(draft_dir, target, max_seq_len=target.cfg.max_seq_len)
    except ValueError as e:
        raise ValueError(f"export: draft {draft_dir} does not fit target {target_dir}: {e}") from e
    return Speculator(target, draft).eval()


def pairing_facts(target_dir: Path, draft_dir: Path, speculator) -> dict:
    """What the .pte's manifest hash stands for (JSON-able)."""
    target_files = hash_tree(Path(target_dir))
    if "tokenizer.json" not in target_files:
        log.warning("export: target %s has no tokenizer.json; the manifest hash covers weights only", target_dir)
    d2t = speculator.draft.d2t.detach().cpu().to(torch.int64).contiguous()
    return {
        "target_files": target_files,
        "draft_files": hash_tree(Path(draft_dir)),
        "tokenizer_sha256": target_files.get("tokenizer.json"),
        "tap_layers": list(speculator.target.cfg.taps),
        "d2t_sha256": hashlib.sha256(d2t.numpy().tobytes()).hexdigest(),
    }


def hash_facts(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
