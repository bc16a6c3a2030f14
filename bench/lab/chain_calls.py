"""Probe: a round's draft in one call (draft_chain_<k>) against step by step (draft_decode per step), on one .pte.

    python -m bench.lab.chain_calls --pte F --tokenizer T [--chains 4,6] [--passes 5] [--threads 1,2]

One process per thread count; in it, passes alternate K = 0, then each K with the chain calls, then each K step by
step, over the same held-out prompts, so both ways meet the same machine state. Prints per K the median tokens/s
of each way and their ratio (chain / steps), and the median speedup of each over the pass's own K = 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(args) -> dict:
    from runner.engine import PteEngine, set_threads

    threads = set_threads(args.threads)
    from tokenizers import Tokenizer

    from bench.targets import make_prompts
    from pipeline.hardware import cpu_fingerprint
    from runner.generate import generate

    engine = PteEngine(args.pte, verified=False)
    if not engine.draft_chains:
        raise SystemExit(f"{args.pte} has no draft_chain_<k> methods (exported with export.draft_chains=false)")
    prompts = make_prompts(Tokenizer.from_file(str(args.tokenizer)), "plain", None, args.prompts, 64, 0)
    chains = [int(k) for k in args.chains.split(",")]

    def rate(k: int, on: bool) -> float:
        engine.draft_chains = on
        ms = n = 0
        for p in prompts:
            r = generate(engine, p, chain=k, max_new_tokens=128)
            ms, n = ms + r.decode_ms, n + r.decode_tokens
        return n / ms * 1e3

    for k in chains:  # warm-up
        rate(k, True), rate(k, False)
    runs = {"base": []} | {(k, on): [] for k in chains for on in (True, False)}
    for _ in range(args.passes):
        runs["base"].append(base := rate(0, True))
        for k in chains:
            for on in (True, False):
                runs[(k, on)].append((rate(k, on), base))
    rows = []
    for k in chains:
        chain, steps = runs[(k, True)], runs[(k, False)]
        rows.append({"chain": k,
                     "chain_tokens_per_s": statistics.median(r for r, _ in chain),
                     "steps_tokens_per_s": statistics.median(r for r, _ in steps),
                     "chain_over_steps": statistics.median(a / b for (a, _), (b, _) in zip(chain, steps)),
                     "chain_speedup": statistics.median(r / b for r, b in chain),
                     "steps_speedup": statistics.median(r / b for r, b in steps)})
    return {"machine": cpu_fingerprint(), "threads": threads, "load_avg_1min": os.getloadavg()[0],
            "baseline_tokens_per_s": statistics.median(runs["base"]), "passes": args.passes, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pte", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--chains", default="4,6")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.threads = int(args.threads)
        print(json.dumps(child(args)))
        return 0
    results = []
    for n in args.threads.split(","):
        cmd = [sys.executable, "-m", "bench.lab.chain_calls", "--child", "--pte", str(args.pte), "--tokenizer",
               str(args.tokenizer), "--chains", args.chains, "--passes", str(args.passes), "--prompts",
               str(args.prompts), "--threads", n]
        out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
        r = json.loads(out.strip().splitlines()[-1])
        results.append(r)
        m = r["machine"]
        print(f"{m['cpu']} ({m['capability']}), {r['threads']} thread(s), K = 0 {r['baseline_tokens_per_s']:.0f} tokens/s")
        for row in r["rows"]:
            print(f"  K={row['chain']}: chain {row['chain_tokens_per_s']:.0f} tokens/s ({row['chain_speedup']:.2f}x), "
                  f"steps {row['steps_tokens_per_s']:.0f} ({row['steps_speedup']:.2f}x), "
                  f"chain / steps {row['chain_over_steps']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
