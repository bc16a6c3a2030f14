"""Side by side in one run: the previous GEMM (bench/_int4_v10.py) against kernels.int4_gemm at the same launch
configuration, per shape, M = 1 and 8, alternating the two several times; and, for the smallest shape, where
its time goes (the prep kernel alone, the GEMM alone on precomputed operands, both).

    python3 -m bench.ab_int4 --out $OUT/ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench import _int4_v10 as OLD
from bench.kernels import GEMM_SHAPES, MODEL_SHAPES, copies_for, gemm_operands, log, time_calls
from kernels import int4_gemm as G


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = {"ab": {}, "split": {}}
    for K, N in GEMM_SHAPES + MODEL_SHAPES:
        cfg = OLD.CONFIGS[(K, N, 128)]
        copies = copies_for(N * K / 2)
        ops_new = gemm_operands(K, N, 128, copies)  # the stored format is unchanged
        row = {}
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            old, new = [], []
            for _ in range(args.rounds):
                old.append(time_calls([lambda i=i: OLD.launch_int4_mm(xs[i], *ops_new[i], 128, cfg)
                                       for i in range(copies)], reps=10))
                new.append(time_calls([lambda i=i: G.launch_int4_mm(xs[i], *ops_new[i], 128, cfg)
                                       for i in range(copies)], reps=10))
            ref = xs[0].float() @ G.dequantize_int4(*ops_new[0], 128, torch.float32).t()
            err = ((G.launch_int4_mm(xs[0], *ops_new[0], 128, cfg).float() - ref).norm() / ref.norm()).item()
            row[M] = dict(old=statistics.median(old), new=statistics.median(new), old_all=old, new_all=new,
                          new_rel_err=err)
            log(f"{K}x{N} M={M} {cfg}: v10 {row[M]['old']:.1f} us, v12 {row[M]['new']:.1f} us "
                f"(ratio {row[M]['new'] / row[M]['old']:.3f}; rel err {err:.1e})")
        res["ab"][f"{K}x{N}"] = dict(config=cfg, **{str(m): v for m, v in row.items()})
        del ops_new
        torch.cuda.empty_cache()
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)

    # 4096x4096, M = 1: the prep kernel, the GEMM on precomputed xp/xs (no programmatic dependency), both
    K, N, group = 4096, 4096, 128
    block_n, block_k, split, warps, stages, *cap = G.pick_config(N, K, group)
    copies = copies_for(N * K / 2)
    ops = gemm_operands(K, N, group, copies)
    xs = [torch.randn(1, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    xp = torch.zeros(G.BLOCK_M, K, device="cuda", dtype=torch.bfloat16)
    xsum = torch.zeros(K // group, G.BLOCK_M, device="cuda")
    ys = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    ws = torch.empty(split, N, device="cuda")
    cnt = G.counters(torch.device("cuda"))

    def prep(i):
        G._int4_prep_kernel[(K // group,)](xs[i], xp, xsum, 1, K, K, GROUP=group, BLOCK_M=G.BLOCK_M, PDL=False,
                                           num_warps=4)

    def gemm(i):
        G._int4_mm_kernel[(N // block_n, split)](
            xp, xsum, ops[i][0], ops[i][1].view(torch.int32), ys[i], ws, cnt, 1, N, K, N, GROUP=group,
            BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=G.BLOCK_M, SPLIT_K=split, EVEN_N=True, PTX=True, PDL=False,
            num_warps=warps, num_stages=stages, **({"maxnreg": cap[0]} if cap else {}))

    t = {name: statistics.median(time_calls([lambda i=i: f(i) for i in range(copies)], reps=10) for _ in range(3))
         for name, f in [("prep", prep), ("gemm", gemm),
                         ("both_no_pdl", lambda i: (prep(i), gemm(i))),
                         ("launch_int4_mm", lambda i: G.launch_int4_mm(xs[i], *ops[i], group))]}
    res["split"] = dict(shape="4096x4096", M=1, config=[block_n, block_k, split, warps, stages, *cap], **t)
    log("4096x4096 M=1: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items()))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
