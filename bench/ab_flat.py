"""Temporary (fifteenth session): bench/_gluon_flat.py (no warp specialisation, 8 programs fit an SM, the next call
launched after this call's wait) against the shipped kernel: `int4_mm` as shipped, the shipped kernel on its prep
path at every M (the same x as the flat kernel), and the flat kernel at the shipped split and others, with every
kernel's preferred carveout at the maximum shared memory (`c100`, so that the prep kernel and two GEMMs share an SM)
or the driver's default. Checked against the reference, then three interleaved rounds, M = 1, 2, 4, 8.

    python3 -m bench.ab_flat $OUT/ab_flat.json
"""

import ctypes
import json
import sys

import torch
import triton

from bench import _gluon_flat as flat
from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

MS = (1, 2, 4, 8)
SPLITS = {(4096, 14336): (2, 1), (14336, 4096): (8, 4), (21504, 5376): (6, 3), (5376, 21504): (1,),
          (8192, 28672): (1,)}
FUNCTIONS = {}


def _loaded(module, function, name, metadata_group, hash):
    FUNCTIONS[(name, hash)] = function


def set_carveout(value: int):
    cuda = ctypes.CDLL("libcuda.so.1")
    for key, f in FUNCTIONS.items():
        assert cuda.cuFuncSetAttribute(ctypes.c_void_p(f), ctypes.c_int(9), ctypes.c_int(value)) == 0, key


def main():
    triton.knobs.runtime.kernel_load_end_hook.add(_loaded)
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), splits in SPLITS.items():
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in (*MS, 3)}
        shipped = int4_gluon.CONFIGS[(K, N)]
        variants = {"int4_mm": (lambda x, i: G.int4_mm(x, *ops[i], 128), -1),
                    "shipped prep": (lambda x, i: int4_gluon.launch(x, *ops[i], shipped[:3]), -1)}
        for split in splits:
            for c in (-1, 100):
                variants[f"flat s{split}" + (" c100" if c == 100 else "")] = (
                    lambda x, i, split=split: flat.launch(x, *ops[i], split), c)
        errs = {}
        for label, (fn, c) in list(variants.items()):
            try:
                for M in (1, 3, 8):
                    ref = G.int4_mm_reference(xs[M][0], *ops[0], 128)
                    y, y2 = fn(xs[M][0], 0), fn(xs[M][0], 0)
                    torch.cuda.synchronize()
                    assert torch.equal(y, y2), f"{label}: repeat launch differs"
                    errs.setdefault(label, []).append(B.rel_err(y, ref))
                assert max(errs[label]) < 5e-3, f"{label}: rel err {errs[label]}"
            except Exception as e:
                B.log(f"{K}x{N} {label}: {e!r}"[:300])
                variants.pop(label)
        rounds = {label: [] for label in variants}
        for rnd in range(3):
            for label, (fn, c) in variants.items():
                set_carveout(c)
                rounds[label].append([B.time_calls([lambda i=i, M=M: fn(xs[M][i], i) for i in range(copies)])
                                      for M in MS])
        set_carveout(-1)
        med = {label: [sorted(r[j] for r in v)[1] for j in range(len(MS))] for label, v in rounds.items()}
        floor = B.weight_bytes(K, N, 128) / 4.26e12 * 1e6
        for label, v in med.items():
            B.log(f"{K}x{N} {label:>13}: " + " / ".join(f"{t:6.2f}" for t in v)
                  + f"   floor/ours {floor / max(v):.2f}-{floor / min(v):.2f}   err {max(errs[label]):.1e}")
        res[f"{K}x{N}"] = dict(median_us=med, rounds=rounds, errs=errs, floor_us=floor)
        del ops, xs
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
