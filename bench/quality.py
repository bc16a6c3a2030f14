"""What 4 bits cost: held-out loss (nats per token) of the fp32 target, of each quantised .pte (its own
target_verify) and of each GGUF (llama.cpp), beside each quantised one-token decoder's greedy tokens until its
first difference from the fp32 target's. The loss is taken from every system's own logits over the same corpus
windows, so a difference is the quantisation's and the kernels', not the windows'. What they save: the weight
bytes one decode step reads (`decode_bytes` of our target as quantised, `gguf_decode_bytes` of a file).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from torch import nn

from bench import llama_run


FP32_TARGET = ("fp32", "8da4w_draft")  # our quants whose target is the fp32 model


def eager_greedy(target, prompts: list[list[int]], n_new: int) -> dict[int, list[int]]:
    """The fp32 target's greedy tokens (n_new per prompt, as every system emits them) through its cached eager
    path: the agreement reference where no fp32 row was timed."""
    out = {}
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            target.reset_cache()
            logits = target(torch.tensor([prompt]), torch.arange(len(prompt)), last_only=True)
            tokens = [int(logits[0, -1].argmax())]
            for pos in range(len(prompt), len(prompt) + n_new - 1):
                tokens.append(int(target(torch.tensor([tokens[-1:]]), torch.tensor([pos]))[0, -1].argmax()))
            out[i] = tokens
    return out


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed -log p(target) of each row of logits [n, V] (float64 softmax)."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return float(-lp.gather(1, torch.tensor(targets)[:, None]).sum())


def eager_loss(target, windows: list[list[int]]) -> float:
    """Mean next-token loss (nats) of the eager fp32 target over `windows` (stateless forward)."""
    total = count = 0
    with torch.inference_mode():
        for ids in windows:
            total += _nll(target(torch.tensor([ids]))[0, :-1], ids[1:])
            count += len(ids) - 1
    return total / count


def pte_loss(engine, windows: list[list[int]]) -> float:
    """The same through a .pte's target_verify, in calls of max_m rows from position 0 (each call writes the
    cache the next attends to): the loss of the program's own target, int4 rounding and XNNPACK's kernels
    included. A last call of one row would score nothing (its position predicts past the window)."""
    m = engine.meta["max_m"]
    total = count = 0
    for ids in windows:
        for start in range(0, len(ids) - 1, m):
            chunk = ids[start:start + m]
            _, _, logits = engine.target_verify(torch.tensor([chunk]), torch.arange(start, start + len(chunk)))
            rows = [j for j in range(len(chunk)) if start + j + 1 < len(ids)]
            total += _nll(logits[0, rows], [ids[start + j + 1] for j in rows])
            count += len(rows)
    return total / count


def llama_loss(path: Path, windows: list[list[int]], threads: int) -> float:
    """The same through llama.cpp on a GGUF: every position's logits of one batched eval per window."""
    llm = llama_run.load(path, threads=threads, n_ctx=max(map(len, windows)) + 16, logits_all=True)
    return llama_run.quality(functools.partial(llama_run.row_logits, llm), windows, [], 0)["loss"]


def quality(target_model, engines: dict, ggufs: dict[str, Path], rows: list[dict], windows: list[list[int]],
            threads: int, llama: bool, n_new: int) -> dict:
    """Per quantised system: held-out loss (nats per token) against the fp32 target's, and its greedy tokens per
    prompt until the first difference from the fp32 target's (the timed runs' first repetition)."""
    out = {"windows": len(windows), "window_tokens": len(windows[0]) if windows else 0, "systems": {}}
    if target_model is not None:
        out["fp32_loss"] = eager_loss(target_model, windows)
    losses = {f"ours {q}": pte_loss(eng, windows) for q, (eng, _) in engines.items() if q not in FP32_TARGET}
    if llama:
        losses.update({f"llama.cpp {label}": llama_loss(path, windows, threads) for label, path in ggufs.items()})
    for name, loss in losses.items():
        entry = {"loss": round(loss, 4)}
        if "fp32_loss" in out:
            entry["loss_vs_fp32"] = round(loss - out["fp32_loss"], 4)
        out["systems"][name] = entry
    for r in rows:  # the one-token decoders: our K=0 rows (T = 1 and exact) and llama.cpp's rows without drafting
        if (r["family"] == "ours" and r["chain"] == 0 and r["quant"] not in FP32_TARGET) or \
                (r["family"] == "llama.cpp" and "pld" not in r["system"]):
            name = r["system"].removesuffix(" K=0")
            entry = out["systems"].setdefault(name, {})
            entry["tokens_until_first_difference"] = r["common_prefix_per_prompt"]
            entry["identical_prompts"] = sum(p == n_new for p in r["common_prefix_per_prompt"])
    if "fp32_loss" in out:
        out["fp32_loss"] = round(out["fp32_loss"], 4)
    return out


def decode_bytes(model: nn.Module) -> int:
    """Bytes of weights one T = 1 step of `model` (as models.quantize leaves it) reads, as XNNPACK stores them:
    an fp32 linear 4 per weight; an 8da8w one 1 per weight and an fp32 scale per row; a symmetric 8da4w one half a
    byte per weight and a bf16 scale per group; a GroupOffsetLinear that, an fp32 offset per group and its
    group-sum matrix; norms as stored; an embedding one row. A tied lm_head counts in full (the head reads it)."""
    from models.quantize import GroupOffsetLinear

    total, inside = 0, []
    for name, m in model.named_modules():
        if any(name.startswith(f"{g}.") for g in inside):
            continue
        bias = 0 if getattr(m, "bias", None) is None else 4 * m.bias.numel()
        if isinstance(m, GroupOffsetLinear):
            inside.append(name)
            (N, K), G = m.main.weight.shape, m.offsets.in_features
            total += N * K // 2 + 2 * N * G + 4 * N * G + 4 * G * K + (0 if m.main.bias is None else 4 * N)
        elif isinstance(m, nn.Linear):
            w, (N, K) = m.weight, m.weight.shape
            kind = getattr(w, "target_dtype", None)
            total += bias + (N * K + 4 * N if kind is torch.int8 else
                             N * K // 2 + 2 * N * (K // w.block_size[1]) if kind is torch.int4 else N * K * w.element_size())
        elif isinstance(m, nn.Embedding):
            total += m.weight.shape[1] * m.weight.element_size()
        else:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of tensor data one decode step of llama.cpp on the GGUF at `path` reads: every tensor in its own
    format, except the token table, of which a step reads one row unless the file has no output tensor and the
    head multiplies by it (tied)."""
    from models.gguf import _tensor_bytes, read_header

    _, tensors, _ = read_header(path)
    tied = not any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        n = _tensor_bytes(t, path)[1]
        if t.name == "token_embd.weight":  # [vocab, hidden]: one row looked up, all of it multiplied when tied
            n = n // t.shape[0] + (n if tied else 0)
        total += n
    return total
