"""Prompts of a fixed token length, cut from one split of the corpus: what the taps stage continues and the
eval stage decodes, built the same way for both so that the draft trains on the distribution it is measured on.

`data.prompt_format`:
- `plain`: windows of corpus text (what a base model continues);
- `chat`: requests built from the split's docstrings ("Write a Python function `name(args)`. <docstring>"),
  wrapped in the target's chat template with a generation prompt, so an instruct model answers them. The
  target's own greedy answer is then the draft's training text (the taps stage's `generate` source). When the
  docstrings long enough for the prompt run out, requests to explain the split's functions and classes
  ("Explain what this Python code does." and the code) follow: a standard library has about one long
  docstring for every six definitions, and a GPU's taps ask for more prompts than the docstrings give. The
  docstring requests come first, so a set of prompts the docstrings can fill is the same with or without the
  second kind.

Every prompt has exactly `length` tokens, because the taps stage decodes a batch of prompts over one set of
cache positions. A chat prompt is the template's ids before the message, the request's first n ids and the
template's ids after it, with n chosen to make the total `length`; the cut falls where the next request token
starts a new word (a leading space or newline), or in code anywhere outside a name or number, so a request ends
on a whole word. Requests shorter than n tokens, or without such a boundary at n, are skipped.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Sequence

import numpy as np
import torch

from models.choices import PROMPT_FORMATS
from models.text import render_chat

_SLOT = "\x00REQUEST\x00"


def cut(texts: Sequence[str], tokenizer, n: int, length: int, seed: int, prompt_format: str = "plain",
        chat_template: str | None = None) -> torch.Tensor:
    """n prompts [n, length] of `prompt_format` from the split `texts`; the same arguments give the same prompts."""
    if prompt_format in PROMPT_FORMATS and n == 0:  # a split nothing reads (a loaded draft's train taps)
        return torch.empty(0, length, dtype=torch.long)
    if prompt_format == "plain":
        return plain_prompts(texts, tokenizer, n, length, seed)
    if prompt_format == "chat":
        return chat_prompts(texts, tokenizer, chat_template, n, length, seed)
    raise ValueError(f"data.prompt_format={prompt_format!r}: expected one of {', '.join(PROMPT_FORMATS)}")


def plain_prompts(texts: Sequence[str], tokenizer, n: int, length: int, seed: int) -> torch.Tensor:
    """n windows [n, length] of token ids from seeded random places of the texts, never crossing a document.

    A document is drawn with probability proportional to its size, then a character snippet at a uniform
    offset is tokenized on its own and its first token (possibly cut in half) dropped. Only n short snippets
    are tokenized, not the whole split (which costs more than generating on a busy machine).
    """
    sizes = np.array([len(t) for t in texts], dtype=np.float64)
    if not len(texts) or sizes.sum() == 0:
        raise ValueError("a split of the corpus is empty: no text to cut prompts from")
    rng = np.random.default_rng(seed)
    chars = 8 * length + 64  # code here is ~3.5 characters per token: a wide margin
    out: list[list[int]] = []
    for _ in range(20):
        docs = rng.choice(len(texts), size=n - len(out), p=sizes / sizes.sum())
        starts = [int(rng.integers(0, max(1, len(texts[d]) - chars))) for d in docs]
        snippets = [texts[d][s : s + chars] for d, s in zip(docs, starts)]
        for enc in tokenizer.encode_batch(snippets, add_special_tokens=False):
            if len(enc.ids) > length:
                out.append(enc.ids[1 : 1 + length])
        if len(out) == n:
            return torch.tensor(out, dtype=torch.int64)
    raise ValueError(f"could not cut {n} windows of {length} tokens from the corpus (documents too short?)")


def _definitions(source: str) -> list[ast.AST]:
    """The public functions and classes of a Python source in walk order (none when it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                      ast.ClassDef)) and not node.name.startswith("_")]


def docstring_requests(source: str) -> list[str]:
    """One request per documented public function or class of a Python source."""
    requests = []
    for node in _definitions(source):
        doc = ast.get_docstring(node)
        if not doc:
            continue
        doc = " ".join(doc.split())
        if isinstance(node, ast.ClassDef):
            requests.append(f"Write a Python class `{node.name}`. {doc}")
        else:
            args = ", ".join(a.arg for a in node.args.args)
            requests.append(f"Write a Python function `{node.name}({args})`. {doc}")
    return requests


EXPLAIN = "Explain what this Python code does.\n\n"


def code_requests(source: str) -> list[str]:
    """One request per public function or class of a Python source: explain its code, docstring included."""
    lines = source.splitlines()
    return [EXPLAIN + textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            for node in _definitions(source)]


def chat_prompts(texts: Sequence[str], tokenizer, template: str, n: int, length: int, seed: int) -> torch.Tensor:
    """n chat prompts [n, length] from `texts`: docstring requests, then code requests, each in a seeded order."""
    if not template:
        raise ValueError("data.prompt_format=chat needs a target with a chat template (chat_template.jinja in "
                         "its artifact); this target has none: use data.prompt_format=plain")
    before, sep, after = render_chat(template, _SLOT, tokenizer).partition(_SLOT)
    if not sep:
        raise ValueError("the target's chat template does not place the user message in its output")
    head = tokenizer.encode(before, add_special_tokens=False).ids
    tail = tokenizer.encode(after, add_special_tokens=False).ids
    room = length - len(head) - len(tail)
    if room < 8:
        raise ValueError(f"prompt length {length} leaves {room} tokens for the request after the chat template's "
                         f"{len(head) + len(tail)}: raise the prompt length")
    out, seen = [], 0
    for kind in (docstring_requests, code_requests):
        requests = [r for t in texts for r in kind(t)]
        seen += len(requests)
        order = np.random.default_rng(seed).permutation(len(requests))
        for start in range(0, len(order), 4 * n):
            batch = [requests[i] for i in order[start : start + 4 * n]]
            for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = enc.ids
                if len(ids) > room and (_starts_word(tokenizer, ids[room]) or
                                        kind is code_requests and not _inside_name(tokenizer, ids, room)):
                    out.append(head + ids[:room] + tail)
                    if len(out) == n:
                        return torch.tensor(out, dtype=torch.int64)
    if not seen:
        raise ValueError("data.prompt_format=chat: the split has no public Python function or class to build "
                         "requests from")
    raise ValueError(f"data.prompt_format=chat: only {len(out)} of {n} requests of the split (docstrings, then "
                     f"code to explain) are long enough for prompts of {length} tokens; lower the prompt length or "
                     f"the number of prompts")


def _starts_word(tokenizer, token_id: int) -> bool:
    """True for a token that begins with a space or newline: byte-level BPE spells them Ġ and Ċ,
    SentencePiece ▁ (a decoded single token may lose its leading space, its spelling does not)."""
    piece = tokenizer.id_to_token(token_id) or ""
    return piece[:1] in ("Ġ", "Ċ", "▁", " ", "\n", "\t")


def _inside_name(tokenizer, ids: list[int], k: int) -> bool:
    """True when a cut before ids[k] splits an identifier or number: code may end before a bracket or a dot."""
    left, right = tokenizer.decode(ids[k - 1 : k]), tokenizer.decode(ids[k : k + 1])
    word = lambda c: c.isalnum() or c == "_"  # noqa: E731
    return bool(left and right) and word(left[-1]) and word(right[0])
