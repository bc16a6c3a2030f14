"""Where a chained call's programs run (temporary diagnostic): a copy of kernels/int4_gluon.py whose kernel writes,
per program, %smid and %globaltimer at entry, at the end of its loop and at exit; a graph of back-to-back calls
on rotating weights, with and without the dependents' trigger (int4_gemm.CHAIN)."""
import importlib.util
import json
import statistics
import sys

import torch

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

src = open(int4_gluon.__file__).read()
src = src.replace("from kernels._jit import TUNED_SMS, sm_count", "from kernels._jit import TUNED_SMS, sm_count\n"
                  "@gluon.jit\ndef _now():\n    return gl.inline_asm_elementwise('mov.u64 $0, %globaltimer;', '=l', [],"
                  " dtype=gl.int64, is_pure=False, pack=1)\n"
                  "@gluon.jit\ndef _smid():\n    return gl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [],"
                  " dtype=gl.int32, is_pure=False, pack=1)\n")
src = src.replace("def _int4_mm_kernel(w_desc, x_desc, sz_desc, xs_desc, xw_ptr, w_ptr, y_ptr,",
                  "def _int4_mm_kernel(w_desc, x_desc, sz_desc, xs_desc, xw_ptr, w_ptr, trace_ptr, y_ptr,")
src = src.replace("    g0 = pid_k * n_g\n", "    g0 = pid_k * n_g\n    tr = trace_ptr + (pid_k * gl.num_programs(0) + pid_n) * 4\n"
                  "    gl.store(tr + 0, _now())\n    gl.store(tr + 1, _smid().to(gl.int64))\n")
src = src.replace("    # split-K as in int4_gemm:", "    gl.store(tr + 2, _now())\n    # split-K as in int4_gemm:")
src = src.replace("            gl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch\n",
                  "            gl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch\n    gl.store(tr + 3, _now())\n")
src = src.replace("def launch(x, packed, scale_zero, config, out=None)", "def launch(x, packed, scale_zero, config, trace, out=None)")
src = src.replace("(w_desc, x_desc, sz_desc, xs_desc, xw, packed, y, ws,", "(w_desc, x_desc, sz_desc, xs_desc, xw, packed, trace, y, ws,")
assert src.count("_now()") == 4
path = "/tmp/int4_gluon_traced.py"
open(path, "w").write(src)
spec = importlib.util.spec_from_file_location("int4_gluon_traced", path)
T = importlib.util.module_from_spec(spec)
sys.modules["int4_gluon_traced"] = T
spec.loader.exec_module(T)

OUT = {}


def run(K, N, M, chain, calls=12):
    G.CHAIN = chain
    copies = calls
    ops = B.gemm_operands(K, N, 128, copies)
    config = int4_gluon.pick(K, N, 128, torch.device("cuda"), M)
    tiles, split = N // 64, config[0]
    traces = [torch.zeros(tiles * split, 4, dtype=torch.int64, device="cuda") for _ in range(calls)]
    xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(calls)]
    fn = lambda: [T.launch(xs[i], *ops[i], config, traces[i]) for i in range(calls)]
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    tr = [t.cpu() for t in traces]
    t0 = min(int(t[:, 0].min()) for t in tr)
    rows = []
    for i, t in enumerate(tr[2:-1], start=2):  # steady state
        start, sm, loop_end, end = (t[:, j] for j in range(4))
        per_sm = torch.bincount(sm, minlength=132)
        prev_end = int(tr[i - 1][:, 3].max())
        rows.append(dict(
            call=i, first_start=(int(start.min()) - prev_end) / 1e3, last_start=(int(start.max()) - prev_end) / 1e3,
            loop_end_min=(int(loop_end.min()) - prev_end) / 1e3,
            loop_end_med=(float(loop_end.double().median()) - prev_end) / 1e3,
            end_max=(int(end.max()) - prev_end) / 1e3,
            per_sm_max=int(per_sm.max()), per_sm_min=int(per_sm.min()),
            per_sm_hist=torch.bincount(per_sm).tolist()))
    del g
    G.CHAIN = 0
    return rows


def main():
    out = sys.argv[1]
    for K, N in ((4096, 14336), (8192, 28672), (5376, 21504)):
        for chain in (0, 1):
            for M in (1, 2):
                rows = run(K, N, M, chain)
                OUT[f"{K}x{N} M={M} chain={chain}"] = rows
                per = [r["end_max"] for r in rows]
                B.log(f"{K}x{N} M={M} chain={chain}: call spans (prev end -> this end, us) "
                      f"{[round(p, 1) for p in per]} median {statistics.median(per):.1f}")
                for r in rows[:3]:
                    B.log(f"   start {r['first_start']:.1f}..{r['last_start']:.1f} loop_end {r['loop_end_min']:.1f}/"
                          f"{r['loop_end_med']:.1f} end {r['end_max']:.1f}  per SM {r['per_sm_min']}..{r['per_sm_max']} "
                          f"hist {r['per_sm_hist']}")
                json.dump(OUT, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
