"""Temporary diagnostic (twelfth session): the TMA ring's stream alone against a bare read on the same grid.
Interleaved in three rounds, back to back over rotating copies, us: `ours` (the shipped config), `stream` (the
same launch with the consumers releasing each stage unread: int4_gluon.DIAG_STREAM; wrong outputs), `stream prep`
(the same with x from the prep kernel), `read grid` (bench.kernels' read kernel overlapped and waiting after its
first 16 KB, with as many programs as our grid), `read 4/SM` (the same with 4 programs per SM).

    python3 -m bench.diag_stream $OUT/diag_stream.json
"""

import json
import math
import sys

import torch

from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672)]


def stream(config):
    def f(x, p, s):
        int4_gluon.DIAG_STREAM = True
        try:
            return int4_gluon.launch(x, p, s, config)
        finally:
            int4_gluon.DIAG_STREAM = False
    return f


def reader(nbytes, programs, copies, dst):
    per = math.ceil(nbytes / 4 / programs / B.READ_BLOCK) * B.READ_BLOCK
    bufs = [torch.randint(0, 1 << 20, (programs * per,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    return [lambda b=b: B._read_kernel[(programs,)](b, dst, per, BLOCK=B.READ_BLOCK, OVERLAP=True, WAIT_FIRST=True,
                                                    num_warps=8, launch_pdl=True) for b in bufs], programs * per * 4


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = max(B.measure_bandwidth().values())
    res["copy_bw"] = bw
    dst = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
    for K, N in SHAPES:
        config = int4_gluon.CONFIGS[(K, N)]
        nbytes = B.weight_bytes(K, N, 128)
        copies = B.copies_for(nbytes)
        ops = B.gemm_operands(K, N, 128, copies)
        reads = {"read grid": reader(nbytes, N // 64 * config[0], copies, dst),
                 "read 4/SM": reader(nbytes, 4 * sms, copies, dst)}
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"ours": lambda x, p, s: int4_gluon.launch(x, p, s, config), "stream": stream(config),
                   "stream prep": stream(config[:3])}
            t = {}
            for rnd in range(3):
                for name, f in fns.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(xs[i], *ops[i]) for i in range(copies)]))
                if M == 1:
                    for name, (calls, _) in reads.items():
                        t.setdefault(name, []).append(B.time_calls(calls))
            row = {name: dict(us=sorted(v)[1], frac=(reads[name][1] if name in reads else nbytes) / bw * 1e6
                              / sorted(v)[1]) for name, v in t.items()}
            res[f"{K}x{N} M={M}"] = row
            B.log(f"{K}x{N} M={M}: " + "  ".join(f"{k} {v['us']:.2f} ({v['frac']:.2f})" for k, v in row.items()))
        del ops, reads
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1)
    names = ["ours", "stream", "stream prep", "read grid", "read 4/SM"]
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, row in res.items():
        if key != "copy_bw":
            shape, m = key.split(" ")
            print(f"| {shape} | {m[2:]} | " + " | ".join(f"{row[n]['us']:.2f} ({row[n]['frac']:.2f})" if n in row
                                                     else "" for n in names) + " |")


if __name__ == "__main__":
    main()
