"""Investigation: what alternating K = 0 and K per prompt (the eval's timing) costs the speculative runs, against
running each K over all prompts in a block (a user's steady use).

    python -m bench.lab.interleave --pte outputs/store/export/<key>/model.pte \
        --tokenizer outputs/store/target/<key>/tokenizer.json --chain 6 --threads 1

One loaded program, the eval's 8 held-out prompts of 64 tokens, 128 new tokens; blocks and alternation twice each,
in turn, printed as K = 0 tokens/s, K tokens/s, their ratio and the round's ms. Alternating, every generation
starts with the other method's weights in the caches (target_decode and target_verify each hold a packed copy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pte", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--chain", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from runner.engine import PteEngine, set_threads

    set_threads(args.threads)
    from tokenizers import Tokenizer

    from bench.targets import make_prompts
    from runner.generate import generate

    engine = PteEngine(args.pte)
    prompts = make_prompts(Tokenizer.from_file(str(args.tokenizer)), "plain", None, 8, 64, 0)
    for k in (0, args.chain):
        generate(engine, prompts[0], chain=k, max_new_tokens=16)

    def rate(results):
        return sum(r.decode_tokens for r in results) / sum(r.decode_ms for r in results) * 1e3

    for mode in ("blocks", "alternating", "blocks", "alternating"):
        base, spec = [], []
        if mode == "blocks":
            base = [generate(engine, p, chain=0, max_new_tokens=128) for p in prompts]
            spec = [generate(engine, p, chain=args.chain, max_new_tokens=128) for p in prompts]
        else:
            for p in prompts:
                base.append(generate(engine, p, chain=0, max_new_tokens=128))
                spec.append(generate(engine, p, chain=args.chain, max_new_tokens=128))
        round_ms = sum(r.decode_ms for r in spec) / sum(r.rounds for r in spec)
        print(f"{mode:12} K=0 {rate(base):7.0f} tokens/s  K={args.chain} {rate(spec):7.0f} tokens/s  "
              f"{rate(spec) / rate(base):.2f}x  round {round_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
