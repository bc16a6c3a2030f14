"""Temporary sweep (tenth session): one-launch configs of the small shapes with the rows-specialised staging,
M = 1 and 8, two interleaved rounds; torch int4 beside them.

    python3 -m bench.sweep_small $OUT/sweep_small.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

GRID = {(4096, 4096): [(sp, st, 64, xd) for sp in (8, 16) for st in (2, 3) for xd in (1, 2)],
        (14336, 4096): [(sp, st, 64, xd) for sp in (8, 14, 16) for st in (2, 4) for xd in (1, 2)]}


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), configs in GRID.items():
        shipped = int4_gluon.CONFIGS[(K, N)]
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops]
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(2):
                for c in [shipped] + [c for c in configs if c != shipped]:
                    int4_gluon.CONFIGS[(K, N)] = c
                    t.setdefault(str(c), []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                int4_gluon.CONFIGS[(K, N)] = shipped
                t.setdefault("torch int4", []).append(
                    B.time_calls([lambda i=i: B.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            best = sorted(t.items(), key=lambda kv: max(kv[1]))[:6]
            B.log(f"{K}x{N} M={M} shipped {shipped}: {max(t[str(shipped)]):.2f}; torch {max(t['torch int4']):.2f}; "
                  "best (worse round): " + "  ".join(f"{k} {max(v):.2f}" for k, v in best))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
