"""Timeline of one int4_mm call on the Gluon path (temporary diagnostic, issue 7): a copy of
kernels/int4_gluon.py whose kernels write %globaltimer at each phase, per program, into a trace buffer.
Prints, per shape, where a call's time goes: prep kernel, GEMM program start, first data, loop, end."""
import re
import statistics
import sys
import types

import torch
import triton
import triton.language as tl

from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon

src = open(int4_gluon.__file__).read()
src = src.replace("from kernels._jit import TUNED_SMS, sm_count", "from kernels._jit import TUNED_SMS, sm_count\n"
                  "@gluon.jit\ndef _now():\n    return gl.inline_asm_elementwise('mov.u64 $0, %globaltimer;', '=l', [],"
                  " dtype=gl.int64, is_pure=False, pack=1)\n"
                  "@gluon.jit\ndef _smid():\n    return gl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [],"
                  " dtype=gl.int32, is_pure=False, pack=1)\n")
# producer: entry and after the dependency wait
src = src.replace("xs_smem, n0, g0, n_g, pdl):", "xs_smem, n0, g0, n_g, pdl, tr):")
src = src.replace("    first = gl.minimum(n_g, STAGES)\n", "    gl.store(tr + 4, _now())\n    first = gl.minimum(n_g, STAGES)\n")
src = src.replace("    if pdl:\n        _gdc_wait()\n", "    if pdl:\n        _gdc_wait()\n    gl.store(tr + 5, _now())\n")
# consumer: entry, first data, loop end
src = src.replace("xs_smem, n_g, GROUP: gl.constexpr,", "xs_smem, n_g, tr, GROUP: gl.constexpr,")
src = src.replace("    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)\n",
                  "    gl.store(tr + 0, _now())\n    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)\n")
src = src.replace("        mbarrier.wait(full.index(st), (g // STAGES) & 1)\n",
                  "        mbarrier.wait(full.index(st), (g // STAGES) & 1)\n        if g == 0:\n"
                  "            gl.store(tr + 1, _now())\n")
src = src.replace("    return (acc,)", "    gl.store(tr + 2, _now())\n    return (acc,)")
src = src.replace("y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,\n", "y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym, trace_ptr,\n")
src = src.replace("    g0 = pid_k * n_g\n", "    g0 = pid_k * n_g\n    tr = trace_ptr + (pid_k * gl.num_programs(0) + pid_n) * 8\n"
                  "    gl.store(tr + 6, _smid().to(gl.int64))\n")
src = src.replace("xs_smem, n_g, GROUP, STAGES, BLOCK_N, BLOCK_M)),", "xs_smem, n_g, tr, GROUP, STAGES, BLOCK_N, BLOCK_M)),")
src = src.replace("xs_smem, n0, g0, n_g,\n                       PDL)),", "xs_smem, n0, g0, n_g,\n                       PDL, tr)),")
src = src.replace("            gl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch\n",
                  "            gl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch\n    gl.store(tr + 3, _now())\n")
src = src.replace("def launch(x, packed, scale_zero, config, out=None)", "def launch(x, packed, scale_zero, config, trace, ptrace, out=None)")
src = src.replace("    int4_gemm._int4_prep_kernel[", "    _prep_traced[")
src = src.replace("x.stride(0), 1, XS_WIDTH, GROUP=GROUP,", "x.stride(0), 1, XS_WIDTH, ptrace, GROUP=GROUP,")
src = src.replace("N, K, y.stride(0), GROUP=GROUP,", "N, K, y.stride(0), trace, GROUP=GROUP,")
assert src.count("_now()") == 7, src.count("_now()")
mod = types.ModuleType("int4_gluon_traced")
mod.__file__ = "/tmp/int4_gluon_traced.py"
open(mod.__file__, "w").write(src)
import importlib.util
spec = importlib.util.spec_from_file_location("int4_gluon_traced", mod.__file__)
T = importlib.util.module_from_spec(spec)
sys.modules["int4_gluon_traced"] = T


