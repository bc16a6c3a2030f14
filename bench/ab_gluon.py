"""Prototype check: the Gluon INT4 GEMM (bench/_gluon_int4.py) for correctness, then side by side with the shipped
Triton kernel at the shipped split, per shape, M = 1 and 8.

    python3 -m bench.ab_gluon --out $OUT/ab_gluon.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench import _gluon_int4 as GL
from bench.kernels import GEMM_SHAPES, copies_for, gemm_operands, log, time_calls
from kernels import int4_gemm as G


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tune", action="store_true", help="time every split of K for the Gluon kernel instead")
    args = ap.parse_args()
    if args.tune:
        return tune(args)
    res = {"check": [], "ab": {}}
    torch.manual_seed(0)
    for K, N, split in [(1024, 256, 1), (2048, 512, 2), (4096, 1024, 4), (8192, 28672, 2)]:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        for M in (1, 3, 8, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = GL.launch(x, packed, sz, 128, split)
            torch.cuda.synchronize()
            ref = x.double() @ G.dequantize_int4(packed, sz, 128, torch.float64).t()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            res["check"].append(dict(K=K, N=N, split=split, M=M, rel_err=err))
            log(f"check {K}x{N} split {split} M={M}: rel err {err:.1e}")
            if not err < 4e-3:
                log("GLUON KERNEL WRONG")
                json.dump(res, open(args.out, "w"), indent=1)
                sys.exit(1)
    variants = [("r64_s4", dict(stages=4, maxnreg=64)), ("r64_s3", dict(stages=3, maxnreg=64)),
                ("r64_s6", dict(stages=6, maxnreg=64)), ("r80_s4", dict(stages=4, maxnreg=80))]
    for K, N in GEMM_SHAPES:
        cfg = G.CONFIGS[(K, N, 128)]
        split = cfg[2]  # (every shipped split leaves an even number of groups per slice)
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        row = {}
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            runs = [("shipped", lambda i, xs=xs: G.launch_int4_mm(xs[i], *ops[i], 128, cfg))] + [
                (name, lambda i, xs=xs, kw=kw: GL.launch(xs[i], *ops[i], 128, split, **kw)) for name, kw in variants]
            ts = {name: [] for name, _ in runs}
            for _ in range(args.rounds):
                for name, f in runs:
                    try:
                        ts[name].append(time_calls([lambda i=i, f=f: f(i) for i in range(copies)], reps=10))
                    except Exception as e:  # a variant the compiler refuses
                        ts[name].append(float("nan"))
                        log(f"{name}: {str(e)[:200]}")
            row[M] = {n: statistics.median(t) for n, t in ts.items()}
            base = row[M]["shipped"]
            log(f"{K}x{N} M={M} shipped {cfg} / gluon split {split}: " +
                ", ".join(f"{n} {v:.1f} ({v / base:.3f})" for n, v in row[M].items()))
        res["ab"][f"{K}x{N}"] = dict(config=cfg, gluon_split=split, **{str(m): v for m, v in row.items()})
        del ops
        torch.cuda.empty_cache()
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)


def tune(args):
    """Per shape: the Gluon kernel (64 registers, 4 stages) at every split of K's groups up to 16 (>= 2 groups per
    slice), M = 1 and 8; the best by the worse of the two, then 56 registers and 3 stages at that split; and the
    shipped kernel once for reference."""
    from bench.kernels import MODEL_SHAPES
    res = {}
    for K, N in GEMM_SHAPES + MODEL_SHAPES:
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in (1, 8)}

        def t(f):
            return [time_calls([lambda i=i, M=M: f(xs[M][i], i) for i in range(copies)], reps=10) for M in (1, 8)]
        cfg = G.CONFIGS[(K, N, 128)]
        rows = {"shipped": t(lambda x, i: G.launch_int4_mm(x, *ops[i], 128, cfg))}
        ng = K // 128
        for split in [s for s in range(1, 17) if ng % s == 0 and ng // s >= 2]:
            rows[f"split{split}"] = t(lambda x, i, s=split: GL.launch(x, *ops[i], 128, s))
        best = min((k for k in rows if k.startswith("split")), key=lambda k: max(rows[k]))
        split = int(best[5:])
        rows[f"split{split}_r56"] = t(lambda x, i: GL.launch(x, *ops[i], 128, split, maxnreg=56))
        rows[f"split{split}_s3"] = t(lambda x, i: GL.launch(x, *ops[i], 128, split, stages=3))
        res[f"{K}x{N}"] = dict(best=best, rows=rows)
        log(f"tune {K}x{N}: shipped {max(rows['shipped']):.1f}, best {best} {max(rows[best]):.1f} us; " +
            ", ".join(f"{k} {max(v):.1f}" for k, v in rows.items() if k not in ("shipped", best)))
        del ops, xs
        torch.cuda.empty_cache()
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
