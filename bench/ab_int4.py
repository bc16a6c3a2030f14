"""Side by side in one run: the shipped GEMM at its configuration against a variant that splits K into slices of
unequal k-tile counts (any split, not only divisors), at splits chosen to fill whole waves of 5 programs per SM,
per shape, M = 1 and 8, alternating several times.

    python3 -m bench.ab_int4 --out $OUT/ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench import _int4_uneven as U
from bench.kernels import GEMM_SHAPES, MODEL_SHAPES, copies_for, gemm_operands, log, time_calls
from kernels import int4_gemm as G


SPLITS = {(4096, 4096): (4, 5, 6, 8, 10), (4096, 14336): (2, 3), (14336, 4096): (8, 10, 12),
          (5376, 21504): (2, 3, 4), (21504, 5376): (6, 7, 8), (8192, 28672): (2, 3), (4096, 28672): (2, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = {"ab": {}}
    for (K, N), splits in SPLITS.items():
        cfg = G.CONFIGS[(K, N, 128)]
        runs = [("shipped", G, cfg)] + [(f"uneven split {s}", U, (*cfg[:2], s, *cfg[3:5], 96)) for s in splits]
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        row = {}
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            ts = {name: [] for name, _, _ in runs}
            for _ in range(args.rounds):
                for name, mod, c in runs:
                    ts[name].append(time_calls([lambda i=i, mod=mod, c=c: mod.launch_int4_mm(xs[i], *ops[i], 128, c)
                                                for i in range(copies)], reps=10))
            ref = xs[0].float() @ G.dequantize_int4(*ops[0], 128, torch.float32).t()
            row[M] = {name: dict(config=c, us=statistics.median(ts[name]), all=ts[name], rel_err=(
                (mod.launch_int4_mm(xs[0], *ops[0], 128, c).float() - ref).norm() / ref.norm()).item())
                for name, mod, c in runs}
            base = row[M]["shipped"]["us"]
            log(f"{K}x{N} M={M} {cfg}: " + ", ".join(f"{n} {r['us']:.1f} ({r['us'] / base:.3f}, err {r['rel_err']:.0e})"
                                                    for n, r in row[M].items()))
        res["ab"][f"{K}x{N}"] = {str(m): v for m, v in row.items()}
        del ops
        torch.cuda.empty_cache()
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
