"""Temporary diagnostic (thirteenth session, call 127): when a chained call's programs start, get their first group,
end their loop and exit, relative to the previous call's last exit (%globaltimer; bench/_gluon_diag.py TRACE), for
`ours` (MODE 0), `no x` (MODE 6: no wait for the previous call) and `no x, waited` (MODE 7), in a graph of
back-to-back calls on rotating weights, one launch, M = 1.

    python3 -m bench.trace_wait $OUT/trace_wait.json
"""

import json
import statistics
import sys

import torch

from bench import _gluon_diag as diag
from bench import kernels as B

GRIDS = [(4096, 14336, 2), (4096, 16896, 1), (21504, 5376, 6)]
MODES = {"ours": 0, "no x": 6, "no x, waited": 7}


def trace(K, N, split, mode, calls=16):
    config = (split, 6 if K == 21504 else 4, 64, 8)
    programs = N // 64 * split
    ops = B.gemm_operands(K, N, 128, calls)
    xs = [torch.randn(1, K, device="cuda").to(torch.bfloat16) for _ in range(calls)]
    traces = [torch.zeros(programs, 5, dtype=torch.int64, device="cuda") for _ in range(calls)]

    def chain():
        diag.MODE, diag.TRIGGER_PER_SM = mode, 3
        try:
            for i in range(calls):
                diag.TRACE = traces[i]
                diag.launch(xs[i], *ops[i], config)
        finally:
            diag.MODE, diag.TRACE = 0, None

    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    tr = [(t.cpu().double() / 1e3) for t in traces]  # us
    rows = []
    for i in range(3, calls - 1):
        prev_end = tr[i - 1][:, 4].max().item()
        t = tr[i] - prev_end
        per_sm = torch.bincount(tr[i][:, 1].long(), minlength=132)
        q = lambda col: [round(float(v), 2) for v in (t[:, col].min(), t[:, col].median(), t[:, col].max())]
        rows.append(dict(start=q(0), usable=q(2), loop_end=q(3), exit=q(4), call=round(float(t[:, 4].max()), 2),
                         per_sm=[int(per_sm.min()), int(per_sm.max())]))
    del g
    return rows


def main():
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for K, N, split in GRIDS:
        for name, mode in MODES.items():
            rows = trace(K, N, split, mode)
            key = f"{K}x{N}/{split} {name}"
            res[key] = rows
            med = {k: [round(statistics.median(r[k][j] for r in rows), 2) for j in range(3)]
                   for k in ("start", "usable", "loop_end", "exit")}
            B.log(f"{key}: call {statistics.median(r['call'] for r in rows):.2f} us; min/med/max after the previous "
                  f"call's last exit: " + "  ".join(f"{k} {v}" for k, v in med.items())
                  + f"; programs a SM {rows[0]['per_sm']}")
        json.dump(res, open(out, "w"), indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
