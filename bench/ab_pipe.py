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

# name: (DIAG, stages or None for the shipped config)
VARIANTS = {"std": (dict(pipe=0, tiled=False), None), "tiled": (dict(pipe=0, tiled=True), None),
            "tiled_p2": (dict(pipe=2, tiled=True), None), "tiled_s6": (dict(pipe=0, tiled=True), 6),
            "tiled_s3": (dict(pipe=0, tiled=True), 3)}
RESET = dict(pipe=0, tiled=False)


def tiled(packed):
    """[N, K/2] -> the same bytes as [N/64, K/128, 64, 64 B]: one contiguous 4 KB box per (column tile, group)."""
    N, half_k = packed.shape
    w = packed.view(torch.int32).reshape(N // 64, 64, half_k // 64, 16).permute(0, 2, 1, 3).contiguous()
    return w.view(torch.uint8).view(N, half_k)


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
            tp = tiled(packed)
            for name, (d, _) in VARIANTS.items():
                int4_gluon.DIAG.update(d)
                ys[name] = G.int4_mm(x, tp if d["tiled"] else packed, sz, 128).clone()
            int4_gluon.DIAG.update(RESET)
            errs = {n: rel_err(y, ref) for n, y in ys.items()}
            diff = {n: (y.float() - ys["std"].float()).abs().max().item() for n, y in ys.items()}
            out.append(dict(K=K, N=N, M=M, err=errs, maxdiff_vs_std=diff))
            ok = all(e < 4e-3 for e in errs.values())
            print(f"check {K}x{N} M={M}: {'ok' if ok else 'FAIL'} " + " ".join(f"{n} {e:.2e}" for n, e in errs.items())
                  + " maxdiff vs std " + " ".join(f"{n} {d:.1e}" for n, d in diff.items()), flush=True)
    return out


def timings(bw, rounds=2):
    rows = []
    for K, N in GEMM_SHAPES:
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        tops = [(tiled(p), sz) for p, sz in ops]
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            res = {}
            for _ in range(rounds):
                for name, (d, stages) in VARIANTS.items():
                    int4_gluon.DIAG.update(d)
                    saved = int4_gluon.CONFIGS[(K, N)]
                    if stages:
                        int4_gluon.CONFIGS[(K, N)] = with_stages(K, N, stages)
                    o = tops if d["tiled"] else ops
                    t = time_calls([lambda i=i: G.int4_mm(xs[i], *o[i], 128) for i in range(copies)])
                    a = time_calls([lambda i=i: int4_mm_alone(xs[i], *o[i], 128) for i in range(copies)])
                    int4_gluon.CONFIGS[(K, N)] = saved
                    res.setdefault(name, []).append(t)
                    res.setdefault(name + " alone", []).append(a)
            int4_gluon.DIAG.update(RESET)
            rows.append(dict(K=K, N=N, M=M, floor=floor, times=res))
            print(f"{K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{n} {min(v):.1f} ({floor / min(v):.2f})"
                                                              for n, v in res.items()), flush=True)
        del ops, tops
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
