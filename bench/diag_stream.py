"""Temporary diagnostic (twelfth session): the TMA ring's stream alone against a bare read on the same grid.
Interleaved in three rounds, back to back over rotating copies, us: `ours` (the shipped config), `stream` (the
same launch with the consumers releasing each stage unread: int4_gluon.DIAG_STREAM; wrong outputs), `ring only`
(the same and the stager stages nothing: the weights' TMA ring alone), `stream prep` (`stream` with x from the
prep kernel), `stager only` (`stream` with no weights copied: the stager and the handshakes alone), `read grid` (bench.kernels' read kernel overlapped and waiting after its
first 16 KB, with as many programs as our grid), `read 4/SM` (the same with 4 programs per SM), `gl read grid` (the same read in Gluon, 16 KB of shared memory a
program) and `gl read grid <=4/SM` (48 KB: at most 4 programs on an SM, as our GEMM).

    python3 -m bench.diag_stream $OUT/diag_stream.json
"""

import json
import math
import sys

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from bench import kernels as B
from kernels import int4_gluon

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672)]


def stream(config, mode=1):
    def f(x, p, s):
        int4_gluon.DIAG_STREAM = mode
        try:
            return int4_gluon.launch(x, p, s, config)
        finally:
            int4_gluon.DIAG_STREAM = 0
    return f


@gluon.jit
def _read_pad(x_ptr, out_ptr, per, BLOCK: gl.constexpr, PAD: gl.constexpr):
    """bench.kernels' read kernel (overlapped, waiting after its first BLOCK words) holding BLOCK + PAD words of
    shared memory, so that only so many programs fit an SM."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [8], [0])
    pad = gl.allocate_shared_memory(gl.int32, [BLOCK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if PAD > 0:
        more = gl.allocate_shared_memory(gl.int32, [PAD], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    int4_gluon._gdc_launch()
    base = gl.program_id(0).to(gl.int64) * per
    offs = gl.arange(0, BLOCK, layout)
    acc = gl.load(x_ptr + base + offs, cache_modifier=".cg")
    int4_gluon._gdc_wait()
    for off in range(BLOCK, per, BLOCK):
        acc += gl.load(x_ptr + base + off + offs, cache_modifier=".cg")
    pad.store(acc)
    if PAD > 0:
        more.slice(0, BLOCK).store(acc)
    gl.thread_barrier()
    total = gl.sum(pad.load(layout), 0)
    if PAD > 0:
        total = total + gl.sum(more.slice(0, BLOCK).load(layout), 0) * 0
    gl.store(out_ptr + gl.program_id(0), total)


def reader(nbytes, programs, copies, dst, pad=None):
    per = math.ceil(nbytes / 4 / programs / B.READ_BLOCK) * B.READ_BLOCK
    bufs = [torch.randint(0, 1 << 20, (programs * per,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    if pad is None:
        return [lambda b=b: B._read_kernel[(programs,)](b, dst, per, BLOCK=B.READ_BLOCK, OVERLAP=True,
                                                        WAIT_FIRST=True, num_warps=8, launch_pdl=True)
                for b in bufs], programs * per * 4
    _read_pad[(programs,)](bufs[0], dst, per, BLOCK=B.READ_BLOCK, PAD=pad, num_warps=8)
    assert torch.equal(dst[:programs].long() & 0xFFFFFFFF, bufs[0].view(programs, per).sum(1) & 0xFFFFFFFF)
    return [lambda b=b: _read_pad[(programs,)](b, dst, per, BLOCK=B.READ_BLOCK, PAD=pad, num_warps=8,
                                               launch_pdl=True) for b in bufs], programs * per * 4


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
        grid = N // 64 * config[0]
        reads = {"read grid": reader(nbytes, grid, copies, dst), "read 4/SM": reader(nbytes, 4 * sms, copies, dst),
                 "gl read grid": reader(nbytes, grid, copies, dst, pad=0),
                 "gl read grid <=4/SM": reader(nbytes, grid, copies, dst, pad=8192)}
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            fns = {"ours": lambda x, p, s: int4_gluon.launch(x, p, s, config), "stream": stream(config),
                   "ring only": stream(config, 2), "stager only": stream(config, 3), "stream prep": stream(config[:3])}
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
    names = ["ours", "stream", "ring only", "stager only", "stream prep", "read grid", "read 4/SM", "gl read grid",
             "gl read grid <=4/SM"]
    print("\n| K x N | M | " + " | ".join(names) + " |")
    for key, row in res.items():
        if key != "copy_bw":
            shape, m = key.split(" ")
            print(f"| {shape} | {m[2:]} | " + " | ".join(f"{row[n]['us']:.2f} ({row[n]['frac']:.2f})" if n in row
                                                     else "" for n in names) + " |")


if __name__ == "__main__":
    main()
