"""A/B (temporary): the one-launch mode (x staged by the GEMM's producer, no prep kernel between chained calls)
on the large shapes in the chained mode, against the shipped configs."""
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

VARIANTS = {  # (split, stages, regs[, x_depth]); the first is the shipped config
    (4096, 14336): [(2, 4, 64), (2, 4, 64, 2), (4, 4, 64, 2), (2, 4, 64, 3)],
    (14336, 4096): [(8, 4, 64), (8, 4, 64, 2), (16, 4, 64, 2), (4, 4, 64, 2)],
    (21504, 5376): [(6, 6, 64), (6, 4, 64, 2), (6, 6, 64, 2), (12, 4, 64, 2)],
    (5376, 21504): [(1, 4, 64), (2, 4, 64, 2), (3, 4, 64, 2), (1, 4, 64, 2)],
    (8192, 28672): [(1, 4, 64), (1, 4, 64, 2), (2, 4, 64, 2)],
    (4096, 4096): [(4, 4, 64, 2), (8, 4, 64, 2), (16, 4, 64, 2), (8, 4, 64)],
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
                for cfg in variants:
                    int4_gluon.CONFIGS[(K, N)] = cfg
                    key = f"{cfg}{' chain' if int4_gluon.triggers(N, cfg[0], 'cuda') else ''}"
                    t.setdefault(key, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    y = G.int4_mm(xs[0], *ops[0], 128)
                    err = B.rel_err(y, xs[0].double() @ G.dequantize_int4(*ops[0], 128, torch.float64).t())
                    assert err < 1e-2, (K, N, M, cfg, err)
            int4_gluon.CONFIGS[(K, N)] = saved
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M} floor {floor:.1f}: " +
                  "  ".join(f"{k} {min(v):.1f} ({floor / min(v):.2f})" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
