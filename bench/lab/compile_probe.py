"""Does inductor close the gap between the CUDA engine's bf16 step and transformers' compiled static cache?

Gemma 3 270M's real layers with random weights (bench.cuda_engine.gemma3_layers): the engine (bf16, CUDA
graphs, kernels off) as it is and with `compile="inductor"` (engine.compile: the captured calls through
torch.compile before capture, inductor's fused kernels inside our own graphs). Beside them,
transformers' Gemma3ForCausalLM on the same config with the static cache generate() compiles. Reports load time
(compilation and capture), tokens/s at K = 0 and K = 3 and whether the compiled engine's ids equal the uncompiled
engine's.

    python3 -m bench.lab.compile_probe --out $OUT/compile_probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.cuda_engine import (GEMMA3_270M, NEW_TOKENS, SHAPES, engine_generate, hf_gemma3, hf_generate, prompt,
                               random_speculator)
from runner.cuda_engine import CudaEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-m", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--chains", default="0,3")
    args = ap.parse_args()
    windows = dict(max_m=args.max_m, default_chain=min(3, args.max_m - 1), max_prefill_chunk=128, min_prefill_chunk=16)
    ids = [prompt(args.context, GEMMA3_270M["vocab_size"], s) for s in range(2)]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "max_m": args.max_m,
           "context": args.context, "new_tokens": NEW_TOKENS, "engine": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    ref = None
    for mode in ("uncompiled", "compiled"):
        spec = random_speculator(SHAPES["gemma3_270m_layers"], max_seq_len=args.context + NEW_TOKENS + 2 * args.max_m)
        t = time.perf_counter()
        engine = CudaEngine(spec, device="cuda", compile="inductor" if mode == "compiled" else "none", exact=False,
                            **windows)
        row = out["engine"][mode] = {"load_s": time.perf_counter() - t}
        print(f"{mode}: load {row['load_s']:.1f} s", flush=True)
        for k in map(int, args.chains.split(",")):
            r = engine_generate(engine, ids, k, NEW_TOKENS)
            row[k] = {key: r[key] for key in ("tokens_per_s", "decode_tokens_per_s", "tau")}
            if ref is None:
                ref = r["outputs"]
            row[k]["equal_to_uncompiled_k0"] = r["outputs"] == ref
            print(f"{mode} K={k}: {r['tokens_per_s']:.0f} tokens/s, decode {r['decode_tokens_per_s']:.0f}, "
                  f"equal {row[k]['equal_to_uncompiled_k0']}", flush=True)
            save()
        del engine, spec
        torch.cuda.empty_cache()
    hf = hf_gemma3()
    hf.generation_config.cache_implementation = "static"
    r = hf_generate(hf, ids, NEW_TOKENS)
    out["transformers_static_compiled"] = {"tokens_per_s": r["tokens_per_s"], "first_call_s": r["first_call_s"]}
    print(f"transformers static: {r['tokens_per_s']:.0f} tokens/s (first call {r['first_call_s']:.0f} s)", flush=True)
    save()


if __name__ == "__main__":
    main()
