"""The learning-rate schedule every training loop here uses (target and draft)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_lr` at `steps`.

    A pure function of the step number, so a run resumed from a checkpoint at step s continues with exactly
    the rates an uninterrupted run would use."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
