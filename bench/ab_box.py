"""Temporary A/B (ninth session): the weights stored tile-major ([N/64, K/128, 64 rows, 64 bytes]) and copied by
TMA in [4, 256]-word boxes (1 KB rows) instead of [64, 16]-word boxes (64-byte rows) of the row-major format.
Item 23's tiled trial kept the 64-byte box rows; this asks whether TMA's per-row requests are what limits the
stream. Back to back, three interleaved rounds, M = 1 and 8.

    python3 -m bench.ab_box $OUT/ab_box.json
"""

import json
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon


def tile_major(packed):
    N, half_k = packed.shape
    return packed.view(N // 64, 64, half_k // 64, 64).permute(0, 2, 1, 3).contiguous().view(N, half_k)


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N in B.GEMM_SHAPES:
        packed, sz = G.quantize_int4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), 128)
        wref = G.dequantize_int4(packed, sz, 128, torch.float32).double()
        tiled = tile_major(packed)
        for M in (1, 5, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wref.T
            int4_gluon.TILED_BOX = True
            e = B.rel_err(G.int4_mm(x, tiled, sz, 128), ref)
            int4_gluon.TILED_BOX = False
            assert e < 4e-3, (K, N, M, e)
        del wref, tiled
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tops = [(tile_major(p), s) for p, s in ops]
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = {}
            for rnd in range(3):
                for name, flag, o in (("row-major", False, ops), ("tiled box", True, tops)):
                    int4_gluon.TILED_BOX = flag
                    t.setdefault(name, []).append(
                        B.time_calls([lambda i=i: G.int4_mm(xs[i], *o[i], 128) for i in range(copies)]))
                    t.setdefault(name + " alone", []).append(
                        B.time_calls([lambda i=i: B.int4_mm_alone(xs[i], *o[i], 128) for i in range(copies)]))
            int4_gluon.TILED_BOX = False
            res[f"{K}x{N} M={M}"] = t
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {sorted(v)[1]:.2f} {[round(u, 2) for u in v]}"
                                                 for k, v in t.items()))
        del ops, tops
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
