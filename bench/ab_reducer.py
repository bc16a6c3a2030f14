"""Temporary A/B (thirteenth session, call 130): the split-K sum by the last slice of each column tile, which waits
for the others' partials, while the others publish theirs with a release and exit without waiting for a reply
(bench/_gluon_diag.py REDUCER), against the shipped sum by whichever program arrives last (every program waits for
an acquire-release counter). Call 129 priced the whole sum at 1.8-2.8 us a call. The shipped rule and configs,
interleaved in three rounds, back to back, us; outputs bitwise equal.

    python3 -m bench.ab_reducer $OUT/ab_reducer.json
"""

import json
import sys

import torch

from bench import _gluon_diag as diag
from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 14336), (14336, 4096), (21504, 5376), (4096, 4096), (4096, 6144), (4096, 1024)]


def reducer(K, N, M):
    def f(x, p, s):
        diag.REDUCER = True
        try:
            return diag.launch(x, p, s, diag.pick(K, N, 128, x.device, M))
        finally:
            diag.REDUCER = False
    return f


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"ours": lambda x, p, s: int4_gluon.launch(x, p, s, int4_gluon.pick(K, N, 128, x.device, M)),
                   "reducer": reducer(K, N, M)}
            for i in (0, 1, 0):
                y = {name: f(xs[i], *ops[i]) for name, f in fns.items()}
                assert torch.equal(y["ours"], y["reducer"]), (K, N, M)
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            # the chain of calls ends with the counters reset and the results unchanged
            y = {name: f(xs[2], *ops[2]) for name, f in fns.items()}
            assert torch.equal(y["ours"], y["reducer"]), (K, N, M, "after timing")
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
