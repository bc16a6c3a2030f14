"""Temporary A/B (fourteenth session): the prep path with fp16 operands (bench/_gluon_fp16.py: one shift and four
lop3 a word) against the shipped prep path (bf16: three shifts and four lop3), same configs, and the shipped
`int4_mm` (one launch where its config says so). Errors against the float64 reference first (a row of x at
1e5 checks the per-group power-of-2 scale), then three interleaved rounds back to back, us.

    python3 -m bench.ab_fp16 $OUT/ab_fp16.json
"""

import json
import sys

import torch

from bench import _gluon_fp16 as F
from bench import kernels as B
from kernels import int4_gemm, int4_gluon

SHAPES = [(8192, 28672), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (4096, 4096)]


def errors(K, N, ops):
    p, sz = ops[0]
    w = int4_gemm.dequantize_int4(p, sz, 128, torch.float64)
    config = int4_gluon.pick(K, N, 128, p.device)[:3]
    out = {}
    for M in (1, 3, 8):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        if M == 3:
            x[1] *= 1e5  # beyond fp16's range before the scale
            x[2, : K // 2] *= 1e-6
        ref = x.double() @ w.t()
        scale = ref.abs().max().item()
        for name, f in (("bf16", lambda: int4_gluon.launch(x, p, sz, config)), ("fp16", lambda: F.launch16(x, p, sz, config))):
            y = f().double()
            assert torch.isfinite(y).all(), (K, N, M, name)
            out[f"{name} M={M}"] = ((y - ref).abs().max() / scale).item()
    return out


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in SHAPES:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        err = errors(K, N, ops)
        res[f"{K}x{N} err"] = err
        B.log(f"{K}x{N} max error / max |ref|: " + "  ".join(f"{k} {v:.2e}" for k, v in err.items()))
        config = int4_gluon.pick(K, N, 128, ops[0][0].device)[:3]
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"ours": lambda x, p, s: int4_gemm.int4_mm(x, p, s, 128),
                   "prep bf16": lambda x, p, s: int4_gluon.launch(x, p, s, config),
                   "prep fp16": lambda x, p, s: F.launch16(x, p, s, config)}
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in t.items()))
        del ops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
