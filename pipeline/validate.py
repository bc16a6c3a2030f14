"""Every value a user sets, checked by type and range once the config is composed, before any stage runs.

A bad value is refused with one `ConfigError` that lists every problem found, each naming the key, the
value given and what is allowed: a typo in `runtime.chain` is reported in a second, not after the minutes
of building the stages before the eval. The checks mirror the config groups (conf/<group>/*.yaml) and the
stages that read them; the stages keep their own checks of what only their inputs can tell (a GGUF's trained
context against export.max_seq_len, the pairing of draft and target).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from models.choices import (CUDA_COMPILES, CUDA_QUANTS, ENGINES, EXPORT_BACKENDS, EXPORT_QUANTS, POLICIES,
                            PROMPT_FORMATS, RENAMED, SERVED_QUANTS)
from models.text import read_prompt_file

log = logging.getLogger(__name__)
PROMPTS_TOO_LONG = ("error", "skip")


class ConfigError(ValueError):
    """One or more config values out of their allowed range; the message lists each."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Checker:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.problems: list[str] = []

    def get(self, key: str):
        """The value at a dotted key; None when absent, "???" when mandatory and unset (OmegaConf's MISSING)."""
        node = self.cfg
        for part in key.split("."):
            if node is None:
                return None
            if OmegaConf.is_missing(node, part):
                return "???"
            node = node.get(part)
        return node

    def fail(self, key: str, value, allowed: str) -> None:
        self.problems.append(f"{key}={value!r}: {allowed}")

    def int_in(self, key: str, lo: int | None = None, hi: int | None = None, *, nullable: bool = False) -> bool:
        v = self.get(key)
        if v is None and nullable:
            return True
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            self.fail(key, v, f"an int in [{lo_s}, {hi_s}]" + (" or null" if nullable else ""))
            return False
        return True

    def number_in(self, key: str, lo: float, hi: float | None = None, *, lo_open: bool = False) -> None:
        v = self.get(key)
        below = v is not None and _is_number(v) and (v <= lo if lo_open else v < lo)
        if not _is_number(v) or below or (hi is not None and v > hi):
            self.fail(key, v, f"a number in {'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]")

    def choice(self, key: str, allowed: tuple) -> None:
        v = self.get(key)
        if v in RENAMED.get(key, {}):  # an old name is refused, never read as whatever it means now
            self.fail(key, v, f"renamed {RENAMED[key][v]} (one of {', '.join(map(str, allowed))})")
        elif v not in allowed:
            self.fail(key, v, f"one of {', '.join(map(str, allowed))}")

    def existing(self, key: str, *, directory: bool) -> bool:
        v = self.get(key)
        ok = isinstance(v, str) and (Path(v).is_dir() if directory else Path(v).is_file())
        if not ok:
            self.fail(key, v, f"an existing {'directory' if directory else 'file'}")
        return ok


def _check_gguf_source(c: _Checker) -> None:
    """target=gguf: exactly one of target.path and target.package; a path must be a file with a GGUF
    header, a package must be known and installed (found without importing it). What only the whole
    header tells (architecture, tokenizer, truncation) is the target stage's check."""
    from models.gguf import PACKAGES, GGUFError, check_magic, check_package

    path, package = c.get("target.path"), c.get("target.package")
    path = None if path in (None, "???", "") else path
    package = None if package in (None, "???", "") else package
    if (path is None) == (package is None):
        c.problems.append(f"target.path={path!r}, target.package={package!r}: set exactly one of them "
                          f"(target.path=FILE.gguf, or target.package=NAME of an installed GGUF package: "
                          f"{', '.join(PACKAGES)})")
        return
    try:
        if path is not None:
            check_magic(path)
        else:
            check_package(package)
    except GGUFError as e:
        c.problems.append(str(e) if package is not None else f"target.path={path!r}: {e}")


def cache_length(c: _Checker) -> tuple[int | None, str]:
    """The KV cache's positions of the engine the eval and serve run, with the key that sets it: the cuda
    engine's own engine.max_seq_len, export.max_seq_len for the engines that run the exported program."""
    key = "engine.max_seq_len" if c.get("engine.kind") == "cuda" else "export.max_seq_len"
    value = c.get(key)
    return (value, f"{key}={value}") if _is_int(value) else (None, "")


