"""Temporary A/B (tenth session): the split-K partials summed through a thread-block cluster's distributed shared
memory (int4_gluon.CLUSTER_SUM: the SPLIT_K CTAs of a column tile form one cluster; the others put their partials
in their own shared memory and arrive on rank 0's mbarrier, rank 0 adds them in slice order and stores) against the
shipped global workspace + arrival counter (two L2 round trips at the end of every tile). Correctness first
(bitwise equal to the shipped path, close to float64), then back to back and alone, three interleaved rounds.

    python3 -m bench.ab_cluster $OUT/ab_cluster.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = [(4096, 4096), (14336, 4096), (21504, 5376), (4096, 14336), (4096, 1024), (4096, 6144)]


def main():
    out, res = sys.argv[1], {"check": {}}
    torch.manual_seed(0)
    for K, N in SHAPES:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        wref = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 3, 8, 12):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wref.T
            shipped = G.int4_mm(x, packed, sz, 128)
            int4_gluon.CLUSTER_SUM = 1
            ys = [G.int4_mm(x, packed, sz, 128) for _ in range(3)]
            int4_gluon.CLUSTER_SUM = 2
            ys.append(G.int4_mm(x, packed, sz, 128))
            int4_gluon.CLUSTER_SUM = 3
            ys.append(G.int4_mm(x, packed, sz, 128))
            int4_gluon.CLUSTER_SUM = 0
            torch.cuda.synchronize()
            e = B.rel_err(ys[0], ref)
            same = all(torch.equal(y, shipped) for y in ys)
            res["check"][f"{K}x{N} M={M}"] = dict(rel_err=e, equal_to_shipped=same)
            B.log(f"check {K}x{N} M={M}: rel err {e:.2e}, equal to shipped {same}")
            assert e < 4e-3 and same, (K, N, M, e, same)
        del wref
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops] if (K, N) == (4096, 4096) else None
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for name, flag in (("workspace", 0), ("cluster", 1), ("cluster launch, workspace", 2),
                                   ("4 producer warps", 3)):
                    int4_gluon.CLUSTER_SUM = flag
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    t.setdefault(name + " alone", []).append(
                        B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)]))
                int4_gluon.CLUSTER_SUM = 0
                if tg:
                    t.setdefault("torch int4", []).append(
                        B.time_calls([lambda i=i: B.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f} {[round(u, 2) for u in v]}"
                                                 for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
