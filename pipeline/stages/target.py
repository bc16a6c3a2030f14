"""The target stage: the model every later stage speculates for.

Artifact (one format for every choice, read with `models.load_target(artifact.path)`):
    tokenizer.json      the tokenizer (`tokenizers.Tokenizer.from_file`)
    config.json         models.TargetConfig.to_dict()
    model.safetensors   Transformer.state_dict() without caches
    weight_types.json   target=gguf only: the GGML type of each weight in the file (below)

`target=tiny` (default) trains the embedded default target from scratch on the train split of `data`:
a byte-level BPE tokenizer first (pipeline.data), then a Llama-family Transformer (models/) on random
windows of the token stream with AdamW, linear warmup and cosine decay. Batches are drawn from a
generator seeded by (seed, step), so a run resumed from its checkpoint (every `checkpoint_every_s`, in the
stage's scratch dir) takes exactly the steps an uninterrupted one would. Held-out loss is measured on
fixed, evenly spaced windows of the held-out split. The last `train.long_steps` steps take windows of
`train.long_seq_len` tokens at the same tokens per step (window_shape): a model never trained at a distance
does not attend across it (RoPE past its trained span), and most steps stay on short windows, whose
attention is cheap; `held_out_loss_long` is the held-out loss on windows of that length.

`target=hf target.path=DIR` loads a local Hugging Face checkpoint with models.load_hf_target (which
validates it) and stores it converted to the format above: later stages never need to know where a
target came from, at the price of one copy of the weights. The key includes the names, sizes and
modification times of the files in DIR, so a checkpoint changed in place is converted again.

`target=gguf target.path=FILE.gguf` (or `target.package=NAME`, a package carrying or assembling a GGUF,
models.gguf.PACKAGES) converts a llama.cpp GGUF file with models.gguf.read_gguf: transformers' reader
dequantises it to float32, models.hf.target_from_hf validates it, and our model's logits are checked
against transformers' before anything is written. Its artifact also holds `weight_types.json`
(models.gguf.WEIGHT_TYPES: our state_dict key -> the GGML type the file stores that weight in, Q4_K, Q6_K, F32,
...), the file's precision per weight, which the schemes that follow the file read (export.quant=8da_file,
engine.quant=w4_file; models.quantize.file_bits). It is a copy of a few hundred header entries kept beside the
weights because the artifact is all a later stage reads: the GGUF it came from may be moved, changed or
uninstalled after the conversion, and the target's key covers the file as it was converted. The key includes the file's size and modification time (for a
package: its installed version and the file's declared sha256, or the carried file's size and mtime), so
a changed file converts again and an unchanged one converts once. Assembled package files are cached
under `<paths.store>/.gguf/`.

Both sources also write `chat_template.jinja` (models.text.CHAT_TEMPLATE) when the source has a chat
template (a GGUF's tokenizer.chat_template; a checkpoint's chat_template.jinja or the chat_template of its
tokenizer_config.json), so later stages can build chat prompts (models.text.load_chat_template).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from pipeline import data, hardware, tracking
from pipeline.stages import PARAM_BYTES, param_count
from pipeline.schedule import warmup_cosine
from pipeline.store import dir_fingerprint, scratch_dir

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: a GGUF target's artifact holds weight_types.json
UPSTREAM = ()
CONFIG_KEYS = ("target", "data", "seed")
CHECKPOINT = "train_state.pt"


def key_extra(cfg: DictConfig) -> dict:
    """What the key needs beyond the config, cheap enough for every plan (no file is read): for target=hf,
    a stat fingerprint of the checkpoint dir (and that its artifact carries the chat template); for
    target=gguf, the file's size and mtime, or the package's identity (models.gguf.package_fingerprint)."""
    tc = cfg.target
    if tc.kind == "hf" and Path(tc.path).is_dir():
        return {"hf_files": dir_fingerprint(Path(tc.path)), "chat_template": True}
    if tc.kind == "gguf":
        from models.gguf import GGUFError, file_fingerprint, package_fingerprint

        if tc.get("package"):
            try:
                return {"gguf": package_fingerprint(tc.package)}
            except GGUFError:
                return {}  # not installed: the stage refuses it with the install command
        if tc.get("path") and Path(tc.path).is_file():
            return {"gguf": file_fingerprint(tc.path)}
    return {}


def estimate_bytes(cfg: DictConfig, upstream: dict) -> int | None:
    """The most the build writes: the float32 weights; target=tiny also its training checkpoint (weights and
    AdamW's two moments) twice while a new one replaces the old; target=gguf also the float32 checkpoint it
    converts through in scratch. None where the parameter count is not at hand without writing (a GGUF
    package that is assembled from chunks)."""
    from models import TargetConfig, Transformer

    tc = cfg.target
    if tc.kind == "tiny":
        model_cfg = TargetConfig(**OmegaConf.to_container(tc.model, resolve=True))
        return PARAM_BYTES * param_count(lambda: Transformer(model_cfg)) * (1 + 2 * 3)
    if tc.kind == "hf":
        from models.hf import target_config_from_hf

        path = Path(str(tc.path))
        model_cfg = target_config_from_hf(json.loads((path / "config.json").read_text()), path)
        return PARAM_BYTES * param_count(lambda: Transformer(model_cfg))
    if tc.kind == "gguf":
        from gguf import GGUFReader

        from models.gguf import find_package, package_gguf

        if not tc.get("path") and find_package(tc.package).assembled:
            return None
        path = Path(tc.path) if tc.get("path") else package_gguf(tc.package, None)  # carried: nothing written
        return PARAM_BYTES * sum(int(t.n_elements) for t in GGUFReader(path).tensors) * 2
    return None


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    kind = cfg.target.kind
    if kind == "tiny":
        return train(cfg, out)
    if kind == "hf":
        return convert_hf(cfg.target, out)
    if kind == "gguf":
        return convert_gguf(cfg, out)
    raise ValueError(f"target.kind must be 'tiny', 'hf' or 'gguf', got {kind!r}")


# --- target=hf ---------------------------------------------------------------------------------------
def convert_hf(tc: DictConfig, out: Path) -> dict:
    from models import load_hf_target, save_target
    from models.text import hf_chat_template, write_chat_template

    path = Path(tc.path)
    if not path.is_dir():
        raise FileNotFoundError(f"target=hf: target.path={str(path)!r} is not a directory")
    taps = tc.get("tap_layers")
    try:
        model, tokenizer = load_hf_target(path, tap_layers=None if taps is None else tuple(taps))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"target=hf: {path} is not a usable Hugging Face checkpoint: {e}") from e
    if tokenizer is None:
        raise FileNotFoundError(f"target=hf: {path} has no tokenizer.json (the pipeline needs a fast tokenizer)")
    save_target(model, out, tokenizer_path=tokenizer)
    has_template = write_chat_template(out, hf_chat_template(path))
    return {"source": str(path.absolute()), "params": sum(p.numel() for p in model.parameters()),
            "n_layers": model.cfg.n_layers, "hidden_size": model.cfg.hidden_size,
            "vocab_size": model.cfg.vocab_size, "chat_template": has_template}


# --- target=gguf ---------------------------------------------------------------------------------------
def gguf_source(cfg: DictConfig) -> Path:
    """The GGUF file of target=gguf: target.path, or the file of target.package (assembled into
    `<paths.store>/.gguf/` once when the package ships it in chunks). Exactly one of them is set."""
    from models.gguf import GGUF_CACHE, GGUFError, package_gguf

    tc = cfg.target
    path, package = tc.get("path"), tc.get("package")
    if bool(path) == bool(package):
        raise GGUFError(f"target=gguf: set exactly one of target.path (a .gguf file) and target.package "
                        f"(an installed GGUF package), got target.path={path!r}, target.package={package!r}")
    if package:
        return package_gguf(package, Path(cfg.paths.store) / GGUF_CACHE)
    return Path(path)


def convert_gguf(cfg: DictConfig, out: Path) -> dict:
    from models import save_target
    from models.gguf import WEIGHT_TYPES, read_gguf
    from models.text import write_chat_template

    tc = cfg.target
    path = gguf_source(cfg)
    taps = tc.get("tap_layers")
    g = read_gguf(path, tap_layers=None if taps is None else tuple(taps))
    t0 = time.perf_counter()
    save_target(g.model, out)
    (out / WEIGHT_TYPES).write_text(json.dumps(g.weight_types, indent=1) + "\n")
    g.tokenizer.save(str(out / "tokenizer.json"))
    has_template = write_chat_template(out, g.chat_template)
    save_s = time.perf_counter() - t0
    log.info("gguf: saved the target (%.1f s)", save_s)
    info, cfg_m = g.info, g.model.cfg
    return {
        "source": str(path.absolute()), "package": tc.get("package"), "architecture": info.architecture,
        "quantisation": info.quantisation(),
        "file_bytes": info.size, "params": sum(p.numel() for p in g.model.parameters()),
        "n_layers": cfg_m.n_layers, "hidden_size": cfg_m.hidden_size, "vocab_size": cfg_m.vocab_size,
        "tokenizer_vocab_size": g.tokenizer.get_vocab_size(with_added_tokens=True),
        "chat_template": has_template, "logit_rel_error": g.logit_rel_error,
        **{f"{step}_s": round(s, 2) for step, s in g.seconds.items()}, "save_s": round(save_s, 2),
    }


# --- target=tiny ---------------------------------------------------------------------------------------
def init_weights(model, std: float = 0.02) -> None:
    """GPT-2/Llama-style init for training from scratch: N(0, std) weights, zero biases, and the residual
    output projections (o_proj, down_proj) scaled by 1/sqrt(2L) so the residual stream starts small."""
    n_layers = len(model.layers)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif p.dim() >= 2:
            scale = 1 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            torch.nn.init.normal_(p, mean=0.0, std=std * scale)


def batch_at(stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int):
    """(inputs, targets) [B, T] of random windows; the same (seed, step) always gives the same batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=g)
    windows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def window_shape(step: int, t) -> tuple[int, int]:
    """(rows, tokens) of step `step`'s windows: `seq_len`, or for the last `long_steps` steps `long_seq_len`
    with as many rows as keep batch_size x seq_len tokens a step."""
    long_steps, long_len = int(t.get("long_steps") or 0), t.get("long_seq_len")
    if long_steps and step >= int(t.steps) - long_steps:
        return max(1, int(t.batch_size) * int(t.seq_len) // int(long_len)), int(long_len)
    return int(t.batch_size), int(t.seq_len)


def held_out_windows(stream: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """n evenly spaced windows of seq_len + 1 tokens (shorter when the held-out split is short)."""
    seq_len = min(seq_len, len(stream) - 1)
    starts = np.linspace(0, len(stream) - seq_len - 1, n).astype(int)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts]).long()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train(cfg: DictConfig, out: Path) -> dict:
    from models import TargetConfig, Transformer, save_target

    tc, t = cfg.target, cfg.target.train
    device = torch.device(cfg.device)
    scratch = scratch_dir()
    t0 = time.perf_counter()

    docs = data.documents(OmegaConf.to_container(cfg.data, resolve=True))
    train_texts, held_texts = data.split(docs, "train"), data.split(docs, "held_out")
    tokenizer = data.train_tokenizer(train_texts, tc.tokenizer.vocab_size, tc.tokenizer.get("train_bytes"))
    tokenizer.save(str(out / "tokenizer.json"))
    train_stream = torch.from_numpy(data.encode(tokenizer, train_texts))
    held_stream = torch.from_numpy(data.encode(tokenizer, held_texts))
    held_bytes_per_token = sum(len(x.encode()) for x in held_texts) / max(1, len(held_stream))
    if len(train_stream) < t.seq_len + 2:
        raise ValueError(f"the train split has {len(train_stream)} tokens, fewer than one window of "
                         f"target.train.seq_len={t.seq_len}: use more data")
    log.info("corpus: %d train docs (%d tokens), %d held-out docs (%d tokens); tokenizer %d tokens (%.1f s)",
             len(train_texts), len(train_stream), len(held_texts), len(held_stream),
             tokenizer.get_vocab_size(), time.perf_counter() - t0)

    model_cfg = TargetConfig(**OmegaConf.to_container(tc.model, resolve=True))
    if model_cfg.vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"target.model.vocab_size={model_cfg.vocab_size} < tokenizer size {tokenizer.get_vocab_size()}")
    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg)
    init_weights(model)
    model = model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.lr, betas=tuple(t.betas))

    start = 0
    ckpt = scratch / CHECKPOINT
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        log.info("resuming target training at step %d from %s", start, ckpt)

    # bf16 matmuls where the device has them natively (pipeline.hardware resolves `auto` before the key is
    # computed: 2-2.5x faster on a CPU with avx512_bf16, 9x slower on one without); loss, optimizer and
    # evaluation stay fp32.
    autocast = torch.autocast(device.type, dtype=getattr(torch, t.autocast or "float32"), enabled=bool(t.autocast))
    held = held_out_windows(held_stream, t.eval_batches * t.batch_size, t.seq_len) if len(held_stream) > 1 else None
    held_loss = float("nan")
    last_save, tokens_done, train_t0 = time.perf_counter(), 0, time.perf_counter()
    loss_ema = None
    from tqdm import tqdm

    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, desc="target", mininterval=2.0,
               dynamic_ncols=True)
    governor = hardware.ThreadGovernor(device, what="target training")
    for step in bar:
        step_t0 = time.perf_counter()
        lr = warmup_cosine(step, lr=t.lr, min_lr=t.min_lr, warmup=t.warmup, steps=t.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch_at(train_stream, step, *window_shape(step, t), cfg.seed)
        x, y = x.to(device), y.to(device)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        tokens_done += x.numel()
        loss_value = loss.item()
        governor.tick(time.perf_counter() - step_t0)
        loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
        bar.set_postfix(loss=f"{loss_ema:.3f}", held=f"{held_loss:.3f}")
        done = step + 1
        if done % t.log_every == 0 or done == t.steps:
            tracking.log_metrics({"loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                  "tokens_per_s": tokens_done / (time.perf_counter() - train_t0)}, step=done)
        if held is not None and (done % t.eval_every == 0 or done == t.steps):
            held_loss = evaluate(model, held, t.batch_size, device)
            tracking.log_metrics({"held_out_loss": held_loss}, step=done)
        if time.perf_counter() - last_save > t.checkpoint_every_s and done < t.steps:
            tmp = scratch / (CHECKPOINT + ".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, ckpt)
            last_save = time.perf_counter()
    bar.close()
    governor.close()
    train_seconds = time.perf_counter() - train_t0
    long_rows, long_len = window_shape(int(t.steps) - 1, t)
    held_long = None
    if long_len > t.seq_len and len(held_stream) > long_len:  # the model at the length it was trained to last
        held_long = evaluate(model, held_out_windows(held_stream, t.eval_batches * long_rows, long_len), long_rows,
                             device)

    model = model.cpu().eval()
    save_target(model, out)
    report = {
        "params": n_params,
        "n_layers": model_cfg.n_layers,
        "hidden_size": model_cfg.hidden_size,
        "vocab_size": model_cfg.vocab_size,
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "train_tokens": int(len(train_stream)),
        "held_out_tokens": int(len(held_stream)),
        "steps": int(t.steps),
        "resumed_at": start,
        "loss": loss_ema,
        "held_out_loss": held_loss,
        **({"held_out_loss_long": held_long, "long_seq_len": long_len} if held_long is not None else {}),
        # bits per byte: comparable across tokenizers (nats/token / ln 2 / bytes per token)
        "held_out_bpb": held_loss / math.log(2) / held_bytes_per_token if held_bytes_per_token else float("nan"),
        "tokens_per_s": tokens_done / train_seconds if train_seconds > 0 else float("nan"),
        "train_seconds": round(train_seconds, 1),
        "autocast": t.autocast or "float32",
    }
    log.info("target: %s params, loss %.3f, held-out loss %.3f (%.3f bits/byte), %.0f tokens/s", f"{n_params:,}",
             loss_ema or 0, held_loss, report["held_out_bpb"], report["tokens_per_s"])
    return report
