"""A request to the server (runner.serve) as data, read from its headers and body and turned into token ids by
functions none of which touches HTTP or the engine: the server's endpoints only move bytes and call these.

`check_api_key` reads the Authorization header and `check_body_length` the declared length. `parse_body` reads the
bytes: UTF-8 JSON, an object, nested at most MAX_JSON_DEPTH deep, every string valid
Unicode (no lone surrogate, which JSON's \\u escapes can spell and no tokenizer can encode). `parse_request`
reads the fields into a `GenerationRequest`, each checked against the engine and the server (`Limits`), and
names the field it refuses. `prompt_and_budget` gives a request's ids and token budget: ids given are checked as
they are, a text or messages are tokenized by `prompt_ids`, off the event loop (`tokenizes`), since a long text
takes a tokenizer milliseconds to seconds. Every refusal is a `RequestError` whose message quotes
at most QUOTE_CHARS characters of the value (`quote`), whatever its size.

A prompt's length is checked twice. Before tokenizing: a text of B bytes is at least B / max_token_bytes
tokens (`max_token_bytes`, read from the vocabulary once), so a text that cannot fit the cache with its
max_tokens is refused without tokenizing it (`check_text_fits`); after: its exact count (`check_fits`). The
cache length is the only bound: no prompt is refused for being long while it fits.

User text cannot forge control tokens. A special token of the tokenizer typed into a completion's prompt or a
chat message is encoded as the text it spells, as any other text is; the chat template's own special tokens
stay control tokens (`chat_ids`). A completion may opt in to reading them as control tokens (`parse_special`,
the name llama.cpp's server gives the same choice). A tokenizer that has no text encoding for such a string
(a word-level vocabulary maps the word to the token itself) refuses the request, naming the token.
"""

from __future__ import annotations

import hmac
import json
import math
import re
import reprlib
import secrets
from dataclasses import dataclass

from models.choices import POLICIES

MAX_STOPS = 4  # OpenAI's limit on `stop`
MAX_TEMPERATURE = 2.0  # OpenAI's range of `temperature`
MAX_SEED = 2 ** 63 - 1
MAX_JSON_DEPTH = 64  # a request nests 5 deep; Python's JSON reader fails near 1,000 (a RecursionError)
QUOTE_CHARS = 200  # the most an error message quotes of a value
# Fields of OpenAI's API this server does not implement: refused unless they hold one of their neutral values.
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
               "top_p": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none")}


class RequestError(Exception):
    """A request refused: the HTTP status, a message naming the field (`param`), and extra headers. A status of
    500 or more is the server's own fault and says so (`kind` server_error); below, the request's."""

    def __init__(self, status: int, message: str, param: str | None = None, *, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


_QUOTER = reprlib.Repr()
_QUOTER.maxlevel, _QUOTER.maxstring, _QUOTER.maxother = 3, QUOTE_CHARS - 40, QUOTE_CHARS - 40
_QUOTER.maxlist = _QUOTER.maxtuple = _QUOTER.maxdict = _QUOTER.maxset = 8


def quote(value) -> str:
    """`value` as an error message shows it: its repr, cut to at most QUOTE_CHARS characters (reprlib, which
    never walks more of a long or deep value than it shows), with the size of a long string said."""
    text = _QUOTER.repr(value)
    if len(text) > QUOTE_CHARS:
        text = text[:QUOTE_CHARS - 3] + "..."
    if isinstance(value, str) and len(value) > _QUOTER.maxstring:
        text += f" ({len(value)} characters)"
    return text


# ----------------------------------------------------------------------------------------------------------
# The body


def check_api_key(authorization: str, api_key: str | None) -> None:
    """A /v1 request's Authorization header against the server's API key (None: every request is let in): a 401
    unless it is `Bearer <key>`, compared in constant time."""
    if api_key is None:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           kind="authentication_error")


def check_body_length(content_length: str, limit: int) -> None:
    """A 413 for a body whose declared length (the Content-Length header, or "") is past `limit` bytes, before
    any of it is read; the server counts the bytes that do come as well."""
    if content_length.isdigit() and int(content_length) > limit:
        raise RequestError(413, f"the request body has {content_length} bytes; the limit is {limit}",
                           headers={"Connection": "close"})


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, refused with 400 unless it is UTF-8 (a BOM allowed), JSON, an object,
    nested at most MAX_JSON_DEPTH deep and free of lone surrogates: each is the client's error, never ours."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the request body is not UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(400, f"the request body is not valid JSON ({quote(str(e))[1:-1]})") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_values(body)
    return body


