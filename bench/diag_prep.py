"""Temporary diagnostic (tenth session): what the prep kernel costs a call on the critical path. Back to back on
the prep path's shapes: the shipped call (prep kernel + GEMM) against the GEMM alone on x already in the fragment
order (the prep kernel's output kept from a first call: int4_gluon.PREPARED), as if the previous kernel had written
x in that order. Same configs, same launch rule; three interleaved rounds, M = 1 and 8.

    python3 -m bench.diag_prep $OUT/diag_prep.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = {(4096, 14336): None, (5376, 21504): None, (21504, 5376): None, (8192, 28672): None,
          (14336, 4096): (8, 4, 64), (4096, 4096): (8, 2, 64)}  # the last two: their split on the prep path


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), config in SHAPES.items():
        if config:
            int4_gluon.CONFIGS[(K, N)] = config
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            int4_gluon.KEEP_PREP = True
            ref = [G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]
            int4_gluon.KEEP_PREP = False
            for i in range(copies):
                assert torch.equal(G.int4_mm(xs[i], *ops[i], 128), ref[i])
                saved, int4_gluon.PREPARED = int4_gluon.PREPARED, {}
                assert torch.equal(G.int4_mm(xs[i], *ops[i], 128), ref[i])
                int4_gluon.PREPARED = saved
            prepared, int4_gluon.PREPARED = int4_gluon.PREPARED, {}
            t = {}
            for rnd in range(3):
                for name, table in (("prep + GEMM", {}), ("GEMM alone", prepared)):
                    int4_gluon.PREPARED = table
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
            int4_gluon.PREPARED = {}
            res[f"{K}x{N} M={M} {config or int4_gluon.CONFIGS[(K, N)]}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f} {[round(u, 2) for u in v]}"
                                                 for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
