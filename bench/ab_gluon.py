"""Side-by-side (one run): the Gluon INT4 GEMM with each column tile starting its walk over K at another group
(ROT) against the shipped order. Temporary A/B harness (issue 7)."""
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

out = {}
SHAPES = B.GEMM_SHAPES[1:] + [(4096, 128256), (4096, 28672)]
for K, N in SHAPES:
    copies = B.copies_for(N * K / 2)
    ops = B.gemm_operands(K, N, 128, copies)
    base = int4_gluon.pick(K, N, 128, torch.device("cuda"))
    for M in (1, 8, 13):
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        ref = G.int4_mm_reference(xs[0], *ops[0], 128)
        row = {"err": max(B.rel_err(int4_gluon.launch(xs[0], *ops[0], (d, 4, 64), rot=r), ref)
                          for d in {1, base[0], 3 if (K // 128) % 3 == 0 else 2} for r in (1, 5))}
        if M == 13:
            print(f"{K}x{N} M=13 err {row['err']:.1e}", flush=True)
            continue
        for rot, stages in ((0, 4), (1, 4), (5, 4), (1, 6), (0, 4)):
            cfg = (base[0], stages, 64)
            row[f"rot{rot} st{stages}" + ("'" if f"rot{rot} st{stages}" in row else "")] = B.time_calls(
                [lambda i=i: int4_gluon.launch(xs[i], *ops[i], cfg, rot=rot) for i in range(copies)])
        out[f"{K}x{N} M={M}"] = row
        floor = B.gemm_floor_bytes(M, K, N, 128) / 4.29e12 * 1e6
        best = min((v, k) for k, v in row.items() if k != "err")
        print(f"{K}x{N} M={M} split {base[0]} floor {floor:.1f} | " + " ".join(f"{k}={v:.1f}" for k, v in row.items()
              if k != "err") + f" | err {row['err']:.1e} | best {best[1]} {best[0]:.1f} ({floor / best[0]:.2f})",
              flush=True)
    del ops
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)