def check_values(body: dict) -> None:
    """Walk the body without recursion: refuse it when it nests deeper than MAX_JSON_DEPTH or a string (a value
    or a key) holds a lone surrogate, naming where."""
    stack = [(body, "body", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {where})")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_unicode(key, f"{where} key")
            if isinstance(item, str):
                _check_unicode(item, f"{where}[{key!r}]" if isinstance(key, str) else f"{where}[{key}]")
            elif isinstance(item, (dict, list)):
                stack.append((item, f"{where}[{key!r}]" if isinstance(key, str) else f"{where}[{key}]", depth + 1))


def _check_unicode(s: str, where: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"{where[:QUOTE_CHARS]}: a lone surrogate ({s[e.start]!r}) at character {e.start}: "
                           "text must be valid Unicode") from None


# ----------------------------------------------------------------------------------------------------------
# The fields


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model served, the engine's ranges and the server's defaults."""

    model: str
    max_seq_len: int
    vocab_size: int
    max_chain: int  # K in [0, max_chain]
    chain: int  # the default K
    policy: str
    temperature: float
    seed: int


@dataclass(frozen=True)
class GenerationRequest:
    """A request's fields, checked: a completion's `prompt` (text or token ids) or a chat's `messages`
    ({"role", "content"} strings), and what to generate. `budget_field` names the field max_tokens came from."""

    chat: bool
    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int | None  # None: the room left in the cache
    budget_field: str
    chain: int
    policy: str
    temperature: float
    seed: int
    stops: list[str]
    stream: bool
    include_usage: bool
    parse_special: bool  # a completion's special-token strings read as control tokens (opt-in)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise RequestError(400, f"{name}: expected an integer in {span}, got {quote(v)}", name)
    return v


def _number(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name)
    if v is None:
        return default
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi):
        raise RequestError(400, f"{name}: expected a number in [{lo}, {hi}], got {quote(v)}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(400, f"{name}: expected true or false, got {quote(v)}", name)
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(400, f"stop: expected a non-empty string or a list of up to {MAX_STOPS} of them, "
                           f"got {quote(v)}", "stop")
    return stops


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return list(p)
    raise RequestError(400, "prompt: expected one non-empty string or list of token ids (one prompt per "
                       f"request), got {quote(p) if p is not None else 'nothing'}", "prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: expected a non-empty list of {role, content} objects, got "
                           f"{quote(messages) if messages is not None else 'nothing'}", "messages")
    plain = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise RequestError(400, f"messages[{i}].content: only text parts are supported, got "
                                   f"{quote(content)}", f"messages[{i}].content")
            content = "".join(c["text"] for c in content)
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(content, str):
            raise RequestError(400, f"messages[{i}]: expected {{\"role\": string, \"content\": string}}, "
                               f"got {quote(msg)}", f"messages[{i}]")
        plain.append({"role": msg["role"], "content": content})
    return plain


def parse_request(body: dict, *, chat: bool, limits: Limits) -> GenerationRequest:
    """The request's fields, each checked (a 4xx naming the field); nothing is tokenized here."""
    name = body.get("model")
    if name is not None and name != limits.model:
        raise RequestError(404, f"model: {quote(name)} is not served here; this server serves {limits.model!r}",
                           "model", kind="not_found_error")
    for field, neutral in UNSUPPORTED.items():
        if field in body and body[field] not in neutral:
            raise RequestError(400, f"{field}: not supported by this server (only {neutral[-1]!r})", field)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, f"stream_options: expected an object, got {quote(options)}", "stream_options")
    budget_field = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    policy = body.get("policy", limits.policy)
    if policy not in POLICIES:
        raise RequestError(400, f"policy: expected one of {', '.join(POLICIES)}, got {quote(policy)}", "policy")
    if chat and "parse_special" in body:
        raise RequestError(400, "parse_special: only a completion may read control tokens from its text; a chat's "
                           "come from the chat template", "parse_special")
    return GenerationRequest(
        chat=chat, prompt=None if chat else _prompt(body), messages=_messages(body) if chat else None,
        max_tokens=_int(body, budget_field, None, 1, limits.max_seq_len - 1), budget_field=budget_field,
        chain=_int(body, "chain", limits.chain, 0, limits.max_chain), policy=policy,
        temperature=_number(body, "temperature", limits.temperature, 0.0, MAX_TEMPERATURE),
        seed=_int(body, "seed", limits.seed, 0, MAX_SEED), stops=_stops(body), stream=_bool(body, "stream", False),
        include_usage=_bool(options, "include_usage", False), parse_special=_bool(body, "parse_special", False))


