"""Benchmark: where a speculative round's time goes on a .pte, against what its calls cost alone.

    python -m bench.round                                  # the store's newest embedded-default .pte, K = 0..7,
                                                           # 1 and 2 threads
    python -m bench.round --pte F --tokenizer T --chains 0,4,6 --threads 1 --json bench/results/x.json

The loop's own rounds (runner.generate over runner.engine.PteEngine, the eval's held-out prompts) run bare, for
their wall time, then again with every engine call timed where it happens (a clock and nothing else around each
call), then once more keeping each call's inputs. Right after that every call of the decode phase is replayed in
the same order on the same inputs (the caches then hold what they held), three ways:
- `alone`: the call three times back to back through the engine, the fastest (what a call costs by itself);
- `after`: the call right after the call that preceded it in the loop (the method switch and reshape, with no
  Python between);
- `execute`: the runtime's own set_inputs + execute, back to back (the engine's wrapper is the rest of `alone`).
A round's wall time then splits into what its calls cost alone, the switch (after - alone), the loop's gaps
(in place - after: threads and caches cooling while Python runs) and the Python between calls (wall - in
place). `round / alone` is the figure to keep near 1. Each thread count runs in a process of its own
(ExecuTorch's pool is sized once per process); every row names the CPU (model, `get_cpu_capability()`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("alone", "switch", "gaps", "python")


class Recorder:
    """An engine that forwards to `inner` and records every call: (method, inputs or None, ms in place). With
    `keep_inputs` it copies each call's inputs (the loop refills its input tensors) for the replay; without,
    it only reads the clock, so the loop around it runs as it does bare."""

    device_rounds = False

    def __init__(self, inner, keep_inputs: bool):
        self.inner, self.meta, self.keep, self.calls = inner, inner.meta, keep_inputs, []
        self.draft_chains = inner.draft_chains

    def reset(self):
        self.inner.reset()

    def _call(self, name, *inputs):
        t0 = time.perf_counter()
        out = self.inner._run(name, *inputs)
        ms = (time.perf_counter() - t0) * 1e3
        self.calls.append((name, tuple(x.clone() for x in inputs) if self.keep else None, ms))
        return out

    def prefill(self, *inputs):
        return self._call("prefill", *inputs)

    def target_verify(self, *inputs):
        return self._call("target_verify", *inputs)

    def target_decode(self, *inputs):
        return self._call("target_decode", *inputs)

    def draft_decode(self, *inputs):
        return self._call("draft_decode", *inputs)

    def draft_chain(self, k, *inputs):
        return self._call(f"draft_chain_{k}", *inputs)[0]


def decode_calls(calls: list, chain: int) -> list:
    """The calls of the rounds: every call after the prefill and, at K > 0, after the draft's seeding on the
    prompt (the first draft_decode; the eval's prompts fit one prefill chunk)."""
    skip = 1 + (chain > 0)
    return calls[skip:]


def _ms(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def _after(engine, prev, fn, inputs) -> float:
    """ms of `fn(*inputs)` run right after the call that preceded it in the loop (`prev`: name, inputs)."""
    if prev is not None:
        engine._run(prev[0], *prev[1])
    return _ms(fn, *inputs)


def _label(name: str, inputs) -> str:
    return f"{name} T={inputs[0].shape[-1]}"


def replay(engine, calls: list) -> tuple[dict, dict]:
    """({method: {in_place, alone, after, execute, n}}, {"<call> after <previous call>": the same}), ms summed
    over `calls`, replayed in order (module docstring)."""
    sums, pairs = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(float))
    prev = None
    for name, inputs, in_place in calls:
        fn = functools.partial(engine._run, name)
        raw = engine._methods[name]._method
        t = {"in_place": in_place, "n": 1}
        t["after"] = min(_after(engine, prev, fn, inputs) for _ in range(2))
        t["alone"] = min(_ms(fn, *inputs) for _ in range(3))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the engine runs a program (runner.engine.PteEngine._run)
        t["execute"] = min(_ms(lambda: (raw.set_inputs(list(inputs)), raw.execute())) for _ in range(3))
        torch.set_num_threads(threads)
        pair = f"{_label(name, inputs)} after {_label(*prev) if prev else 'prefill'}"
        for key, v in t.items():
            sums[name][key] += v
            pairs[pair][key] += v
        prev = (name, inputs)
    return sums, pairs


def child(args) -> dict:
    """One thread count: the rounds at every K, split as the module docstring says."""
    from runner.engine import PteEngine, set_threads

    threads = set_threads(args.threads)
    from tokenizers import Tokenizer

    from bench.targets import make_prompts
    from pipeline.hardware import cpu_fingerprint
    from runner.generate import generate

    engine = PteEngine(args.pte, verified=False)
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    prompts = make_prompts(tokenizer, args.prompt_format, None, args.prompts, args.prompt_len, args.seed)
    clock, keeper = Recorder(engine, keep_inputs=False), Recorder(engine, keep_inputs=True)
    chains = [int(k) for k in args.chains.split(",")]
    for k in chains:  # warm-up: the first calls of each method initialise its delegates
        generate(engine, prompts[0], chain=k, max_new_tokens=16)
    rows = []
    for k in chains:
        wall, rounds, tokens = 0.0, 0, 0
        sums, pairs = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(float))
        for p in prompts:
            # three runs of the same tokens: bare (the round's wall time), clocked (each call in place),
            # keeping the inputs (for the replay, which follows it while the caches hold what they held)
            res = generate(engine, p, chain=k, max_new_tokens=args.new_tokens)
            wall, rounds, tokens = wall + res.decode_ms, rounds + res.rounds, tokens + res.decode_tokens
            clock.calls.clear(), keeper.calls.clear()
            generate(clock, p, chain=k, max_new_tokens=args.new_tokens)
            generate(keeper, p, chain=k, max_new_tokens=args.new_tokens)
            calls = [(name, inputs, ms) for (name, _, ms), (_, inputs, _) in zip(clock.calls, keeper.calls)]
            for into, got in zip((sums, pairs), replay(engine, decode_calls(calls, k))):
                for name, s in got.items():
                    for key, v in s.items():
                        into[name][key] += v
        per_round = lambda key: sum(s[key] for s in sums.values()) / rounds  # noqa: E731
        alone, after, in_place, execute = (per_round(x) for x in ("alone", "after", "in_place", "execute"))
        round_ms = wall / rounds
        rows.append({
            "chain": k, "rounds": rounds, "tokens_per_s": tokens / wall * 1e3, "tau": tokens / rounds,
            "round_ms": round_ms, "alone_ms": alone, "round_over_alone": round_ms / alone,
            "parts_ms": {"alone": alone, "switch": after - alone, "gaps": in_place - after, "python": round_ms - in_place},
            "execute_ms": execute,
            "methods": {name: {key: v / rounds for key, v in s.items() if key != "n"} | {"calls_per_round": s["n"] / rounds}
                        for name, s in sorted(sums.items())},
            "transitions": {name: {key: v / s["n"] for key, v in s.items() if key != "n"} | {"n": s["n"]}
                            for name, s in sorted(pairs.items(), key=lambda kv: -kv[1]["n"])},
        })
    base = next((r for r in rows if r["chain"] == 0), None)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    return {"machine": cpu_fingerprint(), "threads": threads, "load_avg_1min": os.getloadavg()[0],
            "pte": str(args.pte), "prompts": args.prompts, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "rows": rows}


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"{m['cpu']} ({m['capability']}), {result['threads']} thread(s), load {result['load_avg_1min']:.2f}",
             f"{'K':>2} {'tau':>5} {'tok/s':>7} {'speedup':>7} {'round ms':>8} {'alone':>6} {'round/alone':>11}  "
             + " ".join(f"{p:>7}" for p in PARTS[1:]) + "   per call in place / alone (ms)"]
    for r in result["rows"]:
        calls = "  ".join(f"{n} {v['calls_per_round']:.1f}x {v['in_place'] / v['calls_per_round']:.3f}/"
                          f"{v['alone'] / v['calls_per_round']:.3f}" for n, v in r["methods"].items())
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(f"{r['chain']:>2} {r['tau']:>5.2f} {r['tokens_per_s']:>7.0f} {speedup:>7} {r['round_ms']:>8.3f} "
                     f"{r['alone_ms']:>6.3f} {r['round_over_alone']:>10.2f}x  "
                     + " ".join(f"{r['parts_ms'][p]:>7.3f}" for p in PARTS[1:]) + f"   {calls}")
    return "\n".join(lines)


