"""Temporary A/B (twelfth session): two groups of k a stage (one full/empty handshake per two groups) against the
shipped one group a stage. Variants interleaved in three rounds, back to back (CUDA graph of rotating copies), at
M = 1, 2, 4, 8, each on the shipped config's path (one launch up to one_launch_m, the prep kernel above):
`shipped` (SG 1, the config's stages), `sg2 same bytes` (SG 2, half the stages, at least 2) and `sg2` (SG 2, the
config's stages: twice the bytes in flight). (SG 4 spills at 64 registers: `bench.sass`.) Outputs must be bitwise equal (same products, same order).

    python3 -m bench.ab_stage_groups $OUT/ab_stage_groups.json
"""

import json
import sys

import torch

from bench import kernels as B
from bench import _gluon_before as before
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672), (4096, 28672)]


def run(sg, config):
    def f(x, p, s):
        int4_gluon.STAGE_GROUPS = sg
        try:
            return int4_gluon.launch(x, p, s, config)
        finally:
            int4_gluon.STAGE_GROUPS = 1
    return f


def variants(K, N):
    split, stages, regs, *rest = int4_gluon.CONFIGS[(K, N)]
    return {"before": lambda x, p, s: before.launch(x, p, s, (split, stages, regs, *rest)),
            "sg1": run(1, (split, stages, regs, *rest)),
            "sg2 same bytes": run(2, (split, max(stages // 2, 2), regs, *rest)),
            "sg4": run(4, (split, 2, regs, *rest))}


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = variants(K, N)
            y0 = {name: f(xs[0], *ops[0]) for name, f in fns.items()}
            bad = [name for name, y in y0.items() if not torch.equal(y0["before"], y)]
            assert not bad, (K, N, M, bad)
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    print("\n| K x N | M | " + " | ".join(variants(4096, 4096)) + " |")
    for key, t in res.items():
        shape, m = key.split(" ")
        print(f"| {shape} | {m[2:]} | " + " | ".join(f"{sorted(v)[1]:.2f}" for v in t.values()) + " |")


if __name__ == "__main__":
    main()
