"""Temporary A/B (twelfth session): in one launch, slices of up to X_ONCE_GROUPS groups give x a slot per group
of its own (int4_gluon X_SLOTS), so the stager never waits for a weights stage's release and the weights' stages
carry no x (bench/NOTES.md item 29: without the stager in the weights' way the long one-launch loops were 8-25%
faster). Interleaved in three rounds, back to back, us: `before` (the shipped kernel and rule,
bench/_gluon_before.py), `x once` (this kernel, the shipped rule), `x once, one launch` (one launch at every M),
torch int4 on 4096x4096. Outputs bitwise equal.

    python3 -m bench.ab_x_once $OUT/ab_x_once.json
"""

import json
import sys

import torch

from bench import _gluon_before as before
from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144), (4096, 1024)]


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        config = int4_gluon.CONFIGS[(K, N)]
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops] if (K, N) == (4096, 4096) else None
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"before": lambda x, p, s: before.launch(x, p, s, before.pick(K, N, 128, x.device, M)),
                   "x once": lambda x, p, s: int4_gluon.launch(x, p, s, int4_gluon.pick(K, N, 128, x.device, M)),
                   "x once, one launch": lambda x, p, s: int4_gluon.launch(x, p, s, (*config[:3], 8))}
            y0 = {name: f(xs[0], *ops[0]) for name, f in fns.items()}
            bad = [name for name, y in y0.items() if not torch.equal(y0["before"], y)]
            assert not bad, (K, N, M, bad)
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
                if tg:
                    t.setdefault("torch int4", []).append(
                        B.time_calls([lambda i=i: B.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    names = ["before", "x once", "x once, one launch", "torch int4"]
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, t in res.items():
        shape, m = key.split(" ")
        print(f"| {shape} | {m[2:]} | " + " | ".join(f"{sorted(t[n])[1]:.2f}" if n in t else "" for n in names) + " |")


if __name__ == "__main__":
    main()
