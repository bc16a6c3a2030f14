"""Temporary A/B (ninth session): more K slices on the large shapes, so that their grids run in the overlap mode
with several programs per SM (an overlapped bare read reaches 0.97-1.03 of the floor, call 87), against the
shipped configs. Back to back, three interleaved rounds, M = 1 and 8.

    python3 -m bench.ab_split $OUT/ab_split.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

GEMM = {(5376, 21504): [(3, 4, 64), (3, 6, 64)]}
MS = range(1, 9)


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), cfgs in GEMM.items():
        shipped = int4_gluon.CONFIGS[(K, N)]
        cfgs = [shipped] + cfgs
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        wref = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wref.T
            for c in cfgs:
                int4_gluon.CONFIGS[(K, N)] = c
                assert B.rel_err(G.int4_mm(x, packed, sz, 128), ref) < 4e-3, (K, N, M, c)
        int4_gluon.CONFIGS[(K, N)] = shipped
        del wref
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in MS:
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for c in cfgs:
                    int4_gluon.CONFIGS[(K, N)] = c
                    t.setdefault(str(c), []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
            int4_gluon.CONFIGS[(K, N)] = shipped
            res[f"{K}x{N} M={M}"] = t
            med = {k: sorted(v)[1] for k, v in t.items()}
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
