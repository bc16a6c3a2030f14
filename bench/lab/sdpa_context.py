"""sdpa_midm at a context far shorter than the cache (issue 59): what a call costs at contexts of 256 to 4K keys (and
the full cache) in a 32K-key cache, with split boundaries at fixed key counts against the old boundaries at
fractions of the cache, on the CUDA GPU:

    python -m bench.lab.sdpa_context --out $OUT/sdpa-context.json [--cache 32768]
        [--contexts 256,1024,2048,4096,32768] [--split-keys 128,256,512] [--ms 1,8] [--shapes smollm2,gemma3,llama8b]

Columns, per shape (Hq / Hkv / D), M and context, in us a call:
- `fraction`: the old rule, reproduced through the same kernel: one split per program, PROGRAMS = the old
  `default_splits` (one wave, >= 4 key tiles a split) and a split every cdiv(L, PROGRAMS) keys (rounded up to a
  key tile), so the boundaries follow L and a short context leaves all but the first splits empty;
- `head`: the kernel as it was before this change, where bench/lab/_sdpa_before.py holds a copy of it (made for
  the recorded run by `git show HEAD:kernels/sdpa_midm.py`, op renamed; absent otherwise, and the column is
  skipped);
- `keys_<S>`: split boundaries every S keys (kernels.sdpa_midm.CONFIG["split_keys"] is the default);
- `floor`: the context's K and V bytes at the copy bandwidth measured in the same run.
Each call attends M query rows at the context's last M positions. Timing as in bench.kernels (a CUDA graph of calls
rotating over enough input copies to exceed the L2 several times, median of replays); the copies of a cache overlap
in one buffer, each starting `context` keys after the previous one, so the keys a call reads are fresh while the
buffer stays small. `rel_err`: the default launch against the float64 reference at each point.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from bench.kernels import L2_BYTES, log, rel_err, start_report, time_calls
from kernels import sdpa_midm as S
from kernels._jit import sm_count

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "llama8b": (32, 8, 128)}  # Hq, Hkv, D
MAX_COPIES = 512

try:  # the kernel before this change, for the recorded run only (see the docstring)
    from bench.lab import _sdpa_before as BEFORE
except ImportError:
    BEFORE = None


def fraction_launch(L: int, heads: int, sms: int) -> dict:
    """The old split rule: kernels.sdpa_midm.default_splits before issue 59, a split every cdiv(L, splits) keys."""
    block_n = S.CONFIG["block_n"]
    splits = min(max(1, S.CONFIG["programs_per_sm"] * sms // heads), max(1, L // (4 * block_n)), 256)
    chunk = triton.cdiv(triton.cdiv(L, splits), block_n) * block_n
    return dict(split_keys=chunk, programs=splits)


def inputs(shape, L: int, ctx: int, M: int):
    """Rotating (q, k, v) copies for a call at the last M positions of a `ctx`-key context in an L-key cache."""
    Hq, Hkv, D = shape
    copies = min(MAX_COPIES, max(2, math.ceil(3 * L2_BYTES / (2 * Hkv * ctx * D * 2))))
    n = (copies - 1) * ctx + L
    kb, vb = (torch.randn(1, Hkv, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv = [(kb[:, :, i * ctx:i * ctx + L], vb[:, :, i * ctx:i * ctx + L]) for i in range(copies)]
    qs = [torch.randn(1, M, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(copies)]
    return kv, qs, torch.arange(ctx - M, ctx, device="cuda"), copies


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", type=int, default=32768)
    ap.add_argument("--contexts", default="256,1024,2048,4096,32768")
    ap.add_argument("--split-keys", default="128,256,512")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--shapes", default="smollm2,gemma3,llama8b")
    args = ap.parse_args()
    L = args.cache
    report = start_report(args.out)
    bw = report["env"]["copy_bw"]
    sms = sm_count("cuda")
    report["setup"] = dict(cache=L, config=dict(S.CONFIG), head_column=BEFORE is not None, shapes={
        s: SHAPES[s] for s in args.shapes.split(",")})
    rows = report["rows"] = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        Hq, Hkv, D = shape
        for M in map(int, args.ms.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                kv, qs, q_pos, copies = inputs(shape, L, ctx, M)
                launches = {"fraction": fraction_launch(L, Hkv, sms)}
                launches.update({f"keys_{k}": dict(split_keys=int(k)) for k in args.split_keys.split(",")})
                row = dict(shape=name, Hq=Hq, Hkv=Hkv, D=D, M=M, context=ctx, copies=copies,
                           floor_us=2 * Hkv * ctx * D * 2 / bw * 1e6, fraction_launch=launches["fraction"])
                if BEFORE is not None:
                    row["head_us"] = time_calls([lambda i=i: BEFORE.launch_sdpa(qs[i], *kv[i], q_pos)
                                                 for i in range(copies)])
                for col, launch in launches.items():
                    row[f"{col}_us"] = time_calls([lambda i=i, launch=launch: S.launch_sdpa(qs[i], *kv[i], q_pos,
                                                                                            **launch)
                                                   for i in range(copies)])
                k, v = kv[0]
                row["rel_err"] = rel_err(S.launch_sdpa(qs[0], k, v, q_pos),
                                         S.sdpa_reference(qs[0].double(), k.double(), v.double(), q_pos))
                rows.append(row)
                log(" ".join(f"{key}={val:.2f}" if isinstance(val, float) else f"{key}={val}"
                             for key, val in row.items() if key != "fraction_launch"))
                report.save()
                del kv, qs
                torch.cuda.empty_cache()
    cols = (["head"] if BEFORE is not None else []) + ["fraction"] + [f"keys_{k}" for k in args.split_keys.split(",")]
    log("\n| shape | M | context | " + " | ".join(cols) + " | floor |")
    log("|" + " --- |" * (len(cols) + 4))
    for r in rows:
        log(f"| {r['shape']} | {r['M']} | {r['context']} | " + " | ".join(f"{r[c + '_us']:.1f}" for c in cols)
            + f" | {r['floor_us']:.1f} |")


if __name__ == "__main__":
    main()
