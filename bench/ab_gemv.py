"""Side-by-side (one run): a one-launch CUDA-core INT4 GEMV for M <= 4 (kernels/int4_gemv.py) against int4_mm
and torch int4 on the small shapes. Temporary A/B harness (issue 7)."""
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels.int4_gemv import launch_int4_gemv

out = {}
CFGS = [(8, 2, 4), (16, 2, 4), (16, 4, 4), (16, 4, 2), (32, 4, 4), (32, 8, 4), (64, 8, 4)]
for K, N in [(4096, 4096), (4096, 1024), (4096, 6144), (4096, 14336)]:
    copies = B.copies_for(N * K / 2)
    ops = B.gemm_operands(K, N, 128, copies)
    tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops]
    for M in (1, 2, 4):
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        ref = G.int4_mm_reference(xs[0], *ops[0], 128)
        row = {"err": max(B.rel_err(launch_int4_gemv(xs[0], *ops[0], 128, *c), ref) for c in CFGS)}
        row["int4_mm"] = B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)])
        row["torch"] = B.time_calls([lambda i=i: B.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)])
        for c in CFGS:
            row[f"gemv{c}"] = B.time_calls([lambda i=i: launch_int4_gemv(xs[i], *ops[i], 128, *c)
                                            for i in range(copies)])
        out[f"{K}x{N} M={M}"] = row
        best = min((v, k) for k, v in row.items() if k.startswith("gemv"))
        print(f"{K}x{N} M={M} | " + " ".join(f"{k}={v:.1f}" for k, v in row.items() if k != "err")
              + f" | err {row['err']:.1e} | best {best[1]} {best[0]:.1f}", flush=True)
    del ops, tg
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)
