"""Temporary A/B (twelfth session): how far ahead the stager copies x (X_DEPTH groups). Call 116 timed the stager
alone (no weights copied, consumers releasing each stage unread) at 0.3-0.4 us a group with X_DEPTH 2: about
an L2 round trip over 2. Interleaved in three rounds, back to back, us, on one-launch shapes at M = 1, 4, 8:
`ours dD` (the shipped kernel with X_DEPTH D), `stager dD` (int4_gluon.DIAG_STREAM 3 with X_DEPTH D).

    python3 -m bench.ab_x_depth $OUT/ab_x_depth.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (4096, 28672)]
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
            fns = {"ours": run(config, 2), "ours no fence": run(config, 2, 5), "stager": run(config, 2, 3),
                   "stager no fence": run(config, 2, 4)}
            y0 = [fns[n](xs[0], *ops[0]) for n in ("ours", "ours no fence")]
            res.setdefault("no fence equal", []).append(torch.equal(*y0))
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    names = ["ours", "ours no fence", "stager", "stager no fence"]
    print("no fence bitwise equal:", res.pop("no fence equal"))
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, t in res.items():
        if key == "no fence equal":
            continue
        shape, m = key.split(" ")
        print(f"| {shape} | {m[2:]} | " + " | ".join(f"{sorted(t[n])[1]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
