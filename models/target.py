"""The target: one decoder (the Llama family and Gemma 3, as TargetConfig options) used for training, taps,
export and eager inference alike.

Two paths through the same weights:
- stateless (`input_pos=None`): any batch, positions 0..T-1, causal mask; the KV cache is untouched.
  Training and taps extraction use it.
- cached (`input_pos` [T] given): batch 1 (the exported and eager engines), or the batch given to
  `setup_cache` (batched greedy generation for the taps stage); each layer writes K/V for these positions
  into its static cache buffer and attends over the whole buffer under key_pos <= query_pos (and the layer's window).
  Overwriting earlier slots is allowed (a verify window after a partial acceptance overwrites the
  rejected slots); stale slots beyond the query positions are hidden by the mask.

Per-layer choices are Python branches on the config only (never on tensor values), so the traced graph is
static in every shape but T: each layer takes its window's mask (windows are masks over the whole static
cache) and its RoPE tables (the local ones on windowed layers when `rope_local_theta` is set).

Ring caches (`setup_cache(max_t=...)`): a windowed layer attends to at most `window` keys, so its cache holds
`ring_slots` = the largest window + max_t slots, position p in slot p % ring, where max_t is the widest call the
model will be given (the export's and the engines' max(max_prefill_chunk, max_m)). `slot_pos` [ring] records the
position each slot holds (-1: none; `write_slots`), and the windowed layers' masks come from it: a slot is visible
to a row at q when q - window < slot_pos <= q. Why max_t slots of slack: a write at p evicts p - ring, which a row
at q needs only if p > q + max_t. A call writes less than max_t positions past its first row, and no call starts
before the first row of a call before it in the sequence (a verify window after a rejection starts past the
previous one's first row; a one-row remainder of the prompt reaches back one position, into the call before), so
no write evicts a key that a row of its own call, or of a later one, needs. ExecuTorch's RingKVCache takes
2 x window, which holds calls of at most a window; ours costs window + max_t (640 slots for Gemma 3's 512 at
max_t = 128, against 1,024). Global layers stay flat, and so does every layer where a ring would be no shorter
than the cache.

Taps (HF convention): index 0 = embedding output (after embed_scale), index k = residual after layer k-1,
before the final norm. They are the very tensors the layers produce, so they are bit-identical to the
per-layer states and computing them does not change the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import TargetConfig
from models.layers import MLP, Attention, RMSNorm, Rope, cached_mask, is_capturing, is_tracing, start_position


class Block(nn.Module):
    """Pre-norm decoder layer: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)).

    `post_attention_layernorm` is always the norm of the residual before the MLP (the Llama name).
    With cfg.output_norms each sublayer's output is also normed before it joins the residual:
    h += attn_output_norm(attn(..)); h += mlp_output_norm(mlp(..)) (Gemma's sandwich; HF calls these
    post_attention_layernorm and post_feedforward_layernorm, and our pre-MLP norm pre_feedforward_layernorm:
    models/hf.py maps the names).
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        H = cfg.hidden_size

        def norm():
            return RMSNorm(H, cfg.rms_norm_eps, cfg.norm_unit_offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(H, H, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                   cfg.max_seq_len, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                                   qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps, scale=cfg.attn_scale,
                                   softcap=cfg.attn_logit_softcap, norm_unit_offset=cfg.norm_unit_offset)
        self.attn_output_norm = norm() if cfg.output_norms else None
        self.post_attention_layernorm = norm()
        self.mlp = MLP(H, cfg.intermediate_size, cfg.hidden_act)
        self.mlp_output_norm = norm() if cfg.output_norms else None

    def forward(self, h, cos, sin, mask, input_pos=None):
        a = self.self_attn(self.input_layernorm(h), cos, sin, mask, input_pos)
        if self.attn_output_norm is not None:
            a = self.attn_output_norm(a)
        h = h + a
        m = self.mlp(self.post_attention_layernorm(h))
        if self.mlp_output_norm is not None:
            m = self.mlp_output_norm(m)
        return h + m


class Transformer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.partial_rotary_factor,
                         cfg.rope_scaling)
        # Gemma 3's sliding layers: their own base, default RoPE (HF Gemma3TextModel.rotary_emb_local).
        self.rope_local = None if cfg.rope_local_theta is None else Rope(
            cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta, cfg.partial_rotary_factor, None)
        self.register_buffer("key_pos", torch.arange(cfg.max_seq_len), persistent=False)
        self.register_buffer("slot_pos", None, persistent=False)  # the ring's slot positions (module docstring)
        self.max_t = None  # the widest call a ring is sized for; None: flat caches, any width
        self.windows = sorted({cfg.window(i) for i in range(cfg.n_layers)}, key=lambda w: (w is not None, w))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None, *, taps: bool = False,
                last_only: bool = False, exact: bool = False):
        """tokens [B,T] int64 -> logits [B,T,V] (or [B,1,V] with last_only), plus taps when taps=True."""
        h, tapped = self.hidden(tokens, input_pos, self.cfg.taps if taps else (), exact)
        logits = self.head(h[:, -1:] if last_only else h)
        return (logits, tuple(tapped)) if taps else logits

    def head(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits from the last residual (pre-norm) [.., H]: final norm, lm_head, soft-cap.

        `rows` (target ids) computes only those logits, in that order: the draft's labels need the draft
        vocabulary only, and the rest of a 262,144-row lm_head would cost most of a training step."""
        h = self.norm(h)
        logits = self.lm_head(h) if rows is None else F.linear(h, self.lm_head.weight.index_select(0, rows))
        if self.cfg.logit_softcap is not None:
            cap = self.cfg.logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def hidden(self, tokens, input_pos=None, tap_layers=(), exact: bool = False):
        """Run embeddings and all layers. Returns (last residual [B,T,H] pre-norm, [states at tap_layers]).

        `exact` (cached calls): every layer's attention gives a row arithmetic that depends on its position,
        its inputs and the cache alone, not on where its call starts (`cached_mask`: eagle3::exact_sdpa on the
        llama ops); the index_copy path, over the whole buffer, always does."""
        B, T = tokens.shape
        kv_impl = "index_copy"  # the stateless path's masks are the bool ones
        if input_pos is None:
            q_pos = torch.arange(T, device=tokens.device)
            k_pos = q_pos
        else:
            self._check_cached_call(tokens, input_pos)
            q_pos, k_pos = input_pos, self.key_pos
            kv_impl = self.layers[0].self_attn.kv_impl
        ring = self.slot_pos is not None and input_pos is not None
        if ring:  # the windowed layers take their rows' slots; slot_pos learns the positions written there
            slots = self.write_slots(input_pos)
        tables = {False: self.rope.tables(q_pos)}
        if self.rope_local is not None:
            tables[True] = self.rope_local.tables(q_pos)
        if kv_impl == "llama_ops":  # [T, 1, rot]: broadcast over the heads of [B, T, heads, hd]
            tables = {k: (c.unsqueeze(1), s.unsqueeze(1)) for k, (c, s) in tables.items()}
        masks = {w: cached_mask(kv_impl, q_pos, k_pos, w, exact=exact) if w is None or not ring else
                 cached_mask(kv_impl, q_pos, self.slot_pos, w, exact=exact, ring=True) for w in self.windows}
        if kv_impl == "llama_ops":  # the layers take the start position, read once per call
            input_pos = start_position(input_pos, self.key_pos.numel())
        h = self.embed_tokens(tokens)
        if self.cfg.embed_scale != 1.0:
            # float32 scalar cast to the activations' dtype, as HF's Gemma3TextScaledWordEmbedding
            h = h * torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(h.dtype)
        tapped = [h] if 0 in tap_layers else []
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.cfg.local_rope(i)]
            h = layer(h, cos, sin, masks[self.cfg.window(i)], slots if ring and layer.self_attn.ring else input_pos)
            if i + 1 in tap_layers:
                tapped.append(h)
        return h, tapped

    def write_slots(self, input_pos: torch.Tensor) -> torch.Tensor:
        """The ring slots of positions input_pos [T] (p % ring), recorded in slot_pos. A call's positions are
        contiguous from its first, which the runner writes after every earlier position of the sequence; so while
        that first position is below the ring, the slots from it on hold nothing a row may see (a rejected window,
        an earlier sequence, or the buffer's initial bits in a program) and are marked empty first, as ExecuTorch's
        RingKVCache does: no row ever depends on what slot_pos held before the sequence began."""
        n = self.slot_pos.numel()
        self.slot_pos.copy_(torch.where(self.key_pos[:n] < input_pos[0], self.slot_pos, -1))
        slots = input_pos % n
        self.slot_pos.index_copy_(0, slots, input_pos)
        return slots

    def _check_cached_call(self, tokens, input_pos):
        batch, length = self.layers[0].self_attn.cache_size()[0], self.key_pos.numel()
        if tokens.shape[0] != batch:
            raise ValueError(f"cached forward of batch {tokens.shape[0]}, but the KV cache is for batch {batch} "
                             f"(batch 1 unless setup_cache(batch_size) says otherwise)")
        if is_tracing() or is_capturing():
            return
        if self.slot_pos is not None and tokens.shape[1] > self.max_t:
            raise ValueError(f"cached forward of {tokens.shape[1]} rows, but the ring caches are sized for calls of at "
                             f"most max_t={self.max_t} rows (setup_cache(max_t=...)): a wider call would evict keys "
                             f"its own rows need")
        if input_pos.numel() and int(input_pos.max()) >= length:
            raise ValueError(f"input_pos {int(input_pos.max())} is beyond the cache (length {length}, "
                             f"max_seq_len {self.cfg.max_seq_len})")

    def set_kv_impl(self, impl: str) -> None:
        """The cached path's implementation for every layer ("index_copy" | "llama_ops", models.layers);
        one model runs one implementation, so its masks are built once per call for all layers."""
        for layer in self.layers:
            layer.self_attn.set_kv_impl(impl)
        if self.slot_pos is not None:
            self.slot_pos.fill_(-1)

    def setup_cache(self, batch_size: int = 1, length: int | None = None, max_t: int | None = None) -> None:
        """Reallocate every layer's cache for batch_size x length positions (in its kv_impl's layout; length
        defaults to, and may not exceed, max_seq_len), empty. `max_t` (the widest call to come) gives the
        windowed layers ring caches of `ring_slots` slots (module docstring); None keeps every cache flat, for
        calls of any width. The exported methods use batch 1 over the whole max_seq_len with max_t their
        widest call; a shorter, batched cache serves batched greedy generation with the same layers."""
        length = self.cfg.max_seq_len if length is None else int(length)
        if not 1 <= length <= self.cfg.max_seq_len or batch_size < 1 or (max_t is not None and max_t < 1):
            raise ValueError(f"setup_cache(batch_size={batch_size}, length={length}, max_t={max_t}): need "
                             f"batch_size >= 1, 1 <= length <= max_seq_len={self.cfg.max_seq_len} and max_t >= 1")
        device = self.key_pos.device
        self.key_pos = torch.arange(length, device=device)
        ring = ring_slots(self.cfg, length, max_t)
        self.slot_pos = None if ring is None else torch.full((ring,), -1, dtype=torch.long, device=device)
        self.max_t = None if ring is None else max_t
        for i, layer in enumerate(self.layers):
            windowed = ring is not None and self.cfg.window(i) is not None
            layer.self_attn.setup_cache(batch_size, ring if windowed else length, ring=windowed)

    def reset_cache(self) -> None:
        for layer in self.layers:
            layer.self_attn.reset_cache()
        if self.slot_pos is not None:
            self.slot_pos.fill_(-1)


def ring_slots(cfg: TargetConfig, length: int, max_t: int | None) -> int | None:
    """The slots of the windowed layers' ring caches for calls of at most `max_t` rows over `length` positions:
    the largest window + max_t (module docstring); None (flat caches) without max_t, without a windowed layer,
    or where the ring would be no shorter than the flat cache."""
    windows = [w for w in (cfg.sliding_window or ()) if w]
    if max_t is None or not windows or max(windows) + max_t >= length:
        return None
    return max(windows) + max_t


def kv_cache_bytes(cfg: TargetConfig, length: int, dtype: torch.dtype, max_t: int | None = None) -> dict:
    """{"sliding": bytes, "global": bytes}: the K and V caches of the windowed and of the other layers, batch 1,
    over `length` positions with rings for calls of at most `max_t` rows (`ring_slots`), in `dtype`."""
    ring = ring_slots(cfg, length, max_t)
    per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    out = {"sliding": 0, "global": 0}
    for i in range(cfg.n_layers):
        windowed = cfg.window(i) is not None
        out["sliding" if windowed else "global"] += per_slot * (ring if windowed and ring else length)
    return out
