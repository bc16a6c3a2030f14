"""Temporary (fifteenth session): a deep first ring, a shallow steady state. The ring has more stages than the
producer keeps in flight once the loop runs (`ahead`): before the wait for the previous call it fills them all, so the
next call's programs stream twice the bytes during this call's tail, while the steady state stays as shipped (4 or 6
groups ahead). Same programs a SM (8 stages: 52 KB a program, 4 fit). Checked against the reference, then three
interleaved rounds, M = 1, 2, 4, 8.

    python3 -m bench.ab_ahead $OUT/ab_ahead.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

MS = (1, 2, 4, 8)


def _trials(K, N):
    """[(label, config, ahead)]: the shipped config at 8 stages, all in flight or as many as shipped."""
    split, stages, regs, *olm = int4_gluon.CONFIGS[(K, N)]
    return [("8 full", (split, 8, regs, *olm), 0), (f"8 ahead {stages}", (split, 8, regs, *olm), stages)]


SHAPES = [(4096, 14336), (14336, 4096), (21504, 5376), (5376, 21504), (8192, 28672), (4096, 4096)]


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        trials = _trials(K, N)
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in (*MS, 3)}
        shipped = int4_gluon.CONFIGS[(K, N)]
        variants = {"shipped": (shipped, 0)}
        for label, cfg, ahead in trials:
            variants[label] = (cfg, ahead)
        errs = {}
        for label, (cfg, ahead) in list(variants.items()):
            try:
                for M in (1, 3, 8):
                    ref = G.int4_mm_reference(xs[M][0], *ops[0], 128)
                    y = int4_gluon.launch(xs[M][0], *ops[0], cfg, ahead=ahead)
                    y2 = int4_gluon.launch(xs[M][0], *ops[0], cfg, ahead=ahead)
                    torch.cuda.synchronize()
                    assert torch.equal(y, y2), f"{label}: repeat launch differs"
                    errs.setdefault(label, []).append(B.rel_err(y, ref))
                assert max(errs[label]) < 5e-3, f"{label}: rel err {errs[label]}"
            except Exception as e:
                B.log(f"{K}x{N} {label}: {e!r}"[:300])
                variants.pop(label)
        rounds = {label: [] for label in variants}
        for rnd in range(3):
            for label, (cfg, ahead) in variants.items():
                rounds[label].append([B.time_calls([lambda i=i, M=M: int4_gluon.launch(
                    xs[M][i], *ops[i], cfg, ahead=ahead) for i in range(copies)])
                    for M in MS])
        med = {label: [sorted(r[j] for r in v)[1] for j in range(len(MS))] for label, v in rounds.items()}
        floor = B.weight_bytes(K, N, 128) / 4.26e12 * 1e6  # (calls 131-135 measured 4.25-4.27 TB/s)
        for label, v in med.items():
            B.log(f"{K}x{N} {label:>16}: " + " / ".join(f"{t:6.2f}" for t in v)
                  + f"   floor/ours {floor / max(v):.2f}-{floor / min(v):.2f}   err {max(errs[label]):.1e}")
        res[f"{K}x{N}"] = dict(median_us=med, rounds=rounds, errs=errs, floor_us=floor,
                               configs={k: [list(c), a] for k, (c, a) in variants.items()})
        del ops, xs
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
