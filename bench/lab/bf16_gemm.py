"""Investigation: does XNNPACK's bf16 fully-connected make a verify window cheaper than fp32 on this CPU?

    python -m bench.lab.bf16_gemm --out bench/results/cpu-bf16-gemm.json

A verify of T rows costs time(T)/time(1) decode steps, and on a CPU whose fp32 weights sit in the caches the GEMM
pays for rows in arithmetic (docs/design.md §5). bf16 weights would halve the bytes and, on a CPU with
avx512_bf16, double the multiply-adds per instruction. ExecuTorch's XNNPACK partitioner delegates bf16 linears
when asked (`XnnpackPartitioner(enable_bf16=True)`); this times the same chain of 4 linears 1024 <-> 2048 (the
row-tile probe's, pipeline.hardware) with fp32 and with bf16 weights and activations (casts around each linear),
dynamic M in [1, 16], one thread, the best of reps x 3 calls per M, every case interleaved in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

MAX_ROWS = 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.bf16_gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime
    from torch import nn
    from torch.export import Dim, export

    from models import quiet

    torch.set_num_threads(1)
    with quiet.native_stderr():
        portable_lib._unsafe_reset_threadpool(1)

    class Chain(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype
            self.linears = nn.ModuleList(nn.Linear(a, b, bias=False).to(dtype) for a, b in
                                         ((1024, 2048), (2048, 1024), (1024, 2048), (2048, 1024)))

        def forward(self, x):
            for linear in self.linears:
                x = linear(x.to(self.dtype)).float()
            return x

    methods, delegated = {}, {}
    with tempfile.TemporaryDirectory(prefix="bf16_gemm_") as tmp:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            torch.manual_seed(0)
            ep = export(Chain(dtype).eval(), (torch.randn(1, 4, 1024),),
                        dynamic_shapes=({1: Dim("M", min=1, max=MAX_ROWS)},), strict=False)
            lowered = to_edge_transform_and_lower(
                ep, partitioner=[XnnpackPartitioner(enable_bf16=dtype == torch.bfloat16)])
            delegated[name] = lowered.exported_program().graph_module.code.count("executorch_call_delegate")
            path = Path(tmp) / f"{name}.pte"
            path.write_bytes(lowered.to_executorch().buffer)
            methods[name] = Runtime.get().load_program(path).load_method("forward")._method
        best = {(n, m): float("inf") for n in methods for m in range(1, MAX_ROWS + 1)}
        for _ in range(args.reps):
            for (n, m) in best:
                methods[n].set_inputs([torch.randn(1, m, 1024)])
                for _ in range(3):
                    t0 = time.perf_counter()
                    methods[n].execute()
                    best[(n, m)] = min(best[(n, m)], time.perf_counter() - t0)
    fp32_m1 = best[("fp32", 1)]
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "command": " ".join(["python -m bench.lab.bf16_gemm", *(argv if argv is not None else sys.argv[1:])]),
        "delegate_calls": delegated,
        "m1_ms": {n: round(best[(n, 1)] * 1e3, 4) for n in methods},
        "ratio_to_fp32_m1": {n: [round(best[(n, m)] / fp32_m1, 2) for m in range(1, MAX_ROWS + 1)] for n in methods},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