@triton.jit
def _now_tl():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _prep_traced(x_ptr, xp_ptr, xs_ptr, M, M_OUT, K, stride_xm, stride_xs_m, stride_xs_g, tr_ptr,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    tl.store(tr_ptr + tl.program_id(0) * 2, _now_tl())
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=m_ok[:, None], other=0.0)
    tl.store(xs_ptr + offs_m * stride_xs_m + g * stride_xs_g, tl.sum(x.to(tl.float32), axis=1))
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xp_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], x, mask=(offs_m < M_OUT)[:, None])
    tl.debug_barrier()
    tl.store(tr_ptr + tl.program_id(0) * 2 + 1, _now_tl())


T._prep_traced = _prep_traced
spec.loader.exec_module(T)
T._prep_traced = _prep_traced


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def run(K, N, M, config, calls=8):
    copies = max(calls, B.copies_for(N * K / 2))
    ops = B.gemm_operands(K, N, 128, copies)
    xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    split = config[0]
    progs = (N // 64) * split
    trace = torch.zeros(copies, progs, 8, dtype=torch.int64, device="cuda")
    ptrace = torch.zeros(copies, K // 128, 2, dtype=torch.int64, device="cuda")
    t_us = B.time_calls([lambda i=i: T.launch(xs[i], *ops[i], config, trace[i], ptrace[i]) for i in range(copies)])
    ref = G.int4_mm_reference(xs[0], *ops[0], 128)
    err = B.rel_err(T.launch(xs[0], *ops[0], config, trace[0], ptrace[0]), ref)
    # one eager chain of `calls` back-to-back calls inside a graph, traced
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            T.launch(xs[i], *ops[i], config, trace[i], ptrace[i])
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    tr, pt = trace.cpu().tolist(), ptrace.cpu().tolist()
    rows = []
    for c in range(1, 3):  # relative to this call's prep start
        p0 = min(p[0] for p in pt[c])
        rel = lambda v: (v - p0) / 1000.0
        col = lambda j: [rel(t[j]) for t in tr[c]]
        sms = {}
        for t in tr[c]:
            sms[t[6]] = sms.get(t[6], 0) + 1
        by_count = {}
        for t in tr[c]:
            by_count.setdefault(sms[t[6]], []).append((rel(t[1]), rel(t[2])))
        corr = {n: (len(v), statistics.median(a for a, _ in v), statistics.median(b for _, b in v), max(b for _, b in v))
                for n, v in sorted(by_count.items())}
        sm_end = {}
        for t in tr[c]:
            sm_end[t[6]] = max(sm_end.get(t[6], 0), rel(t[2]))
        slow = sorted(sm_end, key=sm_end.get)[-8:]
        rows.append(dict(by_count=corr, slowest_sms=[(s_, sms[s_], round(sm_end[s_], 1)) for s_ in slow],
                         fastest_sms=[(s_, sms[s_], round(sm_end[s_], 1)) for s_ in sorted(sm_end, key=sm_end.get)[:4]]))
        rows.append(dict(prep_end=rel(max(p[1] for p in pt[c])), start=(min(col(0)), q(col(0), .5), max(col(0))),
                         pdl_wait=q(col(5), .5), first=(min(col(1)), q(col(1), .5), max(col(1))),
                         loop_end=(min(col(2)), q(col(2), .5), max(col(2))), end=(min(col(3)), q(col(3), .5), max(col(3))),
                         next_prep=rel(min(p[0] for p in pt[c + 1])),
                         per_sm=sorted(set(sms.values())), n_sm=len(sms)))
    return t_us, err, rows


if __name__ == "__main__":
    fmt = lambda t: "/".join(f"{v:.1f}" for v in t) if isinstance(t, tuple) else (f"{t:.2f}" if isinstance(t, float) else str(t))
    for K, N, M, cfg in [(4096, 14336, 1, (1, 4, 64)), (14336, 4096, 1, (8, 4, 64)), (8192, 28672, 1, (1, 4, 64)),
                         (5376, 21504, 1, (1, 4, 64))]:
        for pdl in (True,):
            G.USE_PDL = pdl
            t_us, err, rows = run(K, N, M, cfg)
            print(f"\n{K}x{N} M={M} cfg={cfg} pdl={pdl}: {t_us:.1f} us per call in the rotating graph, err {err:.1e}")
            for r in rows:
                print("  " + " ".join(f"{k}={fmt(v)}" for k, v in r.items()))
            sys.stdout.flush()
