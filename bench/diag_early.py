"""Temporary diagnostic (thirteenth session): does releasing the weights' stage before the product (once its words,
scale/zero and sums are in registers) bring the ring and the consumers to the ring alone? Interleaved in three
rounds, back to back, us, one launch at every M: `ours` (the shipped kernel), from bench/_gluon_diag.py `ring`
(MODE 1: the consumers release each stage unread, the stager idle), `no x` (MODE 6: the consumers work on whatever x
the stage holds, no wait for x; wrong values), `no x, early` (and the release before the product; call 123) and `no x,
waited` (MODE 7: as `no x`, but the consumers wait once, before their loop, for the previous kernel; call 124), then
(call 125) on grids of exactly 3 and 4 programs a SM beside 4096x14336's 3.4, and (call 126) every grid in the overlap
mode, on grids of 1.7 and 2 programs a SM, so that the next call's grid fits beside this one's (`ours` is then
the diag copy of the kernel); (call 129) `ours` and `no x, waited` with and without the split-K sum (NOSUM).

    python3 -m bench.diag_early $OUT/diag_early.json
"""

import json
import sys

import torch

from bench import _gluon_diag as diag
from bench import kernels as B
from kernels import int4_gluon

# (K, N, split): the shipped 4096x14336 (448 programs, 3.4 a SM) beside grids of exactly 3 and 4 programs a SM
SHAPES = [(4096, 14336, 2), (14336, 4096, 8), (21504, 5376, 6), (4096, 4096, 8)]
TRIGGER_PER_SM = 3  # call 126: 1, every grid in the overlap mode, so the next call's grid can be resident alongside


def variant(config, mode=0, early=False, once=0, nosum=False):
    def f(x, p, s):
        diag.MODE, diag.EARLY, diag.X_ONCE_GROUPS, diag.TRIGGER_PER_SM = mode, early, once, TRIGGER_PER_SM
        diag.NOSUM = nosum
        try:
            return diag.launch(x, p, s, config)
        finally:
            diag.MODE, diag.EARLY, diag.X_ONCE_GROUPS, diag.NOSUM = 0, False, 0, False
    return f


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N, split in SHAPES:
        config = (split, int4_gluon.CONFIGS[(K, N)][1] if (K, N) in int4_gluon.CONFIGS else 4, 64, 8)
        n_g = K // 128 // config[0]
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"ours": variant(config), "ours, no sum": variant(config, nosum=True),
                   "no x, waited": variant(config, mode=7), "no x, waited, no sum": variant(config, mode=7, nosum=True)}
            y0 = {name: f(xs[0], *ops[0]) for name, f in fns.items()}
            torch.cuda.synchronize()
            for name in ("x once", "x once, early"):
                if name in y0:
                    assert torch.equal(y0["ours"], y0[name]), (K, N, M, name)
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            res[f"{K}x{N}/{split} M={M}"] = t
            B.log(f"{K}x{N}/{split} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    names = ["ours", "ours, no sum", "no x, waited", "no x, waited, no sum"]
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, t in res.items():
        shape, m = key.split(" ")
        print(f"| {shape} | {m[2:]} | " + " | ".join(f"{sorted(t[n])[1]:.2f}" if n in t else "" for n in names) + " |")


if __name__ == "__main__":
    main()
