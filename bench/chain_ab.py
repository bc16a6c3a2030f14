"""A/B (temporary): the Gluon GEMM triggering its dependents (CHAIN 1: at start, 2: after its last copy) with
the prep kernel a programmatic dependent too, and L2 prefetch of weights before the dependency wait (L2_AHEAD).

    python3 -m bench.chain_ab --out $OUT/chain.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from bench import kernels as B
from kernels import int4_gemm as G

VARIANTS = [(0, 0), (1, 0), (2, 0), (1, 4), (1, 16), (2, 8)]
RES: dict = {}


def setv(v):
    G.CHAIN, G.L2_AHEAD = v


def chained_check():
    """Outputs feed the next call's input across the three Gluon modes; graph replays (every variant) equal
    the eager calls without chaining, bitwise, on fresh inputs."""
    shapes = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)]
    ws = [tuple(t.cuda() for t in G.quantize_int4(torch.randn(N, K, device="cuda") * 0.02, 128)) for K, N in shapes]
    for M in (1, 3, 8):
        x = torch.randn(M, 4096, device="cuda").to(torch.bfloat16)

        def calls():
            h, outs = x, []
            for w in ws:
                h = G.int4_mm(h, *w, 128)
                outs.append(h)
            return outs

        for v in VARIANTS[1:]:
            setv(v)
            calls()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs_g = calls()
            for _ in range(3):
                x.copy_(torch.randn_like(x))
                for o in outs_g:
                    o.fill_(float("nan"))
                g.replay()
                setv((0, 0))
                ref = calls()
                torch.cuda.synchronize()
                assert all(torch.equal(a, b) for a, b in zip(outs_g, ref)), f"variant {v} M={M} differs"
                setv(v)
            del g
    setv((0, 0))
    B.log("chained check: graph replays of every variant equal the eager calls (M 1, 3, 8)")
    RES["chained_check"] = "passed"


def gemm():
    rows = []
    for K, N in B.GEMM_SHAPES + [(4096, 1024), (4096, 28672), (4096, 128256)]:
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        tg = [B.to_tinygemm(*o, 128, B.TINYGEMM_EVEN_HIGH) for o in ops] if (K, N) == (4096, 4096) else None
        for M in (1, 2, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = B.gemm_floor_bytes(M, K, N, 128) / RES["bw"] * 1e6
            t = {}
            for rnd in range(2):
                for v in VARIANTS:
                    setv(v)
                    us = B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)])
                    t.setdefault(str(v), []).append(us)
                if tg:
                    t.setdefault("torch", []).append(
                        B.time_calls([lambda i=i: B.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)]))
            setv((0, 0))
            best = {k: min(v) for k, v in t.items()}
            rows.append(dict(K=K, N=N, M=M, floor=floor, times=t))
            B.log(f"{K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{k} {u:.1f}({floor / u:.2f})"
                                                                    for k, u in best.items()))
        del ops, tg
        torch.cuda.empty_cache()
        RES["gemm"] = rows
        save()


SPLITS = {(4096, 14336): (1, 2, 4), (5376, 21504): (1, 2, 3), (4096, 28672): (1, 2), (14336, 4096): (4, 8, 16),
          (21504, 5376): (3, 6, 12), (8192, 28672): (1, 2)}


def split():
    """Chaining against the split count (the tune chose the splits without it)."""
    from kernels import int4_gluon
    rows = []
    for (K, N), splits in SPLITS.items():
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        saved = int4_gluon.CONFIGS[(K, N)]
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            floor = B.gemm_floor_bytes(M, K, N, 128) / RES["bw"] * 1e6
            t = {}
            for rnd in range(2):
                for sp in splits:
                    int4_gluon.CONFIGS[(K, N)] = (sp, 4, 64)
                    for chain in (0, 1, 2):
                        setv((chain, 0))
                        us = B.time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)])
                        t.setdefault(f"split{sp} chain{chain}", []).append(us)
            setv((0, 0))
            int4_gluon.CONFIGS[(K, N)] = saved
            best = {k: min(v) for k, v in t.items()}
            rows.append(dict(K=K, N=N, M=M, floor=floor, times=t))
            B.log(f"split {K}x{N} M={M} floor {floor:.1f}: " + "  ".join(f"{k} {u:.1f}({floor / u:.2f})"
                                                                          for k, u in best.items()))
        del ops
        torch.cuda.empty_cache()
        RES["split"] = rows
        save()


def model():
    from kernels.transform import to_kernels

    base = B.llama3_8b(max_seq_len=4096 + 256)
    fused = to_kernels(base, max_m=8, group=128, fuse=True)
    B.set_cache_capacity(fused, 4096 + 256)
    torch.cuda.empty_cache()
    rows = {}
    for rnd in range(2):
        for v in [(0, 0), (1, 0), (2, 0), (1, 4), (2, 8)]:
            setv(v)
            for T in (1, 8):
                rows.setdefault(f"{v} T={T}", []).append(B.time_forward(fused, 4096, T))
    setv((0, 0))
    for k, u in rows.items():
        B.log(f"model fused ctx 4096 {k}: {min(u):.0f} us ({u})")
    RES["model"] = rows
    save()


def save():
    if RES.get("out"):
        json.dump(RES, open(RES["out"], "w"), indent=1, default=str)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--only", default="check,gemm,model")
    a = p.parse_args()
    RES["out"] = a.out
    RES["bw"] = max(B.measure_bandwidth().values())
    only = a.only.split(",")
    for name, fn in (("check", chained_check), ("gemm", gemm), ("split", split), ("model", model)):
        if name in only:
            try:
                fn()
            except Exception:
                import traceback
                B.log(f"{name} FAILED\n{traceback.format_exc()[-3000:]}")
                RES[f"{name}_error"] = traceback.format_exc()[-3000:]
                save()


if __name__ == "__main__":
    main()
