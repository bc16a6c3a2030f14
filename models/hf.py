"""Load a local Hugging Face checkpoint (llama, mistral, qwen2, qwen3, gemma3_text, gemma3) into our Transformer.

The directory holds config.json, one or several *.safetensors (sharded with model.safetensors.index.json
or not) and usually tokenizer.json. Everything we do not implement is refused with the file and key named
(unknown model_type, rope scaling other than default/linear/llama3, activations other than silu and
gelu_pytorch_tanh, MLP bias, attention logit soft-capping outside Gemma 3, bidirectional attention), as is
any missing, unexpected or wrongly shaped tensor: a checkpoint either loads exactly or not at all.
`hf_weight_names` is the one place HF names map to ours.

A config is read as transformers 4.57 and 5.x write it: RoPE settings from 4.x's rope_theta, rope_scaling and
Gemma's rope_local_base_freq, or from 5.x's rope_parameters (one dict, or one per layer type), through one
mapping (`rope_settings`, which follows 5.x's precedence: a rope_scaling key updates rope_parameters). Every
other key the loader reads has one name in both versions.

Per model type (as transformers 4.57 builds them):
  llama  : attention_bias -> bias on q, k, v and o; no sliding window
  mistral: no biases; sliding_window on every layer (or layer_types)
  qwen2  : bias on q, k, v (never o); sliding window only if use_sliding_window, on layers >= max_window_layers
  qwen3  : as qwen2 for windows, attention_bias on q, k, v, o; RMSNorm on q and k per head (qk_norm)
  gemma3_text (Gemma3ForCausalLM): keys missing from config.json take Gemma3TextConfig's defaults
           (GEMMA3_TEXT_DEFAULTS: tie_word_embeddings true, head_dim 256, ...); every norm is Gemma's
           (1 + weight, float32), four per layer (HF post_attention_layernorm and post_feedforward_layernorm
           norm the sublayer outputs and become our attn_output_norm / mlp_output_norm; HF
           pre_feedforward_layernorm is our post_attention_layernorm); QK-norm; GeGLU (hidden_activation);
           embeddings times sqrt(hidden_size); attention scale query_pre_attn_scalar ** -0.5; attention_bias
           on q, k, v and o; layer_types (default: every sliding_window_pattern-th layer full, the others
           sliding) puts sliding_window on the sliding layers, which take RoPE base rope_local_base_freq with
           default RoPE while full layers take rope_theta with rope_scaling; final_logit_softcapping soft-caps
           the logits. attn_logit_softcapping is accepted and not applied: Gemma3Attention.forward does not
           pass it to the attention function, so transformers' Gemma 3 never soft-caps attention scores.
  gemma3 (Gemma3ForConditionalGeneration): its text_config is a gemma3_text config, loaded as above from the
           language model's tensors (language_model.model.* and language_model.lm_head.weight as saved by
           4.57, or model.language_model.* and lm_head.weight); the vision tower and the projector are
           ignored. final_logit_softcapping is not applied: Gemma3ForConditionalGeneration.forward does not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.checkpoint import read_safetensors_dir
from models.config import ACTIVATIONS, ROPE_SCALING_TYPES, TargetConfig
from models.target import Transformer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")
GEMMA = ("gemma3_text",)
# Keys some exporters leave in checkpoints that carry no weights we need (recomputed buffers), after the
# decoder's prefix.
IGNORED_KEYS = r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq"
# The non-text parts of a gemma3 (multimodal) checkpoint.
IGNORED_MULTIMODAL_KEYS = r"(model\.)?(vision_tower|multi_modal_projector)\..*"
DEFAULT_MAX_SEQ_LEN = 4096
# transformers 4.57.6 Gemma3TextConfig.__init__ defaults (save_pretrained omits some of them from
# config.json, and published multimodal checkpoints omit most of text_config): tests pin them to the class.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000.0, attention_bias=False,
    query_pre_attn_scalar=256, sliding_window=4096, layer_types=None, final_logit_softcapping=None,
    attn_logit_softcapping=None, rope_scaling=None, rope_local_base_freq=10_000.0,
    use_bidirectional_attention=False,
)
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # Gemma3TextConfig: kwargs.get("sliding_window_pattern", 6)
# Where the text model's tensors live: (prefix of the decoder's tensors, lm_head key).
CAUSAL_LM_LAYOUT = ("model.", "lm_head.weight")
GEMMA3_LAYOUTS = (("language_model.model.", "language_model.lm_head.weight"),  # as saved by transformers 4.57
                  ("model.language_model.", "lm_head.weight"))  # the in-memory layout of 4.57 (and 5.x files)


def text_config(d: dict) -> tuple[dict, str, str]:
    """-> (the text model's config with its model type's defaults filled in, model_type, key prefix for messages).

    A gemma3 (multimodal) config yields its text_config as model_type gemma3_text."""
    mt = d.get("model_type")
    if mt == "gemma3":
        text = d.get("text_config") or {}
        return {**GEMMA3_TEXT_DEFAULTS, **text}, "gemma3_text", "text_config."
    if mt in GEMMA:
        return {**GEMMA3_TEXT_DEFAULTS, **d}, mt, ""
    return d, mt, ""


def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


def rope_settings(d: dict, model_type: str) -> dict:
    """-> {rope_theta, rope_scaling, rope_local_theta, partial_rotary_factor} (TargetConfig fields) of a text
    config dict of either transformers version, and `source`: the key that set rope_scaling, for messages.

    transformers 5 keeps every RoPE setting in rope_parameters: {rope_type, rope_theta, scaling keys,
    partial_rotary_factor} for one RoPE, or {full_attention: {...}, sliding_attention: {...}} for Gemma 3's
    two. A legacy rope_scaling key updates it and a legacy rope_theta fills a missing base, as 5.x's configs
    read them; 4.x configs carry only the legacy keys. rope_scaling is None for default (unscaled) RoPE.
    Gemma's sliding layers take default RoPE at their own base (rope_local_theta); the others None."""
    params = d.get("rope_parameters") or {}
    gemma = model_type in GEMMA
    if gemma:
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
    else:
        full, sliding = dict(params), {}
    source = "rope_parameters"
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
        source = "rope_scaling"
    theta = full.pop("rope_theta", d.get("rope_theta", 10000.0))
    prf = full.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    out = {"rope_theta": float(theta), "partial_rotary_factor": float(prf),
           "rope_scaling": full if _rope_type(full) != "default" else None, "rope_local_theta": None,
           "source": source}
    if gemma:
        if _rope_type(sliding) != "default":
            raise ValueError(f"rope_parameters.sliding_attention={sliding!r}: sliding layers with RoPE type "
                             f"{_rope_type(sliding)!r} are not implemented (they take default RoPE)")
        out["rope_local_theta"] = float(sliding.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    return out


def target_config_from_hf(d: dict, where, *, max_seq_len: int | None = None, tap_layers=None) -> TargetConfig:
    """The TargetConfig of a Hugging Face config dict (config.json, or a transformers config's to_dict());
    `where` names it in refusals."""
    outer = d.get("model_type")
    if outer not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type={outer!r}: unsupported model type "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    d, mt, prefix = text_config(d)

    def refuse(key, why):
        raise ValueError(f"{where}: {prefix}{key}={d.get(key)!r}: {why}")

    if prefix and d.get("model_type", "gemma3_text") != "gemma3_text":
        refuse("model_type", "the text model of a gemma3 checkpoint must be gemma3_text")
    gemma = mt in GEMMA
    act_key = "hidden_activation" if gemma else "hidden_act"
    if d.get(act_key, "silu") not in ACTIVATIONS:
        refuse(act_key, f"only {', '.join(ACTIVATIONS)} are implemented")
    if d.get("mlp_bias"):
        refuse("mlp_bias", "MLP biases are not implemented")
    if not gemma and d.get("attn_logit_softcapping") is not None:
        refuse("attn_logit_softcapping", "attention logit soft-capping is not implemented for this model type")
    if gemma and d.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "bidirectional attention is not implemented")
    try:
        rope = rope_settings(d, mt)
    except ValueError as e:
        raise ValueError(f"{where}: {prefix}{e}") from None
    rs = rope["rope_scaling"]
    if rs is not None and _rope_type(rs) not in ROPE_SCALING_TYPES:
        raise ValueError(f"{where}: {prefix}{rope['source']}={rs!r}: rope scaling type {_rope_type(rs)!r} is not "
                         f"implemented (supported: {ROPE_SCALING_TYPES})")
    L, H, heads = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    bias = bool(d.get("attention_bias", False))
    qkv_bias, o_bias = {"llama": (bias, bias), "mistral": (False, False), "qwen2": (True, False),
                        "qwen3": (bias, bias), "gemma3_text": (bias, bias)}[mt]
    # Gemma3ForConditionalGeneration applies no final soft-cap; Gemma3ForCausalLM (and the others) do.
    logit_softcap = None if prefix else d.get("final_logit_softcapping")
    extra = {}
    if gemma:
        extra = dict(hidden_act=d["hidden_activation"], norm_unit_offset=True, output_norms=True,
                     attn_scale=d["query_pre_attn_scalar"] ** -0.5, rope_local_theta=rope["rope_local_theta"],
                     embed_scale=H ** 0.5)
    elif "hidden_act" in d:
        extra = dict(hidden_act=d["hidden_act"])
    return TargetConfig(
        vocab_size=d["vocab_size"],
        hidden_size=H,
        n_layers=L,
        n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or H // heads,
        intermediate_size=d["intermediate_size"],
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=mt in ("qwen3", "gemma3_text"),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        logit_softcap=logit_softcap,
        sliding_window=_sliding_windows(d, mt, L, where, prefix),
        max_seq_len=max_seq_len or min(d.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN), DEFAULT_MAX_SEQ_LEN),
        context_length=d.get("max_position_embeddings"),
        tap_layers=tap_layers,
        rope_scaling=rs,
        **extra,
    )


