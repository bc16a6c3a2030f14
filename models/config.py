"""Configurations of the target transformer and the EAGLE-3 draft head.

Both are plain dataclasses with no framework behind them. `TargetConfig.to_dict()/from_dict()` is the
`config.json` of our own target checkpoints; the draft's on-disk form is the vLLM "speculators" layout
(see models/checkpoint.py), so `DraftConfig` has no JSON form of its own beyond `to_dict()` for reports.

Tap layers follow the Hugging Face `hidden_states` index convention: index 0 is the embedding output,
index k is the residual stream after decoder layer k-1 (before the final norm), so valid indices are
[0, L]. `tap_layers=None` means `default_taps(L)`: vLLM's and EAGLE-3's (2, L//2, L-3) where that list is
strictly ascending (L >= 7), and low, middle and top layers on shallower targets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROPE_SCALING_TYPES = ("default", "linear", "llama3")
# The MLP's gate activation (HF names): silu is SwiGLU (Llama family), gelu_pytorch_tanh GeGLU (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def default_taps(n_layers: int) -> tuple[int, int, int]:
    """Three strictly ascending tap layers for any L >= 2 (HF index convention): vLLM's and EAGLE-3's
    (2, L//2, L-3) for L >= 7, where it is valid; below that, the same low/middle/top intent pushed apart
    until ascending (L = 3 gives (1, 2, 3), L = 4..6 give (2, 3, 4))."""
    if n_layers >= 7:
        return (2, n_layers // 2, n_layers - 3)
    a = min(2, n_layers - 2)
    b = max(a + 1, n_layers // 2)
    return (a, b, max(b + 1, n_layers - 3))


def check_taps(tap_layers, n_layers: int) -> tuple[int, int, int]:
    """Return `tap_layers` as a tuple, or raise ValueError showing the bad list.

    Three ints, strictly ascending (hence unique), each in [0, n_layers]; their order is the order of the
    fc input, so a permuted list is a different draft and is refused rather than sorted.
    """
    taps = list(tap_layers)
    ok = (
        len(taps) == 3
        and all(isinstance(t, int) and not isinstance(t, bool) for t in taps)
        and all(0 <= t <= n_layers for t in taps)
        and all(a < b for a, b in zip(taps, taps[1:]))
    )
    if not ok:
        raise ValueError(
            f"tap_layers {taps} invalid for a {n_layers}-layer target: need 3 strictly ascending ints in "
            f"[0, {n_layers}] (HF convention: 0 = embeddings, k = residual after layer k-1)"
        )
    return tuple(taps)


def check_rope_scaling(rope_scaling: dict | None, where: str = "rope_scaling") -> None:
    if rope_scaling is None:
        return
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"{where}: rope scaling type {kind!r} is not implemented (supported: {ROPE_SCALING_TYPES})")


@dataclass
class TargetConfig:
    """A decoder-only transformer: the Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma 3 as options.

    Every option's default is the Llama behaviour, so a Llama config sets none of the Gemma ones.
    `sliding_window` is None (no layer windowed) or a per-layer list of window sizes (None = full
    attention for that layer); a key is visible to a query when query_pos - window < key_pos <= query_pos.
    `max_seq_len` sizes the static KV cache and the RoPE tables: a property of one loaded instance (each stage
    loads the target at the length it needs; the export at export.max_seq_len), not of the weights.
    `context_length` is the context the weights were trained for (a checkpoint's max_position_embeddings, a
    GGUF's context_length), None where the model claims none (the embedded default, trained on short windows):
    no cache is exported longer than a claimed one.

    Gemma options (HF keys of a gemma3_text config.json in brackets):
      hidden_act          the MLP's gate activation, one of ACTIVATIONS [hidden_activation; Llama: hidden_act]
      norm_unit_offset    every RMSNorm scales by (1 + weight), in float32 (Gemma's norm) instead of by weight
      output_norms        each sublayer's output is normed before the residual add (attn_output_norm,
                          mlp_output_norm) [post_attention_layernorm, post_feedforward_layernorm]
      attn_scale          the factor on q.k before the softmax; None = head_dim ** -0.5
                          [query_pre_attn_scalar ** -0.5]
      attn_logit_softcap  attention scores become tanh(s / cap) * cap before the mask; None = off
      logit_softcap       the same on the final logits [final_logit_softcapping]
      rope_local_theta    RoPE base of the windowed layers, with default (unscaled) RoPE; the other layers
                          keep rope_theta and rope_scaling; None = one RoPE for every layer [rope_local_base_freq]
      embed_scale         the embedding output is multiplied by it (Gemma: sqrt(hidden_size))
    """

    vocab_size: int = 256
    hidden_size: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    embed_scale: float = 1.0
    logit_softcap: float | None = None
    sliding_window: list | None = None
    max_seq_len: int = 128
    context_length: int | None = None
    tap_layers: tuple | None = None
    # Needed by real checkpoints:
    o_bias: bool = False  # Llama/Qwen3 attention_bias also puts a bias on o_proj
    rope_scaling: dict | None = None  # None, {"rope_type": "linear"|"llama3", ...}
    # Gemma 3 (see the class docstring):
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    output_norms: bool = False
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    rope_local_theta: float | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.tap_layers is not None:
            self.tap_layers = check_taps(self.tap_layers, self.n_layers)
        if self.sliding_window is not None:
            self.sliding_window = list(self.sliding_window)
            if len(self.sliding_window) != self.n_layers or not all(
                    w is None or (isinstance(w, int) and w > 0) for w in self.sliding_window):
                raise ValueError(f"sliding_window {self.sliding_window} invalid: need {self.n_layers} entries, "
                                 f"each a positive int or None")
        check_rope_scaling(self.rope_scaling)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not implemented (supported: {ACTIVATIONS})")
        for name in ("logit_softcap", "attn_logit_softcap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r}: need a positive number or None")

    @property
    def taps(self) -> tuple[int, int, int]:
        """The effective tap layers (explicit or default), validated."""
        return check_taps(self.tap_layers if self.tap_layers is not None else default_taps(self.n_layers),
                          self.n_layers)

    def window(self, layer: int) -> int | None:
        return None if self.sliding_window is None else self.sliding_window[layer]

    def local_rope(self, layer: int) -> bool:
        """True when `layer` takes the local RoPE (rope_local_theta, default RoPE): it is windowed and
        rope_local_theta is set, as Gemma 3's sliding layers are."""
        return self.rope_local_theta is not None and self.window(layer) is not None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tap_layers"] = None if self.tap_layers is None else list(self.tap_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TargetConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"TargetConfig: unknown keys {unknown}")
        return cls(**d)


@dataclass
class DraftConfig:
    """The EAGLE-3 draft head: one decoder layer with 2H-wide attention input over its own KV cache.

    `vocab_size` is the target vocabulary V (the embedding and t2d size), `draft_vocab_size` Vd the
    lm_head width. `target_hidden_size` is the width of each tap (fc takes 3 * target_hidden_size).
    `tap_layers` None means "the target's default taps" (as in vLLM when the checkpoint omits them).
    `norm_before_residual` (speculators semantics): the attention residual is the normed feature
    instead of the raw one.
    """

    vocab_size: int = 256
    draft_vocab_size: int = 256
    hidden_size: int = 64
    target_hidden_size: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_seq_len: int = 128
    tap_layers: tuple | None = None
    norm_before_residual: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} > vocab_size={self.vocab_size}")
        if self.tap_layers is not None:
            self.tap_layers = tuple(self.tap_layers)
        check_rope_scaling(self.rope_scaling)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tap_layers"] = None if self.tap_layers is None else list(self.tap_layers)
        return d


# The tiny shape used by tests and the smoke pipeline: 4 layers, hidden 64, vocab 256.
TINY = TargetConfig()
