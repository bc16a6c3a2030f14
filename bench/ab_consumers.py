"""Temporary A/B (eighth session): two consumer warp groups per program (int4_gluon.DIAG['consumers'] = 2: the
even and the odd groups, each in stages of its own parity, summed through shared memory at the end) against one.
A program is then 12 warps at 56 registers (the consumers raised to 80 and 64, the producer at 24): 3 per SM.

    python3 -m bench.ab_consumers $OUT/ab_consumers.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

# (K, N): [(name, consumers, config)], the shipped config first
VARIANTS = {
    (5376, 21504): [("shipped", 1, None), ("c2 s4", 2, (1, 4, 64)), ("c2 s6", 2, (1, 6, 64)), ("c2 s8", 2, (1, 8, 64))],
    (4096, 14336): [("shipped", 1, None), ("c2 s4", 2, (1, 4, 64)), ("c2 s8", 2, (1, 8, 64))],
    (21504, 5376): [("shipped", 1, None), ("c2 split4 s8", 2, (4, 8, 64)), ("c2 split3 s8", 2, (3, 8, 64)),
                    ("c2 split4 s4", 2, (4, 4, 64))],
    (14336, 4096): [("shipped", 1, None), ("c2 split4 s8", 2, (4, 8, 64)), ("c2 split4 s4", 2, (4, 4, 64))],
    (8192, 28672): [("shipped", 1, None), ("c2 s8", 2, (1, 8, 64))],
    (4096, 4096): [("shipped", 1, None), ("c2 split4 s4", 2, (4, 4, 64)), ("c2 split4 s8", 2, (4, 8, 64))],
}


def setv(shape, consumers, config, shipped):
    int4_gluon.DIAG["consumers"] = consumers
    int4_gluon.CONFIGS[shape] = config or shipped


def main():
    out, res = sys.argv[1], dict(check=[], rows={})
    torch.manual_seed(0)
    for (K, N), variants in VARIANTS.items():
        shipped = int4_gluon.CONFIGS[(K, N)]
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        w = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 5, 8, 12):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ w.T
            for name, c, cfg in variants:
                setv((K, N), c, cfg, shipped)
                y1 = G.int4_mm(x, packed, sz, 128)
                y2 = G.int4_mm(x, packed, sz, 128)
                err = B.rel_err(y1, ref)
                res["check"].append(dict(K=K, N=N, M=M, name=name, err=err, repeat_equal=bool(torch.equal(y1, y2))))
                assert err < 4e-3 and torch.equal(y1, y2), (K, N, M, name, err)
        setv((K, N), 1, None, shipped)
    B.log("check ok: " + f"{len(res['check'])} cases, worst rel err {max(r['err'] for r in res['check']):.2e}")
    bw = B.measure_bandwidth()["sm_copy"]
    res["bw"] = bw
    for (K, N), variants in VARIANTS.items():
        shipped = int4_gluon.CONFIGS[(K, N)]
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = B.gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            t = {}
            for rnd in range(2):
                for name, c, cfg in variants:
                    setv((K, N), c, cfg, shipped)
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)]))
                    t.setdefault(name + " alone", []).append(
                        B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)]))
            setv((K, N), 1, None, shipped)
            res["rows"][f"{K}x{N} M={M}"] = dict(floor=floor, times=t)
            B.log(f"{K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{k} {min(v):.1f} ({floor / min(v):.2f})"
                                                                for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)
        del ops
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