def _check_context(c: _Checker) -> None:
    """export.max_seq_len (and the cuda engine's) within the context a target=hf checkpoint was trained for
    (its config.json's max_position_embeddings), before any stage runs; a GGUF's context_length is checked by
    the export stage (models.TargetConfig.context_length), before any lowering."""
    from models.hf import text_config

    if c.get("target.kind") != "hf" or not isinstance(c.get("target.path"), str):
        return
    try:
        context = text_config(json.loads((Path(c.get("target.path")) / "config.json").read_text()))[0].get(
            "max_position_embeddings")
    except (OSError, ValueError, TypeError, AttributeError):
        return  # the target stage refuses the checkpoint, naming why
    for key in ("export.max_seq_len", "engine.max_seq_len"):
        value = c.get(key)
        if _is_int(context) and _is_int(value) and value > context:
            c.fail(key, value, f"at most {context}, the max_position_embeddings the target was trained for")


def lengths_problem(prompt_len: int, max_new_tokens: int, max_seq_len: int, source: str) -> str | None:
    """Why prompts of `prompt_len` tokens cannot generate `max_new_tokens` within the KV cache; None if they fit."""
    if prompt_len + max_new_tokens <= max_seq_len:
        return None
    return (f"runtime.prompt_len={prompt_len} + runtime.max_new_tokens={max_new_tokens} = "
            f"{prompt_len + max_new_tokens} exceeds {source}: a prompt and its generation share the KV cache; "
            f"lower one of them")


