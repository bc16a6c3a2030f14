"""Public EAGLE-3 draft checkpoints: three on-disk layouts read into one Eagle3Draft, the aux-layer convention
made explicit, and the held-out check that catches a draft fed the wrong target layers.

Layouts (safetensors only: a pickle checkpoint, .bin/.pt/.pth, is refused, since unpickling runs code):

- `speculators`: config.json has `speculators_model_type` (must be "eagle3"); tensors named as ours
  (`layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `embed_tokens.weight`, `d2t`, `t2d`).
- `specforge`: `architectures` holds `LlamaForCausalLMEagle3` (SpecForge's class, a flat Llama config with
  `draft_vocab_size`, optionally `target_hidden_size` and `eagle_config`); `midlayer.*` -> `layers.0.*`, the
  rest as ours.
- `eagle`: `architectures` holds `Eagle3LlamaForCausalLM` (vLLM's class; AngelSlim's drafts), or
  `LlamaForCausalLM` with `num_hidden_layers` 1, `draft_vocab_size` and an EAGLE-3 `fc.weight` beside
  `midlayer.*` or `layers.0.*` (SafeAILab's EAGLE-3); a leading `model.` is dropped, then `midlayer.*` ->
  `layers.0.*` (vLLM's own remapping: vllm/model_executor/models/llama_eagle3.py).

Every layout may omit `embed_tokens.weight` (the target's is taken), `t2d` (derived from `d2t`) and, where
the draft vocabulary is the whole vocabulary, `d2t` (zeros: the identity, as vLLM takes it). The one decoder
layer's q/k/v_proj take 2*hidden inputs ([input_layernorm(embedding) ; hidden_norm(feature)]); what our layer
does not compute (SpecForge's `fc_norm`, `norm_output: false`, `norm_before_fc`,
`eagle_config.use_aux_hidden_state: false`, more than one layer) is refused naming the key. Anything else is
refused naming what was found.

Aux layers: which target hidden states feed the draft, and how they are counted. Two conventions exist:
- `embedding_first` (ours: models/config.py, check_taps): id k is HF `hidden_states[k]`, 0 = the embedding
  output, k = the residual after decoder layer k-1 (the input of layer k). vLLM reads a draft config's
  top-level `eagle_aux_hidden_state_layer_ids` this way (its target appends `hidden_states + residual` before
  layer idx when idx is in the list; default (2, L//2, L-3): vllm/model_executor/models/llama.py and
  `get_eagle3_aux_layers_from_config` in vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); so do the
  speculators format and SafeAILab's EAGLE-3, which hard-codes the capture before layers (2, L//2, L-3)
  (eagle/model/modeling_llama_kv.py, eagle/traineagle3/modeling_llama_kv.py).
- `layer_output`: id k is the output of decoder layer k (0-based), i.e. `hidden_states[k + 1]`. SpecForge
  trains on it (a forward hook on `layers[k]`, default [1, L//2 - 1, L - 4]:
  specforge/modeling/target/eagle3_target_model.py, specforge/algorithms/model_providers.py) and writes it to
  `eagle_config.eagle_aux_hidden_state_layer_ids`, which SGLang reads with a +1 (`set_eagle3_layers_to_capture`:
  "for the ith layer, it takes the output of the (i-1)th layer"; sgl-project/sglang PR #25454 documents the
  two conventions). Both defaults are the same three hidden states.
The conversion is written once: `to_tap_layers` / `from_tap_layers`. `aux_layer_convention="auto"` reads the
ids by where the file keeps them: top-level `eagle_aux_hidden_state_layer_ids` embedding-first (vLLM's key),
`eagle_config.eagle_aux_hidden_state_layer_ids` layer-output (SpecForge's key); a file without ids takes the
target's default taps, which are every project's default. The loaded draft carries `draft.source`
(`DraftSource`: layout, convention, the ids as the file stores them, the resulting taps).

A wrong reading is caught at load against the target (`check_aux_layers`): the draft's first position is run
on the target's taps of a few held-out sequences at the draft's layers and at the same layers shifted by one
either way; near-zero agreement with the target's next token where a shift agrees far better refuses the
pairing, naming the shift and the setting that fixes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.checkpoint import (
    build_draft,
    draft_config_from_llama,
    draft_config_from_speculators,
    read_safetensors_dir,
    validate_draft,
)
from models.config import DraftConfig, TargetConfig, check_taps
from models.draft import Eagle3Draft
from models.target import Transformer

LAYOUTS = ("speculators", "specforge", "eagle")
CONVENTIONS = ("embedding_first", "layer_output")
CONVENTION_CHOICES = ("auto",) + CONVENTIONS  # draft.aux_layer_convention
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SPECFORGE_ARCH = "LlamaForCausalLMEagle3"
# The check at load (check_aux_layers): refuse when the draft's layers agree below MIN_AGREEMENT and a shift by
# one agrees at least SHIFT_RATIO times as often and SHIFT_MARGIN higher.
MIN_AGREEMENT = 0.05
SHIFT_RATIO = 4.0
SHIFT_MARGIN = 0.10
CONVENTION_WORDS = {
    "embedding_first": "embedding-first (vLLM/speculators/EAGLE: id k = hidden_states[k], 0 = the embedding)",
    "layer_output": "layer-output (SpecForge/SGLang: id k = the output of layer k = hidden_states[k+1])",
}


# --- the convention, converted once ----------------------------------------------------------------
def to_tap_layers(ids, convention: str) -> tuple[int, ...]:
    """Aux-layer ids counted in `convention` -> our tap layers (HF hidden_states index, embedding-first)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"aux layer convention {convention!r}: one of {CONVENTIONS}")
    return tuple(int(i) + (1 if convention == "layer_output" else 0) for i in ids)


