"""Temporary diagnostic (twelfth session): what the weights' ring and the consumers cost without the stager in
their way. Interleaved in three rounds, back to back, us, on one-launch shapes at M = 1, 4, 8: `ours` (the shipped
kernel), `ring + consumers` (int4_gluon.DIAG_STREAM 6: the stager stages nothing and the consumers multiply
whatever x the stage holds: no wait for x, wrong values), `ring only` (2) and `stager` (3) as in call 116.

    python3 -m bench.ab_x_depth $OUT/ab_x_depth.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (4096, 28672), (4096, 6144)]
DEPTHS = (2, 4, 8)


def run(config, depth, diag=0):
    def f(x, p, s):
        int4_gluon.X_DEPTH, int4_gluon.DIAG_STREAM = depth, diag
        try:
            return int4_gluon.launch(x, p, s, config)
        finally:
            int4_gluon.X_DEPTH, int4_gluon.DIAG_STREAM = 2, 0
    return f


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        config = int4_gluon.CONFIGS[(K, N)]
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 4, 8):
            if M > config[3]:
                continue
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"ours": run(config, 2), "ring + consumers": run(config, 2, 6), "ring only": run(config, 2, 2),
                   "stager": run(config, 2, 3)}
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    names = ["ours", "ring + consumers", "ring only", "stager"]
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, t in res.items():
        shape, m = key.split(" ")
        print(f"| {shape} | {m[2:]} | " + " | ".join(f"{sorted(t[n])[1]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
