"""Temporary A/B (tenth session): the one-launch staging of x permutes only the next power of 2 >= M rows
(int4_gluon.ROWS_X; the stage's other rows repeat them, and their products are not stored), so at M = 1 the
producer warp does a quarter of the per-group work; and every shape in one launch with it (int4_gluon.ONE_LAUNCH),
no prep kernel. Back to back, three interleaved rounds, M = 1, 2, 4, 8; torch int4 on 4096x4096.

    python3 -m bench.ab_rows $OUT/ab_rows.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = B.GEMM_SHAPES + [(4096, 1024), (4096, 6144), (4096, 28672)]
VARIANTS = {"shipped": (False, False), "rows": (True, False), "one launch, rows": (True, True)}


def main():
    out, res = sys.argv[1], {"check": {}}
    torch.manual_seed(0)
    for K, N in SHAPES:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        wref = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 2, 3, 5, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wref.T
            shipped = G.int4_mm(x, packed, sz, 128)
            for name, (rows, one) in VARIANTS.items():
                int4_gluon.ROWS_X, int4_gluon.ONE_LAUNCH = rows, one
                ys = [G.int4_mm(x, packed, sz, 128) for _ in range(2)]
                int4_gluon.ROWS_X = int4_gluon.ONE_LAUNCH = False
                e = B.rel_err(ys[0], ref)
                same = torch.equal(ys[0], ys[1])
                res["check"][f"{K}x{N} M={M} {name}"] = dict(rel_err=e, repeat_equal=same,
                                                              equal_to_shipped=torch.equal(ys[0], shipped))
                assert e < 4e-3 and same, (K, N, M, name, e)
        B.log(f"check {K}x{N}: ok, " + ", ".join(f"{k}: {v['equal_to_shipped']}" for k, v in res["check"].items()
                                                 if k.startswith(f"{K}x{N} M=1 ")))
        del wref
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops] if (K, N) == (4096, 4096) else None
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for name, (rows, one) in VARIANTS.items():
                    int4_gluon.ROWS_X, int4_gluon.ONE_LAUNCH = rows, one
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    t.setdefault(name + " alone", []).append(
                        B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)]))
                int4_gluon.ROWS_X = int4_gluon.ONE_LAUNCH = False
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
