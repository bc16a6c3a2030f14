"""Probe: is a round's method switch the CPU's caches? A call timed back to back, right after the call that
precedes it in the loop, and right after reading a buffer of N MiB that shares nothing with the program.

    python -m bench.lab.cache_switch --pte F --tokenizer T [--chain 6] [--threads 1] [--sizes 0,0.5,1,2,4,8,32]

One generate at K=`--chain` over a held-out prompt keeps every call's inputs (bench.round's Recorder); the
rounds' target_verify and draft_chain_<K> calls are then replayed, each way alternating, fastest of three. If a
plain read of about the draft's working set slows the verify as much as the draft call does, the switch is the
caches (the previous call's data evicting this one's), which no change in how the program is exported or called
removes while both working sets exceed the core's L2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pte", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--chain", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="0,0.25,0.5,1,2,4,8,32")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from runner.engine import PteEngine, set_threads

    threads = set_threads(args.threads)
    from tokenizers import Tokenizer

    from bench.round import Recorder, decode_calls
    from bench.targets import make_prompts
    from pipeline.hardware import cpu_fingerprint
    from runner.generate import generate

    engine = PteEngine(args.pte, verified=False)
    prompt = make_prompts(Tokenizer.from_file(args.tokenizer), "plain", None, 1, 64, 0)[0]
    keeper = Recorder(engine, keep_inputs=True)
    generate(engine, prompt, chain=args.chain, max_new_tokens=32)  # warm-up
    generate(keeper, prompt, chain=args.chain, max_new_tokens=128)
    calls = decode_calls(keeper.calls, args.chain)
    sizes = [float(s) for s in args.sizes.split(",")]
    buffers = {s: np.ones(max(1, int(s * 2**20 / 4)), dtype=np.float32) for s in sizes}

    def ms(name, inputs):
        t0 = time.perf_counter()
        engine._run(name, *inputs)
        return (time.perf_counter() - t0) * 1e3

    out = {}
    for target in ("target_verify", f"draft_chain_{args.chain}"):
        pairs = [(calls[i - 1], calls[i]) for i in range(1, len(calls)) if calls[i][0] == target][: args.rounds]
        rows = {"alone": [], "after_previous_call": []} | {f"after_{s:g}MiB": [] for s in sizes}
        for (pname, pin, _), (name, inputs, _) in pairs:
            rows["alone"].append(min(ms(name, inputs) for _ in range(3)))
            after = []
            for _ in range(3):
                engine._run(pname, *pin)
                after.append(ms(name, inputs))
            rows["after_previous_call"].append(min(after))
            for s in sizes:
                after = []
                for _ in range(3):
                    ms(name, inputs)
                    float(buffers[s].sum())
                    after.append(ms(name, inputs))
                rows[f"after_{s:g}MiB"].append(min(after))
        out[target] = {k: statistics.median(v) for k, v in rows.items()}
    result = {"machine": cpu_fingerprint(), "threads": threads, "chain": args.chain, "pte": args.pte,
              "torch_threads": torch.get_num_threads(), "median_ms": out}
    for target, r in out.items():
        base = r["alone"]
        print(f"{target}: " + "  ".join(f"{k} {v:.3f} ms ({v / base:.2f}x)" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
