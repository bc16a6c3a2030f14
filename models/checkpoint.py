"""Checkpoints: our own target format, the vLLM "speculators" draft layout, and target/draft validation.

Target (ours): `config.json` = TargetConfig.to_dict(), every field (the Gemma options included), so a
load rebuilds the same model; a field missing from the file takes its default (the Llama behaviour), and an
unknown one is refused. `model.safetensors` = Transformer.state_dict() (the caches and RoPE tables are
non-persistent buffers, so they are not in it; a tied lm_head is stored once, as embed_tokens.weight),
optional `tokenizer.json` copied beside them.

Draft (speculators, Eagle3), the layout our draft artifacts are written in: `config.json` with
speculators_model_type "eagle3", transformer_layer_config (a Llama config of the single layer),
draft_vocab_size, target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids (embedding-first:
our tap layers, as vLLM reads them); weights `layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`,
`embed_tokens.weight`, `d2t` (int64[Vd]), `t2d` (bool[V]) in `model.safetensors` or sharded
(`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, the HF sharding convention).
`load_speculators` reads this layout alone; `models.draft_layouts.load_draft` reads any public EAGLE-3 head:
speculators, SpecForge (`LlamaForCausalLMEagle3`, `midlayer.*`, layer-output aux ids in `eagle_config`) and
vLLM/AngelSlim/EAGLE-3 (`Eagle3LlamaForCausalLM` or a one-layer `LlamaForCausalLM`, `model.`/`midlayer.`
prefixes), safetensors only, with the aux-layer convention explicit (that module's docstring).

Every load is strict: a missing, unexpected or wrongly shaped tensor is refused naming file and key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.config import DraftConfig, TargetConfig, check_taps
from models.draft import Eagle3Draft
from models.target import Transformer

INDEX_FILE = "model.safetensors.index.json"
SPECULATORS_VERSION = "0.1.0"


# --- safetensors directories ------------------------------------------------------------------------
def read_safetensors_dir(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a checkpoint dir (single file, sharded with an index, or any *.safetensors).

    Returns (tensors, origin) where origin[key] is the file the key came from (for error messages).
    """
    path = Path(path)
    index = path / INDEX_FILE
    weight_map = None
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).exists():
                raise FileNotFoundError(f"{index}: shard {f!r} listed in weight_map does not exist")
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no model.safetensors, {INDEX_FILE} or *.safetensors found")
    tensors, origin = {}, {}
    for f in files:
        try:
            loaded = load_file(str(path / f))
        except (OSError, SafetensorError) as e:  # truncated, not a safetensors file, unreadable
            raise ValueError(f"{path / f} is not a readable safetensors file ({e})") from None
        for k, v in loaded.items():
            if k in tensors:
                raise ValueError(f"{path / f}: tensor {k!r} also present in {origin[k]}")
            if weight_map is not None and weight_map.get(k) != f:
                raise ValueError(f"{path / f}: tensor {k!r} is not mapped to this file in {index}")
            tensors[k], origin[k] = v, f
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index}: keys {missing[:5]} listed in weight_map are missing from the shards")
    return tensors, origin


