"""Temporary A/B (eighth session): ring stages of the one-launch configs (4096x4096, 4096x1024, 4096x6144,
14336x4096), on their own (back to back and alone, against torch's int4 GEMM) and in the model forward.

    python3 -m bench.ab_stages_small $OUT/ab_stages_small.json
"""

import copy
import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 1024), (4096, 6144), (14336, 4096)]
SHIPPED = {s: int4_gluon.CONFIGS[s] for s in SHAPES}
NAMES = ["s4", "s2", "s3"]


def setv(name):
    stages = int(name[1:])
    for s, c in SHIPPED.items():
        int4_gluon.CONFIGS[s] = (c[0], stages, *c[2:])


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:  # correctness of each variant against the float64 reference
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        w = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 5, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ w.T
            for name in NAMES:
                setv(name)
                err = B.rel_err(G.int4_mm(x, packed, sz, 128), ref)
                assert err < 4e-3, (K, N, M, name, err)
    setv("s4")
    B.log("check ok")
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops]
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                t.setdefault("torch", []).append(
                    B.time_calls([lambda i=i: B.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)]))
                for name in NAMES:
                    setv(name)
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    t.setdefault(name + " alone", []).append(
                        B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)]))
            setv("s4")
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {min(v):.2f}" for k, v in t.items()))
        json.dump(res, open(out, "w"), indent=1)
    from kernels.transform import to_kernels
    base = B.llama3_8b(max_seq_len=4096 + 256)
    ours = to_kernels(copy.deepcopy(base), max_m=8, group=128, fuse=False)
    fused = to_kernels(base, max_m=8, group=128, fuse=True)
    for m in (ours, fused):
        B.set_cache_capacity(m, 4096 + 256)
    torch.cuda.empty_cache()
    for mname, m in (("fused", fused), ("ours", ours)):
        for T in (1, 8):
            t = {}
            for rnd in range(3):
                for name in NAMES:
                    setv(name)
                    t.setdefault(name, []).append(B.time_forward(m, 4096, T))
            setv("s4")
            res[f"{mname} T={T}"] = t
            B.log(f"model {mname} ctx 4096 T={T}: " + "  ".join(f"{k} {min(v):.0f} {[round(u) for u in v]}"
                                                               for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
