"""Temporary A/B (eleventh session): where one launch with the stager warp beats the prep kernel, per shape and M.
Three variants interleaved in three rounds, back to back, every M in 1..8: `before` (the tenth session's kernel
and rule, bench/_gluon_before.py), `prep` (this kernel, x from the prep kernel) and `one launch` (this kernel, x
staged by the stager warp); torch int4 on 4096x4096.

    python3 -m bench.ab_one_launch_m $OUT/ab_one_launch_m.json
"""

import json
import sys

import torch

from bench import _gluon_before as before
from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672), (4096, 1024),
          (4096, 6144), (4096, 28672)]


def variants(K, N, M):
    split, stages, regs, *_ = int4_gluon.CONFIGS[(K, N)]
    return {"before": lambda x, p, s: before.launch(x, p, s, before.pick(K, N, 128, x.device, M)),
            "prep": lambda x, p, s: int4_gluon.launch(x, p, s, (split, stages, regs)),
            "one launch": lambda x, p, s: int4_gluon.launch(x, p, s, (split, stages, regs, 8))}


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops] if (K, N) == (4096, 4096) else None
        for M in range(1, 9):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = variants(K, N, M)
            y0 = {name: f(xs[0], *ops[0]) for name, f in fns.items()}
            assert all(torch.equal(y0["before"], y) for y in y0.values()), (K, N, M)
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


if __name__ == "__main__":
    main()
