"""Temporary A/B (eighth session): the block's registers. Gluon pads the 1-warp producer partition to a warp group,
so a program is 8 warps and at 64 registers only 4 fit an SM; at 48 (the producer at 24, the consumer raised to 72
by setmaxnreg) 5 fit. Earlier versions of this harness (git history) tried the product in parts and a tiled layout.

    python3 -m bench.ab_pipe --out $OUT/ab_pipe.json

Checks each variant against the float64 reference and the shipped loop first, then times every shape at
M = 1 and 8, back to back (as bench.kernels' `ours`) and `alone`, variants interleaved over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from bench.kernels import (GEMM_SHAPES, copies_for, gemm_floor_bytes, gemm_operands, int4_mm_alone,
                           measure_bandwidth, rel_err, time_calls)
from kernels import int4_gemm as G
from kernels import int4_gluon

# name: (DIAG, config override {(K, N): config} or {} for the shipped configs); kernel registers / producer's
VARIANTS = {"r64": (dict(worker=0), {}), "r64w24": (dict(worker=24), {}),
            "r48w24": (dict(worker=24), "regs48"),
            "r48w24split": (dict(worker=24), {(21504, 5376): (7, 6, 48), (5376, 21504): (2, 4, 48)}),
            }
RESET = dict(worker=0)


@contextlib.contextmanager
def configs(over):
    """int4_gluon.CONFIGS with `over` (or every config at 48 registers: "regs48") for the duration."""
    saved = dict(int4_gluon.CONFIGS)
    if over == "regs48":
        over = {k: (c[0], c[1], 48, *c[3:]) for k, c in saved.items() if c and not c[3:]}
    int4_gluon.CONFIGS.update(over)
    try:
        yield
    finally:
        int4_gluon.CONFIGS.clear()
        int4_gluon.CONFIGS.update(saved)


def check():
    out = []
    for K, N in GEMM_SHAPES + [(4096, 1024), (4096, 28672)]:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        w = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        for M in (1, 3, 8, 16):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ w.T
            ys = {}
            for name, (d, _) in VARIANTS.items():
                int4_gluon.DIAG.update(d)
                with configs(VARIANTS[name][1]):
                    ys[name] = G.int4_mm(x, packed, sz, 128).clone()
            int4_gluon.DIAG.update(RESET)
            errs = {n: rel_err(y, ref) for n, y in ys.items()}
            diff = {n: (y.float() - ys["r64"].float()).abs().max().item() for n, y in ys.items()}
            out.append(dict(K=K, N=N, M=M, err=errs, maxdiff_vs_r64=diff))
            ok = all(e < 4e-3 for e in errs.values())
            print(f"check {K}x{N} M={M}: {'ok' if ok else 'FAIL'} " + " ".join(f"{n} {e:.2e}" for n, e in errs.items())
                  + " maxdiff vs r64 " + " ".join(f"{n} {d:.1e}" for n, d in diff.items()), flush=True)
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
                for name, (d, over) in VARIANTS.items():
                    int4_gluon.DIAG.update(d)
                    with configs(over):
                        t = time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)])
                        a = time_calls([lambda i=i: int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)])
                    res.setdefault(name, []).append(t)
                    res.setdefault(name + " alone", []).append(a)
            int4_gluon.DIAG.update(RESET)
            rows.append(dict(K=K, N=N, M=M, floor=floor, times=res))
            print(f"{K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{n} {min(v):.1f} ({floor / min(v):.2f})"
                                                              for n, v in res.items()), flush=True)
        del ops
        torch.cuda.empty_cache()
    return rows


SMALL = [(8, 4, 64, 2), (8, 3, 64, 2), (8, 2, 64, 2), (8, 3, 64, 1), (4, 3, 64, 2), (4, 2, 64, 2)]


def small(bw, rounds=3):
    """4096x4096 at M = 1, 2, 4: one-launch configs against torch's int4 GEMM, interleaved over rounds."""
    from bench.kernels import tinygemm_mm, to_tinygemm, TINYGEMM_EVEN_HIGH
    K = N = 4096
    copies = copies_for(N * K / 2)
    ops = gemm_operands(K, N, 128, copies)
    tg = [to_tinygemm(*o, 128, TINYGEMM_EVEN_HIGH) for o in ops]
    rows = []
    for M in (1, 2, 4):
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        res = {}
        for _ in range(rounds):
            res.setdefault("torch", []).append(time_calls([lambda i=i: tinygemm_mm(xs[i], *tg[i], 128)
                                                           for i in range(copies)]))
            for cfg in SMALL:
                with configs({(K, N): cfg}):
                    res.setdefault(str(cfg), []).append(time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128)
                                                                    for i in range(copies)]))
        rows.append(dict(M=M, times=res))
        print(f"small 4096x4096 M={M}: " + "  ".join(f"{n} {min(v):.2f}" for n, v in res.items()), flush=True)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ab_pipe.json")
    a = p.parse_args()
    torch.manual_seed(0)
    result = dict(check=check())
    json.dump(result, open(a.out, "w"), indent=1)
    bw = measure_bandwidth()["sm_copy"]
    result.update(bw=bw, small=small(bw))
    json.dump(result, open(a.out, "w"), indent=1)
    result.update(rows=timings(bw))
    json.dump(result, open(a.out, "w"), indent=1)
