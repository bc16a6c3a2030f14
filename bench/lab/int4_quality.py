"""Investigation: where a 4-bit target's held-out loss goes, by quantisation scheme, in eager PyTorch (torchao).

    python -m bench.lab.int4_quality --target outputs/store/target/<key> --out bench/results/cpu-int4-quality-<name>.json

The scheme it weighs, "the .pte's int4", is symmetric 8da4w: int8 dynamic per-token activations and int4 weights
in symmetric groups of 32 (the only blockwise 4-bit layout XNNPACK runs), every linear the lm_head included; what
the draft keeps and what the target had before its groups carried offsets (models.quantize.GroupOffsetLinear, which
this investigation led to). This loads a target artifact,
quantises copies of it several ways and gives each one's mean next-token loss (nats) over held-out corpus windows
beside the fp32 target's: the scheme the .pte uses, the same without the activation rounding, the same with an
fp32 lm_head, and asymmetric weight groups (what a Q4_1 GGUF stores: w = d*q + m per block of 32). A target
dequantised from a 4-bit GGUF is rounded a second time by any scheme that does not match the file's.

Also the CUDA engine's INT4 weights (`engine.quant=w4_*`: models.quantize.quantize_w4, asymmetric
groups of 128, or 32 where 128 does not divide the width, every linear the lm_head included), dequantised back
into the fp32 model: the weights' share of the loss (the kernels' bf16 activations are not modelled), with the
zero as quantize_w4 chooses it, every zero an integer code in 0..15 as it was before, every zero a bf16 number,
and at group 32 with and without the lm_head (a GGUF's 4-bit blocks are 32 wide; its token table is often wider
than 4 bits).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.int4_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="a target artifact directory of the store")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=192)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    from tokenizers import Tokenizer
    from torch import nn
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    from bench.quality import eager_loss
    from bench.targets import make_prompts
    from models import load_target

    target = load_target(args.target).eval()
    windows = make_prompts(Tokenizer.from_file(str(args.target / "tokenizer.json")), "plain", None, args.windows,
                           args.length, 1)
    group = PerGroup(args.group)
    schemes = {
        "8da4w, symmetric (the .pte's int4)": (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group), True),
        "8da4w, symmetric, lm_head fp32": (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group), False),
        "int4 weights only, symmetric": (IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=group), True),
        "8da4w, asymmetric weight groups": (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group,
                                                  weight_mapping_type=MappingType.ASYMMETRIC), True),
    }
    from models.quantize import dequantize_w4, quantize_w4

    def cuda_int4(model, zero: str = "engine", group: int = 128, head: bool = True):
        """The kernels' weights: groups of `group` (32 where it does not divide the width), the lm_head too
        unless `head` is False; the embedding stays as it is (a tied one is untied from the head). `zero`:
        quantize_w4's own ("engine"), or every group's zero rounded to a code ("code") or kept as a bf16
        number ("fraction")."""
        if target.cfg.tie_embeddings:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and (head or not name.endswith("lm_head")):
                g = group if m.in_features % group == 0 else 32
                w = m.weight.data
                if zero == "engine":
                    m.weight.data = dequantize_w4(*quantize_w4(w, g), g, torch.float32)
                    continue
                wg = w.reshape(w.shape[0], -1, g)
                lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
                sc = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
                z = (-lo / sc).round().clamp(0, 15) if zero == "code" else (-lo / sc).to(torch.bfloat16).float()
                m.weight.data = (((wg / sc + z).round().clamp(0, 15) - z) * sc).reshape(w.shape)
        return model

    t0 = time.perf_counter()
    fp32 = eager_loss(target, windows)
    result = {"target": str(args.target), "windows": len(windows), "window_tokens": args.length,
              "group_size": args.group, "fp32_loss": round(fp32, 4), "schemes": {}}
    print(f"fp32: {fp32:.4f}")
    for name, (config, head) in schemes.items():
        model = copy.deepcopy(target)
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and m.in_features % args.group == 0
                  and (head or not fqn.endswith("lm_head")))
        loss = eager_loss(model, windows)
        result["schemes"][name] = {"loss": round(loss, 4), "loss_vs_fp32": round(loss - fp32, 4)}
        print(f"{name}: {loss:.4f} ({loss - fp32:+.4f})")
    cuda = {"CUDA kernels' int4, group 128 (the engine's)": {},
            "CUDA kernels' int4, group 128, every zero an integer code (before)": {"zero": "code"},
            "CUDA kernels' int4, group 128, every zero a bf16 number": {"zero": "fraction"},
            "CUDA kernels' int4, group 32": {"group": 32},
            "CUDA kernels' int4, group 32, lm_head bf16": {"group": 32, "head": False}}
    for name, kw in cuda.items():
        loss = eager_loss(cuda_int4(copy.deepcopy(target), **kw), windows)
        result["schemes"][name] = {"loss": round(loss, 4), "loss_vs_fp32": round(loss - fp32, 4)}
        print(f"{name}: {loss:.4f} ({loss - fp32:+.4f})")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
