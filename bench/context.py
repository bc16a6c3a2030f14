"""Benchmark: speculative decoding at the lengths users send, on a .pte: prompts of several context lengths.

    python -m bench.context                                   # the store's newest embedded-default .pte
    python -m bench.context --pte F --tokenizer T --contexts 256,1024,1792 --new-tokens 256 --chains 0,3,6 \
        --json bench/results/x.json

For each context length, held-out prompts of that many tokens (cut as the eval cuts them) decode
`--new-tokens` tokens at K = 0 and at every K of `--chains`, K interleaved prompt by prompt, so every K meets the
same machine state. Per context: K=0 tokens/s, each K's tokens/s, tau and speedup, whether every K gave K=0's
tokens (lossless), and tau by position in the answer (the rounds that start at answer tokens 0-64, 64-256,
256-512, ...): a draft that does not carry its acceptance past the lengths it trained at shows there. The
prompt and answer must fit the program's cache (`get_max_seq_len`). Every row names the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.draft import POSITION_BUCKETS as BUCKETS  # the draft stage's held-out report pools by the same


def tau_by_position(results) -> dict[str, float | None]:
    """Tokens per round over the rounds whose first token lies at answer positions [lo, hi) of BUCKETS, pooled
    over `results` (runner.generate.GenerationResult; the prefill's token is answer position 0)."""
    sums = {b: [0, 0] for b in BUCKETS}
    for r in results:
        at = 1
        for emitted in r.emitted:
            b = max(x for x in BUCKETS if x <= at)
            sums[b][0] += emitted
            sums[b][1] += 1
            at += emitted
    edges = list(BUCKETS) + [None]
    return {f"{lo}-{hi if hi is not None else ''}": (s / n if n else None)
            for lo, hi, (s, n) in zip(edges, edges[1:], (sums[b] for b in BUCKETS))}


def run(args) -> dict:
    from runner.engine import PteEngine, set_threads

    threads = set_threads(args.threads)
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from bench.targets import make_prompts
    from pipeline.hardware import cpu_fingerprint
    from runner.generate import generate

    engine = PteEngine(args.pte, verified=False)
    max_seq_len = engine.meta["max_seq_len"]
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    chains = sorted({0, *(int(k) for k in args.chains.split(","))})
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        if context + args.new_tokens > max_seq_len:
            raise SystemExit(f"--contexts {context} + --new-tokens {args.new_tokens} exceed the program's cache of "
                             f"{max_seq_len} positions (export.max_seq_len)")
        prompts = make_prompts(tokenizer, args.prompt_format, None, args.prompts, context, args.seed)
        generate(engine, prompts[0], chain=chains[-1], max_new_tokens=16)  # warm-up at this length
        got = {k: [] for k in chains}
        for p in tqdm(prompts, desc=f"context {context}", leave=False):
            for k in chains:
                got[k].append(generate(engine, p, chain=k, max_new_tokens=args.new_tokens))
        rate = {k: sum(r.decode_tokens for r in got[k]) / sum(r.decode_ms for r in got[k]) * 1e3 for k in chains}
        row = {"context": context, "prompts": len(prompts), "new_tokens": args.new_tokens,
               "k0_tokens_per_s": rate[0], "chains": {}}
        for k in chains[1:]:
            rounds = sum(r.rounds for r in got[k])
            row["chains"][k] = {
                "tokens_per_s": rate[k], "speedup": rate[k] / rate[0],
                "tau": sum(r.decode_tokens for r in got[k]) / rounds,
                "lossless": all(a.output_ids == b.output_ids for a, b in zip(got[k], got[0])),
                "tau_by_position": tau_by_position(got[k]),
            }
        best = max(row["chains"], key=lambda k: row["chains"][k]["tokens_per_s"])
        row["best_chain"], row["best_speedup"] = best, row["chains"][best]["speedup"]
        rows.append(row)
        print(table_row(row), flush=True)
    return {"machine": cpu_fingerprint(), "threads": threads, "pte": str(args.pte), "max_seq_len": max_seq_len,
            "rows": rows}


def table_row(row: dict) -> str:
    best = row["chains"][row["best_chain"]]
    pos = best["tau_by_position"]
    by_pos = " ".join(f"{k}:{v:.2f}" for k, v in pos.items() if v is not None)
    lossless = all(c["lossless"] for c in row["chains"].values())
    return (f"context {row['context']:>5}: K=0 {row['k0_tokens_per_s']:7.0f} tok/s | best K={row['best_chain']} "
            f"{best['tokens_per_s']:7.0f} tok/s, {best['speedup']:.2f}x, tau {best['tau']:.2f} | lossless "
            f"{lossless} | tau by answer position {by_pos}")


def main(argv=None) -> int:
    from bench.round import add_program_arguments, program_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_program_arguments(ap)
    ap.add_argument("--contexts", default="256,1024,1792", help="prompt tokens, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chains", default="2,4,6")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    program_of(ap, args)
    result = run(args)
    m = result["machine"]
    print(f"{m['cpu']} ({m['capability']}), {result['threads']} thread(s), cache {result['max_seq_len']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