def write_safetensors_dir(tensors: dict[str, torch.Tensor], path, max_shard_bytes: int | None = None) -> list[str]:
    """Write `model.safetensors`, or shards + index when max_shard_bytes is given. Returns the file names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    shards, size = [{}], 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
        "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
    }
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return names + [INDEX_FILE]


def assign_state(module: torch.nn.Module, tensors: dict, origin: dict, path, optional=()) -> None:
    """Load `tensors` into `module` strictly: every key expected, none unexpected, shapes equal.

    Floating tensors are cast to the module's dtype; integer/bool buffers to theirs.
    """
    path = Path(path)
    expected = module.state_dict()
    for k in expected:
        if k not in tensors and k not in optional:
            raise ValueError(f"{path}: missing tensor {k!r} (files: {sorted(set(origin.values()))})")
    for k, v in tensors.items():
        if k not in expected:
            raise ValueError(f"{path / origin[k]}: unexpected tensor {k!r}")
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"{path / origin[k]}: tensor {k!r} has shape {tuple(v.shape)}, "
                             f"expected {tuple(expected[k].shape)}")
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)


# --- our target checkpoints -------------------------------------------------------------------------
def save_target(model: Transformer, path, tokenizer_path=None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    write_safetensors_dir(state, path)
    if tokenizer_path is not None and Path(tokenizer_path).resolve() != (path / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_path, path / "tokenizer.json")


def load_target(path, *, max_seq_len: int | None = None, dtype: torch.dtype = torch.float32) -> Transformer:
    """Load our own target checkpoint (see module docstring). `max_seq_len` overrides the cache size."""
    path = Path(path)
    d = json.loads((path / "config.json").read_text())
    if max_seq_len is not None:
        d["max_seq_len"] = max_seq_len
    try:
        cfg = TargetConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e
    model = Transformer(cfg).to(dtype)
    tensors, origin = read_safetensors_dir(path)
    assign_state(model, tensors, origin, path, optional=("lm_head.weight",) if cfg.tie_embeddings else ())
    return model.eval()


# --- validation ------------------------------------------------------------------------------------
def validate_draft(draft: Eagle3Draft | DraftConfig, target_cfg: TargetConfig) -> None:
    """Refuse a draft that does not fit the target, naming the mismatched field.

    Checked: tap width (target_hidden_size), vocab, tap layers, and for a module also the d2t range,
    uniqueness and its agreement with t2d (a wrong d2t silently collapses acceptance).
    """
    dc = draft.cfg if isinstance(draft, Eagle3Draft) else draft
    if dc.target_hidden_size != target_cfg.hidden_size:
        raise ValueError(f"draft/target mismatch in hidden size: the draft's fc expects taps of width "
                         f"target_hidden_size={dc.target_hidden_size}, the target's hidden_size is "
                         f"{target_cfg.hidden_size}")
    if dc.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft/target mismatch in vocab: draft vocab_size={dc.vocab_size}, "
                         f"target vocab_size={target_cfg.vocab_size}")
    draft_taps = dc.tap_layers if dc.tap_layers is not None else target_cfg.taps
    try:
        check_taps(draft_taps, target_cfg.n_layers)
    except ValueError as e:
        raise ValueError(f"draft/target mismatch in tap layers: {e}") from e
    if tuple(draft_taps) != target_cfg.taps:
        raise ValueError(f"draft/target mismatch in tap layers: draft uses {list(draft_taps)}, "
                         f"target taps are {list(target_cfg.taps)}")
    if isinstance(draft, Eagle3Draft):
        check_vocab_map(draft.d2t, draft.t2d, target_cfg.vocab_size)


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    Vd = d2t.numel()
    ids = torch.arange(Vd, dtype=torch.int64) + d2t.to(torch.int64).cpu()
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"d2t out of range: draft id {i} maps to target id {int(ids[i])}, outside "
                         f"[0, {vocab_size}) ({bad.numel()} such entries)")
    if torch.unique(ids).numel() != Vd:
        raise ValueError(f"d2t is not one-to-one: {Vd - torch.unique(ids).numel()} draft ids share a target id")
    if t2d.numel() != vocab_size:
        raise ValueError(f"t2d has {t2d.numel()} entries, target vocab is {vocab_size}")
    t2d = t2d.cpu().bool()
    if int(t2d.sum()) != Vd or not bool(t2d[ids].all()):
        raise ValueError(f"d2t and t2d disagree: t2d marks {int(t2d.sum())} target ids, d2t maps {Vd} "
                         f"draft ids, {int((~t2d[ids]).sum())} of them to ids t2d does not mark")


# --- speculators draft checkpoints -----------------------------------------------------------------
def speculators_config(cfg: DraftConfig, verifier: str | None = None, dtype: torch.dtype = torch.float32) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": None if cfg.tap_layers is None else list(cfg.tap_layers),
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy"}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),  # the weights' dtype, as the file holds them
    }


def draft_config_from_speculators(d: dict, path, max_seq_len: int | None = None,
                                  tap_layers: tuple | list | None = None) -> DraftConfig:
    """The DraftConfig of a speculators config.json. `tap_layers` (our HF index convention) replaces the file's
    eagle_aux_hidden_state_layer_ids when given (models.draft_layouts converts another convention into it)."""
    where = Path(path) / "config.json"
    if d.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{where}: speculators_model_type is {d.get('speculators_model_type')!r}, expected 'eagle3'")
    if d.get("norm_before_fc"):
        raise ValueError(f"{where}: norm_before_fc=true is not supported")
    tlc = d.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise ValueError(f"{where}: missing transformer_layer_config")
    return draft_config_from_llama(
        tlc, where, "transformer_layer_config.", max_seq_len=max_seq_len,
        draft_vocab_size=d.get("draft_vocab_size"), target_hidden_size=d.get("target_hidden_size"),
        tap_layers=d.get("eagle_aux_hidden_state_layer_ids") if tap_layers is None else tap_layers,
        norm_before_residual=bool(d.get("norm_before_residual", False)))


def draft_config_from_llama(layer: dict, where, prefix: str = "", *, max_seq_len: int | None, draft_vocab_size,
                            target_hidden_size, tap_layers, norm_before_residual: bool) -> DraftConfig:
    """The DraftConfig of the Llama config of a draft's one decoder layer (`layer`: speculators'
    transformer_layer_config, or the whole flat config.json of the SpecForge and EAGLE layouts; `prefix` names
    it in errors). Only what our layer computes is accepted: a Llama layer, SiLU, no biases."""
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: {prefix}model_type {layer.get('model_type')!r} is not supported "
                         f"(only 'llama' draft layers)")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if layer.get(key, ok) != ok:
            raise ValueError(f"{where}: {prefix}{key}={layer[key]!r} is not supported")
    try:
        H, heads = layer["hidden_size"], layer["num_attention_heads"]
        return DraftConfig(
            vocab_size=layer["vocab_size"],
            draft_vocab_size=draft_vocab_size or layer["vocab_size"],
            hidden_size=H,
            target_hidden_size=target_hidden_size or H,
            n_heads=heads,
            n_kv_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or H // heads,
            intermediate_size=layer["intermediate_size"],
            rope_theta=layer.get("rope_theta", 10000.0),
            rope_scaling=layer.get("rope_scaling"),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            max_seq_len=max_seq_len or layer.get("max_position_embeddings", 2048),
            tap_layers=tap_layers,
            norm_before_residual=norm_before_residual,
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing key {prefix}{e.args[0]}") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def save_speculators(draft: Eagle3Draft, path, *, max_shard_bytes: int | None = None,
                     verifier: str | None = None) -> None:
    """Write a speculators-layout checkpoint (sharded when max_shard_bytes is given)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = speculators_config(draft.cfg, verifier, dtype=draft.fc.weight.dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors_dir(draft.state_dict(), path, max_shard_bytes)


def load_speculators(path, target: Transformer | TargetConfig | None = None, *, max_seq_len: int | None = None,
                     dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    """Load a speculators Eagle3 checkpoint (our artifact's layout); with a target, validate the pairing
    (validate_draft). Any public layout: models.draft_layouts.load_draft.

    max_seq_len: the draft cache size; default the target's max_seq_len, else the checkpoint's
    max_position_embeddings. A checkpoint without embed_tokens.weight (vLLM shares the target's) needs a
    Transformer target, whose embedding is copied; one that carries it must carry the target's own (the
    draft's embedding is a frozen copy: another one means the draft was trained for another target). One
    without t2d gets t2d derived from d2t.

    The draft does not depend on the device or dtype it was trained in: floating tensors load into `dtype`
    whatever the file holds (a GPU run may leave bfloat16), and a stored embedding is compared with the
    target's at the narrower of the two precisions, then replaced by the target's own table, so a draft
    saved in bfloat16 shares the target's embedding (one table in the .pte) as one saved in float32 does.
    """
    path = Path(path)
    target_cfg = target.cfg if isinstance(target, Transformer) else target
    if max_seq_len is None and target_cfg is not None:
        max_seq_len = target_cfg.max_seq_len
    cfg = draft_config_from_speculators(json.loads((path / "config.json").read_text()), path, max_seq_len)
    tensors, origin = read_safetensors_dir(path)
    return build_draft(cfg, tensors, origin, path, target, dtype=dtype)


def build_draft(cfg: DraftConfig, tensors: dict, origin: dict, path, target: Transformer | TargetConfig | None = None,
                *, dtype: torch.dtype = torch.float32, validate=None, optional=()) -> Eagle3Draft:
    """An Eagle3Draft of `cfg` holding `tensors` (our names, as `Eagle3Draft.state_dict()`), strictly assigned,
    its embedding and t2d completed and the pairing checked (load_speculators' docstring says how).
    `validate(draft, target_cfg)`: the pairing check, default validate_draft; `optional`: further tensors that
    may be absent (keeping Eagle3Draft's initial value)."""
    path = Path(path)
    target_cfg = target.cfg if isinstance(target, Transformer) else target
    draft = Eagle3Draft(cfg).to(dtype)
    optional = ["t2d", *optional]
    if isinstance(target, Transformer) and cfg.hidden_size == target.cfg.hidden_size:
        optional.append("embed_tokens.weight")
    assign_state(draft, tensors, origin, path, optional=optional)
    if "embed_tokens.weight" not in tensors:
        draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    if "t2d" not in tensors:
        draft.t2d.zero_()
        ids = torch.arange(cfg.draft_vocab_size) + draft.d2t
        if ids.min() >= 0 and ids.max() < cfg.vocab_size:
            draft.t2d[ids] = True
    if target_cfg is not None:
        (validate or validate_draft)(draft, target_cfg)
    own_embedding = "embed_tokens.weight" in tensors and isinstance(target, Transformer)
    if own_embedding and cfg.hidden_size == target.cfg.hidden_size:
        stored, table = tensors["embed_tokens.weight"].cpu(), target.embed_tokens.weight.detach().cpu()
        narrow = min((stored.dtype, table.dtype), key=lambda d: torch.finfo(d).bits)
        if not torch.equal(stored.to(narrow), table.to(narrow)):
            raise ValueError("draft/target mismatch: the draft's embed_tokens differs from the target's (the draft's "
                             "embedding is a frozen copy of its target's: trained for another target?)")
        draft.embed_tokens.weight.data.copy_(table)
    return draft.eval()
