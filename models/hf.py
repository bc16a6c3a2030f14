"""Load a local Hugging Face checkpoint (llama, mistral, qwen2, qwen3) into our Transformer.

The directory holds config.json, one or several *.safetensors (sharded with model.safetensors.index.json
or not) and usually tokenizer.json. Everything we do not implement is refused with the file and key named
(unknown model_type, rope scaling other than default/linear/llama3, non-SiLU activations, MLP bias,
attention logit soft-capping), as is any missing, unexpected or wrongly shaped tensor: a checkpoint
either loads exactly or not at all. `hf_weight_names` is the one place HF names map to ours.

Per model type (as transformers 4.57 builds them):
  llama  : attention_bias -> bias on q, k, v and o; no sliding window
  mistral: no biases; sliding_window on every layer (or layer_types)
  qwen2  : bias on q, k, v (never o); sliding window only if use_sliding_window, on layers >= max_window_layers
  qwen3  : as qwen2 for windows, attention_bias on q, k, v, o; RMSNorm on q and k per head (qk_norm)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.checkpoint import read_safetensors_dir
from models.config import ROPE_SCALING_TYPES, TargetConfig
from models.target import Transformer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Keys some exporters leave in checkpoints that carry no weights we need (recomputed buffers).
IGNORED_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
DEFAULT_MAX_SEQ_LEN = 4096


def target_config_from_hf(d: dict, path, *, max_seq_len: int | None = None, tap_layers=None) -> TargetConfig:
    where = Path(path) / "config.json"

    def refuse(key, why):
        raise ValueError(f"{where}: {key}={d.get(key)!r}: {why}")

    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        refuse("model_type", f"unsupported model type (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if d.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only silu (SwiGLU) is implemented")
    if d.get("mlp_bias"):
        refuse("mlp_bias", "MLP biases are not implemented")
    if d.get("attn_logit_softcapping") is not None:
        refuse("attn_logit_softcapping", "attention logit soft-capping is not implemented")
    rs = d.get("rope_scaling")
    if rs is not None and rs.get("rope_type", rs.get("type")) not in ROPE_SCALING_TYPES:
        refuse("rope_scaling", f"rope scaling type {rs.get('rope_type', rs.get('type'))!r} is not implemented "
                               f"(supported: {ROPE_SCALING_TYPES})")
    L, H, heads = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    bias = bool(d.get("attention_bias", False))
    qkv_bias, o_bias = {"llama": (bias, bias), "mistral": (False, False), "qwen2": (True, False),
                        "qwen3": (bias, bias)}[mt]
    return TargetConfig(
        vocab_size=d["vocab_size"],
        hidden_size=H,
        n_layers=L,
        n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or H // heads,
        intermediate_size=d["intermediate_size"],
        rope_theta=float(d.get("rope_theta", 10000.0)),
        partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=mt == "qwen3",
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        logit_softcap=d.get("final_logit_softcapping"),
        sliding_window=_sliding_windows(d, mt, L, where),
        max_seq_len=max_seq_len or min(d.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN), DEFAULT_MAX_SEQ_LEN),
        tap_layers=tap_layers,
        rope_scaling=rs,
    )


def _sliding_windows(d: dict, mt: str, L: int, where) -> list | None:
    window = d.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    if window is None:
        return None
    types = d.get("layer_types")
    if types is None:
        if mt in ("qwen2", "qwen3"):
            start = d.get("max_window_layers", L)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(L)]
        else:
            types = ["sliding_attention"] * L
    if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types={types!r}: need {L} entries of sliding_attention/full_attention")
    windows = [window if t == "sliding_attention" else None for t in types]
    return None if all(w is None for w in windows) else windows


def hf_weight_names(cfg: TargetConfig) -> dict[str, str]:
    """HF checkpoint key -> our state_dict key, for every tensor the target needs."""
    names = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if cfg.qkv_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if cfg.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(cfg.n_layers):
        for n in per_layer:
            names[f"model.layers.{i}.{n}"] = f"layers.{i}.{n}"
    return names


def load_hf_target(path, *, max_seq_len: int | None = None, tap_layers=None,
                   dtype: torch.dtype = torch.float32) -> tuple[Transformer, Path | None]:
    """-> (Transformer in eval mode, path of tokenizer.json or None).

    max_seq_len: KV cache / RoPE table size (default min(max_position_embeddings, 4096)).
    tap_layers: explicit taps (default models.default_taps(L), checked only when taps are used).
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file}: not found (is {path} a Hugging Face checkpoint directory?)")
    cfg = target_config_from_hf(json.loads(cfg_file.read_text()), path, max_seq_len=max_seq_len,
                                tap_layers=tap_layers)
    model = Transformer(cfg).to(dtype)
    tensors, origin = read_safetensors_dir(path)
    names = hf_weight_names(cfg)
    ours = model.state_dict()
    for hf_key in names:
        if hf_key not in tensors:
            raise ValueError(f"{path}: missing tensor {hf_key!r} (files: {sorted(set(origin.values()))})")
    state = {}
    for hf_key, t in tensors.items():
        if IGNORED_KEYS.fullmatch(hf_key):
            continue
        if hf_key == "lm_head.weight" and cfg.tie_embeddings:
            if not torch.equal(t, tensors["model.embed_tokens.weight"]):
                raise ValueError(f"{path / origin[hf_key]}: 'lm_head.weight' differs from the embedding but "
                                 f"config.json has tie_word_embeddings=true")
            continue
        if hf_key not in names:
            raise ValueError(f"{path / origin[hf_key]}: unexpected tensor {hf_key!r} (not part of a "
                             f"{cfg_file.name} model of this configuration)")
        expected = ours[names[hf_key]]
        if tuple(t.shape) != tuple(expected.shape):
            raise ValueError(f"{path / origin[hf_key]}: tensor {hf_key!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(expected.shape)}")
        state[names[hf_key]] = t.to(expected.dtype)
    model.load_state_dict(state, strict=False)
    tokenizer = path / "tokenizer.json"
    return model.eval(), (tokenizer if tokenizer.exists() else None)
