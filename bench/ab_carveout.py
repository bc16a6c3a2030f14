"""Temporary (fifteenth session): does the L1/shared-memory split keep back-to-back kernels of ours apart?

An SM runs kernels of one shared-memory carveout at a time. The driver picks each kernel's carveout from its own
needs, so the prep kernel (a few KB) and the Gluon GEMM (26 KB a program, 4 a SM) may get different ones; then,
under programmatic dependent launch, the prep kernel's programs cannot land beside the GEMM's and the next GEMM's
cannot land beside the prep kernel's. The trial sets every kernel's preferred carveout to the maximum shared memory
(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 100) against the driver's default (-1), three interleaved
rounds, M = 1 .. 8, `int4_mm` as shipped.

    python3 -m bench.ab_carveout $OUT/ab_carveout.json
"""

import ctypes
import json
import sys

import torch
import triton

from bench import kernels as B
from kernels import int4_gemm as G

MS = tuple(range(1, 9))
SHAPES = [(4096, 14336), (5376, 21504), (8192, 28672), (14336, 4096), (21504, 5376), (4096, 4096)]
CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
FUNCTIONS = {}


def _loaded(module, function, name, metadata_group, hash):
    FUNCTIONS[(name, hash)] = function


def set_carveout(value: int):
    cuda = ctypes.CDLL("libcuda.so.1")
    for key, f in FUNCTIONS.items():
        rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(f), ctypes.c_int(CARVEOUT), ctypes.c_int(value))
        assert rc == 0, (key, rc)


def main():
    triton.knobs.runtime.kernel_load_end_hook.add(_loaded)
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in MS}
        for M in MS:  # compile and load every kernel first
            y = G.int4_mm(xs[M][0], *ops[0], 128)
            assert B.rel_err(y, G.int4_mm_reference(xs[M][0], *ops[0], 128)) < 5e-3
        B.log(f"{K}x{N}: kernels loaded {sorted(n for n, _ in FUNCTIONS)}")
        variants = {"default": -1, "shared 100": 100}
        rounds = {label: [] for label in variants}
        for rnd in range(3):
            for label, value in variants.items():
                set_carveout(value)
                rounds[label].append([B.time_calls([lambda i=i, M=M: G.int4_mm(xs[M][i], *ops[i], 128)
                                                    for i in range(copies)]) for M in MS])
        set_carveout(-1)
        med = {label: [sorted(r[j] for r in v)[1] for j in range(len(MS))] for label, v in rounds.items()}
        floor = B.weight_bytes(K, N, 128) / 4.26e12 * 1e6
        for label, v in med.items():
            B.log(f"{K}x{N} {label:>11}: " + " / ".join(f"{t:6.2f}" for t in v)
                  + f"   floor/ours {floor / max(v):.2f}-{floor / min(v):.2f}")
        res[f"{K}x{N}"] = dict(median_us=med, rounds=rounds, floor_us=floor, path=B.gemm_path(K, N))
        del ops, xs
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
