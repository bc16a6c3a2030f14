"""Speculator: the one definition of the exported methods and of the eager engine.

It owns a target and a draft. `prefill` and `target_verify` share the target's KV cache; `draft_decode`
owns the draft's. Every method is batch 1, static in every shape but T, with no Python branch on tensor
values and no branch on T, so `torch.export` with a dynamic T and ExecuTorch lowering see the same graph
the eager engine runs. The feature handed to the draft is fc(taps), computed here, inside the target
methods, so the .pte never ships the 3*H-wide taps across the method boundary.

One token-embedding table: the draft's `embed_tokens` is a frozen copy of the target's (EAGLE-3), so
when the two are equal the Speculator points the draft at the target's Parameter. The eager engine then
holds the table once (262,144 x 640 fp32 is 671 MB for Gemma 3 270M), and every exported method reads
one tensor, which the .pte stores once (pipeline/export_pte.py). A draft with its own table (another
width, or other values) keeps it.

Exporters: wrap one method per module (all wrapping this same instance so the mutable buffers share
names), and set `draft.check_gaps = False` if they trace in a mode where `is_tracing()` is not detected.
"""

from __future__ import annotations

import torch
from torch import nn

from models.draft import Eagle3Draft
from models.target import Transformer


def chain_methods(max_m: int) -> tuple[str, ...]:
    """The exported names of `Speculator.draft_chain` at each K in [1, max_m-1]: draft_chain_<k>, one method per
    K (a chain's steps are unrolled in its graph), so one program serves every K."""
    return tuple(f"draft_chain_{k}" for k in range(1, max_m))


def share_embedding(target: Transformer, draft: Eagle3Draft) -> bool:
    """Make `draft.embed_tokens` read the target's Parameter when the tables are equal; -> whether it does.

    Equal means same shape, dtype, device and values, so no output of the draft changes; a draft trained
    with a table of its own keeps it.
    """
    mine, theirs = draft.embed_tokens.weight, target.embed_tokens.weight
    if mine is theirs:
        return True
    if (mine.shape != theirs.shape or mine.dtype != theirs.dtype or mine.device != theirs.device
            or not torch.equal(mine, theirs)):
        return False
    draft.embed_tokens.weight = theirs
    return True


class Speculator(nn.Module):
    def __init__(self, target: Transformer, draft: Eagle3Draft):
        super().__init__()
        from models.checkpoint import validate_draft

        validate_draft(draft, target.cfg)
        share_embedding(target, draft)
        self.target = target
        self.draft = draft

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor):
        """tokens [1,T], input_pos [T] -> (next_id [1,1] int64, feature [1,T,H], logits [1,V] of the last row)."""
        logits, taps = self.target(tokens, input_pos, taps=True, last_only=True)
        last = logits[:, -1, :]
        return torch.argmax(last, dim=-1, keepdim=True), self.draft.fuse(taps), last

    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor):
        """tokens [1,T], input_pos [T] -> (ids [1,T] = argmax per row, feature [1,T,H], logits [1,T,V])."""
        logits, taps = self.target(tokens, input_pos, taps=True)
        return torch.argmax(logits, dim=-1), self.draft.fuse(taps), logits

    def target_verify_exact(self, tokens: torch.Tensor, input_pos: torch.Tensor):
        """target_verify whose attention does not depend on the call (Transformer.hidden, `exact`): calls of
        one width give a row the same bits whichever call it is in, the exact mode's target call (runner.engine)."""
        logits, taps = self.target(tokens, input_pos, taps=True, exact=True)
        return torch.argmax(logits, dim=-1), self.draft.fuse(taps), logits

    def target_decode(self, tokens: torch.Tensor, input_pos: torch.Tensor):
        """tokens [1,1], input_pos [1] -> (ids [1,1], logits [1,1,V]); the K=0 baseline (no taps, no feature)."""
        logits = self.target(tokens, input_pos)
        return torch.argmax(logits, dim=-1), logits

    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor):
        """tokens [1,T], feature [1,T,H], input_pos [T] -> (target-vocab ids [1,T], g [1,T,H], logits [1,T,Vd])."""
        logits, g = self.draft(tokens, feature, input_pos)
        return self.draft.to_target(torch.argmax(logits, dim=-1)), g, logits

    def draft_chain(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor, k: int):
        """A greedy round's K = k proposals in one call: draft_decode's seeding on tokens [1,T] (a round's
        reseed, T = a+1 <= max_m), then k-1 single steps, each on the last proposal and the last g at the next
        position. -> target-vocab ids [1,k], the ids k draft_decode calls would propose. One call instead of
        k keeps the runtime's per-call cost (inputs, outputs, the switch between methods) out of all but one
        draft step; the lm_head runs on the rows whose argmax is read, one per step."""
        g = self.draft.hidden(tokens, feature, input_pos)[:, -1:]
        ids = [self.draft.to_target(torch.argmax(self.draft.logits(g), dim=-1))]
        pos = input_pos[-1:]
        for _ in range(k - 1):
            pos = pos + 1
            g = self.draft.hidden(ids[-1], g, pos)
            ids.append(self.draft.to_target(torch.argmax(self.draft.logits(g), dim=-1)))
        return torch.cat(ids, dim=1)

    def reset(self) -> None:
        self.target.reset_cache()
        self.draft.reset_cache()
