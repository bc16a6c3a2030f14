"""Side-by-side (one run): the Gluon INT4 GEMM with a balanced tail (the last `tail` chunks of 4 groups of every
column tile handed out through a queue) against the shipped static kernel. Temporary A/B harness (issue 7)."""
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

out = {}
for K, N in [(8192, 28672), (5376, 21504), (4096, 14336), (4096, 28672)]:
    copies = B.copies_for(N * K / 2)
    ops = B.gemm_operands(K, N, 128, copies)
    base = int4_gluon.pick(K, N, 128, torch.device("cuda"))
    n_g = K // 128
    tails = [t for t in (1, 2, 4, 6) if t * 4 < n_g // 2]
    for M in (1, 8):
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        ref = G.int4_mm_reference(xs[0], *ops[0], 128)
        row = {"err": max(B.rel_err(int4_gluon.launch(xs[0], *ops[0], (1, 4, 64, t)), ref) for t in tails)}
        row[f"static s{base[0]}"] = B.time_calls([lambda i=i: int4_gluon.launch(xs[i], *ops[i], base)
                                                  for i in range(copies)])
        for t in tails:
            row[f"tail{t}"] = B.time_calls([lambda i=i: int4_gluon.launch(xs[i], *ops[i], (1, 4, 64, t))
                                            for i in range(copies)])
        row[f"static s{base[0]}'"] = B.time_calls([lambda i=i: int4_gluon.launch(xs[i], *ops[i], base)
                                                   for i in range(copies)])
        out[f"{K}x{N} M={M}"] = row
        floor = B.gemm_floor_bytes(M, K, N, 128) / 4.27e12 * 1e6
        best = min((v, k) for k, v in row.items() if k != "err")
        print(f"{K}x{N} M={M} floor {floor:.1f} | " + " ".join(f"{k}={v:.1f}" for k, v in row.items() if k != "err")
              + f" | err {row['err']:.1e} | best {best[1]} {best[0]:.1f} ({floor / best[0]:.2f})", flush=True)
    del ops
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)
