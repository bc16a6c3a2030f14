"""The bytes floor of a decode step: the model bytes one target forward reads, as each system stores its weights
(our .pte, a GGUF), and the rate an fp32 matrix-vector product reads that many bytes on this machine. Their
quotient is the fastest a one-token decoder can go; what a row takes above it is compute and per-call overhead.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def read_rate(threads: int, nbytes: int = 256 << 20, min_s: float = 0.2) -> float:
    """Bytes/s at which an fp32 matrix-vector product reads a matrix of `nbytes` with the benchmark's threads
    (median of repeated products, at least `min_s` of them): the access pattern of a decode step's weights.
    At 256 MB it is the memory's rate; at a model's own size, what its bytes cost where they fit in cache."""
    w = torch.ones(max(nbytes // 4 // 4096, 1), 4096)
    x = torch.ones(4096)
    torch.mv(w, x)
    times, t_end = [], time.perf_counter() + min_s
    while len(times) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / statistics.median(times)


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: all of them, except token_embd when an output.weight
    exists (then the embedding is read one row per token); a tied token_embd is the output matrix."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    return sum(int(t.n_bytes) for t in reader.tensors
               if not (t.name == "token_embd.weight" and "output.weight" in names))


def target_weight_bytes(target, quant: str, group: int = 32) -> int:
    """Bytes of the target's weights a decode step reads as the .pte stores them: every matrix (a tied
    embedding once, as the head; an untied embedding one row, not counted) at 4 bytes (fp32) or, 8da4w_offsets, at 4
    bits plus a 16-bit scale and a 32-bit offset per group of `group` (XNNPACK's blockwise qb4w and
    models.quantize.GroupOffsetLinear) where in_features divides."""
    total = 0
    for name, p in target.named_parameters():
        if name == "embed_tokens.weight" and not target.cfg.tie_embeddings:
            continue
        if quant == "8da4w_offsets" and p.ndim == 2 and p.shape[1] % group == 0:
            total += p.numel() // 2 + p.numel() // group * (2 + 4)
        else:
            total += 4 * p.numel()
    return total
