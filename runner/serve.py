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
decoded 5-9% slower than whole answers at 20 ms, 0-4% at 50 ms). Request fields (runner.requests): max_tokens
(default: the room left in the cache), stop (up to 4 strings; the text ends before the first one), temperature
(default the server's, 0 = greedy: unlike OpenAI's 1, so that a request that sets none is lossless), seed; and three
extensions: `chain` (K in [0, max_m-1]; default the artifact's get_chain_len or the server's --chain), `policy`
(static | adaptive; default the server's) and, for a completion, `parse_special` (true: the special-token
strings of its prompt are control tokens; by default they are text, as in a chat's messages). `usage` carries,
besides OpenAI's token counts, `chain` (the K asked for), `policy`, `rounds`, `tau` (tokens per round),
`acceptance_rate` and `tokens_per_s` (the decode rate after the first token, as the eval stage measures it).

The text of a request is the same at every K at temperature 0: the tokens are (runner.generate), and the text
is decoded one token at a time (`TextStream`), however the rounds group the tokens.

No client holds up another. One request decodes at a time (the engine's KV caches are shared), on one worker
thread, behind a queue of `queue_size` live requests: one more is answered 429 with Retry-After. The event
loop only moves bytes: a body is parsed, a chat template rendered and a prompt tokenized on worker threads
(runner.requests), and a text prompt that cannot fit the cache is refused by its byte length before it is
tokenized. A client that disconnects takes its request out of the queue at once, or frees the engine after
the round in flight (runner.generate's `on_tokens` returns False). A connection must send a whole request head
within `idle_timeout_s` of opening or of its last answer (idle and slowloris sockets are closed), and its body
within `body_timeout_s` (408); a request line longer than `max_url_bytes` gets 414, a head longer than
`max_header_bytes` 431 (`HttpProtocol`).

Every error is the client's or says it is ours: a malformed body (JSON, UTF-8, nesting, lone surrogates), a
field of the wrong type or range, an unknown model or an oversized body gets a 4xx whose message names the
field and quotes at most a few hundred characters of the value; only a fault of the server is a 500, in the
same JSON shape (an engine error fails that request, never the server), and a stream cut by one ends with an
SSE error event. SIGTERM or SIGINT stops accepting connections and lets the requests in flight finish, up to
`drain_s`; then those left are answered 503 (a stream: an error event) and the process exits 0. The chat
template and the defaults of a request are checked at start-up.

Binds 127.0.0.1 unless told otherwise, before the program loads (a port in use is refused at once). With an
API key (--api-key, or the EAGLE3_API_KEY environment variable) every /v1 request needs `Authorization: Bearer
<key>`; /metrics and /health stay open, as vLLM's.

/metrics uses vLLM's names where the meaning is the same: vllm:num_requests_running / _waiting,
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (per round: a round emits its tokens at
once), vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds, vllm:prompt_tokens,
vllm:generation_tokens, vllm:request_success{finished_reason}, vllm:spec_decode_num_drafts (rounds with
K > 0), vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens and
vllm:spec_decode_num_accepted_tokens_per_pos{position}; and eagle3:requests_refused{reason} (queue_full is the
429s, invalid the other 4xx, shutdown the 503s of the drain, error the 500s), which vLLM has no name for.

Not here: batching several requests into one forward (the .pte has one KV cache), n > 1, logprobs, tools.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
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

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from models.text import stop_ids
from models.choices import POLICIES
from runner import cli
from runner.build import add_engine_arguments, build_engine, engine_options
from runner.generate import GenerationResult, generate
from runner.requests import (MAX_SEED, MAX_TEMPERATURE, GenerationRequest, Limits, RequestError, check_api_key,
                             check_body_length, check_chat_template, check_prompt_bytes, encoder, parse_body,
                             parse_request, prompt_and_budget, quote, tokenizes)

log = logging.getLogger(__name__)

API_KEY_ENV = "EAGLE3_API_KEY"
SWITCH_INTERVAL_S = 5e-4  # the server process's GIL switch interval (run_server)
OFF_LOOP_THREADS = 2  # threads that parse bodies, render chat templates and tokenize prompts
CUT_GRACE_S = 2.0  # after the drain: the time the requests it ended have to send their error before uvicorn cancels
GONE = 499  # the status of an answer to a client that has left (nginx's): nobody reads it


# ----------------------------------------------------------------------------------------------------------
# Settings


@dataclass
class Settings:
    """What the server does by default and what it accepts; a request may override chain, policy,
    temperature and seed. The timeouts and head limits are uvicorn's defaults (a keep-alive of 5 s, h11's
    16 KB head) and nginx's (an 8 KB request line); uvicorn has no body timeout, nginx's is 60 s between reads,
    this one is 30 s for the whole body."""

    model: str
    chain: int | None = None  # None = the engine's default_chain (the .pte's get_chain_len)
    policy: str = "static"
    temperature: float = 0.0
    seed: int = 0
    stop: tuple = ()  # stop tokens besides the tokenizer's end tokens (models.text.stop_ids)
    api_key: str | None = None
    queue_size: int = 16  # live requests besides the one decoding
    max_body_bytes: int = 1 << 20
    stream_interval_s: float = 0.05  # a stream sends the text of the rounds since its last chunk at most this often
    body_timeout_s: float = 30.0  # a request's body must arrive whole within this, or 408
    idle_timeout_s: float = 5.0  # a connection's next request head must arrive whole within this, or it is closed
    max_url_bytes: int = 8192  # the request line (method, URL, version); longer: 414
    max_header_bytes: int = 16384  # the request head (request line and headers); longer: 431


def check_settings(s: Settings) -> None:
    """Refuse settings a request could not have (a ValueError naming the setting, the value and the range), at
    start-up: a default temperature of 5 would be the default of requests that may ask for at most 2."""
    ranges = {"temperature": (0.0, MAX_TEMPERATURE), "seed": (0, MAX_SEED), "queue_size": (0, None),
              "max_body_bytes": (1, None), "stream_interval_s": (0.0, None), "body_timeout_s": (1e-3, None),
              "idle_timeout_s": (1e-3, None), "max_url_bytes": (64, None), "max_header_bytes": (64, None)}
    for name, (lo, hi) in ranges.items():
        v = getattr(s, name)
        whole = isinstance(lo, int)
        ok = (isinstance(v, int) and not isinstance(v, bool) if whole else
              isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
        if not ok or v < lo or (hi is not None and v > hi):
            span = f"[{lo}, {'inf' if hi is None else hi}]"
            raise ValueError(f"{name}={v!r}: expected {'an integer' if whole else 'a number'} in {span}")
    if s.max_header_bytes < s.max_url_bytes:
        raise ValueError(f"max_header_bytes={s.max_header_bytes} is less than max_url_bytes={s.max_url_bytes}: the "
                         "head holds the request line")
    if s.policy not in POLICIES:
        raise ValueError(f"policy={s.policy!r}: expected one of {', '.join(POLICIES)}")


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


@dataclass(eq=False)
class Job:
    """One admitted request: its fields, the prompt once tokenized, and the queue its events reach the handler
    by. `state`: admitted (being tokenized) -> queued -> running -> done, or gone (left before it ran: its
    client disconnected, the request was refused or the drain ended it); it changes under the decoder's lock."""

    req: GenerationRequest
    arrival: float
    loop: asyncio.AbstractEventLoop
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    state: str = "admitted"
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


def decoding_failed(e: Exception) -> RequestError:
    return RequestError(500, f"decoding failed: {type(e).__name__}: {quote(str(e))}", kind="server_error")


class Decoder:
    """One engine, one request decoding at a time on one worker thread, at most `queue_size` more live ones:
    admitted (being tokenized) or queued. The live set counts requests whose client is still there: one that
    leaves before it runs leaves the queue at once (`release`). Events of a job (on its asyncio queue):
    ("text", str) chunks (a stream's at most every stream_interval_s: each one wakes the event loop, whose work
    then competes with the rounds for the GIL; a whole request's text at the end), then ("done", result,
    text), ("error", RequestError) or ("gone",) (its client left). The per-round hook does as little as it can
    (every microsecond there is a share of a 1 ms round on the embedded default): the text is decoded per round
    only for stop strings, and the latency histograms are filled once the request is done."""

    def __init__(self, engine, tokenizer, settings: Settings, metrics: Metrics):
        self.engine, self.tokenizer, self.settings, self.metrics = engine, tokenizer, settings, metrics
        self.stop_ids = stop_ids(tokenizer, settings.stop)
        self.jobs: set[Job] = set()  # the live ones; touched on the event loop only
        self.waiting: collections.deque[Job] = collections.deque()  # queued for the worker, under `lock`
        self.lock = threading.Condition()
        self.closing = False
        self.stopped: RequestError | None = None  # the drain has ended: every request gets this
        self.service_s = 1.0  # a fading mean of the seconds a request holds the engine (for Retry-After)
        self.worker = threading.Thread(target=self._work, name="decode", daemon=True)
        self.worker.start()

    @property
    def live(self) -> int:
        return len(self.jobs)

    def admit(self, req: GenerationRequest) -> Job:
        """A slot for a request (on the event loop), or 429 when `1 + queue_size` requests are live."""
        if self.stopped is not None:
            raise self.stopped
        if len(self.jobs) >= 1 + self.settings.queue_size:
            self.metrics.refused("queue_full")
            retry = max(1, math.ceil(self.service_s * len(self.jobs)))
            raise RequestError(429, f"the queue is full ({self.settings.queue_size} requests wait behind the one "
                               f"decoding); retry in {retry} s", kind="rate_limit_error",
                               headers={"Retry-After": str(retry)})
        job = Job(req, arrival=time.perf_counter(), loop=asyncio.get_running_loop())
        self.jobs.add(job)
        self.metrics.waiting.set(max(len(self.jobs) - 1, 0))
        return job

    def submit(self, job: Job, prompt: list[int], max_tokens: int) -> None:
        """Queue a tokenized job, unless it left while it was tokenized."""
        with self.lock:
            if job.state != "admitted":
                return
            job.prompt, job.max_tokens, job.state = prompt, max_tokens, "queued"
            self.waiting.append(job)
            self.lock.notify()

    def release(self, job: Job) -> bool:
        """Its request is over for the server (on the event loop): a job that has not run leaves the queue and
        the live set now (-> True); a running one stops after the round in flight and leaves once it has."""
        with self.lock:
            waiting = job.state in ("admitted", "queued")
            if job.state == "queued":
                self.waiting.remove(job)
            if waiting:
                job.state = "gone"
        job.cancelled.set()
        if waiting:
            self._forget(job)
        return waiting

    def _forget(self, job: Job, held_s: float | None = None) -> None:
        self.jobs.discard(job)
        if held_s is not None:
            self.service_s = 0.8 * self.service_s + 0.2 * held_s
        self.metrics.waiting.set(max(len(self.jobs) - 1, 0))

    def stop(self, error: RequestError) -> None:
        """The drain has ended (on the event loop): every live request gets `error` now, those queued leave,
        the one decoding stops after its round, and no other is admitted."""
        self.stopped = error
        for job in list(self.jobs):
            job.events.put_nowait(("error", error))
            self.release(job)

    def _work(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not self.closing:
                    self.lock.wait()
                if not self.waiting:
                    return
                job = self.waiting.popleft()
                job.state = "running"
            t0 = time.perf_counter()
            try:
                self._run(job)
            except Exception as e:  # the request fails, the server does not
                log.exception("decoding failed")
                self.metrics.success("error")
                job.post("error", decoding_failed(e))
            finally:
                job.state = "done"
                try:
                    job.loop.call_soon_threadsafe(self._forget, job, time.perf_counter() - t0)
                except RuntimeError:  # the loop has closed
                    pass

    def _run(self, job: Job) -> None:
        m = self.metrics
        req = job.req
        text = TextStream(self.tokenizer, job.prompt, req.stops)
        if job.cancelled.is_set():  # its client left as it was taken from the queue
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
            flush = req.stream and (sent is None or now - sent >= self.settings.stream_interval_s)
            if flush or req.stops:
                text.push(held)
                held.clear()
            if flush and ((chunk := text.take()) or sent is None):  # the first chunk marks the first token
                job.post("text", chunk)
                sent = now
            return not (text.stopped or job.cancelled.is_set())

        try:
            res = generate(self.engine, job.prompt, chain=req.chain, max_new_tokens=job.max_tokens,
                           stop_ids=self.stop_ids, temperature=req.temperature, seed=req.seed, policy=req.policy,
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
        """Stop the worker once the job it runs is done; jobs still queued are dropped (their handlers have
        ended: uvicorn closes the app after its connections)."""
        with self.lock:
            self.closing = True
            self.waiting.clear()
            self.lock.notify()
        self.worker.join()


def usage(job: Job, res: GenerationResult | None, text: TextStream) -> dict:
    completion = text.n_tokens if text.stopped else (len(res.output_ids) if res is not None else text.n_tokens)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion,
            "total_tokens": len(job.prompt) + completion, "chain": job.req.chain, "policy": job.req.policy,
            "rounds": res.rounds if res is not None else 0, "tau": res.tau if res is not None else 0.0,
            "acceptance_rate": res.acceptance_rate if res is not None else 0.0,
            "tokens_per_s": res.tokens_per_s if res is not None else 0.0}


# ----------------------------------------------------------------------------------------------------------
# The answers: a request's events (Job.events) as OpenAI's response bodies and chunks


def choice(chat: bool, content: str | None, reason: str | None, *, whole: bool = False) -> dict:
    """A choice of a response (`whole`) or of a chunk; a chat chunk's delta is empty at the end."""
    if not chat:
        return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": reason}
    key, value = (("message", {"role": "assistant", "content": content}) if whole else
                  ("delta", {} if content is None else {"content": content}))
    return {"index": 0, key: value, "logprobs": None, "finish_reason": reason}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def whole_answer(job: Job, head: dict, chat: bool) -> dict | None:
    """The response body once the job is done (None: its client has left); an error event is raised."""
    parts = []
    while True:
        event = await job.events.get()
        if event[0] == "text":
            parts.append(event[1])
        elif event[0] == "error":
            raise event[1]
        elif event[0] == "gone":
            return None
        else:
            _, res, text = event
            return {**head, "object": "chat.completion" if chat else "text_completion",
                    "choices": [choice(chat, "".join(parts), finish_reason(res, text), whole=True)],
                    "usage": usage(job, res, text)}


async def stream_answer(job: Job, head: dict, chat: bool, counted):
    """The job's events as server-sent events in OpenAI's chunk format, ending with `[DONE]`; an error (the drain's
    end, a decoding failure, a fault here; `counted` records it) is an event of its own before `[DONE]`, so a
    stream is never cut without saying why."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    try:
        if chat:  # the role comes first, as OpenAI's streams send it
            opening = choice(chat, "", None)
            opening["delta"]["role"] = "assistant"
            yield sse({**head, "object": obj, "choices": [opening]})
        while True:
            event = await job.events.get()
            if event[0] == "text":
                yield sse({**head, "object": obj, "choices": [choice(chat, event[1], None)]})
                continue
            if event[0] == "error":
                yield sse(counted(event[1]).body())
            elif event[0] == "done":
                _, res, text = event
                yield sse({**head, "object": obj, "choices": [choice(chat, None, finish_reason(res, text))]})
                if job.req.include_usage:
                    yield sse({**head, "object": obj, "choices": [], "usage": usage(job, res, text)})
            break
        yield "data: [DONE]\n\n"
    except Exception as e:  # our fault, mid-stream: said in the stream's own terms
        log.exception("stream failed")
        yield sse(counted(RequestError(500, f"internal error: {type(e).__name__}: {quote(str(e))}",
                                       kind="server_error")).body())
        yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------------------
# The endpoints' work, and the HTTP application that routes to it


class Api:
    """What the endpoints do, over a loaded engine (any runner.engine.Engine) and its tokenizer: the state they
    share (the decoder, the request limits, the tokenizer's encoder, the metrics, the threads that work off the
    event loop) and one method per endpoint, each reading its request through runner.requests' functions. The
    settings and the chat template are checked here (a ValueError naming what is wrong), before anything is
    served."""

    def __init__(self, engine, tokenizer, settings: Settings, *, chat_template: str | None = None):
        meta = engine.meta
        self.max_k = meta["max_m"] - 1
        self.default_chain = meta["default_chain"] if settings.chain is None else settings.chain
        if not 0 <= self.default_chain <= self.max_k:
            raise ValueError(f"chain K={self.default_chain} is outside [0, {self.max_k}] of this engine "
                             f"(max_m={meta['max_m']})")
        check_settings(settings)
        self.enc = encoder(tokenizer, chat_template)
        check_chat_template(self.enc)
        self.settings, self.max_seq_len = settings, meta["max_seq_len"]
        self.limits = Limits(model=settings.model, max_seq_len=meta["max_seq_len"], vocab_size=meta["vocab_size"],
                             max_chain=self.max_k, chain=self.default_chain, policy=settings.policy,
                             temperature=settings.temperature, seed=settings.seed)
        self.metrics = Metrics(settings.model)
        self.decoder = Decoder(engine, tokenizer, settings, self.metrics)
        self.off_loop = ThreadPoolExecutor(OFF_LOOP_THREADS, thread_name_prefix="requests")
        self.reading: set[asyncio.Timeout] = set()  # the body deadlines of requests being read: the drain ends them

    def close(self) -> None:
        self.off_loop.shutdown(wait=False, cancel_futures=True)
        self.decoder.close()

    def stop(self, drain_s: float) -> None:
        """The drain has ended: the requests still in flight are answered 503 now (runner.serve.Server)."""
        self.decoder.stop(RequestError(503, f"the server is shutting down: this request did not finish within its "
                                       f"drain time of {drain_s:g} s", kind="server_error"))
        now = asyncio.get_running_loop().time()
        for deadline in list(self.reading):
            with contextlib.suppress(RuntimeError):  # one that has just expired on its own
                deadline.reschedule(now)

    # --- refusals: each counted once (Metrics.refused), in the JSON shape of OpenAI's errors
    def counted(self, e: RequestError) -> RequestError:
        if e.status != 429:  # counted where it is refused (Decoder.admit)
            self.metrics.refused("invalid" if e.status < 500 else "shutdown" if e.status == 503 else "error")
        return e

    def refusal(self, e: RequestError) -> JSONResponse:
        return JSONResponse(self.counted(e).body(), status_code=e.status, headers=e.headers)

    def internal(self, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return self.refusal(RequestError(500, f"internal error: {type(e).__name__}: {quote(str(e))}",
                                         kind="server_error"))

    # --- reading a request
    async def off_the_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.off_loop, fn, *args)

    async def read_body(self, request: Request) -> dict:
        """The body as a JSON object (runner.requests.parse_body, off the loop): 413 past max_body_bytes, 408
        when it has not arrived whole within body_timeout_s (or 503 when the drain ends first)."""
        limit, length = self.settings.max_body_bytes, request.headers.get("content-length", "")
        check_body_length(length, limit)
        pieces, size = [], 0
        try:
            async with asyncio.timeout(self.settings.body_timeout_s) as deadline:
                self.reading.add(deadline)
                try:
                    async for piece in request.stream():
                        pieces.append(piece)
                        size += len(piece)
                        if size > limit:
                            raise RequestError(413, f"the request body exceeds the limit of {limit} bytes",
                                               headers={"Connection": "close"})
                finally:
                    self.reading.discard(deadline)
        except TimeoutError:
            if self.decoder.stopped is not None:
                raise self.decoder.stopped from None
            raise RequestError(408, f"the request body did not arrive within body_timeout_s="
                               f"{self.settings.body_timeout_s:g} s ({size} of {length or 'an unknown number of'} "
                               "bytes came)", headers={"Connection": "close"}) from None
        return await self.off_the_loop(parse_body, b"".join(pieces))

    async def watch(self, request: Request, job: Job) -> None:
        """Until the client disconnects: then its job leaves the queue at once (or stops after the round in
        flight) and its handler ends."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if self.decoder.release(job):
            self.metrics.success("abort")
        job.post("gone")

    # --- the endpoints
    async def complete(self, request: Request, chat: bool) -> Response:
        """/v1/completions and /v1/chat/completions: the request read, admitted, tokenized and queued, then its
        answer whole or streamed."""
        check_api_key(request.headers.get("authorization", ""), self.settings.api_key)
        req = parse_request(await self.read_body(request), chat=chat, limits=self.limits)
        check_prompt_bytes(self.enc, req, self.limits)  # before it takes a slot or a thread
        job = self.decoder.admit(req)
        watcher = asyncio.create_task(self.watch(request, job))

        def over() -> None:
            watcher.cancel()
            self.decoder.release(job)

        try:
            prompt, budget = (await self.off_the_loop(prompt_and_budget, self.enc, req, self.limits)
                              if tokenizes(req) else prompt_and_budget(self.enc, req, self.limits))
            self.decoder.submit(job, prompt, budget)
        except BaseException:
            over()
            raise
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": self.settings.model}
        if not req.stream:
            try:
                body = await whole_answer(job, head, chat)
            finally:
                over()
            return Response(status_code=GONE) if body is None else JSONResponse(body)

        async def chunks():
            try:
                async with contextlib.aclosing(stream_answer(job, head, chat, self.counted)) as stream:
                    async for chunk in stream:
                        yield chunk
            finally:
                over()

        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def models(self, request: Request) -> JSONResponse:
        check_api_key(request.headers.get("authorization", ""), self.settings.api_key)
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "eagle3",
             "max_model_len": self.max_seq_len, "max_chain": self.max_k, "default_chain": self.default_chain}]})


def create_app(engine, tokenizer, settings: Settings, *, chat_template: str | None = None):
    """The FastAPI application over a loaded engine and its tokenizer: routes to `Api`'s endpoints, each of whose
    refusals, client departures and faults is answered once (a RequestError in its JSON shape, a gone client with
    nothing, our fault as a 500 in the same shape, logged once). A ValueError names a bad setting or template."""
    api = Api(engine, tokenizer, settings, chat_template=chat_template)

    async def lifespan(app):
        yield
        api.close()

    app = FastAPI(title="eagle3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.decoder, app.state.settings, app.state.stop = api.decoder, settings, api.stop

    @app.exception_handler(RequestError)
    async def refused(request, e: RequestError):
        return api.refusal(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # the router's 404 and 405 (whose Allow header it keeps)
        return JSONResponse(RequestError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def failed(request, e: Exception):
        return api.internal(e)

    def answered(handler):
        """The endpoint `handler`, its answers caught here rather than re-raised into uvicorn's log."""
        @functools.wraps(handler)
        async def endpoint(request: Request):
            try:
                return await handler(request)
            except RequestError as e:
                return api.refusal(e)
            except ClientDisconnect:
                return Response(status_code=GONE)
            except Exception as e:
                return api.internal(e)
        return endpoint

    @app.post("/v1/completions")
    @answered
    async def completions(request: Request):
        return await api.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    @answered
    async def chat_completions(request: Request):
        return await api.complete(request, chat=True)

    @app.get("/v1/models")
    @answered
    async def models(request: Request):
        return await api.models(request)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(api.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


# ----------------------------------------------------------------------------------------------------------
# The HTTP server: uvicorn's, with limits on what a connection may send and a drain that ends every request


def oversized_head(buffer: bytes, settings: Settings) -> tuple[int, str] | None:
    """(status, message) for a request head, whole or in part, past the limits: 414 for a request line longer
    than max_url_bytes, 431 for a head longer than max_header_bytes; None within them."""
    end = buffer.find(b"\r\n\r\n")
    head = buffer if end < 0 else buffer[:end]
    line_end = head.find(b"\r\n")
    line = head if line_end < 0 else head[:line_end]
    more = "more than " if line_end < 0 else ""
    if len(line) > settings.max_url_bytes:
        return 414, f"the request line has {more}{len(line)} bytes; the limit is max_url_bytes={settings.max_url_bytes}"
    if len(head) > settings.max_header_bytes:
        more = "more than " if end < 0 else ""
        return 431, (f"the request head has {more}{len(head)} bytes; the limit is "
                     f"max_header_bytes={settings.max_header_bytes}")
    return None


class HttpProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection (h11) under the settings' limits. Its next request head must arrive whole
    within idle_timeout_s of the connection opening or its last answer ending (uvicorn's keep-alive timer,
    armed from the start and no longer reset by each byte, so an idle or slowloris socket is closed). A head
    past max_url_bytes or max_header_bytes is answered 414 or 431, and a malformed one 400, in the JSON error
    shape; then the connection sends nothing more, reads and drops what the client still sends (so the client
    reads the answer instead of a reset) and closes after idle_timeout_s at most."""

    def __init__(self, *args, settings: Settings, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.timeout_keep_alive = settings.idle_timeout_s
        self.refused = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.conn.receive_data(data)
        if self.conn.their_state is h11.IDLE and (over := oversized_head(self.conn.trailing_data[0], self.settings)):
            self.refuse(*over)
            return
        self.handle_events()

    def send_400_response(self, msg: str) -> None:
        self.refuse(400, "the request is not valid HTTP/1.1")

    def refuse(self, status: int, message: str) -> None:
        self.refused = True
        self._unset_keepalive_if_required()
        body = json.dumps(RequestError(status, message).body(), separators=(",", ":")).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, STATUS_PHRASES[status], len(body), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.transport.close)

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        if self.refused:
            self.transport.close()
        else:
            super().shutdown()


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown gives the requests in flight `drain_s` to finish and then ends them
    itself (the app's `stop`: a 503 in the JSON error shape, or an error event before a stream's end), so none
    is left for uvicorn to cancel (a text/plain 500 or a stream cut short, each with a traceback in the log)."""

    def __init__(self, config: uvicorn.Config, drain_s: float):
        super().__init__(config)
        self.drain_s = drain_s

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        cut = asyncio.get_running_loop().call_later(self.drain_s, app.state.stop, self.drain_s)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def server(app, drain_s: float = 30.0) -> Server:
    """The uvicorn server of an app of create_app: its HttpProtocol under the app's settings, its drain."""
    s = app.state.settings
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            http=functools.partial(HttpProtocol, settings=s), timeout_keep_alive=s.idle_timeout_s,
                            timeout_graceful_shutdown=drain_s + CUT_GRACE_S,
                            h11_max_incomplete_event_size=s.max_header_bytes + 4)
    return Server(config, drain_s)


def warm_up(engine, chain: int | None) -> None:
    """One short generation at K = 0 and at the default K: the first calls allocate and initialise the
    delegates, which would otherwise land on the first request's latency."""
    prompt = [1] * min(engine.meta["max_prefill_chunk"], engine.meta["max_seq_len"] // 2)
    for k in dict.fromkeys((0, engine.meta["default_chain"] if chain is None else chain)):
        generate(engine, prompt, chain=k, max_new_tokens=4)


def listen(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening TCP socket on host:port (port 0 picks a free one), made before anything slow is loaded so
    that a port in use or a bad host is refused at once: an OSError, or a ValueError for a host that does
    not resolve or a port outside [0, 65535]."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port}: expected an integer in [0, 65535]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"host {host!r} does not resolve to an address ({e.strerror})") from None
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it Nagle holds a
    # small chunk back until the client's delayed ACK (40 ms) of the segment before it
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run_server(app, host: str = "127.0.0.1", port: int = 8000, *, drain_s: float = 30.0, ready=None,
               sock: socket.socket | None = None) -> None:
    """Serve `app` (on `sock`, or a socket `listen` makes) until SIGTERM or SIGINT, then let the requests in
    flight finish (up to `drain_s` seconds, then they are answered 503) and return. `ready(url)` is called once
    the socket listens (port 0 picks a free one)."""
    sock = sock if sock is not None else listen(host, port)
    srv = server(app, drain_s)
    # The decoding thread holds the GIL between engine calls and takes it back as soon as a call returns, so
    # the event loop gets it only when the switch interval forces a hand-over: at Python's 5 ms a stream's
    # chunk left 8-13 ms after it was ready, at 0.5 ms within 0.25 ms (the embedded default at K=7, 2 cores).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Everything loaded so far (torch, the runtime, the app: ~250k objects) lives as long as the process: out
    # of the collector's sight, a full collection no longer stalls every thread for ~150 ms while it scans them.
    gc.collect()
    gc.freeze()
    host, bound = sock.getsockname()[:2]
    if ready is not None:
        ready(f"http://{f'[{host}]' if ':' in host else host}:{bound}/v1")
    main = threading.current_thread() is threading.main_thread()
    # uvicorn re-raises the signal that stopped it once it has drained; a stopped server is a normal end
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        srv.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()


# ----------------------------------------------------------------------------------------------------------
# The command line


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(prog="python -m runner.serve", description=__doc__.split("\n")[0])
    add_engine_arguments(p)
    p.add_argument("--tokenizer", required=True, type=Path, help="tokenizer.json (the target artifact's)")
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template; default: chat_template.jinja "
                   "beside the tokenizer, if there is one")
    p.add_argument("--model-name", help="the id /v1/models lists and requests name; default: the .pte's path "
                   "(--engine cuda: the draft's)")
    p.add_argument("--chain", type=cli.integer(0), default=None, help="the default K of a request, in [0, max_m-1]; "
                   "default: the .pte's get_chain_len (required with --engine cuda)")
    p.add_argument("--policy", choices=POLICIES, default=Settings.policy, help="the default policy of a request")
    p.add_argument("--temperature", type=cli.number(0.0, MAX_TEMPERATURE), default=Settings.temperature,
                   help=f"the default temperature of a request, in [0, {MAX_TEMPERATURE:g}] (a request's range)")
    p.add_argument("--seed", type=cli.integer(0, MAX_SEED), default=Settings.seed,
                   help="the default seed of a request")
    p.add_argument("--stop", nargs="*", default=[], help="extra stop tokens (strings or ids), for every request")
    p.add_argument("--threads", type=cli.integer(1), default=None,
                   help="the runtime's CPU threads (default: the cores this process may use)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cli.integer(0, 65535), default=8000, help="0 picks a free port (printed)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer <key>' on /v1 (default: ${API_KEY_ENV})")
    p.add_argument("--queue-size", type=cli.integer(0), default=Settings.queue_size,
                   help="live requests besides the one decoding; one more is answered 429")
    p.add_argument("--max-body-bytes", type=cli.integer(1), default=Settings.max_body_bytes)
    p.add_argument("--drain-s", type=cli.number(0.0), default=30.0,
                   help="on SIGTERM: how long requests in flight may finish (then they are answered 503)")
    p.add_argument("--stream-interval-s", type=cli.number(0.0), default=Settings.stream_interval_s,
                   help="a stream sends a chunk at most this often (the first token at once)")
    p.add_argument("--body-timeout-s", type=cli.number(1e-3), default=Settings.body_timeout_s,
                   help="a request body must arrive whole within this (else 408)")
    p.add_argument("--idle-timeout-s", type=cli.number(1e-3), default=Settings.idle_timeout_s,
                   help="a connection's next request head must arrive whole within this (else it is closed)")
    p.add_argument("--max-url-bytes", type=cli.integer(64), default=Settings.max_url_bytes,
                   help="the longest request line (else 414)")
    p.add_argument("--max-header-bytes", type=cli.integer(64), default=Settings.max_header_bytes,
                   help="the longest request head (else 431)")
    args = p.parse_args(argv)
    try:
        options = engine_options(args)
    except ValueError as e:
        p.error(str(e))

    from models.text import load_chat_template

    model = args.model_name or str(args.draft if args.engine == "cuda" else args.pte)
    settings = Settings(model=model, chain=args.chain, policy=args.policy, temperature=args.temperature,
                        seed=args.seed, stop=tuple(args.stop), api_key=args.api_key or None,
                        queue_size=args.queue_size, max_body_bytes=args.max_body_bytes,
                        stream_interval_s=args.stream_interval_s, body_timeout_s=args.body_timeout_s,
                        idle_timeout_s=args.idle_timeout_s, max_url_bytes=args.max_url_bytes,
                        max_header_bytes=args.max_header_bytes)
    check_settings(settings)
    # Everything that can be refused in a moment is, before the program loads (seconds): the address, the
    # tokenizer, the chat template
    sock = listen(args.host, args.port)
    try:
        tokenizer = cli.load_tokenizer(args.tokenizer)
        template = (cli.read_text(args.chat_template, "chat template") if args.chat_template
                    else load_chat_template(args.tokenizer.parent))
        check_chat_template(encoder(tokenizer, template))
        if args.engine != "cuda":
            from runner.engine import set_threads

            set_threads(args.threads)
        # first: a .pte unlike its manifest or its tokenizer is refused
        engine = build_engine(options, pte=args.pte, tokenizer=args.tokenizer, target=args.target, draft=args.draft)
        app = create_app(engine, tokenizer, settings, chat_template=template)
        warm_up(engine, args.chain)
    except BaseException:
        sock.close()
        raise
    run_server(app, sock=sock, drain_s=args.drain_s,
               ready=lambda url: print(f"serving {model} at {url}" + (" (API key required)" if settings.api_key
                                                                       else ""), flush=True))
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
