"""Randomly initialised targets and drafts of any size, for tests and the smoke pipeline."""

from __future__ import annotations

import dataclasses

import torch

from models.config import TINY, DraftConfig
from models.draft import Eagle3Draft
from models.target import Transformer


def tiny_target(seed: int = 0, **overrides) -> Transformer:
    """TINY with `overrides` (taps: `default_taps(n_layers)` unless given).

    PyTorch's default init (not HF's std 0.02) is kept on purpose: it gives well separated logits, so
    greedy comparisons between code paths are not decided by float noise on near ties.
    """
    cfg = dataclasses.replace(TINY, **overrides)
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def draft_config_for(target_cfg, **overrides) -> DraftConfig:
    """A DraftConfig matching a TargetConfig (same widths, heads, RoPE, cache size, taps, full vocab)."""
    c = target_cfg
    fields = dict(vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  target_hidden_size=c.hidden_size, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                  head_dim=c.head_dim, intermediate_size=c.intermediate_size, rope_theta=c.rope_theta,
                  rope_scaling=c.rope_scaling, rms_norm_eps=c.rms_norm_eps, max_seq_len=c.max_seq_len,
                  tap_layers=c.taps)
    fields.update(overrides)
    return DraftConfig(**fields)


def tiny_draft(target: Transformer, seed: int = 1, **overrides) -> Eagle3Draft:
    """A random draft fitting `target`; embed_tokens is copied from the target when widths agree.

    With draft_vocab_size < V the draft vocab is the first Vd target ids (d2t = 0); set a real map
    with `draft.set_vocab_map(ids)`.
    """
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config_for(target.cfg, **overrides))
    if draft.cfg.hidden_size == target.cfg.hidden_size:
        draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    return draft.eval()
