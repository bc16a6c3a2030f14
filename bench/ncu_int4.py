"""The workload that Nsight Compute profiles for the INT4 GEMM: a few calls of ours and of torch's tinygemm.

    ncu --clock-control none --set full -k regex:'int4_mm|tinygemm_m16' --export $OUT/int4 python3 -m bench.ncu_int4

Each (K, N, M) calls both three times (ncu profiles each launch on its own, so no warm-up is needed; the
first call's compilation happens on the host). The stall reasons per SASS line (`ncu --import ... --page
source --print-source sass --csv`) are what decided the GEMM's v7-v10; see bench/NOTES.md.
"""

from __future__ import annotations

import sys

import torch

import kernels.int4_gemm as G
from bench.kernels import to_tinygemm, tinygemm_mm

SHAPES = [(8192, 28672, 1), (8192, 28672, 8), (4096, 4096, 1)]


def main(shapes=SHAPES):
    torch.manual_seed(0)
    for K, N, M in shapes:
        packed, scale_zero = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        w, sz = to_tinygemm(packed, scale_zero, 128)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            G.launch_int4_mm(x, packed, scale_zero, 128)
            tinygemm_mm(x, w, sz, 128)
        torch.cuda.synchronize()
        print(K, N, M, "done", file=sys.stderr)


if __name__ == "__main__":
    main()
