"""The EAGLE-3 draft head (one decoder layer over [embedding ; feature], its own KV cache).

With H the draft hidden size and Ht the target's:
    f       = fc(cat(h_a, h_b, h_c))                        # 3*Ht -> H, at confirmed positions
            | g from the draft's previous step              # at speculative positions
    x       = cat(input_layernorm(embed(tok)), hidden_norm(f))   # [.., 2H]
    h       = r + o_proj(attn(x))          r = f (or hidden_norm(f) when norm_before_residual)
    g       = h + mlp(post_attention_layernorm(h))          # the recurrent feature
    logits  = lm_head(norm(g))                              # over the draft vocab Vd
    target  = draft_id + d2t[draft_id]
This is the layout and semantics of vLLM / speculators' Eagle3 first layer, and the module names are the
speculators checkpoint keys (layers.0.self_attn.q_proj.weight, layers.0.hidden_norm.weight, fc.weight,
d2t, t2d, ...), so `state_dict()` is the checkpoint.

Paths:
- `forward(tokens, feature, input_pos)`: cached, batch 1. Refuses a write that would leave a gap
  (first position > number of contiguous valid slots) and batch > 1. Overwriting earlier slots is allowed
  (the runner reseeds after a partial acceptance); the valid length becomes last written position + 1.
  The gap check is data dependent, so it runs only in eager mode (skipped while tracing, or when
  `check_gaps` is False).
- `forward(tokens, feature)` (input_pos None): stateless causal recompute, any batch.
- `forward_ttt(...)`: stateless training-time-test step (see its docstring).

`predicted_tau` turns the draft's per-position acceptance into expected tokens per round.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import DraftConfig
from models.layers import MLP, Attention, RMSNorm, Rope, attention_mask, cached_mask, is_tracing, start_position


# Where in the answer a round (a chain) starts: answer tokens [0,64), [64,256), [256,512), [512,1024), [1024,...).
# The draft stage's held-out report (pipeline.train_draft) and bench.context pool acceptance by these, so a draft
# that does not carry its acceptance deep into an answer shows it in both.
POSITION_BUCKETS = (0, 64, 256, 512, 1024)


def predicted_tau(acceptance) -> float:
    """Expected tokens per round of a chain of len(acceptance) proposals: 1 + sum_k prod_{i<=k} alpha_i.

    alpha_i = acceptance[i] is the probability that proposal i is accepted given that proposals 0..i-1
    were (the eval's `acceptance_pos_<i>`); the 1 is the token verify adds itself (correction or bonus).
    With these conditional rates the sum is exact, not an independence approximation: prod_{i<=k} alpha_i
    is the probability that the round accepts more than k proposals.

    It lives beside the draft because it is a fact of the draft's acceptance, read by both sides of the
    pipeline/runner line: the draft stage predicts tau from held-out taps with it, and the adaptive chain
    policy (runner.policy) ranks K with it. Here both import it downward."""
    total, survive = 1.0, 1.0
    for alpha in acceptance:
        survive *= alpha
        total += survive
    return total


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the feature
        self.self_attn = Attention(2 * H, H, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len,
                                   eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def attn_input(self, embeds, feature):
        """-> (x [.., 2H], residual [.., H])."""
        f = self.hidden_norm(feature)
        x = torch.cat((self.input_layernorm(embeds), f), dim=-1)
        return x, (f if self.norm_before_residual else feature)

    def finish(self, residual, attn_out):
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, feature, cos, sin, mask, input_pos=None):
        x, residual = self.attn_input(embeds, feature)
        return self.finish(residual, self.self_attn(x, cos, sin, mask, input_pos))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's (models.Speculator shares it)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Identity mapping onto the first Vd target ids until a real d2t is loaded/set.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.rope = Rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, 1.0, cfg.rope_scaling)
        self.register_buffer("key_pos", torch.arange(cfg.max_seq_len), persistent=False)
        self.check_gaps = True  # exporters may turn the eager-only cache guard off explicitly
        self.valid_len = 0  # contiguous valid cache slots [0, valid_len) (eager bookkeeping only)

    # --- pieces -------------------------------------------------------------------------------------
    def fuse(self, taps) -> torch.Tensor:
        """taps: 3 x [B,T,Ht] (in tap order) -> feature [B,T,H]."""
        return self.fc(torch.cat(tuple(taps), dim=-1))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def set_vocab_map(self, used_target_ids: torch.Tensor) -> None:
        """Set d2t/t2d from the sorted target ids that form the draft vocab (len Vd)."""
        used = torch.as_tensor(used_target_ids, dtype=torch.int64)
        if used.shape != (self.cfg.draft_vocab_size,):
            raise ValueError(f"need {self.cfg.draft_vocab_size} target ids for the draft vocab, got {tuple(used.shape)}")
        if (used[1:] <= used[:-1]).any() or used.min() < 0 or used.max() >= self.cfg.vocab_size:
            raise ValueError(f"draft vocab ids must be strictly ascending in [0, {self.cfg.vocab_size})")
        self.d2t.copy_(used - torch.arange(len(used)))
        self.t2d.zero_()
        self.t2d[used] = True

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(g))

    # --- cached / stateless forward -----------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor | None = None):
        """tokens [B,T], feature [B,T,H] -> (logits [B,T,Vd], g [B,T,H]). Cached (batch 1) iff input_pos."""
        g = self.hidden(tokens, feature, input_pos)
        return self.logits(g), g

    def hidden(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor | None = None):
        """forward's g [B,T,H] alone: a caller that reads one row's logits takes the lm_head on that row only."""
        T = tokens.shape[1]
        kv_impl = "index_copy"
        if input_pos is None:
            q_pos = torch.arange(T, device=tokens.device)
            k_pos = q_pos
        else:
            self._check_cache_write(tokens, input_pos)
            q_pos, k_pos = input_pos, self.key_pos
            kv_impl = self.layers[0].self_attn.kv_impl
        cos, sin = self.rope.tables(q_pos)
        if kv_impl == "llama_ops":  # [T, 1, rot]: broadcast over the heads of [B, T, heads, hd]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = cached_mask(kv_impl, q_pos, k_pos, None)
        if kv_impl == "llama_ops":  # the layer takes the start position, read once per call
            input_pos = start_position(input_pos, self.key_pos.numel())
        return self.layers[0](self.embed_tokens(tokens), feature, cos, sin, mask, input_pos)

    def _check_cache_write(self, tokens, input_pos):
        if tokens.shape[0] != 1:
            raise ValueError(f"draft cache is batch 1; got batch {tokens.shape[0]}")
        if not self.check_gaps or is_tracing():
            return
        first, last = int(input_pos[0]), int(input_pos[-1])
        if first > self.valid_len:
            filled = f"positions 0..{self.valid_len - 1} filled" if self.valid_len else "cache empty"
            raise ValueError(f"draft cache gap: write starts at position {first} but the next writable "
                             f"position is {self.valid_len} ({filled})")
        if last >= self.cfg.max_seq_len:
            raise ValueError(f"draft cache overflow: position {last} >= max_seq_len {self.cfg.max_seq_len}")
        self.valid_len = last + 1

    def reset_cache(self) -> None:
        self.layers[0].self_attn.reset_cache()
        self.valid_len = 0

    # --- training-time test -------------------------------------------------------------------------
    def forward_ttt(self, tokens: torch.Tensor, feature: torch.Tensor, past_kv: list, step: int | None = None,
                    position_offset: int | None = None, first: int = 0):
        """One stateless training-time-test step i = len(past_kv) (EAGLE-3).

        tokens, feature [B,T,H] are slot-aligned by the caller (step 0: fc(taps) over every slot; step i: the g
        of step i-1, with ids shifted by i, over the query slots first..). Slot t of step i stands for the draft
        cache entry at absolute position t + i at inference, so RoPE uses positions t + position_offset
        (default: i). Attention of (step i, slot t) sees step-0 keys at slots s <= t and the keys of steps
        1..i at slot t (the "diagonal"), which is exactly what the inference-time cache holds after a seed + i
        steps. Only slots t >= `first` are queried: step 0 still projects keys at every slot (a long prompt
        costs its keys, not its logits), which is all a later slot reads of an earlier one.
        past_kv: [(k, v)] of steps 0..i-1, RoPE applied: step 0's [B, kv, S, hd] over every slot, later
        steps' over the query slots.
        Returns (logits [B,Q,Vd], g [B,Q,H] of the Q query slots, (k, v) of this step, to append to past_kv).
        """
        i = len(past_kv)
        if step is not None and step != i:
            raise ValueError(f"forward_ttt: step={step} but len(past_kv)={i}")
        B, T = tokens.shape
        S = T if i == 0 else past_kv[0][0].shape[2]  # slots of step 0's keys
        layer = self.layers[0]
        attn = layer.self_attn
        start = 0 if i == 0 else first  # the absolute slot of this step's first input
        pos = torch.arange(start, start + T, device=tokens.device) + (i if position_offset is None else position_offset)
        cos, sin = self.rope.tables(pos)
        x, residual = layer.attn_input(self.embed_tokens(tokens), feature)
        q, k, v = attn.project(x, cos, sin)
        if i == 0 and first:
            q, residual = q[:, :, first:], residual[:, first:]
        keys = [k] if i == 0 else [past_kv[0][0]] + [kv[0] for kv in past_kv[1:]] + [k]
        vals = [v] if i == 0 else [past_kv[0][1]] + [kv[1] for kv in past_kv[1:]] + [v]
        rep = attn.n_heads // attn.n_kv_heads
        expand = (lambda t: t.repeat_interleave(rep, dim=1)) if rep > 1 else (lambda t: t)
        k0, v0 = expand(keys[0]), expand(vals[0])
        causal = attention_mask(torch.arange(first, S, device=tokens.device), torch.arange(S, device=tokens.device),
                                None)
        s0 = (torch.matmul(q, k0.transpose(-2, -1)) * attn.scale).masked_fill(~causal, float("-inf"))
        Q = S - first
        if i == 0:
            p = torch.softmax(s0.float(), dim=-1).to(q.dtype)
            out = torch.matmul(p, v0)
        else:
            kd = torch.stack([expand(t) for t in keys[1:]], dim=-2)  # [B,h,Q,i,hd]
            vd = torch.stack([expand(t) for t in vals[1:]], dim=-2)
            sd = (q.unsqueeze(-2) * kd).sum(-1) * attn.scale  # [B,h,Q,i]
            p = torch.softmax(torch.cat((s0, sd), dim=-1).float(), dim=-1).to(q.dtype)
            out = torch.matmul(p[..., :S], v0) + (p[..., S:].unsqueeze(-1) * vd).sum(-2)
        out = attn.o_proj(out.transpose(1, 2).reshape(B, Q, attn.n_heads * attn.head_dim))
        g = layer.finish(residual, out)
        return self.logits(g), g, (k, v)
