"""The workload that Nsight Compute profiles for the INT4 GEMM: a few calls of ours and of torch's tinygemm.

    ncu --clock-control none --set full -k regex:'int4|prep|tinygemm_m16' --export $OUT/int4 python -m bench.lab.ncu_int4
    ncu --import $OUT/int4.ncu-rep --page source --print-source sass --csv   # stall reasons per SASS line

Each (K, N, M) calls `int4_mm` (the path it takes on this GPU: on Hopper the Gluon kernel for these shapes),
the Triton kernel (`launch_int4_mm`) and tinygemm three times each; ncu profiles each launch on its own, so no
warm-up is needed (the first call's compilation happens on the host).
"""

from __future__ import annotations

import sys

import torch

import kernels.int4_gemm as G
from kernels.int4_gemm import tinygemm_mm, to_tinygemm
from models.quantize import quantize_w4

SHAPES = [(8192, 28672, 1), (8192, 28672, 8), (4096, 4096, 1)]


def main(shapes=SHAPES):
    torch.manual_seed(0)
    for K, N, M in shapes:
        packed, scale_zero = quantize_w4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        w, sz = to_tinygemm(packed, scale_zero, 128)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            G.int4_mm(x, packed, scale_zero, 128)
            G.launch_int4_mm(x, packed, scale_zero, 128)
            tinygemm_mm(x, w, sz, 128)
        torch.cuda.synchronize()
        print(K, N, M, "done", file=sys.stderr)


if __name__ == "__main__":
    main()
