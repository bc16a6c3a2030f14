"""Temporary (fifteenth session): one wide program a SM against the shipped grids on the four shapes that miss 0.8.

The trial: 128 output columns a program (two consumer warp groups), as few K slices as give about one program a
SM (4096x14336 unsplit: 112 programs; 14336x4096 split 4: 128; 21504x5376 split 3: 126; 5376x21504 unsplit: 168),
a ring of 10-16 stages, so that shared memory admits one program a SM: the next call's programs land one a SM as
this call's exit, each prefetching a ring of 80-128 KB before it waits, and the split-K sum is gone or smaller.
Always in the overlap mode. Checked against the reference, then three interleaved rounds, M = 1, 2, 4, 8.

    python3 -m bench.ab_wide $OUT/ab_wide.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

MS = (1, 2, 4, 8)
# (K, N): [(label, config, block_n, trigger)]
TRIALS = {
    (4096, 14336): [("wide s1 12", (1, 12, 64), 128, True), ("wide s1 16", (1, 16, 64), 128, True),
                    ("wide s1 12 one", (1, 12, 64, 8), 128, True), ("wide s1 10", (1, 10, 64), 128, True)],
    (14336, 4096): [("wide s4 12", (4, 12, 64), 128, True), ("wide s4 12 one", (4, 12, 64, 8), 128, True),
                    ("wide s4 16", (4, 16, 64), 128, True)],
    (21504, 5376): [("wide s3 12", (3, 12, 64), 128, True), ("wide s3 12 one", (3, 12, 64, 8), 128, True),
                    ("wide s3 16", (3, 16, 64), 128, True)],
    (5376, 21504): [("wide s1 12", (1, 12, 64), 128, True), ("narrow s1 12", (1, 12, 64), 64, True)],
}


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), trials in TRIALS.items():
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in (*MS, 3)}
        shipped = int4_gluon.CONFIGS[(K, N)]
        variants = {"shipped": (shipped, int4_gluon.BLOCK_N, None)}
        for label, cfg, block_n, trig in trials:
            variants[label] = (cfg, block_n, trig)
        errs = {}
        for label, (cfg, block_n, trig) in list(variants.items()):
            try:
                for M in (1, 3, 8):
                    ref = G.int4_mm_reference(xs[M][0], *ops[0], 128)
                    y = int4_gluon.launch(xs[M][0], *ops[0], cfg, block_n=block_n, trigger=trig)
                    y2 = int4_gluon.launch(xs[M][0], *ops[0], cfg, block_n=block_n, trigger=trig)
                    torch.cuda.synchronize()
                    assert torch.equal(y, y2), f"{label}: repeat launch differs"
                    errs.setdefault(label, []).append(B.rel_err(y, ref))
                assert max(errs[label]) < 5e-3, f"{label}: rel err {errs[label]}"
            except Exception as e:
                B.log(f"{K}x{N} {label}: {e!r}"[:300])
                variants.pop(label)
        rounds = {label: [] for label in variants}
        for rnd in range(3):
            for label, (cfg, block_n, trig) in variants.items():
                rounds[label].append([B.time_calls([lambda i=i, M=M: int4_gluon.launch(
                    xs[M][i], *ops[i], cfg, block_n=block_n, trigger=trig) for i in range(copies)])
                    for M in MS])
        med = {label: [sorted(r[j] for r in v)[1] for j in range(len(MS))] for label, v in rounds.items()}
        floor = B.weight_bytes(K, N, 128) / 4.26e12 * 1e6  # (calls 131-135 measured 4.25-4.27 TB/s)
        for label, v in med.items():
            B.log(f"{K}x{N} {label:>16}: " + " / ".join(f"{t:6.2f}" for t in v)
                  + f"   floor/ours {floor / max(v):.2f}-{floor / min(v):.2f}   err {max(errs[label]):.1e}")
        res[f"{K}x{N}"] = dict(median_us=med, rounds=rounds, errs=errs, floor_us=floor,
                               configs={k: [list(c), b, t] for k, (c, b, t) in variants.items()})
        del ops, xs
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
