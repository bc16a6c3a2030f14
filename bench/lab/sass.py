"""Compile our Triton kernels for sm_90 on a machine without a GPU and report what the compiler did.

Uses the ptxas/cuobjdump that ship inside the triton wheel. Prints, per kernel variant: registers,
spills, shared memory, which matrix instructions appear (HGMMA = wgmma, HMMA = mma.sync) and the
instruction mix inside the hot loop, so block shapes can be judged before spending device time.

    python -m bench.lab.sass int4 BLOCK_N BLOCK_K GROUP SPLIT warps stages
    python -m bench.lab.sass sdpa BLOCK_R BLOCK_N warps stages
    python -m bench.lab.sass gluon BLOCK_M SPLIT stages regs [x_depth [trigger [rows]]]    # kernels/int4_gluon.py
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, aligned=()):
    """`aligned`: argument names a launch would specialise as divisible by 16 (pointers, most sizes)."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                             num_stages=num_stages))


def report(k, name: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        open(cubin, "wb").write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", cubin], capture_output=True,
                              text=True).stdout
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(k.asm["ptx"])
        v = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "o")],
                           capture_output=True, text=True).stderr
    ops = [m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)]
    mix = collections.Counter(ops)
    regs = re.search(r"Used (\d+) registers", v)
    spill = re.findall(r"(\d+) bytes spill stores", v)
    out = dict(name=name, regs=int(regs.group(1)) if regs else None, spill_stores=spill,
               shared=k.metadata.shared, n_instr=len(ops),
               mma=sorted(o for o in mix if "MMA" in o or "GMMA" in o),
               top=mix.most_common(25))
    return out


def int4(block_n, block_k, group, split, warps, stages):
    from kernels.int4_gemm import BLOCK_M, _int4_mm_kernel
    sig = dict(xp_ptr="*bf16", xs_ptr="*fp32", w_ptr="*u8", sz_ptr="*i32", y_ptr="*bf16",
               ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", stride_ym="i32",
               GROUP="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", BLOCK_M="constexpr",
               SPLIT_K="constexpr", PTX="constexpr", PDL="constexpr")
    const = dict(GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=BLOCK_M, SPLIT_K=split, PTX=True, PDL=True)
    aligned = [a for a, t in sig.items() if t.startswith("*")] + ["N", "K", "stride_ym"]
    return compile_sm90(_int4_mm_kernel.get(), sig, const, warps, stages, aligned)


def gluon(block_m, split, stages, regs, x_depth=0, trigger=0, rows=0):
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import int4_gluon as g
    w_l, x_l, words = g._shared_layouts(block_m)
    desc = lambda dtype, shape, layout: f"tensordesc<{dtype}{list(shape)},{layout!r}>"
    sig = dict(w_desc=desc("i32", [g.BLOCK_N, g.GROUP // 8], w_l),
               x_desc="constexpr" if x_depth else desc("fp16", [block_m, g.GROUP], x_l),
               sz_desc=desc("i32", [1, g.BLOCK_N], words),
               xs_desc="constexpr" if x_depth else desc("fp32", [1, 4 * block_m], words),
               xw_ptr="*i32" if x_depth else "constexpr", y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", M="i32",
               N="i32", K="i32", stride_xw="i32", stride_ym="i32")
    const = dict(GROUP=g.GROUP, BLOCK_N=g.BLOCK_N, BLOCK_M=block_m, SPLIT_K=split, STAGES=stages, REGS=regs, PDL=True,
                 X_LAYOUT=x_l, X_DEPTH=x_depth, TRIGGER=bool(trigger), ROWS=rows or block_m)
    const.update({k: None for k in ("x_desc", "xs_desc", "xw_ptr") if sig[k] == "constexpr"})
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    aligned = [a for a in ("xw_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "N", "K", "stride_xw", "stride_ym")
               if sig[a] != "constexpr"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=g._int4_mm_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=regs))


def sdpa(block_r, block_n, warps, stages, G=4, m_pad=8, D=128):
    from kernels.sdpa_midm import _sdpa_split_kernel
    sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", vlen_ptr="*i64", ml_ptr="*fp32",
               acc_ptr="*fp32", M="i32", L="i32", qk_scale="fp32", window="i32",
               stride_qb="i32", stride_qh="i32", stride_qm="i32", stride_kb="i32", stride_kh="i32",
               stride_kl="i32", stride_vb="i32", stride_vh="i32", stride_vl="i32", SPLITS="i32",
               H_KV="constexpr", G="constexpr", M_PAD="constexpr", BLOCK_R="constexpr", BLOCK_N="constexpr",
               D="constexpr", HAS_VLEN="constexpr", HAS_WINDOW="constexpr", PDL="constexpr")
    const = dict(H_KV=8, G=G, M_PAD=m_pad, BLOCK_R=block_r, BLOCK_N=block_n, D=D, HAS_VLEN=True,
                 HAS_WINDOW=False, PDL=True)
    aligned = [a for a, t in sig.items() if t.startswith("*")] + [a for a in sig if a.startswith("stride")] + ["L"]
    return compile_sm90(_sdpa_split_kernel.get(), sig, const, warps, stages, aligned)


if __name__ == "__main__":
    what, *nums = sys.argv[1:]
    nums = [int(n) for n in nums]
    k = {"int4": int4, "sdpa": sdpa, "gluon": gluon}[what](*nums)
    r = report(k, f"{what}{nums}")
    for key, val in r.items():
        print(f"{key}: {val}")
    if os.environ.get("DUMP"):
        open(os.environ["DUMP"] + ".ttgir", "w").write(k.asm["ttgir"])
        open(os.environ["DUMP"] + ".ptx", "w").write(k.asm["ptx"])