def _sliding_windows(d: dict, mt: str, L: int, where, prefix: str = "") -> list | None:
    window = d.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    types = d.get("layer_types")
    if types is None and mt in GEMMA:
        pattern = d.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    if window is None:
        if mt in GEMMA and types is not None and "sliding_attention" in types:
            raise ValueError(f"{where}: {prefix}sliding_window=None: layer_types has sliding_attention layers, "
                             f"which need a window size")
        return None
    if types is None:
        if mt in ("qwen2", "qwen3"):
            start = d.get("max_window_layers", L)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(L)]
        else:
            types = ["sliding_attention"] * L
    if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: {prefix}layer_types={types!r}: need {L} entries of "
                         f"sliding_attention/full_attention")
    windows = [window if t == "sliding_attention" else None for t in types]
    return None if all(w is None for w in windows) else windows


def hf_weight_names(cfg: TargetConfig, layout: tuple[str, str] = CAUSAL_LM_LAYOUT) -> dict[str, str]:
    """HF checkpoint key -> our state_dict key, for every tensor the target needs.

    layout = (prefix of the decoder's tensors, lm_head key): CAUSAL_LM_LAYOUT, or one of GEMMA3_LAYOUTS for
    the language model inside a multimodal gemma3 checkpoint. With cfg.output_norms (Gemma) HF's
    post_attention_layernorm norms the attention output (ours: attn_output_norm), pre_feedforward_layernorm
    is the pre-MLP norm (ours: post_attention_layernorm) and post_feedforward_layernorm norms the MLP output
    (ours: mlp_output_norm)."""
    prefix, lm_head = layout
    names = {f"{prefix}embed_tokens.weight": "embed_tokens.weight", f"{prefix}norm.weight": "norm.weight"}
    if not cfg.tie_embeddings:
        names[lm_head] = "lm_head.weight"
    per_layer = {n: n for n in ["input_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                "mlp.down_proj.weight"]}
    if cfg.output_norms:
        per_layer.update({"post_attention_layernorm.weight": "attn_output_norm.weight",
                          "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
                          "post_feedforward_layernorm.weight": "mlp_output_norm.weight"})
    else:
        per_layer["post_attention_layernorm.weight"] = "post_attention_layernorm.weight"
    per_layer.update({f"self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"})
    if cfg.qkv_bias:
        per_layer.update({f"self_attn.{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in "qkv"})
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = "self_attn.o_proj.bias"
    if cfg.qk_norm:
        per_layer.update({f"self_attn.{n}_norm.weight": f"self_attn.{n}_norm.weight" for n in "qk"})
    for i in range(cfg.n_layers):
        for hf, ours in per_layer.items():
            names[f"{prefix}layers.{i}.{hf}"] = f"layers.{i}.{ours}"
    return names


def _layout(model_type: str, tensors: dict, path) -> tuple[tuple[str, str], re.Pattern]:
    """-> (layout for hf_weight_names, pattern of the tensors to skip) for this checkpoint's model type."""
    if model_type != "gemma3":
        return CAUSAL_LM_LAYOUT, re.compile(re.escape(CAUSAL_LM_LAYOUT[0]) + IGNORED_KEYS)
    for layout in GEMMA3_LAYOUTS:
        if f"{layout[0]}embed_tokens.weight" in tensors:
            return layout, re.compile(f"{re.escape(layout[0])}{IGNORED_KEYS}|{IGNORED_MULTIMODAL_KEYS}")
    raise ValueError(f"{path}: a gemma3 checkpoint needs "
                     f"{' or '.join(repr(p + 'embed_tokens.weight') for p, _ in GEMMA3_LAYOUTS)}")


def load_hf_target(path, *, max_seq_len: int | None = None, tap_layers=None,
                   dtype: torch.dtype = torch.float32) -> tuple[Transformer, Path | None]:
    """-> (Transformer in eval mode, path of tokenizer.json or None) of a checkpoint directory.

    max_seq_len: KV cache / RoPE table size (default min(max_position_embeddings, 4096)).
    tap_layers: explicit taps (default models.default_taps(L), checked only when taps are used).
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file}: not found (is {path} a Hugging Face checkpoint directory?)")
    tensors, origin = read_safetensors_dir(path)
    model = target_from_hf(json.loads(cfg_file.read_text()), tensors, cfg_file,
                           where={k: path / f for k, f in origin.items()}, max_seq_len=max_seq_len,
                           tap_layers=tap_layers, dtype=dtype)
    tokenizer = path / "tokenizer.json"
    return model, (tokenizer if tokenizer.exists() else None)


def target_from_hf(hf_cfg: dict, tensors: dict[str, torch.Tensor], config_where, *, where=None,
                   max_seq_len: int | None = None, tap_layers=None,
                   dtype: torch.dtype = torch.float32) -> Transformer:
    """-> our Transformer (eval mode) of a Hugging Face config dict and its tensors under HF names (a
    checkpoint's files, or a transformers model's state_dict()). Exactly the tensors this configuration
    needs, each of its shape, or a ValueError naming the key: `config_where` names the config in messages,
    `where[key]` the file a tensor came from (default: config_where)."""
    where = where or {}
    cfg = target_config_from_hf(hf_cfg, config_where, max_seq_len=max_seq_len, tap_layers=tap_layers)
    model = Transformer(cfg).to(dtype)
    layout, skip = _layout(hf_cfg.get("model_type"), tensors, config_where)
    lm_head, embed = layout[1], f"{layout[0]}embed_tokens.weight"
    names = hf_weight_names(cfg, layout)
    ours = model.state_dict()
    for hf_key in names:
        if hf_key not in tensors:
            files = sorted({Path(str(w)).name for w in where.values()}) or [str(config_where)]
            raise ValueError(f"{config_where}: missing tensor {hf_key!r} (files: {files})")
    state = {}
    for hf_key, t in tensors.items():
        if skip.fullmatch(hf_key):
            continue
        origin = where.get(hf_key, config_where)
        if hf_key == lm_head and cfg.tie_embeddings:
            if not torch.equal(t, tensors[embed]):
                raise ValueError(f"{origin}: {lm_head!r} differs from the embedding but the config has "
                                 f"tie_word_embeddings=true")
            continue
        if hf_key not in names:
            raise ValueError(f"{origin}: unexpected tensor {hf_key!r} (not part of a model of this configuration)")
        expected = ours[names[hf_key]]
        if tuple(t.shape) != tuple(expected.shape):
            raise ValueError(f"{origin}: tensor {hf_key!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(expected.shape)}")
        state[names[hf_key]] = t.to(expected.dtype)
    model.load_state_dict(state, strict=False)
    return model.eval()
