"""`python -m runner.serve`: an OpenAI-compatible HTTP server over one loaded artifact, K chosen per request.

    python -m runner.serve --pte model.pte --tokenizer tokenizer.json              # http://127.0.0.1:8000/v1
    python -m runner.serve --pte model.pte --tokenizer tokenizer.json --port 9000 --api-key SECRET --policy adaptive
    python -m runner.serve --engine cuda --target TARGET_DIR --draft DRAFT_DIR --tokenizer TARGET_DIR/tokenizer.json \
        --max-m 8 --chain 4 --max-prefill-chunk 128
    python -m pipeline +stage=serve                    # the artifacts the config names, as the eval stage loads them

Endpoints: POST /v1/completions, POST /v1/chat/completions (the target's chat template: chat_template.jinja
beside the tokenizer, which is how the target artifact holds it), GET /v1/models, GET /metrics (Prometheus),
GET /health. Streaming (`"stream": true`) sends server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`; `stream_options.include_usage` adds the usage chunk. A stream sends the first token at once,
then the text of the rounds since its last chunk at most every `stream_interval_s` (50 ms): each chunk wakes
the event loop, whose work competes with the rounds for the GIL (on the embedded default's 1 ms rounds, streams
decoded 5-9% slower than whole answers at 20 ms, 0-4% at 50 ms). Request fields: max_tokens (default: the
room left in the cache), stop (up to 4 strings; the text ends before the first one), temperature (default the
server's, 0 = greedy: unlike OpenAI's 1, so that a plain request is lossless), seed; and two extensions:
`chain` (K in [0, max_m-1]; default the artifact's get_chain_len or the server's --chain) and `policy`
(static | adaptive; default the server's). `usage` carries, besides OpenAI's token counts, `chain` (the K
asked for), `policy`, `rounds`, `tau` (tokens per round), `acceptance_rate` and `tokens_per_s` (the decode rate
after the first token, as the eval stage measures it).

The text of a request is the same at every K at temperature 0: the tokens are (runner.generate), and the text
is decoded one token at a time (`TextStream`), however the rounds group the tokens.

One request decodes at a time (the engine's KV caches are shared), on one worker thread, behind a queue of
`queue_size` waiting requests: one more is answered 429 with Retry-After. A request whose prompt and max_tokens
cannot fit the cache is refused with 400 before it queues. A client that disconnects frees the engine after the
round in flight (runner.generate's `on_tokens` returns False); one that leaves while queued is skipped. A
malformed body, a field of the wrong type or range, an unknown model or an oversized body gets a 4xx whose
message names the field; an engine error fails that request with 500, never the server. SIGTERM or SIGINT
stops accepting connections and lets the requests in flight finish (up to `drain_s`), then exits 0.

Binds 127.0.0.1 unless told otherwise. With an API key (--api-key, or the EAGLE3_API_KEY environment
variable) every /v1 request needs `Authorization: Bearer <key>`; /metrics and /health stay open, as vLLM's.

/metrics uses vLLM's names where the meaning is the same: vllm:num_requests_running / _waiting,
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (per round: a round emits its tokens at
once), vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds, vllm:prompt_tokens,
vllm:generation_tokens, vllm:request_success{finished_reason}, vllm:spec_decode_num_drafts (rounds with
K > 0), vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens and
vllm:spec_decode_num_accepted_tokens_per_pos{position}; and eagle3:requests_refused{reason} (queue_full is the
429s), which vLLM has no name for.

Not here: batching several requests into one forward (the .pte has one KV cache), n > 1, logprobs, tools.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from starlette.exceptions import HTTPException

from models.text import render_chat, stop_ids
from runner.cuda_engine import QUANTS
from runner.generate import GenerationResult, generate
from runner.policy import POLICIES

log = logging.getLogger(__name__)

API_KEY_ENV = "EAGLE3_API_KEY"
MAX_STOPS = 4  # OpenAI's limit on `stop`
SWITCH_INTERVAL_S = 5e-4  # the server process's GIL switch interval (run_server)
# Fields of OpenAI's API this server does not implement: refused unless they hold one of their neutral values.
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
               "top_p": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none")}


# ----------------------------------------------------------------------------------------------------------
# Settings and errors


@dataclass
class Settings:
    """What the server does by default and what it accepts; a request may override chain, policy,
    temperature and seed."""

    model: str
    chain: int | None = None  # None = the engine's default_chain (the .pte's get_chain_len)
    policy: str = "static"
    temperature: float = 0.0
    seed: int = 0
    stop: tuple = ()  # stop tokens besides the tokenizer's end tokens (models.text.stop_ids)
    api_key: str | None = None
    queue_size: int = 16  # requests waiting behind the one decoding
    max_body_bytes: int = 1 << 20
    stream_interval_s: float = 0.05  # a stream sends the text of the rounds since its last chunk at most this often


class RequestError(Exception):
    """A request refused: the HTTP status, a message naming the field (`param`), and extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, *, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise RequestError(400, f"{name}: expected an integer in {span}, got {v!r}", name)
    return v


