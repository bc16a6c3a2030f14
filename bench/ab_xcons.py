"""Temporary A/B (tenth session): x staged by the consumer warpgroup itself (int4_gluon.CONSUMER_X: cp.async of
natural x CONSUMER_X groups ahead, permuted into the stage with its sums just before the group's product), so that
no call runs a prep kernel and the producer warp only moves weights; against the shipped paths (prep kernel, or
the producer staging x in the one-launch configs) and the GEMM alone on x already in the fragment order
(int4_gluon.PREPARED, the bound from bench/diag_prep.py). Back to back and alone, three interleaved rounds.

    python3 -m bench.ab_xcons $OUT/ab_xcons.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = B.GEMM_SHAPES + [(4096, 1024), (4096, 6144), (4096, 28672)]


def main():
    out, res = sys.argv[1], {"check": {}}
    torch.manual_seed(0)
    for K, N in SHAPES:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        wref = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 3, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wref.T
            int4_gluon.CONSUMER_X = 2
            ys = [G.int4_mm(x, packed, sz, 128) for _ in range(3)]
            int4_gluon.CONSUMER_X = 0
            e = B.rel_err(ys[0], ref)
            same = all(torch.equal(y, ys[0]) for y in ys)
            res["check"][f"{K}x{N} M={M}"] = dict(rel_err=e, repeat_equal=same)
            assert e < 4e-3 and same, (K, N, M, e, same)
        B.log(f"check {K}x{N}: ok")
        del wref
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            config = int4_gluon.CONFIGS[(K, N)]
            if config is not None and len(config) == 3:  # the GEMM alone on prepared x (prep path only)
                int4_gluon.KEEP_PREP = True
                for i in range(copies):
                    G.int4_mm(xs[i], *ops[i], 128)
                int4_gluon.KEEP_PREP = False
            prepared, int4_gluon.PREPARED = int4_gluon.PREPARED, {}
            t = {}
            for rnd in range(3):
                for name, depth, table in (("shipped", 0, {}), ("consumer x 2", 2, {}), ("consumer x 3", 3, {}),
                                           ("GEMM alone", 0, prepared)):
                    if name == "GEMM alone" and not prepared:
                        continue
                    int4_gluon.CONSUMER_X, int4_gluon.PREPARED = depth, table
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    if name != "GEMM alone":
                        t.setdefault(name + " alone", []).append(
                            B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)]))
            int4_gluon.CONSUMER_X, int4_gluon.PREPARED = 0, {}
            res[f"{K}x{N} M={M} {config}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
