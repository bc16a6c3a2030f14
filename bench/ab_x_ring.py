"""Temporary A/B (twelfth session): x in a ring of its own in the one-launch mode (int4_gluon.X_RING_STAGES slots,
the stager's `xfull` / `xempty`), so the stager no longer waits for a weights stage's release before staging x
into it (bench/NOTES.md item 29: without the stager in the weights' way a call is 8-25% faster). Interleaved in
three rounds, back to back, us: `before` (the shipped kernel and rule, bench/_gluon_before.py), `ring 8` and
`ring 4` (one launch at every M with 8 or 4 x slots), `prep` (x from the prep kernel). Outputs bitwise equal.

    python3 -m bench.ab_x_ring $OUT/ab_x_ring.json
"""

import json
import sys

import torch

from bench import _gluon_before as before
from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672), (4096, 28672),
          (4096, 6144), (4096, 1024)]


def ring(config, slots):
    def f(x, p, s):
        int4_gluon.X_RING_STAGES = slots
        try:
            return int4_gluon.launch(x, p, s, (*config[:3], 8))
        finally:
            int4_gluon.X_RING_STAGES = 8
    return f


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        config = int4_gluon.CONFIGS[(K, N)]
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"before": lambda x, p, s: before.launch(x, p, s, before.pick(K, N, 128, x.device, M)),
                   "ring 8": ring(config, 8), "ring 4": ring(config, 4),
                   "prep": lambda x, p, s: int4_gluon.launch(x, p, s, config[:3])}
            y0 = {name: f(xs[0], *ops[0]) for name, f in fns.items()}
            bad = [name for name, y in y0.items() if not torch.equal(y0["before"], y)]
            assert not bad, (K, N, M, bad)
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    names = ["before", "ring 8", "ring 4", "prep"]
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, t in res.items():
        shape, m = key.split(" ")
        print(f"| {shape} | {m[2:]} | " + " | ".join(f"{sorted(t[n])[1]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
