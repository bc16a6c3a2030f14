"""A/B (temporary): what the chained mode and the new small-shape splits do to the model forward."""
import copy
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon
from kernels import sdpa_midm as S


def setv(name):
    G.ONE_LAUNCH_PDL = name != "one_launch_plain"
    int4_gluon.TRIGGER_PER_SM = 10 ** 6 if name in ("no_chain", "no_chain_old_splits") else 3
    old = name.endswith("old_splits")
    int4_gluon.CONFIGS[(4096, 4096)] = (4, 4, 64, 2) if old else (8, 4, 64, 2)
    int4_gluon.CONFIGS[(14336, 4096)] = (8, 4, 64) if old else (8, 4, 64, 2)
    G.USE_PDL = S.USE_PDL = name != "no_pdl"


def main():
    out, res = sys.argv[1], {}
    from kernels.transform import to_kernels
    base = B.llama3_8b(max_seq_len=4096 + 256)
    ours = to_kernels(copy.deepcopy(base), max_m=8, group=128, fuse=False)
    fused = to_kernels(base, max_m=8, group=128, fuse=True)
    for m in (ours, fused):
        B.set_cache_capacity(m, 4096 + 256)
    torch.cuda.empty_cache()
    names = ["shipped", "one_launch_plain", "no_pdl"]
    bw = max(B.measure_bandwidth().values())
    for K, N in [(4096, 4096), (4096, 1024), (4096, 6144), (14336, 4096)]:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(2):
                for name in names:
                    setv(name)
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
            setv("shipped")
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {min(v):.1f}" for k, v in t.items()))
    for mname, m in (("fused", fused), ("ours", ours)):
        for T in (1, 8):
            t = {}
            for rnd in range(3):
                for name in names:
                    setv(name)
                    t.setdefault(name, []).append(B.time_forward(m, 4096, T))
            setv("shipped")
            res[f"{mname} T={T}"] = t
            B.log(f"model {mname} ctx 4096 T={T}: " + "  ".join(f"{k} {min(v):.0f} {[round(u) for u in v]}"
                                                               for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
