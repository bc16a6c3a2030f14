"""Benchmark: runner.serve against the in-process runner on the same prompts, and a load test of the server.

    python -m bench.serve                                   # the newest export artifact in the store
    python -m bench.serve --pte model.pte --tokenizer tokenizer.json --threads 1
    python -m bench.serve --load                            # 16 clients, 500 requests, then a SIGTERM mid-load
    python -m bench.serve --load --clients 4 --requests 40 --queue-size 1 --out /tmp/load.json   # the test's size
    python -m bench.serve --load --clients 8 --queue-size 16 --big-senders 4 --churners 4   # under abuse

Both modes start `python -m runner.serve` as a subprocess on 127.0.0.1 (a free port) over the .pte, with the
same torch/ExecuTorch threads as this process's in-process engine (`--threads`), and send completions with the
real `openai` client, prompts as token ids (windows of this interpreter's standard library, tokenized by the
target's tokenizer), streaming, at temperature 0.

Throughput (default): a mix of per-request K (0, 1, 2, the .pte's default, max_m-1; or `--chains`), `--prompts`
prompts each, of `--prompt-len` tokens (up to what the cache holds beside `--max-tokens`). Checks: every answer's
text (in process, streamed, whole) equals its prompt's K = 0 text in process, and the server's equals the
in-process one of the same request.
- 1 client: request by request, the in-process runner (runner.generate on a PteEngine in this process), the
  server streaming and the server answering whole, on the same (prompt, K), interleaved (`--reps` passes, the
  order rotated), so a change of load on the shared machine hits all alike. Decode tokens/s of a request =
  tokens after the first / time from the first to the last token: in process from GenerationResult
  (decode_ms); streamed, from the chunks' arrival times at the client (the first chunk carries the prefill's
  token, the last the finish reason) and from the server's own clock (usage.tokens_per_s); answered whole,
  from the server's clock. Per K: medians over requests, and the medians of the paired ratios to in-process,
  which must lie within 5% of 1.
- 4 and 16 clients: the same requests from that many threads at once; the server decodes one at a time, so
  aggregate tokens/s stays near the 1-client figure while time to first token grows with the queue.
Percentiles (p50/p95/p99) of time to first token and end-to-end latency, per level; in process they are
prefill_ms and prefill + decode.

Load (`--load`): `--clients` threads share `--requests` requests with random K in [0, max_m-1], random prompt
length and max_tokens, streaming or not, policy static or (1 in 5) adaptive. A 429 is counted and retried after
its Retry-After. Checks: every request answered (none lost), each text equal to its own K=0 reference (the
in-process K=0 tokens of that prompt, cut to its max_tokens, as runner.serve.TextStream turns them into text),
the server's RSS flat (its growth from the end of the first tenth of the requests to the end), then a second
burst with a SIGTERM once a quarter of it is answered: each request of the burst either completes with its
reference text or is refused before any response (connection refused or closed); none is cut mid-stream, and
the server exits 0. Exit status 1 when a check fails.

Abuse (`--big-senders N`, `--churners M`, with `--load`): the main burst runs twice, quiet and then beside N
clients that send `--big-prompt-bytes` (1 MB) prompts one after another (each answered 400: it cannot fit the
cache) and M clients that send a completion, wait until it is queued and disconnect, over and over. Checks: the
median end-to-end latency of the burst's requests under abuse within 1.5x of the quiet run's, and, where the
burst's clients and the churners together fit the queue (clients + churners <= queue_size + 1), no 429.

Writes bench/results/cpu-serve.json (throughput) or cpu-serve-load.json (load), or `--out`, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STARTUP_S = 300


# ----------------------------------------------------------------------------------------------------------
# Inputs: the artifact, the prompts


def newest_export(store: Path) -> tuple[Path, Path]:
    """(model.pte, tokenizer.json) of the newest export artifact in the store, with its target's tokenizer."""
    found = []
    for manifest in (store / "export").glob("*/manifest.json"):
        try:
            m = json.loads(manifest.read_text())
            found.append((m.get("created_at", ""), manifest.parent / "model.pte",
                          store / "target" / m["upstream"]["target"] / "tokenizer.json"))
        except (OSError, KeyError, ValueError):
            continue
    if not found:
        raise SystemExit(f"no export artifact in {store}: run `python -m pipeline +stage=export` or pass --pte "
                         "and --tokenizer")
    _, pte, tok = max(found)
    return pte, tok


