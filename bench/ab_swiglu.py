"""Temporary A/B (eighth session): the SwiGLU product as our kernel against torch's silu and mul, in the model."""
import copy
import json
import sys

from bench import kernels as B
from kernels.transform import KernelMLP, to_kernels


def main():
    out, res = sys.argv[1], {}
    base = B.llama3_8b(max_seq_len=4096 + 256)
    ours = to_kernels(copy.deepcopy(base), max_m=8, group=128, fuse=False)
    fused = to_kernels(base, max_m=8, group=128, fuse=True)
    for m in (ours, fused):
        B.set_cache_capacity(m, 4096 + 256)
    for mname, m in (("fused", fused), ("ours", ours)):
        mlps = [mod for mod in m.modules() if isinstance(mod, KernelMLP)]
        for T in (1, 8):
            t = {}
            for rnd in range(3):
                for name in ("swiglu kernel", "torch silu*up"):
                    for mod in mlps:
                        mod.kernel_swiglu = name == "swiglu kernel"
                    t.setdefault(name, []).append(B.time_forward(m, 4096, T))
            for mod in mlps:
                mod.kernel_swiglu = True
            res[f"{mname} T={T}"] = t
            B.log(f"model {mname} ctx 4096 T={T}: " + "  ".join(f"{k} {min(v):.0f} {[round(u) for u in v]}"
                                                               for k, v in t.items()))
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
