"""A/B (temporary): stages (shared memory per program, which also caps how many of the next call's programs an
SM can take while this call runs) in the chained mode, and the chained mode forced on sparse grids."""
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

VARIANTS = {  # (split, stages, forced chain)
    (4096, 14336): [(2, 4, 0), (1, 4, 1), (1, 6, 1), (1, 8, 1), (2, 6, 0), (2, 8, 0)],
    (8192, 28672): [(1, 4, 0), (1, 6, 0), (1, 8, 0)],
    (5376, 21504): [(1, 4, 0), (1, 4, 1), (1, 6, 1), (1, 8, 1)],
    (14336, 4096): [(8, 4, 0), (8, 6, 0), (8, 8, 0)],
    (21504, 5376): [(6, 4, 0), (6, 6, 0), (6, 8, 0)],
}


def main():
    out, res = sys.argv[1], {}
    bw = max(B.measure_bandwidth().values())
    for (K, N), variants in VARIANTS.items():
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        saved = int4_gluon.CONFIGS[(K, N)]
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = B.gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            t = {}
            for rnd in range(2):
                for split, stages, forced in variants:
                    int4_gluon.CONFIGS[(K, N)] = (split, stages, 64)
                    int4_gluon.TRIGGER_PER_SM = 0 if forced else 3
                    key = f"split{split} stages{stages}{' chain' if int4_gluon.triggers(N, split, 'cuda') else ''}"
                    t.setdefault(key, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
            int4_gluon.CONFIGS[(K, N)], int4_gluon.TRIGGER_PER_SM = saved, 3
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M} floor {floor:.1f}: " +
                  "  ".join(f"{k} {min(v):.1f} ({floor / min(v):.2f})" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