def stdlib_prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    """One window of token ids per length, from seeded places of this interpreter's standard library."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    out = []
    while len(out) < len(lengths):
        text = rng.choice(files).read_text(encoding="utf-8", errors="replace")
        n = lengths[len(out)]
        start = rng.randrange(max(1, len(text) - 16 * n))
        ids = tokenizer.encode(text[start:start + 16 * n], add_special_tokens=False).ids[1:n + 1]
        if len(ids) == n:
            out.append(ids)
    return out


# ----------------------------------------------------------------------------------------------------------
# The two systems: the server (a subprocess) and the in-process runner


class Server:
    """`python -m runner.serve` in a subprocess on a free port of 127.0.0.1."""

    def __init__(self, pte: Path, tokenizer: Path, *, threads: int, queue_size: int, drain_s: float = 30.0):
        cmd = [sys.executable, "-m", "runner.serve", "--pte", str(pte), "--tokenizer", str(tokenizer), "--port", "0",
               "--queue-size", str(queue_size), "--drain-s", str(drain_s), "--model-name", "bench",
               "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        t0 = time.monotonic()
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("serving "):
                self.url = line.split(" at ", 1)[1].split()[0]
                break
            if time.monotonic() - t0 > STARTUP_S:
                break
        else:
            raise RuntimeError("the server exited before serving:\n" + "".join(self.lines))
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.model = "bench"

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=600)

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def cpu_s(self) -> float:
        """The CPU seconds the server has used (user + system)."""
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def complete(client, model: str, prompt: list[int], k: int, max_tokens: int, *, stream: bool = True,
             policy: str = "static") -> dict:
    """One completion; text, timings (from sending), usage. Streams keep each chunk's arrival time."""
    t0 = time.perf_counter()
    extra = {"chain": k, "policy": policy}
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body=extra)
        e2e = time.perf_counter() - t0
        return {"text": r.choices[0].text, "e2e_s": e2e, "ttft_s": None, "usage": r.usage.model_dump(),
                "finish_reason": r.choices[0].finish_reason}
    parts, times, usage, reason = [], [], None, None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra):
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            if c.finish_reason is not None:
                reason, last = c.finish_reason, now
            else:  # a chunk of text (the first one at the first token, even if it shows nothing)
                parts.append(c.text)
                times.append(now)
    if reason is None:
        raise RuntimeError("the stream ended without a finish reason")
    n = usage["completion_tokens"]
    decode_s = last - times[0] if times else 0.0
    return {"text": "".join(parts), "ttft_s": times[0] if times else last, "e2e_s": last, "usage": usage,
            "finish_reason": reason, "decode_tokens": n - 1, "decode_s": decode_s}


