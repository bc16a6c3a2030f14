"""Temporary A/B (eleventh session): the one-launch mode with x staged by separate one-warp partitions
(`_stager`, 1-3 of them, each taking every NS-th group) while the producer warp issues only the weights' TMA
copies. The extra warps sit in the warp group Gluon pads the producer partition to, so a program stays 8 warps
and 64 registers. Checked bitwise against the shipped path; timed back to back (and alone), three interleaved
rounds, M = 1, 2, 4, 8, with torch int4 on 4096x4096.

    python3 -m bench.ab_stagers $OUT/ab_stagers.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672), (4096, 1024),
          (4096, 6144), (4096, 28672)]


def variants(K, N):
    split, stages, regs, *_ = int4_gluon.CONFIGS[(K, N)]
    v = {"shipped": None, "one launch": (split, stages, regs, 2)}
    for ns, depth in ((1, 2), (2, 1), (2, 2), (3, 1)):
        if stages % ns == 0:  # each stage's groups all go to one stager, so its empty waits are in phase order
            v[f"stagers {ns} depth {depth}"] = (split, stages, regs, depth, ns)
    return v


def call(x, packed, sz, config):
    if config is None:
        return G.int4_mm(x, packed, sz, 128)
    return int4_gluon.launch(x, packed, sz, config)


def call_alone(x, packed, sz, config):
    from kernels._jit import note_launch
    note_launch(x.device, False)
    return call(x, packed, sz, config)


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
            for name, config in variants(K, N).items():
                ys = [call(x, packed, sz, config) for _ in range(2)]
                e = B.rel_err(ys[0], ref)
                same = torch.equal(ys[0], ys[1])
                res["check"][f"{K}x{N} M={M} {name}"] = dict(rel_err=e, repeat_equal=same,
                                                              equal_to_shipped=torch.equal(ys[0], shipped))
                assert e < 4e-3 and same, (K, N, M, name, e)
        assert not G.counters(torch.device("cuda")).any()
        B.log(f"check {K}x{N}: ok, " + ", ".join(f"{k}: {v['equal_to_shipped']}" for k, v in res["check"].items()
                                                 if k.startswith(f"{K}x{N} M=1 ")))
        del wref
    json.dump(res, open(out, "w"), indent=1)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops] if (K, N) == (4096, 4096) else None
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for name, config in variants(K, N).items():
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: call(xs[i], *ops[i], config) for i in range(copies)]))
                    t.setdefault(name + " alone", []).append(
                        B.time_calls([lambda i=i: call_alone(xs[i], *ops[i], config) for i in range(copies)]))
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
