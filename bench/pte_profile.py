"""Where a .pte's decode time goes: the raw execute() of a constant method and of target_decode against the
decoding loop's wall time per token (what the runtime itself costs per call), and ExecuTorch's own event trace
(ETDump) of target_decode split into the XNNPACK delegate, the portable operators outside it and the top events.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path

import torch


def pte_call_costs(engine, prompt: list[int], calls: int = 200) -> dict:
    """Median raw execute() of a constant method and of target_decode (inputs set beforehand, outputs not
    copied: what the runtime itself costs) at the prompt's context, and the loop's wall time per K=0 token."""
    from runner.generate import generate

    def median_ms(method, inputs):
        raw = engine.program.load_method(method)._method if method.startswith("get_") else \
            engine._methods[method]._method
        ts = []
        for _ in range(calls):
            raw.set_inputs(inputs)
            t0 = time.perf_counter()
            raw.execute()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    generate(engine, prompt, chain=0, max_new_tokens=2)
    P = len(prompt) + 1
    decode = median_ms("target_decode", [torch.tensor([[prompt[-1]]]), torch.tensor([P])])
    const = median_ms("get_max_m", [])
    wrapped = []
    for _ in range(calls):
        t0 = time.perf_counter()
        engine.target_decode(torch.tensor([[prompt[-1]]]), torch.tensor([P]))
        wrapped.append(time.perf_counter() - t0)
    return {"constant_method_execute_ms": round(const, 4), "target_decode_execute_ms": round(decode, 4),
            "target_decode_with_io_ms": round(statistics.median(wrapped) * 1e3, 4)}


def pte_profile(pte: Path, context: int, calls: int = 50, top: int = 8) -> dict:
    """Where target_decode's time goes, from ExecuTorch's own event tracer (ETDump; it adds a little time to
    each event): per token, the whole execute, the XNNPACK delegate calls, the operators run outside the
    delegate (ExecuTorch's portable kernels), and the `top` events by time, at positions from `context` on."""
    import collections
    import tempfile

    from executorch.extension.pybindings import portable_lib

    module = portable_lib._load_for_executorch(str(pte), enable_etdump=True, debug_buffer_size=0)
    # no prefill (it would be traced too): a decode reads the whole static cache under its mask at any position
    for i in range(calls):
        module.run_method("target_decode", (torch.tensor([[5]]), torch.tensor([context + i])))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode.etdp"
        module.write_etdump_result_to_file(str(path))
        from executorch.devtools import Inspector

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inspector = Inspector(etdump_path=str(path))
    total, count = collections.Counter(), collections.Counter()
    for block in inspector.event_blocks:
        if block.name != "Execute":
            continue
        for event in block.events:
            if event.perf_data is not None:
                total[event.name] += sum(event.perf_data.raw)
                count[event.name] += len(event.perf_data.raw)
    per = {name: t / calls for name, t in total.items()}  # ms per target_decode call
    outside = {n: v for n, v in per.items() if n.startswith("native_call_")}
    return {
        "calls": calls, "context": context,
        "execute_ms": round(per.get("Method::execute", 0.0), 3),
        "delegate_ms": round(per.get("DELEGATE_CALL", 0.0), 3),
        "delegate_calls": count["DELEGATE_CALL"] // calls,
        "outside_delegate_ms": round(per.get("OPERATOR_CALL", 0.0), 3),
        "outside_delegate_ops": count["OPERATOR_CALL"] // calls,
        "gemm_ms": round(sum(v for n, v in per.items() if "GEMM" in n), 3),
        "top_events_ms": dict(sorted(((n, round(v, 3)) for n, v in per.items()
                                      if n not in ("Method::execute", "DELEGATE_CALL", "OPERATOR_CALL")),
                                     key=lambda kv: -kv[1])[:top]),
        "outside_delegate_by_op_ms": {n.removeprefix("native_call_"): round(v, 3)
                                      for n, v in sorted(outside.items(), key=lambda kv: -kv[1])},
    }