def from_tap_layers(taps, convention: str) -> tuple[int, ...]:
    """Our tap layers -> the ids a file counting in `convention` stores (the inverse of to_tap_layers)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"aux layer convention {convention!r}: one of {CONVENTIONS}")
    return tuple(int(t) - (1 if convention == "layer_output" else 0) for t in taps)


@dataclass(frozen=True)
class DraftSource:
    """Where a loaded draft came from and how its aux layers were read.

    layout: one of LAYOUTS. ids_key: the config key the aux-layer ids came from (None: the file has none, the
    target's default taps apply). file_ids: the ids as stored. convention: the convention they were read in;
    convention_from: "layout" (auto) or "config" (draft.aux_layer_convention). tap_layers: ours (None = the
    target's default)."""

    layout: str
    ids_key: str | None
    file_ids: tuple | None
    convention: str
    convention_from: str
    tap_layers: tuple | None

    def describe(self) -> str:
        if self.file_ids is None:
            return f"{self.layout} layout, no aux-layer ids in the file (the target's default taps)"
        how = "the layout's reading" if self.convention_from == "layout" else "draft.aux_layer_convention"
        return (f"{self.layout} layout, {self.ids_key}={list(self.file_ids)} read {self.convention} ({how}): "
                f"hidden states {list(self.tap_layers)}")

    def report(self) -> dict:
        return {"layout": self.layout, "aux_layer_convention": self.convention,
                "aux_layers_file": None if self.file_ids is None else list(self.file_ids),
                "aux_layers_key": self.ids_key}


# --- detection and reading ---------------------------------------------------------------------------
def refuse_pickle(path: Path) -> None:
    """A directory with pickle weights and no safetensors is refused (unpickling runs arbitrary code)."""
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(f"{path}: only pickle weights ({', '.join(pickles[:3])}); they are not loaded, since "
                         f"unpickling runs code. Convert them to safetensors first, e.g. safetensors.torch.save_file("
                         f"torch.load(FILE, weights_only=True), 'model.safetensors') in a sandbox")


def _found(config: dict, keys) -> str:
    keys = sorted(keys)
    return (f"architectures={config.get('architectures')!r}, speculators_model_type="
            f"{config.get('speculators_model_type')!r}, num_hidden_layers={config.get('num_hidden_layers')!r}, "
            f"{len(keys)} tensors like {keys[:6]}")


def detect_layout(config: dict, keys, where) -> str:
    """The layout of a draft checkpoint from its config.json (and, for a plain LlamaForCausalLM, its tensor
    names); ValueError naming what was found when it is none of LAYOUTS."""
    keys = set(keys)
    if "speculators_model_type" in config:
        return "speculators"
    archs = config.get("architectures") or []
    if SPECFORGE_ARCH in archs:
        return "specforge"
    stripped = {k.removeprefix("model.") for k in keys}
    eagle_keys = "fc.weight" in stripped and any(k.startswith(("midlayer.", "layers.0.")) for k in stripped)
    if "Eagle3LlamaForCausalLM" in archs or (
            "LlamaForCausalLM" in archs and config.get("num_hidden_layers") == 1 and "draft_vocab_size" in config
            and eagle_keys):
        return "eagle"
    raise ValueError(
        f"{where}: not an EAGLE-3 draft layout this loads: found {_found(config, keys)}. Loadable: speculators "
        f"(speculators_model_type 'eagle3'), SpecForge (architectures ['{SPECFORGE_ARCH}'], midlayer.*), "
        f"vLLM/AngelSlim/EAGLE-3 (architectures ['Eagle3LlamaForCausalLM'], or ['LlamaForCausalLM'] with one layer, "
        f"draft_vocab_size, fc.weight and midlayer.* or layers.0.*)")


def our_names(tensors: dict, origin: dict, layout: str, path) -> tuple[dict, dict]:
    """Rename a layout's tensors to Eagle3Draft.state_dict() names (speculators: unchanged)."""
    if layout == "speculators":
        return tensors, origin
    out, out_origin = {}, {}
    for k, v in tensors.items():
        name = k.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):  # a non-persistent HF buffer some exports carry: not a weight
            continue
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        if name.startswith("layers.") and not name.startswith("layers.0."):
            raise ValueError(f"{Path(path) / origin[k]}: tensor {k!r}: an EAGLE-3 draft has one decoder layer")
        if name in out:
            raise ValueError(f"{Path(path) / origin[k]}: tensors {k!r} and another both map to {name!r}")
        out[name], out_origin[name] = v, origin[k]
    return out, out_origin


def _aux_ids(config: dict, layout: str, where) -> tuple[str | None, list | None, str]:
    """(key, ids, the convention auto gives them) of a config's aux-layer ids."""
    eagle_config = config.get("eagle_config") or {}
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    if top and nested and to_tap_layers(top, "embedding_first") != to_tap_layers(nested, "layer_output"):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids={list(top)} (vLLM's key, embedding-first) and "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (SpecForge's, layer-output) "
                         f"name different hidden states; set draft.aux_layer_convention to the one the draft was "
                         f"trained with")
    if layout == "specforge" and nested:
        return "eagle_config.eagle_aux_hidden_state_layer_ids", list(nested), "layer_output"
    if top:
        return "eagle_aux_hidden_state_layer_ids", list(top), "embedding_first"
    if nested:
        return "eagle_config.eagle_aux_hidden_state_layer_ids", list(nested), "layer_output"
    return None, None, "embedding_first"


