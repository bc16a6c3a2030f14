"""Temporary harness (eighth session): is the Gluon INT4 GEMM bound by DRAM or by its own per-group work?

    python3 -m bench.diag_int4 --out $OUT/diag.json          # timings, side by side in one run
    python3 -m bench.diag_int4 --ncu                         # the workload for ncu (a few launches)

Per shape and M, back to back as bench.kernels times `ours`:
- cold: the shipped call over rotating weight copies (> L2);
- hot: the same grid and placement, but every program reads the weights of one of the first `hot` column
  tiles (int4_gluon.DIAG['hot']), a set that stays in L2: the time the kernel needs when DRAM is not the limit;
- nomma: cold, but the consumer releases each stage without the unpack, product or epilogue: the producer's
  stream alone (the time the kernel needs when its per-group work is free);
- hot_nomma: both.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.kernels import GEMM_SHAPES, copies_for, gemm_floor_bytes, gemm_operands, measure_bandwidth, time_calls
from kernels import int4_gemm as G
from kernels import int4_gluon

HOT_BYTES = 16e6


def timings(out_path):
    bw = measure_bandwidth()["sm_copy"]
    rows = []
    for K, N in GEMM_SHAPES:
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        hot = max(1, int(HOT_BYTES // (int4_gluon.BLOCK_N * K // 2)))
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            res = {}
            for name, diag, same in [("cold", dict(hot=0, nomma=False), False),
                                     ("hot", dict(hot=hot, nomma=False), True),
                                     ("nomma", dict(hot=0, nomma=True), False),
                                     ("hot_nomma", dict(hot=hot, nomma=True), True)]:
                int4_gluon.DIAG.update(diag)
                res[name] = time_calls([lambda i=i: G.int4_mm(xs[i], *ops[0 if same else i], 128)
                                        for i in range(copies)])
            int4_gluon.DIAG.update(hot=0, nomma=False)
            rows.append(dict(K=K, N=N, M=M, floor=floor, hot_tiles=hot, **res))
            print(f"{K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{k} {v:.1f} ({floor / v:.2f})"
                                                              for k, v in res.items()), flush=True)
            json.dump(dict(bw=bw, rows=rows), open(out_path, "w"), indent=1)
        del ops
        torch.cuda.empty_cache()


def ncu_workload():
    torch.manual_seed(0)
    for K, N in [(8192, 28672), (5376, 21504), (4096, 14336)]:
        packed, scale_zero = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            G.int4_mm(x, packed, scale_zero, 128)
        torch.cuda.synchronize()
        print(K, N, "done", file=sys.stderr)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="diag.json")
    p.add_argument("--ncu", action="store_true")
    a = p.parse_args()
    ncu_workload() if a.ncu else timings(a.out)