def newest_default_export(store: Path) -> tuple[Path, Path, str]:
    """(model.pte, tokenizer.json, prompt format) of the store's newest export of the embedded default."""
    from bench.targets import store_exports, which_target

    exports = [e for e in store_exports(store) if which_target(e["target_cfg"]) == "tiny"]
    if not exports:
        raise SystemExit(f"no export of the embedded default in {store}: run `python -m pipeline +stage=export` "
                         f"first, or pass --pte and --tokenizer")
    e = max(exports, key=lambda e: e["created_at"] or "")
    return e["path"] / "model.pte", e["target_path"] / "tokenizer.json", e["data_cfg"].get("prompt_format", "plain")


def add_program_arguments(ap: argparse.ArgumentParser) -> None:
    """--pte, --tokenizer, --store, --prompt-format: the program a bench runs and how its prompts are cut
    (`program_of` fills them in)."""
    ap.add_argument("--pte", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--store", type=Path, default=ROOT / "outputs/store")
    ap.add_argument("--prompt-format", default=None, help="plain | chat (default: the target's)")


def program_of(ap: argparse.ArgumentParser, args) -> None:
    """`args.pte`, `.tokenizer` and `.prompt_format` set: as given, or the store's newest export of the embedded
    default; --pte without --tokenizer is refused."""
    if args.pte is None:
        args.pte, tokenizer, fmt = newest_default_export(args.store)
        args.tokenizer = args.tokenizer or tokenizer
        args.prompt_format = args.prompt_format or fmt
    elif args.tokenizer is None:
        ap.error("--pte needs --tokenizer (the tokenizer.json of its target artifact)")
    args.prompt_format = args.prompt_format or "plain"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_program_arguments(ap)
    ap.add_argument("--chains", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--threads", default="1,2", help="comma-separated; each in a process of its own")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    program_of(ap, args)
    if args.child:
        args.threads = int(args.threads)
        print(json.dumps(child(args)))
        return 0
    results = []
    for n in [int(t) for t in str(args.threads).split(",")]:
        cmd = [sys.executable, "-m", "bench.round", "--child", "--pte", str(args.pte), "--tokenizer",
               str(args.tokenizer), "--prompt-format", args.prompt_format, "--chains", args.chains, "--threads",
               str(n), "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new-tokens",
               str(args.new_tokens), "--seed", str(args.seed)]
        out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(table(results[-1]), end="\n\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
