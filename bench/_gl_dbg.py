"""Prototype smoke check of bench/_gluon_int4.py on two small shapes (run under compute-sanitizer)."""
import torch

from bench import _gluon_int4 as GL
from kernels import int4_gemm as G

torch.manual_seed(0)
for K, N, split in [(1024, 256, 1), (2048, 512, 2)]:
    packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
    x = torch.randn(3, K, device="cuda", dtype=torch.bfloat16)
    y = GL.launch(x, packed, sz, 128, split)
    torch.cuda.synchronize()
    ref = x.double() @ G.dequantize_int4(packed, sz, 128, torch.float64).t()
    print("ok", ((y.double() - ref).norm() / ref.norm()).item())