def _number(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not lo <= v <= hi:
        raise RequestError(400, f"{name}: expected a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(400, f"{name}: expected true or false, got {v!r}", name)
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(400, f"stop: expected a non-empty string or a list of up to {MAX_STOPS} of them, "
                           f"got {v!r}", "stop")
    return stops


# ----------------------------------------------------------------------------------------------------------
# Text: the tokens of a generation as text, one token at a time, and stop strings


class TextStream:
    """The text of a generation as its tokens arrive, built one token at a time so that it does not depend on
    how the rounds group them. Each token is decoded with the tokens before it from the last released point
    (at first, a few prompt tokens, so that a leading space comes out right), and held back while the text
    ends in an incomplete UTF-8 character: the incremental detokenisation of vLLM and TGI. Written here
    rather than with tokenizers' DecodeStream, which raises where a decoder rewrites the text before a new
    token; this one takes the new characters as they are. The text ends before the first occurrence of a stop
    string (`stopped`; `n_tokens` counts the tokens up to the one that completed it); while the generation
    runs, a tail that could still grow into a stop string is held back from `take`."""

    CONTEXT = 5  # prompt tokens decoded before the first new one

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.text, self.sent, self.n_tokens, self.stopped, self.done = "", 0, 0, False, False

    def _decode(self, final: bool = False) -> None:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            checked = len(self.text)
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            if self.stops:
                self._find_stop(checked)

    def _find_stop(self, checked: int) -> None:
        hits = [i for s in self.stops if (i := self.text.find(s, max(0, checked - len(s) + 1))) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def push(self, ids: list[int]) -> None:
        for t in ids:
            if self.stopped:
                return
            self.ids.append(int(t))
            self.n_tokens += 1
            self._decode()

    def finish(self) -> None:
        """The generation ended: release what was held back (an incomplete character decodes as U+FFFD), and
        nothing waits for a stop string any more."""
        if not self.stopped and self.read < len(self.ids):
            self._decode(final=True)
        self.done = True

    def take(self) -> str:
        """The text not yet taken, short of a tail that is the start of a stop string."""
        ready = len(self.text)
        if not (self.stopped or self.done):
            for s in self.stops:
                ready = min(ready, len(self.text) - max((k for k in range(len(s), 0, -1) if self.text.endswith(s[:k])),
                                                        default=0))
        out, self.sent = self.text[self.sent:ready], max(self.sent, ready)
        return out


# ----------------------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """The Prometheus series (module doc), in a registry of their own (one per server). The series labelled by
    the model only are held as its children: labelling costs a lock and a lookup, and some are set every round."""

    LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0, 160.0, 640.0)

    def __init__(self, model: str):
        disable_created_metrics()  # no `_created` twin of every series (vLLM's choice too)
        self.registry = r = CollectorRegistry()
        self.model = model

        def one(kind, name: str, doc: str, **kw):
            return kind(name, doc, ["model_name"], registry=r, **kw).labels(model_name=model)

        def hist(name: str, doc: str):
            return one(Histogram, name, doc, buckets=self.LATENCY)

        self.running = one(Gauge, "vllm:num_requests_running", "Requests decoding (at most 1).")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Requests queued behind the one decoding.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to the first token (queue included).")
        self.itl = hist("vllm:inter_token_latency_seconds", "Between successive rounds' tokens of a request.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue_time = hist("vllm:request_queue_time_seconds", "Arrival to the start of decoding.")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.drafts = one(Counter, "vllm:spec_decode_num_drafts", "Rounds that drafted (K > 0).")
        self.draft_tokens = one(Counter, "vllm:spec_decode_num_draft_tokens", "Proposals drafted.")
        self.accepted = one(Counter, "vllm:spec_decode_num_accepted_tokens", "Proposals accepted.")
        self._accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Proposals accepted at each position of a round's chain.",
                                         ["model_name", "position"], registry=r)
        self._success = Counter("vllm:request_success", "Requests finished.", ["model_name", "finished_reason"],
                                registry=r)
        self._refused = Counter("eagle3:requests_refused", "Requests refused before decoding (queue_full = 429).",
                                ["model_name", "reason"], registry=r)

    def success(self, reason: str) -> None:
        self._success.labels(model_name=self.model, finished_reason=reason).inc()

    def refused(self, reason: str) -> None:
        self._refused.labels(model_name=self.model, reason=reason).inc()

    def finished(self) -> dict[str, int]:
        """{finish reason: requests}, as vllm:request_success counts them."""
        return {s.labels["finished_reason"]: int(s.value) for metric in self._success.collect()
                for s in metric.samples if s.name.endswith("_total")}

    def record_rounds(self, res: GenerationResult) -> None:
        drafted = [(k, a) for k, a in zip(res.chain_per_round, res.accepted) if k > 0]
        self.drafts.inc(len(drafted))
        self.draft_tokens.inc(sum(k for k, _ in drafted))
        self.accepted.inc(sum(a for _, a in drafted))
        for pos, n in enumerate(sum(a > i for _, a in drafted) for i in range(max((a for _, a in drafted), default=0))):
            self._accepted_per_pos.labels(model_name=self.model, position=str(pos)).inc(n)


# ----------------------------------------------------------------------------------------------------------
# One request, and the decoder that runs them one at a time


@dataclass
class Job:
    """One admitted request: what to generate, and the queue its events reach the handler by."""

    prompt: list[int]
    max_tokens: int
    chain: int
    policy: str
    temperature: float
    seed: int
    stops: list[str]
    stream: bool
    arrival: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening
            pass


def finish_reason(res: GenerationResult | None, text: TextStream) -> str:
    if text.stopped or (res is not None and res.stop_reason == "stop_token"):
        return "stop"
    if res is None or res.stop_reason == "caller":
        return "abort"
    return "length"  # the token budget, or the end of the cache


class Decoder:
    """One engine, one request decoding at a time on one worker thread, `queue_size` more waiting. Events of
    a job (on its asyncio queue): ("text", str) chunks (a stream's at most every stream_interval_s: each one
    wakes the event loop, whose work then competes with the rounds for the GIL; a whole request's text at
    the end), then ("done", result, text) or ("error", exception). The per-round hook does as little as it
    can (every microsecond there is a share of a 1 ms round on the embedded default): the text is decoded
    per round only for stop strings, and the latency histograms are filled once the request is done."""

    def __init__(self, engine, tokenizer, settings: Settings, metrics: Metrics):
        self.engine, self.tokenizer, self.settings, self.metrics = engine, tokenizer, settings, metrics
        self.stop_ids = stop_ids(tokenizer, settings.stop)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self.admitted = 0  # decoding + waiting; touched on the event loop only
        self.service_s = 1.0  # a fading mean of the seconds a request holds the engine (for Retry-After)

    def admit(self) -> None:
        if self.admitted >= 1 + self.settings.queue_size:
            self.metrics.refused("queue_full")
            retry = max(1, math.ceil(self.service_s * self.admitted))
            raise RequestError(429, f"the queue is full ({self.settings.queue_size} requests wait behind the one "
                               f"decoding); retry in {retry} s", kind="rate_limit_error",
                               headers={"Retry-After": str(retry)})
        self.admitted += 1
        self.metrics.waiting.set(self.admitted - 1)

    def _release(self, held_s: float) -> None:
        self.admitted -= 1
        self.service_s = 0.8 * self.service_s + 0.2 * held_s
        self.metrics.waiting.set(max(self.admitted - 1, 0))

    def submit(self, job: Job) -> None:
        """Queue an admitted job; its slot is freed when the worker is done with it."""
        def run():
            t0 = time.perf_counter()
            try:
                self._run(job)
            except Exception as e:  # the request fails, the server does not
                log.exception("decoding failed")
                self.metrics.success("error")
                job.post("error", e)
            finally:
                try:
                    job.loop.call_soon_threadsafe(self._release, time.perf_counter() - t0)
                except RuntimeError:  # the loop has closed
                    pass

        self.worker.submit(run)

    def _run(self, job: Job) -> None:
        m = self.metrics
        text = TextStream(self.tokenizer, job.prompt, job.stops)
        if job.cancelled.is_set():  # its client left while it waited
            m.success("abort")
            job.post("done", None, text)
            return
        start = time.perf_counter()
        m.running.set(1)
        times: list[float] = []  # when each round's tokens came (the metrics are recorded after the request)
        held: list[int] = []  # tokens not detokenised yet
        sent = None

        def on_tokens(ids: list[int]) -> bool:
            """Per round, as little as it can: detokenise only for a stop string or a stream's next chunk."""
            nonlocal sent
            now = time.perf_counter()
            times.append(now)
            held.extend(ids)
            flush = job.stream and (sent is None or now - sent >= self.settings.stream_interval_s)
            if flush or job.stops:
                text.push(held)
                held.clear()
            if flush and ((chunk := text.take()) or sent is None):  # the first chunk marks the first token
                job.post("text", chunk)
                sent = now
            return not (text.stopped or job.cancelled.is_set())

        try:
            res = generate(self.engine, job.prompt, chain=job.chain, max_new_tokens=job.max_tokens,
                           stop_ids=self.stop_ids, temperature=job.temperature, seed=job.seed, policy=job.policy,
                           on_tokens=on_tokens)
        finally:
            m.running.set(0)
        text.push(held)
        text.finish()
        if chunk := text.take():  # a whole request's text goes out here unless it streams
            job.post("text", chunk)
        m.queue_time.observe(start - job.arrival)
        if times:
            m.ttft.observe(times[0] - job.arrival)
        for a, b in zip(times, times[1:]):
            m.itl.observe(b - a)
        m.e2e.observe(time.perf_counter() - job.arrival)
        m.prompt_tokens.inc(len(job.prompt))
        m.generation_tokens.inc(len(res.output_ids))
        m.success(finish_reason(res, text))
        m.record_rounds(res)
        job.post("done", res, text)

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)


def usage(job: Job, res: GenerationResult | None, text: TextStream) -> dict:
    completion = text.n_tokens if text.stopped else (len(res.output_ids) if res is not None else text.n_tokens)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion,
            "total_tokens": len(job.prompt) + completion, "chain": job.chain, "policy": job.policy,
            "rounds": res.rounds if res is not None else 0, "tau": res.tau if res is not None else 0.0,
            "acceptance_rate": res.acceptance_rate if res is not None else 0.0,
            "tokens_per_s": res.tokens_per_s if res is not None else 0.0}


# ----------------------------------------------------------------------------------------------------------
# The HTTP application


def create_app(engine, tokenizer, settings: Settings, *, chat_template: str | None = None):
    """The FastAPI application over a loaded engine (any runner.engine.Engine) and its tokenizer."""
    meta = engine.meta
    max_k = meta["max_m"] - 1
    default_chain = meta["default_chain"] if settings.chain is None else settings.chain
    if not 0 <= default_chain <= max_k:
        raise ValueError(f"chain K={default_chain} is outside [0, {max_k}] of this engine (max_m={meta['max_m']})")
    if settings.policy not in POLICIES:
        raise ValueError(f"policy {settings.policy!r}: expected one of {', '.join(POLICIES)}")
    metrics = Metrics(settings.model)
    decoder = Decoder(engine, tokenizer, settings, metrics)

    async def lifespan(app):
        yield
        decoder.close()

    app = FastAPI(title="eagle3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.decoder = decoder

    @app.exception_handler(RequestError)
    async def refused(request, e: RequestError):
        if e.status != 429:
            metrics.refused("invalid" if e.status < 500 else "error")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(RequestError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def failed(request, e: Exception):
        log.exception("request failed")
        return JSONResponse(RequestError(500, f"internal error: {type(e).__name__}: {e}",
                                         kind="server_error").body(), status_code=500)

    def authorise(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise RequestError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                               kind="authentication_error")

    async def read_body(request: Request) -> dict:
        limit = settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise RequestError(413, f"the request body has {length} bytes; the limit is {limit}")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise RequestError(413, f"the request body exceeds the limit of {limit} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    def decoding_failed(e: Exception) -> RequestError:
        return RequestError(500, f"decoding failed: {type(e).__name__}: {e}", kind="server_error")

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name is not None and name != settings.model:
            raise RequestError(404, f"model: {name!r} is not served here; this server serves {settings.model!r}",
                               "model", kind="not_found_error")

    def check_ids(ids: list[int], name: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < meta["vocab_size"]]
        if bad:
            raise RequestError(400, f"{name}: token ids must lie in [0, {meta['vocab_size']}), got {bad[:4]}", name)
        return ids

    def completion_prompt(body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str) and p:
            return check_ids(tokenizer.encode(p, add_special_tokens=False).ids, "prompt")
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            return check_ids(list(p), "prompt")
        raise RequestError(400, "prompt: expected one non-empty string or list of token ids (one prompt per "
                           f"request), got {json.dumps(p)[:80] if p is not None else 'nothing'}", "prompt")

    def chat_prompt(body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages: expected a non-empty list of {role, content} objects", "messages")
        plain = []
        for i, msg in enumerate(messages):
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list):  # content parts: only text ones
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise RequestError(400, f"messages[{i}].content: only text parts are supported",
                                       f"messages[{i}].content")
                content = "".join(c["text"] for c in content)
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(content, str):
                raise RequestError(400, f"messages[{i}]: expected {{\"role\": string, \"content\": string}}, "
                                   f"got {json.dumps(msg)[:80]}", f"messages[{i}]")
            plain.append({"role": msg["role"], "content": content})
        if chat_template is None:
            raise RequestError(400, "this model has no chat template (no chat_template.jinja beside its "
                               "tokenizer): use /v1/completions", "messages")
        try:
            text = render_chat(chat_template, plain, tokenizer)
        except Exception as e:  # the template's own checks (e.g. roles must alternate) raise here
            raise RequestError(400, f"messages: the chat template refused them ({e})", "messages") from None
        return check_ids(tokenizer.encode(text, add_special_tokens=False).ids, "messages")

    def make_job(body: dict, prompt: list[int], budget_field: str, stream: bool) -> Job:
        for name, neutral in UNSUPPORTED.items():
            if name in body and body[name] not in neutral:
                raise RequestError(400, f"{name}: not supported by this server (only {neutral[-1]!r})", name)
        room = meta["max_seq_len"] - len(prompt)
        max_tokens = _int(body, budget_field, None, 1)
        if max_tokens is None and room < 1:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens: no room to generate in this model's "
                               f"max_seq_len={meta['max_seq_len']}", budget_field)
        max_tokens = room if max_tokens is None else max_tokens
        if len(prompt) + max_tokens > meta["max_seq_len"]:
            raise RequestError(400, f"{budget_field}: the prompt's {len(prompt)} tokens + {budget_field}="
                               f"{max_tokens} exceed this model's max_seq_len={meta['max_seq_len']} (at most "
                               f"{max(room, 0)} for this prompt)", budget_field)
        policy = body.get("policy", settings.policy)
        if policy not in POLICIES:
            raise RequestError(400, f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}", "policy")
        return Job(prompt=prompt, max_tokens=max_tokens, chain=_int(body, "chain", default_chain, 0, max_k),
                   policy=policy, temperature=_number(body, "temperature", settings.temperature, 0.0, 2.0),
                   seed=_int(body, "seed", settings.seed, 0, 2 ** 63 - 1), stops=_stops(body), stream=stream,
                   arrival=time.perf_counter(), loop=asyncio.get_running_loop())

    async def events_of(job: Job, request: Request):
        """The job's events until it is done (read it under contextlib.aclosing); a client that disconnects
        cancels the job, which stops at the next round."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancelled.set()

        watcher = asyncio.create_task(watch())
        try:
            while True:
                event = await job.events.get()
                yield event
                if event[0] != "text":
                    return
        finally:
            job.cancelled.set()  # a no-op once it is done; stops it when the stream was abandoned
            watcher.cancel()

    async def respond(request: Request, chat: bool):
        authorise(request)
        body = await read_body(request)
        check_model(body)
        stream = _bool(body, "stream", False)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, f"stream_options: expected an object, got {options!r}", "stream_options")
        include_usage = _bool(options, "include_usage", False)
        prompt = chat_prompt(body) if chat else completion_prompt(body)
        job = make_job(body, prompt, "max_completion_tokens" if chat and "max_completion_tokens" in body
                       else "max_tokens", stream)
        decoder.admit()
        decoder.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "created": created, "model": settings.model}

        def choice(content: str | None, reason: str | None, *, whole: bool = False) -> dict:
            """A choice of the response (`whole`) or of a chunk; a chat chunk's delta is empty at the end."""
            if not chat:
                return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": reason}
            key, value = (("message", {"role": "assistant", "content": content}) if whole else
                          ("delta", {} if content is None else {"content": content}))
            return {"index": 0, key: value, "logprobs": None, "finish_reason": reason}

        if not stream:
            parts, res, text = [], None, None
            async with contextlib.aclosing(events_of(job, request)) as events:
                async for event in events:
                    if event[0] == "error":
                        raise decoding_failed(event[1])
                    if event[0] == "text":
                        parts.append(event[1])
                    else:
                        _, res, text = event
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice("".join(parts), finish_reason(res, text), whole=True)],
                                 "usage": usage(job, res, text)})

        obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def chunks():
            if chat:  # the role comes first, as OpenAI's streams send it
                opening = choice("", None)
                opening["delta"]["role"] = "assistant"
                yield sse({**head, "object": obj, "choices": [opening]})
            async with contextlib.aclosing(events_of(job, request)) as events:
                async for event in events:
                    if event[0] == "text":
                        yield sse({**head, "object": obj, "choices": [choice(event[1], None)]})
                    elif event[0] == "error":
                        yield sse(decoding_failed(event[1]).body())
                    else:
                        _, res, text = event
                        yield sse({**head, "object": obj, "choices": [choice(None, finish_reason(res, text))]})
                        if include_usage:
                            yield sse({**head, "object": obj, "choices": [], "usage": usage(job, res, text)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "eagle3", "max_model_len": meta["max_seq_len"],
                                            "max_chain": max_k, "default_chain": default_chain}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def warm_up(engine, chain: int | None) -> None:
    """One short generation at K = 0 and at the default K: the first calls allocate and initialise the
    delegates, which would otherwise land on the first request's latency."""
    prompt = [1] * min(engine.meta["max_prefill_chunk"], engine.meta["max_seq_len"] // 2)
    for k in dict.fromkeys((0, engine.meta["default_chain"] if chain is None else chain)):
        generate(engine, prompt, chain=k, max_new_tokens=4)


def run_server(app, host: str = "127.0.0.1", port: int = 8000, *, drain_s: float = 30.0, ready=None) -> None:
    """Serve `app` until SIGTERM or SIGINT, then let the requests in flight finish (up to `drain_s` seconds)
    and return. `ready(url)` is called once the socket listens (port 0 picks a free one)."""
    import uvicorn

    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it Nagle holds a
    # small chunk back until the client's delayed ACK (40 ms) of the segment before it
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=drain_s,
                            lifespan="on")
    server = uvicorn.Server(config)
    # The decoding thread holds the GIL between engine calls and takes it back as soon as a call returns, so
    # the event loop gets it only when the switch interval forces a hand-over: at Python's 5 ms a stream's
    # chunk left 8-13 ms after it was ready, at 0.5 ms within 0.25 ms (the embedded default at K=7, 2 cores).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Everything loaded so far (torch, the runtime, the app: ~250k objects) lives as long as the process: out
    # of the collector's sight, a full collection no longer stalls every thread for ~150 ms while it scans them.
    gc.collect()
    gc.freeze()
    bound = sock.getsockname()[1]
    if ready is not None:
        ready(f"http://{host}:{bound}/v1")
    main = threading.current_thread() is threading.main_thread()
    # uvicorn re-raises the signal that stopped it once it has drained; a stopped server is a normal end
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()


# ----------------------------------------------------------------------------------------------------------
# The command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.serve", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("pte", "cuda"), default="pte")
    p.add_argument("--pte", type=Path, help="the .pte (--engine pte)")
    p.add_argument("--exact-width", type=int, default=None, metavar="W",
                   help="--engine pte: exact mode (runtime.exact_width), every target call W rows, every K gives "
                        "K=0's tokens bit for bit; W in [2, max_m]")
    p.add_argument("--tokenizer", required=True, type=Path, help="tokenizer.json (the target artifact's)")
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template; default: chat_template.jinja "
                   "beside the tokenizer, if there is one")
    p.add_argument("--model-name", help="the id /v1/models lists and requests name; default: the .pte's path "
                   "(--engine cuda: the draft's)")
    p.add_argument("--chain", type=int, default=None, help="the default K of a request, in [0, max_m-1]; "
                   "default: the .pte's get_chain_len (required with --engine cuda)")
    p.add_argument("--policy", choices=POLICIES, default=Settings.policy, help="the default policy of a request")
    p.add_argument("--temperature", type=float, default=Settings.temperature,
                   help="the default temperature of a request")
    p.add_argument("--seed", type=int, default=Settings.seed, help="the default seed of a request")
    p.add_argument("--stop", nargs="*", default=[], help="extra stop tokens (strings or ids), for every request")
    p.add_argument("--threads", type=int, default=None,
                   help="the runtime's CPU threads (default: the cores this process may use)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer <key>' on /v1 (default: ${API_KEY_ENV})")
    p.add_argument("--queue-size", type=int, default=Settings.queue_size,
                   help="requests that may wait behind the one decoding")
    p.add_argument("--max-body-bytes", type=int, default=Settings.max_body_bytes)
    p.add_argument("--drain-s", type=float, default=30.0, help="on SIGTERM: how long requests in flight may finish")
    p.add_argument("--stream-interval-s", type=float, default=Settings.stream_interval_s,
                   help="a stream sends a chunk at most this often (the first token at once)")
    cuda = p.add_argument_group("--engine cuda: the target and draft artifacts, in the export's call windows")
    cuda.add_argument("--target", type=Path)
    cuda.add_argument("--draft", type=Path)
    cuda.add_argument("--max-m", type=int)
    cuda.add_argument("--max-prefill-chunk", type=int)
    cuda.add_argument("--min-prefill-chunk", type=int)
    cuda.add_argument("--device", default="cuda")
    cuda.add_argument("--quant", choices=tuple(QUANTS), default="none",
                      help="the weights: bf16, or the INT4 GPU kernels (runtime.cuda_quant; runner.cuda_engine.QUANTS)")
    cuda.add_argument("--no-exact", dest="exact", action="store_false", help="decode at T=1 (runtime.exact=false)")
    cuda.add_argument("--compile", choices=("none", "inductor"), default="none",
                      help="torch.compile the dense engine's calls before capture (runtime.cuda_compile)")
    args = p.parse_args(argv)
    if args.queue_size < 0 or args.max_body_bytes < 1 or args.drain_s < 0 or args.stream_interval_s < 0:
        p.error("--queue-size must be >= 0, --max-body-bytes >= 1, --drain-s and --stream-interval-s >= 0")

    from tokenizers import Tokenizer

    from models.text import load_chat_template

    if args.engine == "pte":
        if args.pte is None:
            p.error("--engine pte needs --pte")
        from runner.engine import ExactEngine, PteEngine, set_threads

        set_threads(args.threads)
        engine = PteEngine(args.pte, tokenizer=args.tokenizer)  # first: a .pte unlike its manifest is refused
        if args.exact_width is not None:
            engine = ExactEngine(engine, args.exact_width)
        model = args.model_name or str(args.pte)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("target", "draft", "max_m", "max_prefill_chunk", "chain")
                   if getattr(args, k) is None]
        if missing:
            p.error(f"--engine cuda needs {' '.join(missing)}")
        from runner.cuda_engine import load_cuda_engine

        windows = dict(max_m=args.max_m, default_chain=args.chain, max_prefill_chunk=args.max_prefill_chunk,
                       min_prefill_chunk=args.min_prefill_chunk or args.max_m + 1)
        engine = load_cuda_engine(args.target, args.draft, windows=windows, device=args.device,
                                  quant=args.quant, exact=args.exact, compile=args.compile)
        model = args.model_name or str(args.draft)
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    template = (args.chat_template.read_text(encoding="utf-8") if args.chat_template
                else load_chat_template(args.tokenizer.parent))
    settings = Settings(model=model, chain=args.chain, policy=args.policy, temperature=args.temperature,
                        seed=args.seed, stop=tuple(args.stop), api_key=args.api_key or None,
                        queue_size=args.queue_size, max_body_bytes=args.max_body_bytes,
                        stream_interval_s=args.stream_interval_s)
    app = create_app(engine, tokenizer, settings, chat_template=template)
    warm_up(engine, args.chain)
    run_server(app, args.host, args.port, drain_s=args.drain_s,
               ready=lambda url: print(f"serving {model} at {url}" + (" (API key required)" if settings.api_key
                                                                       else ""), flush=True))
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:  # refusals (a changed .pte, K out of range) read as one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
