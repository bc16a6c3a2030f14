"""Temporary A/B (fourteenth session, call 134): the fused model (Llama-3-8B shapes, CUDA-graph forward, as
bench.kernels' model section) on this code's GEMMs (the fp16 prep path, item 31) against a97837f's (the bf16 prep
path and its one_launch_m; bench/_old_int4_gluon.py), three interleaved rounds, us; plus both paths' GEMM at M = 1
and 8 on the model's shapes back to back.

    python3 -m bench.ab_model_fp16 $OUT/ab_model_fp16.json
"""

import json
import sys

import torch

from bench import _old_int4_gluon as old
from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon as new
from kernels.transform import to_kernels

PATHS = {"fp16 prep": new, "bf16 prep (a97837f)": old}


def main():
    out, res = sys.argv[1], {}
    model = B.llama3_8b(max_seq_len=32768 + 256)
    model = to_kernels(model, max_m=8, group=128, fuse=True)
    torch.cuda.empty_cache()
    for (K, N) in [(4096, 28672), (4096, 128256)]:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for name, mod in PATHS.items():
                    G.int4_gluon = mod
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128)
                                                                for i in range(copies)]))
            G.int4_gluon = new
            res[f"gemm {K}x{N} M={M}"] = t
            B.log(f"gemm {K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
    for ctx in (4096, 32768):
        B.set_cache_capacity(model, ctx + 256)
        torch.cuda.empty_cache()
        for T in (1, 2, 4, 8):
            t = {}
            for rnd in range(3):
                for name, mod in PATHS.items():
                    G.int4_gluon = mod
                    try:
                        t.setdefault(name, []).append(B.time_forward(model, ctx, T))
                    finally:
                        G.int4_gluon = new
            res[f"model ctx={ctx} T={T}"] = t
            B.log(f"model ctx={ctx} T={T}: " + "  ".join(f"{k} {sorted(v)[1]:.0f}" for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