def _flat_config(config: dict, where, max_seq_len, taps) -> DraftConfig:
    """SpecForge / EAGLE: the whole config.json is the Llama config of the one layer plus the draft's keys."""
    eagle_config = config.get("eagle_config") or {}
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers={config['num_hidden_layers']}: an EAGLE-3 draft has one layer")
    for key, bad in (("fc_norm", True), ("norm_before_fc", True), ("norm_output", False)):
        if key in config and bool(config[key]) == bad:
            raise ValueError(f"{where}: {key}={config[key]!r} is not supported")
    if isinstance(eagle_config, dict) and eagle_config.get("use_aux_hidden_state", True) is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state=false (no fc over three target layers) is "
                         f"not an EAGLE-3 draft this loads")
    return draft_config_from_llama(
        config, where, max_seq_len=max_seq_len, draft_vocab_size=config.get("draft_vocab_size"),
        target_hidden_size=config.get("target_hidden_size"), tap_layers=taps,
        norm_before_residual=bool(config.get("norm_before_residual", False)))


def read_draft(path, *, max_seq_len: int | None = None, aux_layer_convention: str = "auto"
               ) -> tuple[DraftConfig, dict, dict, DraftSource]:
    """(config, tensors under our names, origin, source) of an EAGLE-3 draft checkpoint in any of LAYOUTS.

    `aux_layer_convention`: "auto" (the file's own, see the module docstring) or one of CONVENTIONS, which
    overrides it for the ids the file stores."""
    path = Path(path)
    if aux_layer_convention not in CONVENTION_CHOICES:
        raise ValueError(f"aux_layer_convention={aux_layer_convention!r}: one of {CONVENTION_CHOICES}")
    where = path / "config.json"
    if not where.is_file():
        raise FileNotFoundError(f"{path}: no config.json (an EAGLE-3 draft checkpoint directory has one)")
    refuse_pickle(path)
    try:
        config = json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e})") from None
    tensors, origin = read_safetensors_dir(path)
    layout = detect_layout(config, tensors, where)
    key, ids, convention = _aux_ids(config, layout, where)
    convention_from = "layout"
    if aux_layer_convention != "auto":
        convention, convention_from = aux_layer_convention, "config"
    taps = None if ids is None else to_tap_layers(ids, convention)
    if layout == "speculators":
        cfg = draft_config_from_speculators(config, path, max_seq_len, tap_layers=taps)
    else:
        cfg = _flat_config(config, where, max_seq_len, taps)
    tensors, origin = our_names(tensors, origin, layout, path)
    source = DraftSource(layout, key, None if ids is None else tuple(ids), convention, convention_from, cfg.tap_layers)
    return cfg, tensors, origin, source


