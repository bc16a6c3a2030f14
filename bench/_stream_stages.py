"""Temporary: the producer's stream alone (consumer releases unread), weights in the shipped [N, K/2] layout or
tiled (each TMA box 4 contiguous KB), against the full kernel."""
import json, sys
import torch
from bench import kernels as B
from kernels import int4_gemm as G
from kernels import int4_gluon


def tiled(packed):
    N, half_k = packed.shape
    w = packed.view(torch.int32).reshape(N // 64, 64, half_k // 64, 16).permute(0, 2, 1, 3).contiguous()
    return w.view(torch.uint8).view(N, half_k)


bw = B.measure_bandwidth()["sm_copy"]
res = {}
for (K, N), split in [((5376, 21504), 1), ((8192, 28672), 1), ((4096, 14336), 2), ((21504, 5376), 6)]:
    int4_gluon.CONFIGS[(K, N)] = (split, 4 if split == 1 or split == 2 else 6, 64)
    copies = B.copies_for(N * K / 2)
    ops = B.gemm_operands(K, N, 128, copies)
    xs = [torch.randn(1, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    floor = B.gemm_floor_bytes(1, K, N, 128) / bw * 1e6
    tops = [(tiled(p), sz) for p, sz in ops]
    t = {}
    for rnd in range(2):
        for nomma in (True, False):
            for lay in ("std", "tiled"):
                int4_gluon.DIAG.update(nomma=nomma, tiled=lay == "tiled")
                o = tops if lay == "tiled" else ops
                t.setdefault(f"{'stream' if nomma else 'full'} {lay}", []).append(
                    B.time_calls([lambda i=i: G.int4_mm(xs[i], *o[i], 128) for i in range(copies)]))
    int4_gluon.DIAG.update(nomma=False, tiled=False)
    res[f"{K}x{N}"] = dict(floor=floor, times=t)
    print(f"{K}x{N} M=1 floor {floor:.1f}: " + "  ".join(f"{k} {min(v):.1f}" for k, v in t.items()), flush=True)
    del ops, tops
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
