"""The training corpus and its tokenizer.

A corpus is a sorted list of documents, each with a stable id; a document is held out when
sha256(id) mapped to [0, 1) falls below `data.held_out_fraction`, so the split depends only on the id:
adding, removing or capping files never moves another file across the split, and held-out prompts are
never trained on.

- `data=stdlib`: the running interpreter's standard library `.py` files (id = path relative to the stdlib
  directory). Directories named in `data.exclude_dirs` are skipped: site-packages (not the stdlib), the
  test suites (`test`, `tests`, `idle_test`: 19 MB of repetitive test code and data beside 12 MB of library
  code on CPython 3.11) and `pydoc_data` (one generated 760 KB file of English help text, which would
  otherwise dominate whichever split it falls in), leaving ~730 files, 11 MB.
- `data=text data.paths=[...]`: files or globs (recursive `**` allowed), id = the path relative to its
  pattern's directory (the part before the first glob component; a plain file's own directory), so the
  split does not move when the corpus does. Two files with one id (`a/*.txt` and `b/*.txt` both matching
  `x.txt`) are refused: give one pattern over their common directory. A `.jsonl` file is one document per
  line, read from `data.text_field` (id = `<id>#<line>`); any other file is one plain-text document. If the
  hash split leaves either side empty (a single file, say), every document is cut at a line boundary
  instead: the first (1 - fraction) of it trains, the rest is held out.

`data.max_bytes` caps the corpus (documents in sorted order until the cap; the smoke preset uses it).
`fingerprint(data_cfg)` hashes ids and contents: the pipeline adds it to the `data` config subtree so a
changed corpus changes every cache key that depends on `data`.

The tokenizer is a byte-level BPE (GPT-2 style pre-tokenizer, no unknown tokens) trained with `tokenizers`
on the train split, with special tokens `<|bos|>` (id 0) and `<|eos|>` (id 1). Token streams are the
documents' ids concatenated, each document followed by `<|eos|>`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.text import EOS_TOKENS, eos_id

log = logging.getLogger(__name__)

BOS, EOS = "<|bos|>", EOS_TOKENS[0]
SPECIAL_TOKENS = (BOS, EOS)


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    held_out: bool


def _held_out(doc_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:16], 16) / 16**16 < fraction


def _stdlib_sources(cfg: Mapping) -> list[tuple[str, Path]]:
    root = Path(cfg.get("root") or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"data.root {root} is not a directory")
    exclude = set(cfg.get("exclude_dirs") or ())
    files = [p for p in root.rglob("*.py") if not exclude & set(p.relative_to(root).parts[:-1])]
    return sorted((p.relative_to(root).as_posix(), p) for p in files)


def _pattern_dir(pattern: str) -> str:
    """The directory a glob's matches are named from: its components before the first one with a glob
    character (a plain file's own directory)."""
    parts = Path(pattern).parts
    plain = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
    return str(Path(*parts[:plain])) if plain else "."


def _text_sources(cfg: Mapping) -> list[tuple[str, Path]]:
    patterns = list(cfg.get("paths") or ())
    if not patterns:
        raise ValueError("data=text needs data.paths=[FILE_OR_GLOB,...]")
    found: dict[str, Path] = {}
    for pattern in patterns:
        matches = [m for m in glob.glob(str(pattern), recursive=True) if Path(m).is_file()]
        if not matches:
            raise FileNotFoundError(f"data.paths: {pattern!r} matches no file")
        base = _pattern_dir(str(pattern))
        for m in matches:
            doc_id = Path(os.path.relpath(m, base)).as_posix()
            if doc_id in found and found[doc_id].resolve() != Path(m).resolve():
                raise ValueError(f"data.paths: {str(found[doc_id])!r} and {m!r} both have the id {doc_id!r} (ids are "
                                 "paths relative to each pattern's directory); use one pattern over their common "
                                 "directory instead")
            found[doc_id] = Path(m)
    return sorted(found.items())


def _read(doc_id: str, path: Path, text_field: str) -> list[tuple[str, str]]:
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        return [(doc_id, raw)]
    docs = []
    for i, line in enumerate(raw.splitlines()):
        if not line.strip():
            continue
        record = json.loads(line)
        if text_field not in record:
            raise KeyError(f"{path}:{i + 1}: no field {text_field!r} (set data.text_field)")
        docs.append((f"{doc_id}#{i}", str(record[text_field])))
    return docs


def documents(cfg: Mapping) -> list[Document]:
    """All documents of the corpus `cfg` (the `data` config subtree) with their split.

    Memoised per process on the config (the fingerprint and the stage read the same corpus).
    """
    memo = json.dumps({k: v for k, v in dict(cfg).items() if k != "fingerprint"}, sort_keys=True, default=str)
    if memo not in _documents_memo:
        _documents_memo.clear()
        _documents_memo[memo] = _read_documents(cfg)
    return _documents_memo[memo]


_documents_memo: dict[str, list[Document]] = {}


def _read_documents(cfg: Mapping) -> list[Document]:
    kind = cfg.get("kind")
    if kind == "stdlib":
        sources = _stdlib_sources(cfg)
    elif kind == "text":
        sources = _text_sources(cfg)
    else:
        raise ValueError(f"data.kind must be 'stdlib' or 'text', got {kind!r}")
    fraction = float(cfg.get("held_out_fraction", 0.05))
    max_bytes = cfg.get("max_bytes")
    raw, total = [], 0
    for doc_id, path in sources:
        if max_bytes is not None and total >= max_bytes:
            break
        for did, text in _read(doc_id, path, cfg.get("text_field", "text")):
            if max_bytes is not None and total >= max_bytes:
                break
            raw.append((did, text))
            total += len(text.encode())
    if not raw:
        raise ValueError(f"data: the corpus is empty ({kind})")
    docs = [Document(did, text, _held_out(did, fraction)) for did, text in raw]
    if fraction > 0 and (all(d.held_out for d in docs) or not any(d.held_out for d in docs)):
        log.warning("data: the hash split of %d document(s) leaves one side empty; cutting each document "
                    "at %.0f%% of its lines instead", len(docs), 100 * (1 - fraction))
        docs = [part for d in docs for part in _cut(d, fraction)]
    return docs


def _cut(doc: Document, fraction: float) -> list[Document]:
    lines = doc.text.splitlines(keepends=True)
    at = min(max(1, round(len(lines) * (1 - fraction))), max(1, len(lines) - 1))
    return [Document(doc.id + ":train", "".join(lines[:at]), False),
            Document(doc.id + ":held_out", "".join(lines[at:]), True)]


def split(docs: Sequence[Document], which: str) -> list[str]:
    """Texts of the 'train' or 'held_out' split."""
    if which not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {which!r}")
    return [d.text for d in docs if d.held_out == (which == "held_out")]


def fingerprint(cfg: Mapping) -> str:
    """sha256 over the ids and contents of the corpus: what the data actually is, beyond its config."""
    h = hashlib.sha256()
    for d in documents(cfg):
        h.update(f"{d.id}\0{len(d.text)}\0{int(d.held_out)}\0".encode())
        h.update(d.text.encode())
    return h.hexdigest()


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_bytes: int | None = None):
    """A byte-level BPE with <|bos|>=0, <|eos|>=1, trained on `texts` (the first `max_bytes` of them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if max_bytes is not None:
        kept, total = [], 0
        for t in texts:
            if total >= max_bytes:
                break
            kept.append(t)
            total += len(t)
        texts = kept
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tokenizer, texts: Sequence[str], eos: int | None = None) -> np.ndarray:
    """One int32 token stream: each text's ids followed by `eos` (default: the tokenizer's)."""
    eos = eos_id(tokenizer) if eos is None else eos
    parts = []
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        if eos is not None:
            parts.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
