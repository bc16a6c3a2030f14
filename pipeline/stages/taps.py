"""The taps stage: run the target over sequences and store what training the draft needs.

Artifact (read with `pipeline.artifacts.load_taps(artifact.path, split)`):
    taps.json                     layout: source, per-split sequence length and prompt lengths (a list),
                                  tap_layers, hidden/vocab size, dtype, end token ids, shard files per split
    train-00000.safetensors ...   shards of `taps.shard_sequences` sequences of the train split (none for a
                                  loaded draft, `draft=load`: it reads the held-out split alone)
    held_out-00000.safetensors    the same for the held-out split (never trained on; draft eval reads it)
    long-00000.safetensors        the long split, where taps.long_sequences > 0: train sequences at the lengths
                                  the draft serves (the draft trains on them every draft.train.long_every steps)
Each shard holds, for n sequences of T tokens (taps.seq_len; held_out_seq_len, long_seq_len):
    ids    int32[n,T]      tokens
    taps   dtype[n,T,3H]   cat(h_a, h_b, h_c) at the target's tap layers (fc-ready, tap order = fc order)
    final  dtype[n,T,H]    the target's last residual before the final norm: the draft stage turns it into
                           the target's logits (norm + lm_head), which is H wide instead of V wide on disk
    top1   int32[n,T]      the target's argmax at each position (computed in float32)
    mask   bool[n,T]       positions whose next-token prediction counts in the loss and in acceptance

`taps.source`:
- `generate` (default): prompts of `prompt_len` tokens (pipeline.prompts, in `data.prompt_format`: corpus
  text for a base model, chat-templated requests for an instruct model), continued greedily by the target
  to T tokens in batches with a KV cache; the taps are the states the target computes while it generates.
  This is on-policy data: the draft learns on the text the target actually produces, which is what the eval
  measures (greedy continuations of held-out prompts built the same way). mask = the continuation
  (positions >= prompt_len-1) up to a generated end token, or every position with `mask_prompt: false`.
- `corpus`: windows of T corpus tokens, tapped with one stateless forward per batch; mask = everything.
The held-out split may have its own lengths (`held_out_seq_len`, `held_out_prompt_len`) so that it mirrors
the eval (runtime.prompt_len prompt tokens + runtime.max_new_tokens greedy ones), while the train split uses
short sequences: for a fixed compute budget, more and shorter on-policy sequences train the draft better. The
long split (`long_seq_len`, `long_prompt_len`, `long_sequences`) is what short sequences cannot teach: the
positions and attention spans of a long prompt and a long answer. A split's prompt length may be a list: a
batch decodes over one set of cache positions, so batches take the lengths in turn (prompt_lengths), and a
sequence's answer is T minus its prompt. A long prompt enters the target `PREFILL_CHUNK` tokens a call.

The target computes as the program that serves the draft holds it (`taps.target_quant`, resolved by
pipeline.hardware.served_quant: `auto` is the served target's scheme, export.quant's 8da4w_offsets/8da_file or
engine.quant's w4_*; models.quantize.quantize_served), so the draft learns the quantised target's answers and
states, which are what it will be asked to predict; `none` taps the float target.

Sequences of a split are fixed up front from `seed` (windows cut at random places of the split's documents),
and shard i always holds the same sequences, so an interrupted run resumes shard by shard from the stage's
scratch directory. Under torchrun (pipeline.distributed) shard j of the list of every shard (train,
held-out, long) belongs to rank j % N: each rank writes its own shards into the shared scratch directory (skipping
those already there), all ranks meet at a barrier, and rank 0 (the only one given an `out`) checks that every
shard is there and assembles the artifact. A shard's sequences and batches do not depend on N, so the files
are the ones a single rank writes, and N is not in the key (the report records `world_size` and `backend`).
The batched decode below runs the target's own layer modules (norms, projections, the
attention math in `Attention.attend`, MLP) over a per-batch KV cache; tests pin it against the target's
stateless forward (same greedy tokens, same taps within float tolerance).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from models.text import end_ids, load_chat_template
from pipeline import data, distributed, hardware, prompts, tracking
from pipeline.artifacts import TAPS_FIELDS, TAPS_INDEX, TAPS_SPLITS
from pipeline.store import scratch_dir, sha256_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: the long split; prompt lengths are lists
DISTRIBUTED = True  # under torchrun every rank runs a share of it (pipeline.app.Job.help)
UPSTREAM = ("target",)
CONFIG_KEYS = ("data", "taps", "seed")


# --- the target, batched -----------------------------------------------------------------------------
PREFILL_CHUNK = 256  # prompt tokens a prefill call takes: bounds its [B, h, chunk, P] scores and [B, chunk, V] logits


@torch.no_grad()
def generate_tapped(target, prompts: torch.Tensor, seq_len: int, tick=None,
                    chunk: int = PREFILL_CHUNK) -> dict[str, torch.Tensor]:
    """Greedy continuation of prompts [B,P] to seq_len tokens; ids, taps, final, top1 of every position.
    `tick(seconds)` hears each decode step's time (a hardware.ThreadGovernor's).

    The target itself runs the batch, on a [B, kv, seq_len, hd] cache of its own layers (setup_cache), so
    the states tapped here are the ones its exported methods compute; the batch-1 cache is restored after.
    The prompt goes in `chunk` tokens a call, so a long prompt's memory is a chunk's, not the prompt's."""
    B, P = prompts.shape
    dev = prompts.device
    ids = torch.zeros(B, seq_len, dtype=torch.int64, device=dev)
    ids[:, :P] = prompts
    out = {"taps": [], "final": [], "top1": []}

    def step(tokens, pos):
        final, tapped = target.hidden(tokens, pos, target.cfg.taps)
        top1 = target.head(final).argmax(-1)
        for name, value in (("taps", torch.cat(tapped, dim=-1)), ("final", final), ("top1", top1)):
            out[name].append(value)
        return top1[:, -1]

    target.setup_cache(B, seq_len)
    try:
        for c in range(0, P, chunk):
            nxt = step(prompts[:, c : c + chunk], torch.arange(c, min(P, c + chunk), device=dev))
        for t in range(P, seq_len):
            t0 = time.perf_counter()
            ids[:, t] = nxt
            nxt = step(ids[:, t : t + 1], torch.tensor([t], device=dev))
            if tick is not None:
                tick(time.perf_counter() - t0)
    finally:
        target.setup_cache()
    return {"ids": ids, **{name: torch.cat(parts, dim=1) for name, parts in out.items()}}