def text_of(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text the server makes of `ids` after `prompt` (without stop strings)."""
    from runner.serve import TextStream

    text = TextStream(tokenizer, prompt, [])
    text.push(ids)
    text.finish()
    return text.take()


def in_process(engine, tokenizer, stops: list[int], prompt: list[int], k: int, max_tokens: int) -> dict:
    from runner.generate import generate

    r = generate(engine, prompt, chain=k, max_new_tokens=max_tokens, stop_ids=stops)
    return {"text": text_of(tokenizer, prompt, r.output_ids), "ids": r.output_ids, "ttft_s": r.prefill_ms / 1e3,
            "e2e_s": (r.prefill_ms + r.decode_ms) / 1e3, "decode_tokens": r.decode_tokens,
            "decode_s": r.decode_ms / 1e3, "tau": r.tau}


def pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]  # noqa: E731
    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)} if xs else {}


def rate(runs: list[dict]) -> float:
    """Decode tokens/s of runs together: tokens after each one's first over the time from first to last."""
    s = sum(r["decode_s"] for r in runs)
    return sum(r["decode_tokens"] for r in runs) / s if s > 0 else 0.0


def median_rate(runs: list[dict]) -> float:
    return statistics.median(rate([r]) for r in runs)


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").is_file() else platform.processor()
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "nproc": os.cpu_count(),
            "loadavg": list(os.getloadavg()), "python": platform.python_version(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


# ----------------------------------------------------------------------------------------------------------
# Throughput: 1, 4 and 16 clients against the in-process runner


def fan_out(server: Server, n: int, clients: int, work, on_answer=None) -> tuple[list, float]:
    """`work(client, i)` for i < n from `clients` threads, each with its own openai client, taking the next i as
    it is free; (results by i, wall seconds). `on_answer(answered)` after each."""
    out: list = [None] * n
    todo, done = list(range(n)), [0]
    lock = threading.Lock()

    def client_loop():
        client = server.client()
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            out[i] = work(client, i)
            with lock:
                done[0] += 1
                answered = done[0]
            if on_answer is not None:
                on_answer(answered)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def throughput(args, engine, tokenizer, server: Server) -> dict:
    from models.text import stop_ids

    meta = engine.meta
    max_k = meta["max_m"] - 1
    ks = args.chains if args.chains is not None else sorted({0, 1, 2, meta["default_chain"], max_k})
    if 0 not in ks or not all(0 <= k <= max_k for k in ks):
        raise SystemExit(f"--chains {ks}: need 0 (the reference) and each K in [0, {max_k}] (the .pte's max_m - 1)")
    prompts = stdlib_prompts(tokenizer, [args.prompt_len] * args.prompts, args.seed)
    max_tokens = min(args.max_tokens, meta["max_seq_len"] - args.prompt_len)
    stops = stop_ids(tokenizer)
    requests = [(p, k, max_tokens) for p in prompts for k in ks]
    client = server.client()
    pairs = requests * args.reps
    for k in ks:  # warm-up, not counted
        in_process(engine, tokenizer, stops, prompts[0], k, 8)
        complete(client, server.model, prompts[0], k, 8)

    systems = {"local": lambda req: in_process(engine, tokenizer, stops, *req),
               "stream": lambda req: complete(client, server.model, *req),
               "whole": lambda req: complete(client, server.model, *req, stream=False)}
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for i, req in enumerate(pairs):  # interleaved, each pass in a rotated order
        names = list(systems)[i % 3:] + list(systems)[:i % 3]
        for name in names:
            runs[name].append(systems[name](req))
    local, remote = runs["local"], runs["stream"]
    mismatched = sum(not a["text"] == b["text"] == c["text"] for a, b, c in zip(local, remote, runs["whole"]))
    # every K's answer (in process, streamed, whole) against its prompt's K = 0 answer in process
    k0 = {tuple(q[0]): a["text"] for q, a in zip(pairs, local) if q[1] == 0}
    differ_k0 = sorted({q[1] for q, *rs in zip(pairs, local, remote, runs["whole"])
                        if any(r["text"] != k0[tuple(q[0])] for r in rs)})
    per_k = []
    for k in ks:
        lk, rk, wk = ([r for r, q in zip(runs[name], pairs) if q[1] == k] for name in systems)
        own = lambda rs: statistics.median(r["usage"]["tokens_per_s"] for r in rs)  # noqa: E731
        per_k.append({"chain": k, "requests": len(lk), "in_process_tokens_per_s": median_rate(lk),
                      "server_tokens_per_s": median_rate(rk), "server_own_tokens_per_s": own(rk),
                      "server_whole_own_tokens_per_s": own(wk),
                      "ratio": statistics.median(rate([b]) / rate([a]) for a, b in zip(lk, rk) if rate([a])),
                      "ratio_whole": statistics.median(w["usage"]["tokens_per_s"] / rate([a])
                                                       for a, w in zip(lk, wk) if rate([a])),
                      "tau": statistics.mean(r["tau"] for r in lk),
                      "ttft_ms_in_process": 1e3 * statistics.median(r["ttft_s"] for r in lk),
                      "ttft_ms_server": 1e3 * statistics.median(r["ttft_s"] for r in rk)})

    def level(runs: list[dict], wall: float, clients: int, system: str) -> dict:
        tokens = sum(r["decode_tokens"] + 1 for r in runs)
        return {"system": system, "clients": clients, "requests": len(runs), "tokens": tokens,
                "tokens_per_s": tokens / wall, "decode_tokens_per_s": rate(runs),
                "ttft_ms": {q: 1e3 * v for q, v in pct([r["ttft_s"] for r in runs]).items()},
                "e2e_ms": {q: 1e3 * v for q, v in pct([r["e2e_s"] for r in runs]).items()}}

    levels = [level(local, sum(r["e2e_s"] for r in local), 1, "in-process"),
              level(remote, sum(r["e2e_s"] for r in remote), 1, "server")]
    for clients in args.clients:
        if clients == 1:
            continue
        reps = requests * max(1, clients // 4)
        got, wall = fan_out(server, len(reps), clients, lambda c, i: complete(c, server.model, *reps[i]))
        mismatched += sum(r["text"] != local[i % len(requests)]["text"] for i, r in enumerate(got))
        levels.append(level(got, wall, clients, "server"))
    paired = [{"chain": q[1], "in_process": rate([a]), "streamed": rate([b]),
               "streamed_own": b["usage"]["tokens_per_s"], "whole_own": w["usage"]["tokens_per_s"],
               "ttft_ms_in_process": 1e3 * a["ttft_s"], "ttft_ms_server": 1e3 * b["ttft_s"]}
              for q, a, b, w in zip(pairs, local, remote, runs["whole"])]
    overall = {"streamed": statistics.median(p["streamed"] / p["in_process"] for p in paired),
               "whole": statistics.median(p["whole_own"] / p["in_process"] for p in paired)}
    return {"ks": ks, "prompts": args.prompts, "reps": args.reps, "prompt_len": args.prompt_len,
            "max_tokens": max_tokens, "paired": paired, "overall_ratio": overall,
            "per_k": per_k, "levels": levels, "mismatched_texts": mismatched, "chains_differing_from_k0": differ_k0,
            "within_5_percent": all(abs(r["ratio"] - 1) <= 0.05 for r in per_k),
            "whole_within_5_percent": all(abs(r["ratio_whole"] - 1) <= 0.05 for r in per_k)}


def print_throughput(res: dict) -> None:
    print(f"\n1 client, decode tokens/s per K, medians over {res['per_k'][0]['requests']} requests ({res['prompts']} "
          f"prompts of {res['prompt_len']} tokens x {res['reps']} reps, {res['max_tokens']} new tokens, interleaved):")
    print("  K   in-process   server streamed (client's clock / own)   ratio   not streamed (own)   ratio   tau   "
          "TTFT ms in-process / server")
    for r in res["per_k"]:
        print(f"  {r['chain']:<3d} {r['in_process_tokens_per_s']:10.1f} {r['server_tokens_per_s']:17.1f} / "
              f"{r['server_own_tokens_per_s']:7.1f} {r['ratio']:14.3f} {r['server_whole_own_tokens_per_s']:14.1f} "
              f"{r['ratio_whole']:12.3f} {r['tau']:5.2f}   {r['ttft_ms_in_process']:8.1f} / {r['ttft_ms_server']:.1f}")
    o = res["overall_ratio"]
    print(f"  all K, median of the {len(res['paired'])} paired ratios: streamed {o['streamed']:.3f}, "
          f"not streamed {o['whole']:.3f}")
    print("\nsystem      clients requests  tokens/s  decode tok/s  TTFT ms p50/p95/p99        e2e ms p50/p95/p99")
    for lv in res["levels"]:
        t, e = lv["ttft_ms"], lv["e2e_ms"]
        print(f"{lv['system']:11s} {lv['clients']:7d} {lv['requests']:8d} {lv['tokens_per_s']:9.1f} "
              f"{lv['decode_tokens_per_s']:13.1f}  {t['p50']:6.1f} {t['p95']:7.1f} {t['p99']:7.1f}   "
              f"{e['p50']:7.1f} {e['p95']:7.1f} {e['p99']:7.1f}")
    differ = res["chains_differing_from_k0"]
    print(f"\ntexts differing between server and in-process: {res['mismatched_texts']}; K whose text differs from "
          f"K = 0's: {differ or 'none'}; every K within 5%: streamed {res['within_5_percent']}, whole "
          f"{res['whole_within_5_percent']}")


# ----------------------------------------------------------------------------------------------------------
# Load: many clients, random K and lengths, then a SIGTERM mid-load


def load_requests(rng: random.Random, n: int, meta: dict, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    out = []
    for _ in range(n):
        p = rng.randrange(len(prompts))
        room = meta["max_seq_len"] - len(prompts[p])
        out.append({"prompt": p, "chain": rng.randint(0, meta["max_m"] - 1),
                    "max_tokens": rng.randint(1, min(max_tokens, room)), "stream": rng.random() < 0.5,
                    "policy": "adaptive" if rng.random() < 0.2 else "static"})
    return out


def drive(server: Server, requests: list[dict], prompts, refs: dict, clients: int, *, on_answer=None) -> dict:
    """Send `requests` from `clients` threads; 429s are counted and retried after Retry-After. Each request ends
    as `ok` (its reference text), `mismatch`, `refused` (no response: connection refused or closed before any
    byte), `http <status>` or `truncated` (a stream cut before its finish reason)."""
    import openai

    counts = {"429": 0}
    lock = threading.Lock()

    def one(client, i: int) -> tuple[str, float | None]:
        """(how it ended, the seconds its answered attempt took from sending to the last byte)."""
        q = requests[i]
        while True:
            try:
                r = complete(client, server.model, prompts[q["prompt"]], q["chain"], q["max_tokens"],
                             stream=q["stream"], policy=q["policy"])
                return ("ok" if r["text"] == refs[(q["prompt"], q["max_tokens"])] else "mismatch"), r["e2e_s"]
            except openai.RateLimitError as e:
                with lock:
                    counts["429"] += 1
                time.sleep(float(e.response.headers.get("retry-after", 1)))
            except openai.APIStatusError as e:
                return f"http {e.status_code}", None
            except openai.APIConnectionError:  # no response: refused, or closed before one
                return "refused", None
            except Exception as e:  # the response began, then stopped short (the transport's own error)
                return f"truncated ({type(e).__name__})", None

    ended, wall = fan_out(server, len(requests), clients, one, on_answer)
    status = [s for s, _ in ended]
    tally = {s: status.count(s) for s in set(status)}
    e2e = [t for _, t in ended if t is not None]
    return {"requests": len(requests), "seconds": wall, "status": tally, "429s": counts["429"],
            "e2e_ms": {q: 1e3 * v for q, v in pct(e2e).items()}}


def abusers(server: Server, big_senders: int, churners: int, big_bytes: int, max_tokens: int, seed: int):
    """Start the abusers in a process of their own (so their threads do not take this process's GIL from the
    clients being measured): `big_senders` threads that post completions with a prompt of `big_bytes` bytes
    (text of this interpreter's standard library) one after another, and `churners` threads that post a
    completion of `max_tokens`, wait until the server has queued it (20-100 ms) and disconnect, over and over.
    -> stop(), which ends them and returns their tallies."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    done, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=abuse, args=(server.url, server.model, big_senders, churners, big_bytes, max_tokens,
                                            seed, done, out), daemon=True)
    proc.start()

    def stop() -> dict:
        done.set()
        tallies = out.get(timeout=300)
        proc.join(60)
        return tallies

    return stop


def abuse(url: str, model: str, big_senders: int, churners: int, big_bytes: int, max_tokens: int, seed: int,
          done, out) -> None:
    """The abusers' process (`abusers`): runs them until `done` is set, then puts their tallies on `out`."""
    import http.client
    import socket

    host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    text = ""
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += f.read_text(encoding="utf-8", errors="replace")
        if len(text.encode()) >= big_bytes:
            break
    big = json.dumps({"model": model, "prompt": text.encode()[:big_bytes].decode(errors="ignore"),
                      "max_tokens": 16}).encode()
    tallies = {"big": {}, "churned": 0, "churn_answered": 0}
    lock = threading.Lock()

    def send_big():
        while not done.is_set():
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            try:
                conn.request("POST", "/v1/completions", body=big, headers={"Content-Type": "application/json"})
                status = str(conn.getresponse().status)
            except OSError as e:
                status = type(e).__name__
            finally:
                conn.close()
            with lock:
                tallies["big"][status] = tallies["big"].get(status, 0) + 1

    def churn(rng: random.Random):
        body = json.dumps({"model": model, "prompt": "def main():", "max_tokens": max_tokens}).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        while not done.is_set():
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(request)
                sock.settimeout(rng.uniform(0.02, 0.1))
                try:  # an answer within the wait (a 429, a 400, or a request that ran at once) is counted apart
                    answered = bool(sock.recv(1))
                except OSError:
                    answered = False
            with lock:
                tallies["churned" if not answered else "churn_answered"] += 1

    rng = random.Random(seed)
    threads = [threading.Thread(target=send_big, daemon=True) for _ in range(big_senders)]
    threads += [threading.Thread(target=churn, args=(random.Random(rng.random()),), daemon=True)
                for _ in range(churners)]
    for t in threads:
        t.start()
    done.wait()
    for t in threads:
        t.join(180)
    out.put(tallies)


def load(args, engine, tokenizer, pte: Path, tok_path: Path) -> dict:
    from models.text import stop_ids

    meta = engine.meta
    rng = random.Random(args.seed)
    top = min(args.prompt_len, meta["max_seq_len"] // 2)
    prompts = stdlib_prompts(tokenizer, [rng.randint(4, top) for _ in range(args.prompts)], args.seed)
    max_tokens = min(args.max_tokens, meta["max_seq_len"] - 4)
    stops = stop_ids(tokenizer)
    refs_ids = {i: in_process(engine, tokenizer, stops, p, 0, min(max_tokens, meta["max_seq_len"] - len(p)))["ids"]
                for i, p in enumerate(prompts)}
    main_burst = load_requests(rng, args.requests, meta, prompts, max_tokens)
    term_burst = load_requests(rng, max(8, args.requests // 8), meta, prompts, max_tokens)
    refs = {(q["prompt"], q["max_tokens"]):
            text_of(tokenizer, prompts[q["prompt"]], refs_ids[q["prompt"]][:q["max_tokens"]])
            for q in main_burst + term_burst}

    server = Server(pte, tok_path, threads=args.threads, queue_size=args.queue_size, drain_s=args.drain_s)
    try:
        rss = {"start": server.rss()}
        samples, warm = [], max(1, args.requests // 10)
        sampling = threading.Event()

        def sample():
            while not sampling.wait(0.5):
                samples.append(server.rss())

        monitor = threading.Thread(target=sample, daemon=True)
        monitor.start()

        def answered(n: int):
            if n == warm and "warm" not in rss:
                rss["warm"] = server.rss()

        cpu = server.cpu_s()
        main = drive(server, main_burst, prompts, refs, args.clients, on_answer=answered)
        main["server_cpu_per_s"] = (server.cpu_s() - cpu) / main["seconds"]
        sampling.set()
        rss.update(end=server.rss(), max=max(samples, default=rss["start"]))
        abused = None
        if args.big_senders or args.churners:
            stop = abusers(server, args.big_senders, args.churners, args.big_prompt_bytes, max_tokens, args.seed)
            cpu = server.cpu_s()
            try:
                abused = drive(server, main_burst, prompts, refs, args.clients)
            finally:
                tallies = stop()
            abused.update(abusers=tallies, server_cpu_per_s=(server.cpu_s() - cpu) / abused["seconds"],
                          big_per_s=sum(tallies["big"].values()) / abused["seconds"],
                          churns_per_s=(tallies["churned"] + tallies["churn_answered"]) / abused["seconds"])

        term: dict = {}

        def terminate(n: int):
            if n == max(1, len(term_burst) // 4) and "sent_at" not in term:
                term["sent_at"] = n
                server.proc.send_signal(signal.SIGTERM)

        term.update(drive(server, term_burst, prompts, refs, args.clients, on_answer=terminate))
        try:
            term["exit_code"] = server.proc.wait(args.drain_s + 30)
        except subprocess.TimeoutExpired:
            term["exit_code"] = None
    finally:
        server.stop()
    growth = rss["end"] - rss.get("warm", rss["start"])
    checks = {
        "none_lost": main["status"].get("ok", 0) + main["status"].get("mismatch", 0) == args.requests,
        "texts_equal_k0": main["status"].get("mismatch", 0) == 0 and term["status"].get("mismatch", 0) == 0,
        "rss_flat": growth <= max(16 << 20, 0.05 * rss.get("warm", rss["start"])),
        "sigterm_clean": set(term["status"]) <= {"ok", "refused"} and term["exit_code"] == 0,
    }
    if abused is not None:
        checks["abused_none_lost"] = abused["status"].get("ok", 0) == args.requests
        checks["abused_p50_within_1.5x"] = abused["e2e_ms"]["p50"] <= 1.5 * main["e2e_ms"]["p50"]
        if args.clients + args.churners <= args.queue_size + 1:  # every live request fits the queue
            checks["abused_no_429"] = abused["429s"] == 0
    return {"clients": args.clients, "requests": args.requests, "queue_size": args.queue_size, "main": main,
            "abused": abused, "big_senders": args.big_senders, "churners": args.churners,
            "big_prompt_bytes": args.big_prompt_bytes, "sigterm": term, "rss_bytes": rss, "rss_growth_bytes": growth,
            "checks": checks, "server_log": "".join(server.lines[-20:])}


def print_load(res: dict) -> None:
    m, t, r = res["main"], res["sigterm"], res["rss_bytes"]
    mb = lambda b: f"{b / 2**20:.1f} MB"  # noqa: E731
    print(f"\nload: {res['clients']} clients, {res['requests']} requests, queue_size {res['queue_size']}: "
          f"{m['seconds']:.1f} s, {m['status']}, 429s {m['429s']}, e2e ms p50 {m['e2e_ms']['p50']:.1f} "
          f"p95 {m['e2e_ms']['p95']:.1f}, server CPU {m['server_cpu_per_s']:.2f} cores")
    if (a := res.get("abused")) is not None:
        print(f"the same beside {res['big_senders']} senders of {res['big_prompt_bytes']}-byte prompts and "
              f"{res['churners']} churning clients: {a['seconds']:.1f} s, {a['status']}, 429s {a['429s']}, e2e ms p50 "
              f"{a['e2e_ms']['p50']:.1f} p95 {a['e2e_ms']['p95']:.1f} ({a['e2e_ms']['p50'] / m['e2e_ms']['p50']:.2f}x "
              f"the quiet p50), server CPU {a['server_cpu_per_s']:.2f} cores; long prompts {a['big_per_s']:.0f}/s "
              f"({a['abusers']['big']}), churns {a['churns_per_s']:.0f}/s ({a['abusers']['churned']} left queued, "
              f"{a['abusers']['churn_answered']} answered first)")
    print(f"server RSS: start {mb(r['start'])}, after the first tenth {mb(r.get('warm', r['start']))}, max "
          f"{mb(r['max'])}, end {mb(r['end'])} (growth {mb(res['rss_growth_bytes'])})")
    print(f"SIGTERM after {t.get('sent_at')} of {t['requests']} answered: {t['status']}, 429s {t['429s']}, "
          f"server exit code {t['exit_code']}")
    print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in res["checks"].items()))


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--pte", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("PIPELINE_OUTPUTS", ROOT / "outputs")) / "store")
    ap.add_argument("--threads", type=int, default=1, help="torch and ExecuTorch threads, here and in the server")
    ap.add_argument("--load", action="store_true", help="the load test instead of the throughput table")
    ap.add_argument("--clients", type=int, nargs="+", default=None,
                    help="throughput: the levels (default 1 4 16); --load: the number (default 16)")
    ap.add_argument("--requests", type=int, default=500, help="--load: requests in all")
    ap.add_argument("--queue-size", type=int, default=None, help="the server's (default 16; --load: 8)")
    ap.add_argument("--drain-s", type=float, default=30.0)
    ap.add_argument("--prompts", type=int, default=None, help="distinct prompts (default 4; --load: 32)")
    ap.add_argument("--reps", type=int, default=3, help="throughput: passes over the 1-client requests")
    ap.add_argument("--prompt-len", type=int, default=64, help="throughput: its length; --load: the longest")
    ap.add_argument("--max-tokens", type=int, default=128, help="throughput: per request; --load: the largest")
    ap.add_argument("--chains", type=lambda s: sorted({int(k) for k in s.split(",")}), default=None,
                    help="throughput: the K of the requests, comma-separated, 0 among them (default 0, 1, 2, the "
                         ".pte's default, max_m - 1)")
    ap.add_argument("--big-senders", type=int, default=0,
                    help="--load: clients sending --big-prompt-bytes prompts beside a second run of the burst")
    ap.add_argument("--churners", type=int, default=0,
                    help="--load: clients that disconnect while queued, beside a second run of the burst")
    ap.add_argument("--big-prompt-bytes", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if (args.pte is None) != (args.tokenizer is None):
        ap.error("give both --pte and --tokenizer, or neither (the newest export artifact in --store)")
    pte, tok_path = (args.pte, args.tokenizer) if args.pte else newest_export(args.store)
    args.prompts = args.prompts or (32 if args.load else 4)
    args.queue_size = args.queue_size if args.queue_size is not None else (8 if args.load else 16)

    import torch
    from tokenizers import Tokenizer

    from runner.build import build_engine

    torch.set_num_threads(args.threads)
    # as runner.serve builds it without --exact-width
    engine = build_engine({"kind": "pte", "exact": False, "exact_width": None}, pte=pte, tokenizer=tok_path)
    tokenizer = Tokenizer.from_file(str(tok_path))
    head = {"command": "python -m bench.serve " + " ".join(argv if argv is not None else sys.argv[1:]),
            "pte": str(pte), "tokenizer": str(tok_path), "threads": args.threads, "machine": machine(),
            "meta": {k: v for k, v in engine.meta.items() if k != "d2t"}}
    if args.load:
        args.clients = (args.clients or [16])[0]
        res = {**head, **load(args, engine, tokenizer, pte, tok_path)}
        print_load(res)
        ok = all(res["checks"].values())
    else:
        args.clients = args.clients or [1, 4, 16]
        server = Server(pte, tok_path, threads=args.threads, queue_size=args.queue_size, drain_s=args.drain_s)
        try:
            res = {**head, **throughput(args, engine, tokenizer, server)}
        finally:
            server.stop()
        print_throughput(res)
        ok = res["mismatched_texts"] == 0 and not res["chains_differing_from_k0"]
    res["machine_after"] = {"loadavg": list(os.getloadavg())}
    out = args.out or RESULTS / ("cpu-serve-load.json" if args.load else "cpu-serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