def prompt_file_lines(path: Path, prompts: list[str], count, *, max_new_tokens: int, max_seq_len: int, source: str,
                      policy: str) -> list[int]:
    """The indices of `prompts` (read from `path`) to keep: those of `count(text)` tokens that leave room
    for `max_new_tokens` within `max_seq_len`. A long one is refused with `policy` "error" (ConfigError naming
    the file and every long line) and left out with a warning naming them with "skip"; all of them long is
    an error either way."""
    numbers = [n for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    budget = max_seq_len - max_new_tokens
    long = [(i, n) for i, (n, text) in enumerate(zip(numbers, prompts)) if count(text) > budget]
    if not long:
        return list(range(len(prompts)))
    lines = ", ".join(str(n) for _, n in long[:20]) + (f" and {len(long) - 20} more" if len(long) > 20 else "")
    what = (f"prompt file {path}: line(s) {lines} hold more than {budget} tokens, which with "
            f"runtime.max_new_tokens={max_new_tokens} exceeds {source}")
    if policy != "skip" or len(long) == len(prompts):
        raise ConfigError(what + ("" if policy == "skip" else
                                  "; shorten them, or set runtime.prompts_too_long=skip to leave them out"))
    log.warning("%s: left out (runtime.prompts_too_long=skip)", what)
    skipped = {i for i, _ in long}
    return [i for i in range(len(prompts)) if i not in skipped]


def _check_lengths(c: _Checker) -> None:
    """Every length against the engine's KV cache (`cache_length`): the cut prompts'
    runtime.prompt_len + max_new_tokens, or each line of a prompt file. A line's tokens are counted with the
    tokenizer where one is at hand without building anything (target=hf: the checkpoint's tokenizer.json);
    elsewhere the tokenizer is the target stage's output, so the eval stage counts them before it evaluates
    anything (`prompt_file_lines`, the same rule; the job's plan does it as soon as the target is in the
    store), and this only notes the lines whose UTF-8 bytes + 1 (a bound on the tokens of a byte-level or
    byte-fallback vocabulary) do not clear the budget. Exact mode's padding rows take exact_width - 1
    positions of the cache (runner.engine.ExactEngine), which a prompt then cannot use."""
    max_seq_len, source = cache_length(c)
    width = exact_width(c)
    if max_seq_len is not None and width is not None:
        max_seq_len, source = max_seq_len - (width - 1), f"{source} less exact mode's {width - 1} padding positions"
    prompt_len, max_new = c.get("runtime.prompt_len"), c.get("runtime.max_new_tokens")
    if max_seq_len is None or not (_is_int(prompt_len) and _is_int(max_new)):
        return
    prompts = c.get("runtime.prompts")
    if prompts is None:
        if problem := lengths_problem(prompt_len, max_new, max_seq_len, source):
            c.problems.append(problem)
        return
    if max_new >= max_seq_len:
        c.problems.append(f"runtime.max_new_tokens={max_new} leaves no room for a prompt within {source}")
        return
    try:
        texts = read_prompt_file(Path(prompts))
    except (OSError, ValueError):
        return  # refused above, naming the file
    tokenizer = Path(str(c.get("target.path"))) / "tokenizer.json" if c.get("target.kind") == "hf" else None
    if tokenizer is None or not tokenizer.is_file():
        budget = max_seq_len - max_new
        unsure = [n for n, text in enumerate(texts, 1) if len(text.encode("utf-8")) + 1 > budget]
        if unsure:
            log.info("prompt file %s: %d prompt(s) (the %s) may hold more than %d tokens; the eval stage counts "
                     "their tokens before it evaluates any", prompts, len(unsure),
                     ", ".join(map(str, unsure[:10])) + ("..." if len(unsure) > 10 else ""), budget)
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    try:
        prompt_file_lines(Path(prompts), texts, lambda text: len(tok.encode(text, add_special_tokens=False).ids),
                          max_new_tokens=max_new, max_seq_len=max_seq_len, source=source,
                          policy=str(c.get("runtime.prompts_too_long")))
    except ConfigError as e:
        c.problems.append(str(e))


def check_prompts_with_target(cfg: DictConfig, target_dir: Path) -> None:
    """A prompt file's lines counted with the tokenizer of a target artifact already in the store, against
    the engine's KV cache (`cache_length`), before any stage runs (ConfigError naming the file and the lines,
    as the eval does)."""
    rt = cfg.runtime
    max_seq_len, source = cache_length(_Checker(cfg))
    if not rt.get("prompts") or max_seq_len is None or not (Path(target_dir) / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    prompt_file_lines(Path(rt.prompts), read_prompt_file(Path(rt.prompts)),
                      lambda text: len(tok.encode(text, add_special_tokens=False).ids),
                      max_new_tokens=int(rt.max_new_tokens), max_seq_len=max_seq_len, source=source,
                      policy=str(rt.get("prompts_too_long") or "error"))


def exact_width(c: _Checker) -> int | None:
    """The rows of every target call in exact mode (engine.exact=true), as far as the config tells: the cuda
    engine's max_m, the other engines' engine.exact_width; None when off or not yet known."""
    if c.get("engine.exact") is not True:
        return None
    width = c.get("engine.max_m") if c.get("engine.kind") == "cuda" else c.get("engine.exact_width")
    return width if _is_int(width) and width >= 2 else None


def _check_engine(c: _Checker, export_max_m: int | None) -> int | None:
    """engine.* (conf/engine/<kind>.yaml): the kind, exact mode and, on the cuda engine, its weights, compilation,
    device and call windows (its own: it runs no .pte). -> the engine's max_m, the widest verify call: the cuda
    engine's own, export.max_m for the engines that run the exported program; None where it is not valid."""
    kind = c.get("engine.kind")
    c.choice("engine.kind", ENGINES)
    c.choice("engine.exact", (True, False, "auto"))
    if kind != "cuda":
        if kind == "eager" and str(c.get("engine.device")).split(":")[0] not in ("cpu", "cuda"):
            c.fail("engine.device", c.get("engine.device"), "a torch device: cpu, cuda or cuda:N")
        width = c.get("engine.exact_width")
        if width != "auto" and export_max_m is not None:
            c.int_in("engine.exact_width", 2, export_max_m)
        return export_max_m

    from kernels.rule import SMALL_M_LIMIT

    c.choice("engine.quant", tuple(CUDA_QUANTS))
    if (CUDA_QUANTS.get(c.get("engine.quant")) or {}).get("file") and c.get("target.kind") != "gguf":
        c.fail("engine.quant", c.get("engine.quant"), "a scheme that does not follow a GGUF file (w4_g32, w4_g128, "
               f"bf16): target={c.get('target.kind')} has no file whose precision it could follow")
    c.choice("engine.compile", CUDA_COMPILES)
    if c.get("engine.compile") == "inductor" and c.get("engine.quant") != "bf16":
        c.fail("engine.compile", "inductor", f"none with engine.quant={c.get('engine.quant')} (inductor compiles "
               "the bf16 engine; the INT4 kernels are fused already)")
    if not isinstance(c.get("engine.device"), str) or c.get("engine.device").split(":")[0] != "cuda":
        c.fail("engine.device", c.get("engine.device"), "a CUDA device: cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        c.fail("engine", "cuda", "pte or eager on a machine where torch sees no CUDA device")
    max_m = c.get("engine.max_m") if c.int_in("engine.max_m", 2, SMALL_M_LIMIT) else None
    if max_m is None:
        return None
    if c.get("engine.default_chain") != "auto":
        c.int_in("engine.default_chain", 1, max_m - 1)
    if c.int_in("engine.max_prefill_chunk", 1) and c.int_in("engine.min_prefill_chunk", 1, nullable=True):
        lo, hi = c.get("engine.min_prefill_chunk"), c.get("engine.max_prefill_chunk")
        if lo is not None and lo <= max_m:  # kernels.rule.use_small_m: a prefill of M <= max_m rows takes other kernels
            c.fail("engine.min_prefill_chunk", lo, f"null or above engine.max_m={max_m} (a prefill range may not "
                   "straddle the dispatch threshold max_m)")
        lo = max_m + 1 if lo is None else lo
        max_seq_len = c.get("engine.max_seq_len") if c.int_in("engine.max_seq_len", 2) else None
        if hi < lo or (max_seq_len is not None and hi > max_seq_len):
            c.fail("engine.max_prefill_chunk", hi, f"an int in [{lo}, {max_seq_len or 'inf'}]"
                   " (engine.min_prefill_chunk .. engine.max_seq_len)")
    return max_m


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError listing every out-of-range value of the composed config; return None when all fit."""
    c = _Checker(cfg)
    c.choice("device", ("cpu", "cuda"))
    c.int_in("threads", 1, nullable=True)
    c.int_in("seed", 0)

    c.choice("target.kind", ("tiny", "hf", "gguf"))
    if c.get("target.kind") == "hf":
        c.existing("target.path", directory=True)
    elif c.get("target.kind") == "gguf":
        _check_gguf_source(c)

    c.choice("data.kind", ("stdlib", "text"))
    c.number_in("data.held_out_fraction", 0.0, 1.0)
    c.int_in("data.max_bytes", 1, nullable=True)
    if c.get("data.prompt_format") is not None:
        c.choice("data.prompt_format", PROMPT_FORMATS)

    for group in ("target", "draft"):
        if c.get(f"{group}.train") is not None and c.get(f"{group}.train.autocast") is not None:
            c.choice(f"{group}.train.autocast", ("auto", "bfloat16"))  # null = fp32

    c.choice("taps.source", ("generate", "corpus"))
    c.choice("taps.target_quant", ("auto", *SERVED_QUANTS))
    if c.get("taps.target_quant") in ("8da_file", "w4_file") and c.get("target.kind") != "gguf":
        c.fail("taps.target_quant", c.get("taps.target_quant"), f"a scheme that does not follow a GGUF file: "
               f"target={c.get('target.kind')} has no file whose precision it could follow")
    for key in ("seq_len", "train_sequences", "held_out_sequences", "shard_sequences", "batch_size"):
        c.int_in(f"taps.{key}", 1)

    c.choice("draft.kind", ("train", "load"))
    if c.get("draft.kind") == "load":
        c.existing("draft.path", directory=True)
        if c.get("draft.aux_layer_convention") is not None:  # absent: auto
            from models.draft_layouts import CONVENTION_CHOICES

            c.choice("draft.aux_layer_convention", CONVENTION_CHOICES)
    from pipeline import distributed

    world = distributed.world_size()
    if c.get("draft.kind") == "train" and world > 1:  # torchrun: each rank trains on its share of the batch
        bs = c.get("draft.train.batch_size")
        if _is_int(bs) and bs < world:
            c.fail("draft.train.batch_size", bs, f"at least the {world} ranks of this torchrun job (it is the "
                   "global batch, split among them)")

    c.choice("export.backend", EXPORT_BACKENDS)
    c.choice("export.quant", EXPORT_QUANTS)
    if c.get("export.quant") == "8da_file" and c.get("target.kind") != "gguf":
        c.fail("export.quant", "8da_file", "a scheme that does not follow a GGUF file (8da4w_offsets, 8da4w_draft, "
               f"fp32): target={c.get('target.kind')} has no file whose precision it could follow")
    max_m = c.get("export.max_m") if c.int_in("export.max_m", 2) else None
    c.choice("export.draft_chains", (True, False))
    # default_chain `auto` (pipeline.hardware) is at most DEFAULT_CHAIN; it is checked as itself once resolved
    chain_ok = c.get("export.default_chain") == "auto" or c.int_in("export.default_chain", 1)
    ints = [chain_ok, c.int_in("export.max_prefill_chunk", 1),
            c.int_in("export.min_prefill_chunk", 1, nullable=True), c.int_in("export.group_size", 2)]
    max_seq_len = c.get("export.max_seq_len") if c.int_in("export.max_seq_len", 2) else None
    named = c.get("export.backend") in EXPORT_BACKENDS and c.get("export.quant") in EXPORT_QUANTS  # refused above
    if max_m is not None and all(ints) and named and max_seq_len is not None:
        from pipeline.export_pte import DEFAULT_CHAIN, check_export_args

        min_prefill = c.get("export.min_prefill_chunk")
        default_chain = c.get("export.default_chain")
        try:
            check_export_args(max_m=max_m, default_chain=min(DEFAULT_CHAIN, max_m - 1) if default_chain == "auto"
                              else default_chain,
                              min_prefill_chunk=max_m + 1 if min_prefill is None else min_prefill,
                              max_prefill_chunk=c.get("export.max_prefill_chunk"), max_seq_len=max_seq_len,
                              backend=c.get("export.backend"), quant=c.get("export.quant"),
                              group_size=c.get("export.group_size"))
        except ValueError as e:
            c.problems.append(str(e))

    engine_max_m = _check_engine(c, max_m)
    rt = "runtime"
    # 0 = the greedy baseline only
    chain_ok = engine_max_m is not None and c.int_in(f"{rt}.chain", 0, engine_max_m - 1, nullable=True)
    c.choice(f"{rt}.policy", POLICIES)
    width = exact_width(c)
    chain = c.get(f"{rt}.chain")
    if chain_ok and width is not None and _is_int(chain) and chain > width - 1:
        c.fail(f"{rt}.chain", chain, f"at most engine.exact_width - 1 = {width - 1} in exact mode (a round verifies "
               "K+1 rows in one call of exact_width rows), or a larger engine.exact_width")
    c.number_in(f"{rt}.temperature", 0.0)
    c.int_in(f"{rt}.max_new_tokens", 1)
    c.int_in(f"{rt}.seed", 0)
    c.int_in(f"{rt}.n_prompts", 1)
    c.int_in(f"{rt}.repeats", 1)
    c.number_in(f"{rt}.repeat_tolerance", 0.0)
    c.int_in(f"{rt}.prompt_len", 1)
    if c.get(f"{rt}.prompts") is not None and c.existing(f"{rt}.prompts", directory=False):
        try:
            if not read_prompt_file(Path(c.get(f"{rt}.prompts"))):
                c.fail(f"{rt}.prompts", c.get(f"{rt}.prompts"), "a file with at least one prompt")
        except ValueError as e:
            c.fail(f"{rt}.prompts", c.get(f"{rt}.prompts"), f"a readable prompt file ({e})")

    c.choice(f"{rt}.prompts_too_long", PROMPTS_TOO_LONG)
    _check_context(c)
    _check_lengths(c)

    if c.get("serve") is not None:
        if not isinstance(c.get("serve.host"), str) or not c.get("serve.host"):
            c.fail("serve.host", c.get("serve.host"), "a host name or address, e.g. 127.0.0.1")
        c.int_in("serve.port", 0, 65535)
        c.int_in("serve.queue_size", 0)
        c.int_in("serve.max_body_bytes", 1)
        c.number_in("serve.drain_s", 0.0)
        c.number_in("serve.stream_interval_s", 0.0)
        c.number_in("serve.body_timeout_s", 0.0, lo_open=True)
        c.number_in("serve.idle_timeout_s", 0.0, lo_open=True)
        c.int_in("serve.max_url_bytes", 1)
        c.int_in("serve.max_header_bytes", 1)
        if c.get("serve.model_name") is not None and not isinstance(c.get("serve.model_name"), str):
            c.fail("serve.model_name", c.get("serve.model_name"), "a string or null")

    if c.problems:
        raise ConfigError("invalid config (set on the command line or in conf/):\n  " + "\n  ".join(c.problems))
