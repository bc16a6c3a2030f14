"""Temporary A/B (eighth session): 21504x5376 in one launch (the tune's pick in call 75) against the shipped prep
path at 6 stages, and 14336x4096's one launch at 2 stages against 4, on its own and in the model (down_proj).

    python3 -m bench.ab_last $OUT/ab_last.json
"""

import copy
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

GEMM = {(21504, 5376): [(6, 6, 64), (6, 4, 64, 2), (6, 2, 64, 2), (6, 6, 64, 2)],
        (14336, 4096): [(8, 4, 64, 2), (8, 2, 64, 2)]}


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), cfgs in GEMM.items():
        shipped = int4_gluon.CONFIGS[(K, N)]
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        ref = None
        for M in (1, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ G.dequantize_int4(packed, sz, 128, torch.float32).double().T
            for c in cfgs:
                int4_gluon.CONFIGS[(K, N)] = c
                assert B.rel_err(G.int4_mm(x, packed, sz, 128), ref) < 4e-3, (K, N, M, c)
        int4_gluon.CONFIGS[(K, N)] = shipped
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for c in cfgs:
                    int4_gluon.CONFIGS[(K, N)] = c
                    t.setdefault(str(c), []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    t.setdefault(f"{c} alone", []).append(
                        B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)]))
            int4_gluon.CONFIGS[(K, N)] = shipped
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {min(v):.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    from kernels.transform import to_kernels
    base = B.llama3_8b(max_seq_len=4096 + 256)
    ours = to_kernels(copy.deepcopy(base), max_m=8, group=128, fuse=False)
    fused = to_kernels(base, max_m=8, group=128, fuse=True)
    for m in (ours, fused):
        B.set_cache_capacity(m, 4096 + 256)
    torch.cuda.empty_cache()
    shipped = int4_gluon.CONFIGS[(14336, 4096)]
    for mname, m in (("fused", fused), ("ours", ours)):
        for T in (1, 8):
            t = {}
            for rnd in range(3):
                for c in GEMM[(14336, 4096)]:
                    int4_gluon.CONFIGS[(14336, 4096)] = c
                    t.setdefault(str(c), []).append(B.time_forward(m, 4096, T))
            int4_gluon.CONFIGS[(14336, 4096)] = shipped
            res[f"{mname} T={T}"] = t
            B.log(f"model {mname} ctx 4096 T={T}: " + "  ".join(f"{k} {min(v):.0f} {[round(u) for u in v]}"
                                                               for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