# ----------------------------------------------------------------------------------------------------------
# Lengths: the cache bounds a prompt, before and after it is tokenized


def utf8_len(text: str) -> int:
    """The UTF-8 bytes of `text`: its length for ASCII, which Python knows without a pass over it."""
    return len(text) if text.isascii() else len(text.encode())


def check_fits(n_prompt: int, req: GenerationRequest, limits: Limits) -> int:
    """The token budget of a prompt of `n_prompt` tokens: max_tokens, or the room left in the cache; a 400 when
    the prompt and its budget exceed max_seq_len."""
    room = limits.max_seq_len - n_prompt
    field = req.budget_field
    if req.max_tokens is None:
        if room < 1:
            raise RequestError(400, f"the prompt has {n_prompt} tokens: no room to generate in this model's "
                               f"max_seq_len={limits.max_seq_len}", field)
        return room
    if req.max_tokens > room:
        raise RequestError(400, f"{field}: the prompt's {n_prompt} tokens + {field}={req.max_tokens} exceed this "
                           f"model's max_seq_len={limits.max_seq_len} (at most {max(room, 0)} for this prompt)",
                           field)
    return req.max_tokens


def check_text_fits(n_bytes: int, bytes_per_token: int | None, req: GenerationRequest, limits: Limits,
                    field: str) -> None:
    """Before tokenizing: a 400 when a text of `n_bytes` bytes cannot fit with its budget, since it is at least
    n_bytes / bytes_per_token tokens (`max_token_bytes`; None: no bound is known, nothing is refused here)."""
    if bytes_per_token is None:
        return
    at_least = -(-n_bytes // bytes_per_token)
    need = at_least + (req.max_tokens or 1)
    if need > limits.max_seq_len:
        budget = f" + {req.budget_field}={req.max_tokens}" if req.max_tokens else ""
        raise RequestError(400, f"{field}: its {n_bytes} bytes are at least {at_least} tokens (a token of this "
                           f"tokenizer spells at most {bytes_per_token} bytes){budget}: more than this model's "
                           f"max_seq_len={limits.max_seq_len}", req.budget_field if req.max_tokens else field)


# Normalizers that never drop text, with the most they shrink it (bytes in per byte out): Unicode composition
# (NFC, NFKC) and compatibility or case mappings fold up to three 3-byte characters into one
_NORMALIZER_SHRINK = {"NFD": 1, "Prepend": 1, "NFC": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4}
# Pre-tokenizers that split text without dropping any (Split and Punctuation unless their behavior is "Removed")
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token of `tokenizer` stands for, read from its vocabulary once; None where no
    such bound holds. It holds for a BPE in which every byte of the text lands in a token that spells it: over
    bytes (a ByteLevel pre-tokenizer: each character of a token is one byte), with byte fallback, or with an
    unknown token per character (each a character: at most 4 bytes); with no normalizer or pre-tokenizer that
    drops text (whitespace splitting, stripping, accents) and no added token that takes up the whitespace
    beside it (lstrip, rstrip). A normalizer that folds characters multiplies the bound by its shrink factor.
    Then a text of B bytes is at least B / max_token_bytes tokens (a tokenizer's byte-level BPE: our targets')."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None

    def parts(node) -> list[dict]:
        if not node:
            return []
        if node.get("type") == "Sequence":
            return [p for child in node.get("normalizers") or node.get("pretokenizers") or [] for p in parts(child)]
        return [node]

    shrink = 1
    for n in parts(spec.get("normalizer")):
        if n["type"] == "Replace":
            pattern = n.get("pattern") or {}
            if "String" not in pattern or len(n.get("content", "").encode()) < len(pattern["String"].encode()):
                return None  # a regex, or a replacement shorter than what it replaces
        elif n["type"] in _NORMALIZER_SHRINK:
            shrink *= _NORMALIZER_SHRINK[n["type"]]
        else:
            return None
    pre = parts(spec.get("pre_tokenizer"))
    if any(p["type"] not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return None
    byte_level = any(p["type"] == "ByteLevel" for p in pre)
    if not (byte_level or model.get("byte_fallback") or model.get("unk_token")):
        return None  # a character outside the vocabulary would be dropped
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = max((len(t) if byte_level else len(t.encode()) for t in model.get("vocab") or {}), default=1)
    longest = max([longest, 4 if model.get("unk_token") and not byte_level else 1,
                   *(len(t["content"].encode()) for t in added)])
    return longest * shrink


# ----------------------------------------------------------------------------------------------------------
# Text to ids


@dataclass(frozen=True)
class Encoder:
    """What turns a request's text into ids, built once at start-up (`encoder`): the tokenizer; a copy that
    encodes special-token strings as text (`as_text`); a matcher of the special tokens alone (`specials`: the
    tokenizer's added special tokens over a vocabulary of one unknown word, so encoding a text marks where
    they stand); their ids; the chat template; and the bytes-per-token bound (`max_token_bytes`)."""

    tokenizer: object
    as_text: object
    specials: object
    special_ids: frozenset
    chat_template: str | None
    bytes_per_token: int | None


def encoder(tokenizer, chat_template: str | None = None) -> Encoder:
    from tokenizers import Tokenizer, models

    as_text = Tokenizer.from_str(tokenizer.to_str())
    as_text.encode_special_tokens = True
    added = {i: t for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    specials = Tokenizer(models.WordLevel({"\x00": 0}, unk_token="\x00"))
    specials.normalizer = tokenizer.normalizer
    specials.add_special_tokens(list(added.values()))
    return Encoder(tokenizer, as_text, specials, frozenset(added), chat_template, max_token_bytes(tokenizer))


def check_chat_template(enc: Encoder) -> None:
    """At start-up: the chat template renders a plain user message into text, so that a broken template stops
    the server from starting instead of failing every chat request."""
    if enc.chat_template is None:
        return
    from models.text import render_chat

    try:
        text = render_chat(enc.chat_template, [{"role": "user", "content": "Hello"}], enc.tokenizer)
    except Exception as e:
        raise ValueError(f"the chat template fails on a plain user message: {type(e).__name__}: {e}") from None
    if not isinstance(text, str) or "Hello" not in text:
        raise ValueError(f"the chat template renders a plain user message 'Hello' as {quote(text)}: a chat "
                         "template must place the message's content in its text")


def special_spans(enc: Encoder, text: str) -> list[tuple[int, int]]:
    """The (start, end) characters of every special token of the tokenizer spelled in `text`."""
    if not enc.special_ids:
        return []
    e = enc.specials.encode(text, add_special_tokens=False)
    return [span for i, span in zip(e.ids, e.offsets) if i != 0]


def text_ids(enc: Encoder, text: str, field: str) -> list[int]:
    """`text` as user text: its special-token strings encoded as the text they spell; a 400 naming the token
    where the tokenizer has no other encoding for one (a word-level vocabulary holds it as a word)."""
    ids = enc.as_text.encode(text, add_special_tokens=False).ids
    forged = [i for i in ids if i in enc.special_ids]
    if forged:
        token = enc.tokenizer.id_to_token(forged[0])
        raise RequestError(400, f"{field}: {quote(token)} is a control token of this model, and its tokenizer "
                           "has no text encoding for it", field)
    return ids


@dataclass(frozen=True)
class Rendered:
    """A chat rendered by its template, with each special-token string of the user's text replaced by a marker
    (`marker`: private-use characters around a random number and an index into `replaced`), so that the
    template's own special tokens and the user's can be told apart (`chat_ids`)."""

    text: str
    replaced: tuple[str, ...]
    marker: str

    def n_bytes(self) -> int:
        """The UTF-8 bytes of the rendered text with the user's strings back in place of the markers."""
        n = utf8_len(self.text)
        for m in re.finditer(self.marker, self.text) if self.replaced else ():
            n += utf8_len(self.replaced[int(m[1])]) - utf8_len(m[0])
        return n


def render(enc: Encoder, messages: list[dict]) -> Rendered:
    """The chat template around `messages`, each special-token string of their roles and contents replaced by
    a marker the template passes through as it is; a 400 when the template refuses them (its own checks, such
    as roles that must alternate, raise a TemplateError)."""
    from jinja2 import TemplateError

    from models.text import render_chat

    nonce = secrets.randbelow(10 ** 12)
    replaced: list[str] = []

    def defuse(text: str) -> str:
        out, at = [], 0
        for a, b in special_spans(enc, text):
            out += [text[at:a], f"\ue000{nonce}.{len(replaced)}\ue001"]
            replaced.append(text[a:b])
            at = b
        return "".join(out) + text[at:]

    plain = [{"role": defuse(m["role"]), "content": defuse(m["content"])} for m in messages]
    try:
        text = render_chat(enc.chat_template, plain, enc.tokenizer)
    except TemplateError as e:
        raise RequestError(400, f"messages: the chat template refused them ({quote(str(e))[1:-1]})",
                           "messages") from None
    return Rendered(text, tuple(replaced), f"\ue000{nonce}\\.(\\d+)\ue001")


def chat_ids(enc: Encoder, rendered: Rendered) -> list[int]:
    """The rendered chat as ids: the template's special tokens are control tokens, the user's are text. With no
    marker it is one call, the text tokenized exactly as a whole; else the text between markers is encoded
    piece by piece and each marker becomes the text-encoding of the string it replaced (`text_ids`)."""
    if not rendered.replaced:
        return enc.tokenizer.encode(rendered.text, add_special_tokens=False).ids
    ids: list[int] = []
    for i, piece in enumerate(re.split(rendered.marker, rendered.text)):
        if i % 2:
            ids += text_ids(enc, rendered.replaced[int(piece)], "messages")
        elif piece:
            ids += enc.tokenizer.encode(piece, add_special_tokens=False).ids
    return ids


def prompt_ids(enc: Encoder, req: GenerationRequest, limits: Limits) -> tuple[list[int], int]:
    """(the prompt's ids, its token budget) of a request with a text prompt or messages, refused (400) when it
    cannot fit the cache: by its bytes before it is tokenized where the bound is known (a chat's once rendered:
    a template may leave a message out), then by its ids. Runs off the event loop (runner.serve): rendering and
    tokenizing take long for a long text."""
    if req.chat:
        if enc.chat_template is None:
            raise RequestError(400, "this model has no chat template (no chat_template.jinja beside its "
                               "tokenizer): use /v1/completions", "messages")
        rendered = render(enc, req.messages)
        check_text_fits(rendered.n_bytes(), enc.bytes_per_token, req, limits, "messages")
        ids = chat_ids(enc, rendered)
    else:
        check_text_fits(utf8_len(req.prompt), enc.bytes_per_token, req, limits, "prompt")
        ids = (enc.tokenizer.encode(req.prompt, add_special_tokens=False).ids if req.parse_special
               else text_ids(enc, req.prompt, "prompt"))
    budget = check_fits(len(ids), req, limits)
    check_ids(ids, limits, "messages" if req.chat else "prompt")
    return ids, budget


def tokenizes(req: GenerationRequest) -> bool:
    """Whether the request's prompt is text or messages, which `prompt_and_budget` tokenizes (off the event loop),
    rather than ids, which it only checks."""
    return not isinstance(req.prompt, list)


def check_prompt_bytes(enc: Encoder, req: GenerationRequest, limits: Limits) -> None:
    """Before a request takes a slot or a thread: a text prompt that cannot fit the cache by its bytes alone
    (`check_text_fits`) is a 400."""
    if isinstance(req.prompt, str):
        check_text_fits(utf8_len(req.prompt), enc.bytes_per_token, req, limits, "prompt")


def prompt_and_budget(enc: Encoder, req: GenerationRequest, limits: Limits) -> tuple[list[int], int]:
    """(the prompt's ids, its token budget) of any request, refused (400) when it cannot fit the cache or holds an
    id outside the vocabulary: ids given are checked as they are, a text or messages tokenized (`prompt_ids`)."""
    if not tokenizes(req):
        budget = check_fits(len(req.prompt), req, limits)
        return check_ids(req.prompt, limits, "prompt"), budget
    return prompt_ids(enc, req, limits)


def check_ids(ids: list[int], limits: Limits, field: str) -> list[int]:
    """Token ids all inside the engine's vocabulary, or a 400 quoting the first few outside it."""
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(400, f"{field}: token ids must lie in [0, {limits.vocab_size}), got {quote(bad[:4])}",
                           field)
    return ids
