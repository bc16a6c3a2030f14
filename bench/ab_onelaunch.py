"""Temporary A/B (fourteenth session): with the prep path now on fp16 operands (item 31), where does one launch
(the stager's bf16 x) still beat the prep kernel? Per CONFIGS shape with a one_launch_m, every M in 1..8, one
launch forced against the prep path, same split and stages, three interleaved rounds back to back, us; prints
the largest M up to which one launch wins at every M (the rule `one_launch_m` follows).

    python3 -m bench.ab_onelaunch $OUT/ab_onelaunch.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gluon


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), config in int4_gluon.CONFIGS.items():
        if config is None or len(config) < 4:
            continue
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        wins = []
        for M in range(1, 9):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"one launch": lambda x, p, s: int4_gluon.launch(x, p, s, (*config[:3], 8)),
                   "prep fp16": lambda x, p, s: int4_gluon.launch(x, p, s, config[:3])}
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            med = {k: sorted(v)[1] for k, v in t.items()}
            wins.append(med["one launch"] < med["prep fp16"])
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} {config} M={M}: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
        limit = next((m for m in range(8) if not wins[m]), 8)
        res[f"{K}x{N} one_launch_m"] = limit
        B.log(f"{K}x{N}: one launch wins up to M = {limit} (configured {config[3]})")
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