@torch.no_grad()
def tap_sequences(target, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One stateless forward over ids [B,T]: taps, final, top1 of every position."""
    final, tapped = target.hidden(ids, None, target.cfg.taps)
    return {"ids": ids, "taps": torch.cat(tapped, dim=-1), "final": final, "top1": target.head(final).argmax(-1)}


def generation_mask(ids: torch.Tensor, prompt_len: int, ends: list[int], mask_prompt: bool) -> torch.Tensor:
    """bool [B,T]: positions whose prediction counts. With mask_prompt, only the continuation (the
    prediction at prompt_len-1 is the first generated token); never past a generated end token (`ends`:
    models.text.end_ids, where the eval stops)."""
    B, T = ids.shape
    mask = torch.ones(B, T, dtype=torch.bool, device=ids.device)
    if mask_prompt:
        mask[:, : prompt_len - 1] = False
    if ends:
        gen_end = torch.isin(ids, torch.tensor(ends, device=ids.device)) & (torch.arange(T, device=ids.device) >= prompt_len)
        mask &= torch.cumsum(gen_end.to(torch.int64), dim=1) == 0  # positions from the first generated end on
    return mask


# --- sequences and shards -------------------------------------------------------------------------------
def split_lengths(tc) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{split: (sequence length, prompt lengths)}. A split's prompt length is one value or a list (batches take
    them in turn, prompt_lengths); the held-out split may have its own (null = the train's); the long split
    exists where `long_sequences` > 0."""
    def prompts(value) -> tuple[int, ...]:
        return tuple(int(p) for p in value) if isinstance(value, (list, tuple, ListConfig)) else (int(value),)

    T, P = int(tc.seq_len), prompts(tc.prompt_len)
    hT, hP = tc.get("held_out_seq_len"), tc.get("held_out_prompt_len")
    out = {"train": (T, P), "held_out": (int(hT) if hT is not None else T, prompts(hP) if hP is not None else P)}
    if int(tc.get("long_sequences") or 0):
        out["long"] = (int(tc.long_seq_len), prompts(tc.long_prompt_len))
    return out


def prompt_lengths(n: int, prompt_lens: tuple[int, ...], per_shard: int, batch_size: int) -> list[int]:
    """The prompt length of each of a split's n sequences: batch g of the split (batches of batch_size within
    shards of per_shard sequences) takes prompt_lens[g % len]. A batch decodes over one set of cache positions,
    so it has one prompt length; a sequence's length is a function of its index, so shards resume as before."""
    per = -(-per_shard // batch_size)  # batches per shard
    return [prompt_lens[((k // per_shard) * per + (k % per_shard) // batch_size) % len(prompt_lens)]
            for k in range(n)]


def shard_name(split: str, i: int) -> str:
    return f"{split}-{i:05d}.safetensors"


def write_shard(path: Path, shard: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    tensors = {
        "ids": shard["ids"].to(torch.int32),
        "taps": shard["taps"].to(dtype),
        "final": shard["final"].to(dtype),
        "top1": shard["top1"].to(torch.int32),
        "mask": shard["mask"].bool(),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


# --- the stage ------------------------------------------------------------------------------------------
def split_counts(cfg: DictConfig) -> dict[str, int]:
    """Sequences per split. A loaded draft (`draft=load`) reads the held-out split alone, so its taps hold no
    train split: generating one would be most of a load job's time (SmolLM2: 1,024 train sequences, 32 held out)."""
    loads = cfg.get("draft") is not None and cfg.draft.get("kind") == "load"
    counts = {"train": 0 if loads else int(cfg.taps.train_sequences), "held_out": int(cfg.taps.held_out_sequences)}
    if int(cfg.taps.get("long_sequences") or 0):
        counts["long"] = 0 if loads else int(cfg.taps.long_sequences)
    return counts


def key_extra(cfg: DictConfig) -> dict | None:
    """Taps without a train split are another artifact than the same config's with one; taps of a target
    quantised as the .pte holds it (taps.target_quant 8da4w_offsets or 8da_file) depend on the export's groups."""
    extra = {"train_split": False} if split_counts(cfg)["train"] == 0 else {}
    if group := target_quant_group(cfg):
        extra["target_quant_group"] = group
    return extra or None


def target_quant_group(cfg: DictConfig) -> int:
    """export.group_size where taps.target_quant is a .pte scheme (8da4w_offsets, 8da_file), whose groups it
    sets; 0 for the others."""
    return int(cfg.export.group_size) if str(cfg.taps.get("target_quant", "none")).startswith("8da") else 0


def estimate_bytes(cfg: DictConfig, upstream: dict) -> int:
    """The shards: per token its id, top-1 and mask (4 + 4 + 1 bytes) and 4 H values of taps.dtype (three
    tap layers and the final state), over every sequence of both splits."""
    hidden = int(json.loads((Path(upstream["target"].path) / "config.json").read_text())["hidden_size"])
    width = torch.empty(0, dtype=getattr(torch, str(cfg.taps.dtype))).element_size()
    counts = split_counts(cfg)
    return sum(counts[split] * T * (9 + 4 * hidden * width) for split, (T, _) in split_lengths(cfg.taps).items())


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    from models import load_target
    from tokenizers import Tokenizer
    from tqdm import tqdm

    tc = cfg.taps
    t0 = time.perf_counter()
    source = str(tc.source)
    if source not in ("generate", "corpus"):
        raise ValueError(f"taps.source must be 'generate' or 'corpus', got {source!r}")
    lengths = split_lengths(tc)
    if source == "generate":
        for split, (T, Ps) in lengths.items():
            if not all(1 <= P < T for P in Ps):
                raise ValueError(f"taps ({split}): prompt lengths {list(Ps)} must be in [1, sequence length {T})")
    dtype = getattr(torch, str(tc.dtype))
    device = distributed.device(cfg.device)
    target_dir = Path(upstream["target"].path)
    longest = max(T for T, _ in lengths.values())
    context = json.loads((target_dir / "config.json").read_text()).get("context_length")
    if context is not None and longest > context:
        raise ValueError(f"taps: sequences of {longest} tokens exceed the {context} positions the target was "
                         f"trained for (its context_length)")
    target = load_target(target_dir, max_seq_len=longest)  # caches as long as the sequences
    quant = str(tc.get("target_quant", "none"))  # resolved (pipeline.hardware.served_quant): never auto here
    if quant != "none":
        from models.gguf import read_weight_types
        from models.quantize import quantize_served

        quantize_served(target, quant, target_quant_group(cfg), read_weight_types(target_dir))
        log.info("taps: the target's weights as it is served (taps.target_quant=%s)", quant)
    target = target.to(device).eval()
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ends = end_ids(tokenizer)

    docs = data.documents(OmegaConf.to_container(cfg.data, resolve=True))
    fmt = str(cfg.data.get("prompt_format", "plain"))
    if fmt == "chat" and source != "generate":
        raise ValueError("data.prompt_format=chat needs taps.source=generate (the target answers the requests)")
    chat_template = load_chat_template(target_dir)
    counts = split_counts(cfg)
    per_shard, bs = int(tc.shard_sequences), int(tc.batch_size)
    sequences, prompt_of = {}, {}
    for k, split in enumerate(TAPS_SPLITS):
        if split not in lengths:
            continue
        T, Ps = lengths[split]
        if source != "generate":  # windows of T corpus tokens
            Ps = (T,)
        prompt_of[split] = prompt_lengths(counts[split], Ps, per_shard, bs)
        texts = data.split(docs, "held_out" if split == "held_out" else "train")
        # one cut per prompt length; the first length keeps the split's own seed (a one-length split: as before)
        cut = {P: iter(prompts.cut(texts, tokenizer, prompt_of[split].count(P), P,
                                   (int(cfg.seed) * 1_000_003 + k) * (1 if j == 0 else 7_919) + j, fmt, chat_template))
               for j, P in enumerate(dict.fromkeys(Ps))}
        sequences[split] = [next(cut[P]) for P in prompt_of[split]]
    log.info("taps: %s, %s (%.1f s to read and cut)", source,
             ", ".join(f"{counts[s]} {s} sequences of {lengths[s][0]} tokens" for s in sequences),
             time.perf_counter() - t0)

    scratch = scratch_dir()
    rank, world = distributed.rank(), distributed.world_size()
    # Every shard of both splits in one list; shard j belongs to rank j % world. A shard's sequences and its
    # batches (batch_size sequences at a time, within the shard) do not depend on the world size, so N ranks
    # write the very files one rank writes.
    work = [(split, i) for split in sequences for i in range((len(sequences[split]) + per_shard - 1) // per_shard)]
    mine = [w for j, w in enumerate(work) if j % world == rank]
    resumed, generated, written, t_gen = 0, 0, 0, time.perf_counter()
    bar = tqdm(total=sum(min(per_shard, len(sequences[s]) - i * per_shard) for s, i in mine), desc="taps",
               unit="seq", mininterval=2.0, dynamic_ncols=True, disable=not distributed.is_main())
    governor = hardware.ThreadGovernor(device, what="taps")  # generation, like training, beside a busy neighbour
    for split, i in mine:
        T = lengths[split][0]
        name = shard_name(split, i)
        part = sequences[split][i * per_shard : (i + 1) * per_shard]
        if (scratch / name).is_file():
            resumed += 1
            bar.update(len(part))
            continue
        generated += len(part) * T
        pieces = []
        for b in range(0, len(part), bs):
            x = torch.stack(part[b : b + bs]).to(device)  # one prompt length a batch (prompt_lengths)
            piece = (generate_tapped(target, x, T, governor.tick) if source == "generate"
                     else tap_sequences(target, x))
            piece["mask"] = (generation_mask(piece["ids"], x.shape[1], ends, bool(tc.mask_prompt))
                             if source == "generate" else torch.ones_like(piece["ids"], dtype=torch.bool))
            pieces.append({k: v.cpu() for k, v in piece.items()})
            bar.update(len(x))
        write_shard(scratch / name, {k: torch.cat([p[k] for p in pieces]) for k in TAPS_FIELDS}, dtype)
        written += 1
        distributed.fault_point("taps", written)
        tracking.log_metrics({"shards_done": resumed + written}, step=resumed + written)
    bar.close()
    governor.close()
    gen_seconds = time.perf_counter() - t_gen
    distributed.barrier("taps: every rank wrote its shards")
    resumed, generated = (int(v) for v in distributed.all_sum([resumed, generated], "taps shards"))
    gen_seconds = max(distributed.all_sum([gen_seconds], "taps seconds")[0] / world, 1e-9)  # ranks run at once
    if out is None:  # a rank other than 0: its shards are in scratch, rank 0 assembles the artifact
        return {}

    shards: dict[str, list[str]] = {s: [] for s in sequences}
    tokens = {s: 0 for s in sequences}
    counted = {s: 0 for s in sequences}
    for split, i in work:
        name = shard_name(split, i)
        if not (scratch / name).is_file():
            raise RuntimeError(f"taps: shard {name} is missing from {scratch} after every rank reported done")
        with safe_open(str(scratch / name), framework="pt") as f:
            mask = f.get_tensor("mask")
        tokens[split] += mask.numel()
        counted[split] += int(mask.sum())
        shards[split].append(name)
    for split in sequences:
        for name in shards[split]:
            shutil.move(str(scratch / name), str(out / name))
    index = {
        "source": source,
        **{f"{split}_{what}": n for split, (T, Ps) in lengths.items()
           for what, n in (("seq_len", T), ("prompt_len", list(Ps) if source == "generate" else [0]))},
        "tap_layers": list(target.cfg.taps), "hidden_size": target.cfg.hidden_size,
        "vocab_size": target.cfg.vocab_size, "dtype": str(tc.dtype), "end_ids": ends,
        "mask_prompt": bool(tc.mask_prompt) if source == "generate" else False, "shards": shards,
    }
    (out / TAPS_INDEX).write_text(json.dumps(index, indent=2))
    bytes_written = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    report = {
        "source": source,
        "target_key": upstream["target"].key,
        "target_quant": quant,
        "tap_layers": list(target.cfg.taps),
        "tokenizer_sha256": sha256_file(target_dir / "tokenizer.json"),
        "seq_len": lengths["train"][0],
        "held_out_seq_len": lengths["held_out"][0],
        "train_sequences": counts["train"],
        "held_out_sequences": counts["held_out"],
        "train_tokens": tokens["train"],
        "held_out_tokens": tokens["held_out"],
        "train_counted_tokens": counted["train"],
        "held_out_counted_tokens": counted["held_out"],
        **({"long_seq_len": lengths["long"][0], "long_sequences": counts["long"], "long_tokens": tokens["long"],
            "long_counted_tokens": counted["long"]} if "long" in sequences else {}),
        "bytes_written": bytes_written,
        "shards_resumed": resumed,
        "tokens_per_s": round(generated / gen_seconds, 1),  # of the target over shards built now, all ranks
        **distributed.describe(),  # world_size, backend: how it was built (not in the key: the files are the same)
    }
    log.info("taps: %s tokens, %.1f MB, %.1f s", " + ".join(f"{n} {s}" for s, n in tokens.items()),
             bytes_written / 1e6, time.perf_counter() - t0)
    return report
