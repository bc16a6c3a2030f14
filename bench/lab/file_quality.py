"""Investigation: a 4-bit GGUF target's quality and weight bytes per decode step, by scheme, beside llama.cpp's own.

    python -m bench.lab.file_quality --target outputs/store/target/<key> --out bench/results/cpu-xeon-file-quality-<preset>.json

For a target artifact converted from a GGUF (target=gguf: its weight_types.json), the held-out loss (nats per
token over corpus windows) of the fp32 target, of each `export.quant` scheme's target as a .pte runs it (its own
logits: the quantised target lowered to XNNPACK as one target_verify method, exactly as pipeline.export_pte lowers
it, and run through ExecuTorch's runtime), and of llama.cpp on the file itself (bench.quality.llama_loss's
llama-cpp-python); with each one's greedy agreement with the fp32 target (the share of the windows' positions
whose argmax, its greedy next token, is the fp32 target's, teacher-forced) and the weight bytes one decode step
reads (bench.quality.decode_bytes, gguf_decode_bytes). The schemes: `8da4w_offsets` (every target
linear 4-bit with group offsets) and `8da_file` (each at the file's precision: models.quantize.quantize_file).
Beside them, on the same windows, the CUDA engine's weights (`engine.quant` w4_g32 and w4_file) dequantised into
the fp32 model: their share of the loss, without the engine's bf16 activations.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

SCHEMES = ("8da4w_offsets", "8da_file")  # export.quant
CUDA_SCHEMES = ("w4_g32", "w4_file")  # engine.quant


class TargetProgram:
    """A target lowered as a .pte of one method, target_verify (T in [2, max_m]), in the engine interface
    bench.quality.pte_loss reads (`meta["max_m"]`, `target_verify` -> (ids, None, logits))."""

    def __init__(self, target, max_m: int):
        import torch
        from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
        from executorch.exir.passes import MemoryPlanningPass
        from executorch.runtime import Runtime
        from torch import nn
        from torch.export import Dim, export

        from models.layers import load_llama_ops
        from pipeline.export_pte import _export_graph, _partitioners, pick_attention

        class Verify(nn.Module):
            def __init__(self, target):
                super().__init__()
                self.target = target

            def forward(self, tokens, input_pos):
                return self.target(tokens, input_pos)

        self.meta = {"max_m": max_m}
        t = Dim("T", min=2, max=max_m)
        args = (torch.zeros(1, max_m, dtype=torch.int64), torch.arange(max_m))
        t0 = time.perf_counter()
        with torch.no_grad(), _export_graph(target, pick_attention(target, "llama_ops"), True):
            ep = export(Verify(target), args, dynamic_shapes=({1: t}, {0: t}), strict=False)
            print(f"  torch.export: {time.perf_counter() - t0:.0f} s", flush=True)
            edge = to_edge_transform_and_lower({"target_verify": ep}, partitioner={"target_verify": _partitioners("xnnpack")},
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
            print(f"  lowered: {time.perf_counter() - t0:.0f} s", flush=True)
        buffer = edge.to_executorch(ExecutorchBackendConfig(
            emit_mutable_buffer_names=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=True))).buffer
        self.lower_s = time.perf_counter() - t0
        print(f"  to_executorch: {self.lower_s:.0f} s", flush=True)
        self.pte_bytes = len(buffer)
        load_llama_ops()
        self.buffer = buffer  # the runtime reads the program from these bytes without a copy of its own
        self.method = Runtime.get().load_program(self.buffer).load_method("target_verify")

    def target_verify(self, tokens, input_pos):
        import torch

        n = torch.get_num_threads()
        torch.set_num_threads(1)  # the runtime's pool runs the kernels (runner.engine.PteEngine._run)
        try:
            logits = self.method.execute((tokens, input_pos))[0]
        finally:
            torch.set_num_threads(n)
        return logits.argmax(-1), None, logits


def cuda_weights(target, quant: str, weight_types: dict) -> tuple:
    """(a copy of `target` whose linears carry the weights `engine.quant=quant` gives them on the INT4 kernels,
    dequantised back to fp32: models.quantize.quantize_w4 on every linear but the dense ones, as runner.build
    picks them; the bytes one step reads on the engine: INT4 half a byte a weight and a bf16 (scale, zero) per
    group, a dense linear, the norms and one embedding row bf16)."""
    import torch
    from torch import nn

    from models.choices import CUDA_QUANTS
    from models.quantize import dequantize_w4, file_bits, quantize_w4

    options = CUDA_QUANTS[quant]
    group, dense = options["group"], set(options["dense"])
    model = copy.deepcopy(target)
    if options.get("file"):
        dense |= {n for n, b in file_bits(model, weight_types, f"engine.quant={quant}", "engine.quant=w4_g32").items() if b > 4}
    if model.cfg.tie_embeddings:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    n_bytes = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            N, K = m.weight.shape
            if name in dense:
                n_bytes += 2 * N * K
                continue
            g = group if K % group == 0 else 32
            m.weight.data = dequantize_w4(*quantize_w4(m.weight.data, g), g, torch.float32)
            n_bytes += N * K // 2 + 4 * N * (K // g)
        elif isinstance(m, nn.Embedding):
            n_bytes += 2 * m.weight.shape[1]
        else:
            n_bytes += sum(2 * p.numel() for p in m.parameters(recurse=False))
    return model, n_bytes


def pte_logits(program: TargetProgram, ids: list[int]):
    """Every row's logits [len(ids), V] (numpy) through the program, in calls of max_m rows from position 0 (a
    last call of one row is padded with the row before it)."""
    import torch

    m, rows = program.meta["max_m"], []
    for start in range(0, len(ids), m):
        lo = min(start, len(ids) - 2)  # every call takes at least 2 rows
        chunk = ids[lo:start + m]
        _, _, logits = program.target_verify(torch.tensor([chunk]), torch.arange(lo, lo + len(chunk)))
        rows.append(logits[0, start - lo:])
    return torch.cat(rows).float().numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.file_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="a target=gguf artifact directory of the store")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=192)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--max-m", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import functools

    import torch
    from tokenizers import Tokenizer

    from bench import llama_run
    from bench.quality import decode_bytes, gguf_decode_bytes
    from bench.targets import make_prompts
    from models import load_target
    from models.gguf import read_weight_types
    from models.quantize import linear_bits, quantize_8da4w_offsets, quantize_file
    from runner.engine import size_runtime_pool

    torch.set_num_threads(args.threads)
    size_runtime_pool()
    t_start = time.perf_counter()
    manifest = json.loads((args.target / "manifest.json").read_text())
    source = Path(manifest["report"]["source"])
    weight_types = read_weight_types(args.target)
    target = load_target(args.target, max_seq_len=args.length + 16).eval()  # caches of the windows, not the context
    windows = make_prompts(Tokenizer.from_file(str(args.target / "tokenizer.json")), "plain", None, args.windows,
                           args.length, 1)

    def stateless(model, ids):
        with torch.inference_mode():
            return model(torch.tensor([ids]))[0].float().numpy()

    reference = {}  # window -> the fp32 target's argmax at each position

    def measure(logits_of) -> dict:
        """Mean next-token loss over the windows and the share of their positions whose argmax is the fp32
        target's (its greedy next token, teacher-forced on the corpus text), both from one pass of logits."""
        total = agree = count = 0
        for i, ids in enumerate(windows):
            logits = logits_of(ids)[:-1]
            total += llama_run.nll(logits, ids[1:])
            top = logits.argmax(axis=1)
            agree += int((top == reference.setdefault(i, top)).sum())
            count += len(ids) - 1
        return {"loss": round(total / count, 4), "greedy_agreement": round(agree / count, 4)}

    result = {"target": str(args.target), "gguf": source.name, "file_types": manifest["report"].get("quantisation"),
              "windows": len(windows), "window_tokens": args.length,
              "greedy_agreement": "share of the windows' positions whose argmax is the fp32 target's (teacher-forced)",
              "group_size": args.group, "threads": args.threads, "systems": {}}
    fp32 = measure(functools.partial(stateless, target))
    result["systems"]["fp32 (eager)"] = {**fp32, "decode_weight_bytes": decode_bytes(target)}
    print(f"fp32: {fp32}", flush=True)
    for scheme in args.schemes:
        model = copy.deepcopy(target)
        if scheme == "8da4w_offsets":
            quantize_8da4w_offsets(model, args.group)
        else:
            quantize_file(model, weight_types, args.group)
        bits = linear_bits(model)
        print(f"{scheme}: quantised ({time.perf_counter() - t_start:.0f} s in)", flush=True)
        program = TargetProgram(model, args.max_m)
        q = measure(functools.partial(pte_logits, program))
        result["systems"][f"ours {scheme} (.pte)"] = {
            **q, "loss_vs_fp32": round(q["loss"] - fp32["loss"], 4), "decode_weight_bytes": decode_bytes(model),
            "linears_by_bits": {str(b): sum(v == b for v in bits.values()) for b in sorted(set(bits.values()))},
            "lower_s": round(program.lower_s, 1), "pte_bytes": program.pte_bytes}
        print(f"{scheme}: {result['systems'][f'ours {scheme} (.pte)']}", flush=True)
        del program, model
    for quant in CUDA_SCHEMES:  # the cuda engine's weights, dequantised into the fp32 model (bf16 not modelled)
        model, n_bytes = cuda_weights(target, quant, weight_types)
        q = measure(functools.partial(stateless, model))
        result["systems"][f"cuda {quant} weights (eager fp32)"] = {
            **q, "loss_vs_fp32": round(q["loss"] - fp32["loss"], 4), "decode_weight_bytes": n_bytes}
        print(f"cuda {quant}: {result['systems'][f'cuda {quant} weights (eager fp32)']}", flush=True)
        del model
    if not args.no_llama:
        llm = llama_run.load(source, threads=args.threads, n_ctx=args.length + 16, logits_all=True)
        q = measure(functools.partial(llama_run.row_logits, llm))
        result["systems"][f"llama.cpp {source.name}"] = {**q, "loss_vs_fp32": round(q["loss"] - fp32["loss"], 4),
                                                         "decode_weight_bytes": gguf_decode_bytes(source)}
        print(f"llama.cpp: {result['systems'][f'llama.cpp {source.name}']}", flush=True)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
