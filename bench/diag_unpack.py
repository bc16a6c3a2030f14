"""Temporary diagnostic (eleventh session): the A operand from the raw weight words, no unpack (int4_gluon.DIAG = 1;
the 32 lop3 and 24 shifts a group and thread become about 24 register copies; wrong values), side by side with the
shipped kernel, three interleaved rounds, back to back, M = 1 and 8: what the unpack costs a call.

    python3 -m bench.diag_unpack $OUT/diag_unpack.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672)]


def main():
    out, res = sys.argv[1], {}
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for name, one in (("shipped", 0), ("no unpack", 1)):
                    int4_gluon.DIAG = one
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    int4_gluon.DIAG = 0
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
