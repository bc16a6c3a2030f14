"""A/B (temporary): the prep kernel launched as a programmatic dependent of the previous kernel, or plainly."""
import copy
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G


def main():
    out, res = sys.argv[1], {}
    bw = max(B.measure_bandwidth().values())
    for K, N in [(5376, 21504), (4096, 14336), (14336, 4096), (21504, 5376), (8192, 28672), (4096, 28672)]:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = B.gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            t = {}
            for rnd in range(3):
                for prep in (True, False):
                    G.PREP_PDL = prep
                    t.setdefault(f"prep_pdl={prep}", []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
            G.PREP_PDL = True
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M} {B.gemm_path(K, N)} floor {floor:.1f}: " +
                  "  ".join(f"{k} {min(v):.1f} ({floor / min(v):.2f}) {[round(u, 1) for u in v]}" for k, v in t.items()))
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
    for name, m in (("ours", ours), ("fused", fused)):
        for T in (1, 8):
            t = {}
            for rnd in range(3):
                for prep in (True, False):
                    G.PREP_PDL = prep
                    t.setdefault(f"prep_pdl={prep}", []).append(B.time_forward(m, 4096, T))
            G.PREP_PDL = True
            res[f"model {name} T={T}"] = t
            B.log(f"model {name} ctx 4096 T={T}: " + "  ".join(f"{k} {min(v):.0f} {[round(u) for u in v]}"
                                                              for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