def load_draft(path, target: Transformer | TargetConfig | None = None, *, max_seq_len: int | None = None,
               dtype: torch.dtype = torch.float32, aux_layer_convention: str = "auto") -> Eagle3Draft:
    """Load an EAGLE-3 draft in any of LAYOUTS (models.checkpoint.load_speculators' rules for the embedding,
    t2d, dtype and the pairing); the result carries `draft.source` (DraftSource). A tap-layer mismatch with the
    target names how the file's ids were read and the setting for the other convention."""
    target_cfg = target.cfg if isinstance(target, Transformer) else target
    if max_seq_len is None and target_cfg is not None:
        max_seq_len = target_cfg.max_seq_len
    cfg, tensors, origin, source = read_draft(path, max_seq_len=max_seq_len,
                                              aux_layer_convention=aux_layer_convention)

    def validate(draft, tc):
        if source.file_ids is not None and tuple(cfg.tap_layers) != tc.taps:
            other = CONVENTIONS[1 - CONVENTIONS.index(source.convention)]
            raise ValueError(
                f"draft/target mismatch in tap layers: {source.describe()}; the target's taps are "
                f"{list(tc.taps)}. Set target.tap_layers={list(cfg.tap_layers)} to feed the draft the layers it "
                f"names, or draft.aux_layer_convention={other} if the file counts "
                f"{CONVENTION_WORDS[other]} (hidden states {list(to_tap_layers(source.file_ids, other))})")
        validate_draft(draft, tc)

    whole_vocab = ("d2t",) if cfg.draft_vocab_size == cfg.vocab_size else ()  # vLLM: no d2t = identity
    draft = build_draft(cfg, tensors, origin, path, target, dtype=dtype, validate=validate, optional=whole_vocab)
    draft.source = source
    return draft


# --- the check at load --------------------------------------------------------------------------------
def shifted(taps, shift: int, n_layers: int) -> tuple[int, ...] | None:
    """`taps` moved by `shift` hidden states, or None where that leaves [0, n_layers]."""
    out = tuple(t + shift for t in taps)
    try:
        return check_taps(out, n_layers)
    except ValueError:
        return None


