"""The draft stage: an EAGLE-3 head for the target, trained on the taps (`draft=train`) or loaded (`draft=load`).

Artifact: a speculators-layout checkpoint (config.json + model.safetensors with d2t/t2d), read with
`models.load_speculators(artifact.path, target)`. Its manifest names the target and taps it was built
from (upstream keys, and `target_key` in the report, which the export stage checks).

`draft=train` (default), docs/design.md §3, the loop in pipeline/train_draft.py:
- draft vocab: the `draft_vocab_size` target ids that are most often the target's argmax at counted
  positions of the train taps, sorted; d2t[i] = used[i] - i. A target vocab no larger than
  draft_vocab_size makes the draft vocab the whole vocab (d2t = 0). Coverage is reported.
- one decoder layer of the target's width (heads, head_dim, RoPE from the target; intermediate size from
  the target unless `draft.intermediate_size`); embed_tokens is a frozen copy of the target's; with
  `init_from_target` lm_head and the final norm start as the target's (its rows for the draft vocab;
  the norm's effective scale).
- training-time test with `train.ttt_steps` unrolled steps, loss weights decay^i, soft cross-entropy
  against the target restricted to the draft vocab, AdamW + warmup/cosine, gradient clipping; per-step
  metrics (loss, loss_i, acc_i, lr) and per-epoch held-out metrics go to MLflow; a checkpoint in the
  stage's scratch directory every `train.checkpoint_every_s` lets an interrupted run resume exactly.
`draft=load draft.path=DIR`: an EAGLE-3 checkpoint in the speculators, SpecForge or vLLM/EAGLE layout
(models/draft_layouts.py), its aux-layer ids read in `draft.aux_layer_convention` (auto: the file's own),
validated against the target (hidden size, vocab, tap layers, d2t range and t2d agreement, the frozen
embedding); a mismatch fails naming the field. Then the check of its aux layers on CHECK_TOKENS held-out
tokens (models.draft_layouts.check_aux_layers): the draft's first position agreeing with the target's next
token below 5% where the layers shifted by one agree far better refuses the pairing, naming the likely
off-by-one and the setting that fixes it. The report records the layout, the convention, the file's ids and
the agreements (`aux_agreement`, `aux_agreement_plus1`, `aux_agreement_minus1`: the layers shifted by one).

Under torchrun (pipeline.distributed) `draft=train` runs on every rank with DistributedDataParallel:
`train.batch_size` is the global batch, each rank trains on its share of the same rows, so N ranks see the
samples one rank sees at every step (pipeline/train_draft.py, `fit`); rank 0 alone checkpoints, evaluates
and writes the artifact (the others get `out=None`). The report records `world_size` and `backend`; neither
enters the key. `draft=load` runs on rank 0 only.

Both report, on the held-out taps, `held_out_acc_i` (i = 0..N-1: top-1 agreement of TTT step i with the
target; the per-step training metrics are `loss`, `loss_i`, `acc_i`, `lr`) and the draft's prediction of
what the eval measures at K = N: `predicted_acceptance_pos_i` (acceptance at position i given position i is
reached, from the leading run of agreeing steps, which on greedy taps is exactly what a chain of N started
at that slot gets accepted) and `predicted_tau` (models.draft.predicted_tau of those); and the same by where in
the answer the chain starts, `predicted_tau_pos_<lo>_<hi>` with `held_out_slots_pos_<lo>_<hi>` (answer tokens
[0,64), [64,256), [256,512), [512,1024), [1024,...): train_draft.POSITION_BUCKETS, bench.context's buckets), for
the buckets the held-out answers reach: a draft trained on short answers shows its fall there.
With `train.long_every` the draft also trains on the taps' long split (train_draft.fit).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline import distributed, tracking
from pipeline import train_draft as td
from pipeline.artifacts import load_taps, taps_index
from pipeline.stages import PARAM_BYTES, param_count
from pipeline.store import dir_fingerprint, scratch_dir

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DISTRIBUTED = True  # under torchrun every rank runs a share of it (pipeline.app.Job.help)
UPSTREAM = ("target", "taps")
CONFIG_KEYS = ("draft", "seed")
CHECKPOINT = "train_state.pt"
CHECK_TOKENS = 256  # held-out tokens of draft=load's aux-layer check (one target pass, three draft passes)


def key_extra(cfg: DictConfig) -> dict:
    """draft=load: a stat fingerprint of the checkpoint directory, so a checkpoint changed in place reloads."""
    if cfg.draft.kind != "load" or not Path(str(cfg.draft.path)).is_dir():
        return {}
    return {"draft_files": dir_fingerprint(Path(str(cfg.draft.path)))}


def estimate_bytes(cfg: DictConfig, upstream: dict) -> int:
    """The most the build writes: the float32 draft, and for draft=train its checkpoint (weights and AdamW's two
    moments) twice while a new one replaces the old; draft=load writes about the checkpoint it loads."""
    from models import Eagle3Draft, TargetConfig, draft_config_for

    dc = cfg.draft
    if dc.kind == "load":
        return sum(f.stat().st_size for f in Path(str(dc.path)).rglob("*") if f.is_file())
    target_cfg = TargetConfig.from_dict(json.loads((Path(upstream["target"].path) / "config.json").read_text()))
    overrides = {"draft_vocab_size": min(int(dc.draft_vocab_size), target_cfg.vocab_size)}
    if dc.get("intermediate_size"):
        overrides["intermediate_size"] = int(dc.intermediate_size)
    return PARAM_BYTES * param_count(lambda: Eagle3Draft(draft_config_for(target_cfg, **overrides))) * (1 + 2 * 3)


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    from models import load_target, save_speculators

    dc = cfg.draft
    device = distributed.device(cfg.device)
    target_art, taps_art = upstream["target"], upstream["taps"]
    index = taps_index(taps_art.path)
    longest = max(v for k, v in index.items() if k.endswith("_seq_len"))
    # the target (its head, and the draft's RoPE tables it sizes) at the taps' longest sequence
    target = load_target(Path(target_art.path), max_seq_len=longest).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    if tuple(index["tap_layers"]) != target.cfg.taps or index["hidden_size"] != target.cfg.hidden_size:
        raise ValueError(f"draft: taps {taps_art.path} were taken at layers {index['tap_layers']} of width "
                         f"{index['hidden_size']}, the target has {list(target.cfg.taps)} / {target.cfg.hidden_size}")
    held_out = load_taps(taps_art.path, "held_out")
    tc = train_config(dc, int(cfg.seed))

    if dc.kind == "train":
        draft, report = train(cfg, target, Path(taps_art.path), held_out, tc, device)
        if out is None:  # a rank other than 0: its share of the training is done, rank 0 stores the draft
            return {}
    elif out is None:  # draft=load has nothing to share across ranks
        return {}
    elif dc.kind == "load":
        draft, report = load(dc, target, held_out["ids"])
        draft = draft.to(device)
    else:
        raise ValueError(f"draft.kind must be 'train' or 'load', got {dc.kind!r}")

    used = draft_vocab_ids(draft)
    held = td.evaluate(draft, held_out, target.head, tc, device, used)  # float32
    draft = draft.cpu().eval()
    save_speculators(draft, out)
    report.update({
        "kind": str(dc.kind),
        "target_key": target_art.key,
        "taps_key": taps_art.key,
        "ttt_steps": tc.ttt_steps,
        "draft_vocab_size": draft.cfg.draft_vocab_size,
        **{f"held_out_acc_{i}": round(held[f"acc_{i}"], 4) for i in range(tc.ttt_steps)},
        **{f"predicted_acceptance_pos_{i}": round(held[f"predicted_acceptance_pos_{i}"], 4)
           for i in range(tc.ttt_steps)},
        "predicted_tau": round(held["predicted_tau"], 4),
        # by the answer position a chain starts at, where the held-out answers reach (train_draft.POSITION_BUCKETS)
        **{k: round(v, 4) for k, v in held.items() if k.startswith("predicted_tau_pos_")},
        **{f"held_out_{k}": v for k, v in held.items() if k.startswith("slots_pos_")},
        "held_out_loss_0": round(held["loss_0"], 4),
        "held_out_slots": held["slots"],
        **distributed.describe(),  # world_size, backend: how it was trained (not in the key: same samples)
    })
    log.info("draft (%s): held-out acc %s, predicted tau %.2f at K=%d (by answer position: %s)", dc.kind,
             " ".join(f"{held[f'acc_{i}']:.3f}" for i in range(tc.ttt_steps)), held["predicted_tau"], tc.ttt_steps,
             " ".join(f"{k[len('predicted_tau_pos_'):]}: {v:.2f}" for k, v in held.items()
                      if k.startswith("predicted_tau_pos_")))
    return report


def train_config(dc: DictConfig, seed: int) -> td.TrainConfig:
    t = OmegaConf.to_container(dc.get("train") or {}, resolve=True)
    known = set(td.TrainConfig.__dataclass_fields__) - {"seed"}
    c = td.TrainConfig(seed=seed, **{k: v for k, v in t.items() if k in known})
    c.betas = tuple(c.betas)
    return c


def draft_vocab_ids(draft) -> torch.Tensor | None:
    """The target ids of the draft vocab (None when it is the whole vocab in order)."""
    Vd, V = draft.cfg.draft_vocab_size, draft.cfg.vocab_size
    if Vd == V and not draft.d2t.any():
        return None
    return torch.arange(Vd, device=draft.d2t.device) + draft.d2t


# --- draft=train ---------------------------------------------------------------------------------------
def train(cfg: DictConfig, target, taps_path: Path, held_out: dict, tc: td.TrainConfig, device):
    from models import Eagle3Draft, draft_config_for

    dc = cfg.draft
    V = target.cfg.vocab_size
    train_taps = load_taps(taps_path, "train")
    vm = td.build_vocab_map(td.token_counts(train_taps["top1"], train_taps["mask"], V), int(dc.draft_vocab_size))
    log.info("draft vocab: %d of %d target ids, covering %.2f%% of the target's argmax tokens", vm.size, V,
             100 * vm.coverage)
    overrides = {"draft_vocab_size": vm.size, "norm_before_residual": bool(dc.get("norm_before_residual", False))}
    if dc.get("intermediate_size"):
        overrides["intermediate_size"] = int(dc.intermediate_size)
    torch.manual_seed(int(cfg.seed))
    draft = Eagle3Draft(draft_config_for(target.cfg, **overrides))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
        draft.set_vocab_map(vm.used)
        if dc.get("init_from_target", False):
            draft.lm_head.weight.copy_(target.lm_head.weight[vm.used])
            # the draft's norm scales by w; a (1 + w) target norm (Gemma) hands over its effective scale
            draft.norm.weight.copy_(target.norm.weight + 1 if target.norm.unit_offset else target.norm.weight)
    draft = draft.to(device)
    used = None if vm.size == V else vm.used.to(device)

    long = load_taps(taps_path, "long") if tc.long_every and taps_index(taps_path)["shards"].get("long") else None
    if tc.long_every and long is None:
        raise ValueError(f"draft.train.long_every={tc.long_every} needs long taps (taps.long_sequences > 0)")
    result = td.fit(draft, target.head, train_taps, held_out if distributed.is_main() else None, tc, device,
                    checkpoint=scratch_dir() / CHECKPOINT, checkpoint_every_s=float(dc.train.checkpoint_every_s),
                    eval_every=dc.train.get("eval_every"), log=tracking.log_metrics if distributed.is_main() else None,
                    log_every=int(dc.train.log_every), used=used, long=long)
    report = {
        "params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "vocab_coverage": round(vm.coverage, 4),
        "steps": tc.steps,
        "epochs": round(result["epochs"], 2),
        "resumed_at": result["resumed_at"],
        "train_seconds": round(result["train_seconds"], 1),
        "train_loss": result["loss"],  # the last step's, over the global batch (all ranks)
        "train_sequences": int(train_taps["ids"].shape[0]),
        **({"long_sequences": int(long["ids"].shape[0])} if long is not None else {}),
        "autocast": tc.autocast or "float32",  # the matmul dtype used (pipeline.hardware resolves `auto`)
    }
    return draft, report


# --- draft=load ----------------------------------------------------------------------------------------
def load(dc: DictConfig, target, held_out_ids: torch.Tensor | None = None):
    """The checkpoint at draft.path in any public layout, validated against the target and, given held-out token
    ids [B,T], checked on the first rows holding CHECK_TOKENS of them (check_aux_layers)."""
    from models.draft_layouts import check_aux_layers, load_draft

    path = Path(str(dc.path))
    if not path.is_dir():
        raise FileNotFoundError(f"draft=load: draft.path={str(path)!r} is not a directory")
    convention = str(dc.get("aux_layer_convention") or "auto")
    try:
        draft = load_draft(path, target, max_seq_len=target.cfg.max_seq_len, aux_layer_convention=convention)
        draft = draft.to(target.embed_tokens.weight.device)
        report = {"source": str(path.absolute()), "params": sum(p.numel() for p in draft.parameters()),
                  **draft.source.report()}
        if held_out_ids is not None:
            rows = max(1, -(-CHECK_TOKENS // held_out_ids.shape[1]))
            ids = held_out_ids[:rows].to(target.embed_tokens.weight.device)
            report.update(check_aux_layers(target, draft, ids))
            log.info("draft=load: %s; first-position agreement with the target %.1f%% on %d held-out tokens",
                     draft.source.describe(), 100 * report["aux_agreement"], ids.numel())
    except ValueError as e:
        raise ValueError(f"draft=load: {path} does not fit the target: {e}") from e
    return draft, report
