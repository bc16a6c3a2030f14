"""The big shape at M = 1 through the previous GEMM (old) or the current one (new), for Nsight Compute (call 27).

    ncu --clock-control none --set full -k regex:_int4_mm_kernel -c 1 --export $OUT/new python3 -m bench._ncu_ab new
"""
import sys

import torch

import kernels.int4_gemm as G
from bench import _int4_v10 as OLD

mod = OLD if sys.argv[1] == "old" else G
torch.manual_seed(0)
K, N = 8192, 28672
packed, scale_zero = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    mod.launch_int4_mm(x, packed, scale_zero, 128, (64, 256, 2, 4, 3, 96))
torch.cuda.synchronize()