@torch.no_grad()
def first_position_agreement(target: Transformer, draft: Eagle3Draft, ids: torch.Tensor, tap_sets) -> dict:
    """{taps: agreement} for each tap-layer triple: the fraction of positions t of `ids` [B,T] where the draft's
    first position (token ids[t+1], feature fc(taps[t]) at those layers, a stateless causal pass, as TTT step 0)
    proposes the target's own next token there (its argmax at t+1). One target pass serves every triple."""
    layers = sorted({t for taps in tap_sets for t in taps})
    final, tapped = target.hidden(ids, None, tuple(layers))
    by_layer = dict(zip(layers, tapped))
    top1 = torch.cat([target.head(final[:, i:i + 64]).argmax(-1) for i in range(0, final.shape[1], 64)], dim=1)
    wanted = top1[:, 1:]
    dtype = draft.fc.weight.dtype
    out = {}
    for taps in tap_sets:
        feature = draft.fuse([by_layer[t][:, :-1].to(dtype) for t in taps])
        logits, _ = draft(ids[:, 1:], feature)
        out[tuple(taps)] = float((draft.to_target(logits.argmax(-1)) == wanted).float().mean())
    return out


def aux_layer_verdict(taps, agreement: dict, source: DraftSource | None = None) -> str | None:
    """The refusal message when the draft's layers `taps` agree below MIN_AGREEMENT and a shift by one (a key of
    `agreement` other than taps) agrees at least SHIFT_RATIO times as often and SHIFT_MARGIN more; else None."""
    taps = tuple(taps)
    base = agreement[taps]
    others = [(other, a) for other, a in agreement.items() if other != taps]
    if base >= MIN_AGREEMENT or not others:
        return None
    best, best_a = max(others, key=lambda item: item[1])
    if best_a < max(SHIFT_RATIO * base, base + SHIFT_MARGIN):
        return None
    shift = best[0] - taps[0]
    msg = f"aux layers {list(taps)} agree {base:.1%}; shifted by {shift:+d} ({list(best)}) they agree {best_a:.1%}: "
    convention = None if source is None or source.file_ids is None else source.convention
    fix_taps = f"target.tap_layers={list(best)}"
    if convention == "embedding_first" and shift == 1:
        msg += (f"the checkpoint probably counts hidden states {CONVENTION_WORDS['layer_output']}, not "
                f"embedding-first; set draft.aux_layer_convention=layer_output and {fix_taps}")
    elif convention == "layer_output" and shift == -1:
        msg += (f"the checkpoint probably counts hidden states {CONVENTION_WORDS['embedding_first']}, not "
                f"layer-output; set draft.aux_layer_convention=embedding_first and {fix_taps}")
    else:
        read = "" if source is None else f" ({source.describe()})"
        msg += f"the draft was probably trained on hidden states {list(best)}{read}; set {fix_taps}"
    return msg


def check_aux_layers(target: Transformer, draft: Eagle3Draft, ids: torch.Tensor) -> dict:
    """The held-out check of the draft's aux layers against the target (module docstring): returns
    {"aux_agreement": a, "aux_agreement_plus1": .., "aux_agreement_minus1": ..} (the shifts that fit the
    target), or raises ValueError with aux_layer_verdict's message."""
    taps = tuple(draft.cfg.tap_layers) if draft.cfg.tap_layers is not None else target.cfg.taps
    L = target.cfg.n_layers
    sets = [taps] + [s for s in (shifted(taps, 1, L), shifted(taps, -1, L)) if s is not None]
    agreement = first_position_agreement(target, draft, ids, sets)
    message = aux_layer_verdict(taps, agreement, getattr(draft, "source", None))
    if message is not None:
        raise ValueError(message)
    out = {"aux_agreement": round(agreement[taps], 4)}
    for s in sets[1:]:
        out["aux_agreement_plus1" if s[0] > taps[0] else "aux_agreement_minus1"] = round(agreement[s], 4)
    return out
