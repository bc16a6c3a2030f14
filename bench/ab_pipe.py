"""Temporary A/B (eighth session): the consumer's product issued in parts, each part's unpack overlapping the
previous part's wgmma (int4_gluon.DIAG['pipe'] = 2 or 4), against the shipped loop (0).

    python3 -m bench.ab_pipe --out $OUT/ab_pipe.json

Checks each variant against the float64 reference and the shipped loop first, then times every shape at
M = 1 and 8, back to back (as bench.kernels' `ours`) and `alone`, variants interleaved over rounds.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernels import (GEMM_SHAPES, copies_for, gemm_floor_bytes, gemm_operands, int4_mm_alone,
                           measure_bandwidth, rel_err, time_calls)
from kernels import int4_gemm as G
from kernels import int4_gluon

VARIANTS = {"p0": dict(pipe=0), "p2": dict(pipe=2), "p4": dict(pipe=4)}
STAGE_VARIANTS = {"p4s6": (dict(pipe=4), 6)}


def with_stages(K, N, stages):
    cfg = int4_gluon.CONFIGS[(K, N)]
    return (cfg[0], stages, *cfg[2:])


def check():
    out = []
    for K, N in GEMM_SHAPES + [(4096, 1024), (4096, 28672)]:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        w = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 3, 8, 16):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ w.T
            ys = {}
            for name, d in VARIANTS.items():
                int4_gluon.DIAG.update(d)
                ys[name] = G.int4_mm(x, packed, sz, 128).clone()
            int4_gluon.DIAG.update(pipe=0)
            errs = {n: rel_err(y, ref) for n, y in ys.items()}
            diff = {n: (y.float() - ys["p0"].float()).abs().max().item() for n, y in ys.items()}
            out.append(dict(K=K, N=N, M=M, err=errs, maxdiff_vs_p0=diff))
            ok = all(e < 4e-3 for e in errs.values())
            print(f"check {K}x{N} M={M}: {'ok' if ok else 'FAIL'} " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()),
                  flush=True)
    return out


def timings(bw, rounds=2):
    rows = []
    for K, N in GEMM_SHAPES:
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            res = {}
            for _ in range(rounds):
                for name, d in list(VARIANTS.items()) + [(n, v[0]) for n, v in STAGE_VARIANTS.items()]:
                    int4_gluon.DIAG.update(d)
                    saved = int4_gluon.CONFIGS[(K, N)]
                    if name in STAGE_VARIANTS:
                        int4_gluon.CONFIGS[(K, N)] = with_stages(K, N, STAGE_VARIANTS[name][1])
                    t = time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)])
                    a = time_calls([lambda i=i: int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)])
                    int4_gluon.CONFIGS[(K, N)] = saved
                    res.setdefault(name, []).append(t)
                    res.setdefault(name + " alone", []).append(a)
            int4_gluon.DIAG.update(pipe=0)
            rows.append(dict(K=K, N=N, M=M, floor=floor, times=res))
            print(f"{K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{n} {min(v):.1f} ({floor / min(v):.2f})"
                                                              for n, v in res.items()), flush=True)
        del ops
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ab_pipe.json")
    a = p.parse_args()
    torch.manual_seed(0)
    result = dict(check=check())
    json.dump(result, open(a.out, "w"), indent=1)
    bw = measure_bandwidth()["sm_copy"]
    result.update(bw=bw, rows=timings(bw))
    json.dump(result, open(a.out, "w"), indent=1)
