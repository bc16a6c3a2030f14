"""Temporary (fourteenth session, call 135): `bench.kernels --tune`'s Gluon part again on the shapes that miss 0.8,
now that the prep path runs fp16 operands (item 31): the prep path at every split up to 8 and 4 or 6 stages, M = 1,
2, 4, 8, one round; then its two best configs and the shipped one (one launch up to its one_launch_m) interleaved in
three rounds.

    python3 -m bench.tune_gluon $OUT/tune_gluon.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376)]
MS = (1, 2, 4, 8)


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in MS}
        groups = K // int4_gluon.GROUP

        def timed(cfg, reps=10):
            return [B.time_calls([lambda i=i, M=M: int4_gluon.launch(xs[M][i], *ops[i], cfg) for i in range(copies)],
                                 reps=reps) for M in MS]

        rows = {}
        for split in [d for d in range(1, 9) if groups % d == 0 and groups // d >= 2]:
            for stages in (4, 6):
                cfg = (split, stages, 64)
                try:
                    rows[cfg] = timed(cfg)
                except Exception as e:  # shared memory
                    B.log(f"{K}x{N} {cfg}: {e!r}"[:200])
        tried = rows
        ranked = sorted(tried, key=lambda c: max(tried[c]))
        shipped = int4_gluon.CONFIGS[(K, N)]
        finalists = list(dict.fromkeys(ranked[:2] + [shipped]))
        B.log(f"{K}x{N}: " + "; ".join(f"{c} {max(tried[c]):.2f}" for c in ranked[:6]) + f" (shipped {shipped})")
        again = {str(c): [] for c in finalists}
        for rnd in range(3):
            for c in finalists:
                again[str(c)].append(timed(c, reps=25))
        med = {c: [sorted(r[j] for r in v)[1] for j in range(len(MS))] for c, v in again.items()}
        for c, v in med.items():
            B.log(f"   {c}: " + " / ".join(f"{t:.2f}" for t in v))
        res[f"{K}x{N}"] = dict(rows={str(c): v for c, v in rows.items()}, ranked=[str(c) for c in ranked[:6]],
                               finalists=med)
        del ops, xs
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
