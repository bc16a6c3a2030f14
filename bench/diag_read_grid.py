"""Temporary diagnostic (twelfth session): does a bare read care about the grid our GEMM uses? The read kernel of
bench.kernels (overlapped and waiting after its first 16 KB a program: `read_dep`), over each shape's weight bytes,
back to back over rotating copies, with the programs of our GEMM's grid (column tiles x split), with 3, 4 and 8
per SM, and with our grid at 4 warps a program; our GEMM at M = 1 beside it. frac = bytes read (rounded up to
whole 16 KB blocks a program) at the copy bandwidth / time.

    python3 -m bench.diag_read_grid $OUT/diag_read_grid.json
"""

import json
import math
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm, int4_gluon

SHAPES = [(4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672)]


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = max(B.measure_bandwidth().values())
    res["copy_bw"] = bw
    dst = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
    for K, N in SHAPES:
        split = int4_gluon.CONFIGS[(K, N)][0]
        ours_p = N // int4_gluon.BLOCK_N * split
        nbytes = B.weight_bytes(K, N, 128)
        copies = B.copies_for(nbytes)
        row = {"programs ours": ours_p}
        grids = {"our grid": (ours_p, 8), "our grid, 4 warps": (ours_p, 4), "3 per SM": (3 * sms, 8),
                 "4 per SM": (4 * sms, 8), "8 per SM": (8 * sms, 8)}
        for name, (programs, warps) in grids.items():
            per = math.ceil(nbytes / 4 / programs / B.READ_BLOCK) * B.READ_BLOCK
            bufs = [torch.randint(0, 1 << 20, (programs * per,), dtype=torch.int32, device="cuda")
                    for _ in range(copies)]
            read = lambda b: B._read_kernel[(programs,)](b, dst, per, BLOCK=B.READ_BLOCK, OVERLAP=True, WAIT_FIRST=True,
                                                         num_warps=warps, launch_pdl=True)
            t = sorted(B.time_calls([lambda b=b: read(b) for b in bufs]) for _ in range(3))[1]
            row[name] = dict(us=t, frac=programs * per * 4 / bw * 1e6 / t)
            del bufs
            torch.cuda.empty_cache()
        ops = B.gemm_operands(K, N, 128, copies)
        xs = [torch.randn(1, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        t = sorted(B.time_calls([lambda i=i: int4_gemm.int4_mm(xs[i], *ops[i], 128)
                                 for i in range(copies)]) for _ in range(3))[1]
        row["ours M=1"] = dict(us=t, frac=nbytes / bw * 1e6 / t)
        del ops
        torch.cuda.empty_cache()
        res[f"{K}x{N}"] = row
        B.log(f"{K}x{N}: " + "  ".join(f"{k} {v['us']:.2f} ({v['frac']:.2f})" for k, v in row.items()
                                       if isinstance(v, dict)))
        json.dump(res, open(out, "w"), indent=1)
    names = [k for k in res[f"{SHAPES[0][0]}x{SHAPES[0][1]}"] if k != "programs ours"]
    print("\n| K x N | programs | " + " | ".join(names) + " |")
    for key, row in res.items():
        if key == "copy_bw":
            continue
        print(f"| {key} | {row['programs ours']} | " + " | ".join(f"{row[n]['us']:.2f} ({row[n]['frac']:.2f})"
                                                           for n in names) + " |")


if __name__ == "__main__":
    main()
