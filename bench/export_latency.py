"""Benchmark: export time, .pte size and per-call latency of the exported methods, per backend and quant.

    python bench/export_latency.py --store                 # every model.pte in outputs/store/export/
    python bench/export_latency.py --pte a.pte b.pte       # given files
    python bench/export_latency.py --random xnnpack:none xnnpack:int4 portable:none
                                                          # export a RANDOM model of the embedded default's
                                                          # size first (conf/target/tiny.yaml), timing it

Latency is the runtime's own `execute()` of the loaded method (inputs are set beforehand and outputs are
not copied, via the pybinding's set_inputs / execute), median of `--calls` calls after `--warmup`, with a
64-token prefill in the cache first so attention sees a realistic context. Rows: target_decode (T=1, the
K=0 baseline), target_verify at T = 2, 4 and max_m, draft_decode at T=1, prefill at its max chunk.
A verify that costs about as much as a decode step is what makes speculation pay (docs/design.md §5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def default_sized_speculator():
    """Random target + draft with the embedded default's shapes (conf/target/tiny.yaml, full-vocab draft)."""
    from omegaconf import OmegaConf

    from models import Speculator, TargetConfig, Transformer, tiny_draft

    conf = OmegaConf.load(ROOT / "conf/target/tiny.yaml")
    model = {k: v for k, v in OmegaConf.to_container(conf.model, resolve=False).items()
             if k not in ("vocab_size", "max_seq_len", "tap_layers")}
    torch.manual_seed(0)
    cfg = TargetConfig(vocab_size=conf.tokenizer.vocab_size, max_seq_len=conf.max_seq_len, **model)
    target = Transformer(cfg).eval()
    return Speculator(target, tiny_draft(target)).eval()


def export_random(spec_str: str, out_dir: Path, max_m: int, chain: int, max_prefill: int) -> Path:
    from pipeline.export_pte import export_pte

    backend, quant = spec_str.split(":")
    path = out_dir / f"default_{backend}_{quant}.pte"
    t0 = time.perf_counter()
    report = export_pte(default_sized_speculator(), max_m=max_m, default_chain=chain, max_prefill_chunk=max_prefill,
                        min_prefill_chunk=max_m + 1, backend=backend, quant=quant, out_path=path,
                        manifest_hash="0" * 64)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return path


def timed(method, inputs, calls: int, warmup: int) -> list[float]:
    raw = method._method  # the pybinding method: time execute() alone
    out = []
    for i in range(warmup + calls):
        raw.set_inputs(inputs)
        t0 = time.perf_counter()
        raw.execute()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure(path: Path, calls: int, warmup: int) -> dict:
    from executorch.runtime import Runtime

    prog = Runtime.get().load_program(path)
    get = lambda name: prog.load_method(name).execute([])[0]  # noqa: E731
    max_m, hidden, vocab = get("get_max_m"), get("get_hidden_size"), get("get_vocab_size")
    max_prefill, min_prefill = get("get_max_prefill_chunk"), get("get_min_prefill_chunk")
    g = torch.Generator().manual_seed(0)
    P = max(min(64, max_prefill), min_prefill)
    prompt = torch.randint(0, vocab, (1, P), generator=g)
    prog.load_method("prefill").execute([prompt, torch.arange(P)])
    row = {"file": str(path), "bytes": path.stat().st_size, "backend": get("get_backend"), "quant": get("get_quant"),
           "max_m": max_m, "context": P}

    def ids(T):
        return torch.randint(0, vocab, (1, T), generator=g), torch.arange(P, P + T)

    cases = {"target_decode T=1": ("target_decode", ids(1))}
    for T in sorted({2, 4, max_m} & set(range(2, max_m + 1))):
        cases[f"target_verify T={T}"] = ("target_verify", ids(T))
    tok, p = ids(1)
    cases["draft_decode T=1"] = ("draft_decode", (tok, torch.randn(1, 1, hidden, generator=g), p))
    tok, _ = ids(max_prefill)
    cases[f"prefill T={max_prefill}"] = ("prefill", (tok, torch.arange(max_prefill)))
    for name, (method, inputs) in cases.items():
        ms = timed(prog.load_method(method), list(inputs), calls if "prefill" not in name else max(5, calls // 10),
                   warmup)
        q = statistics.quantiles(ms, n=10)
        row[name] = {"median_ms": round(statistics.median(ms), 3), "p10_ms": round(q[0], 3), "p90_ms": round(q[-1], 3)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--pte", nargs="+", type=Path)
    src.add_argument("--store", action="store_true", help="every model.pte under outputs/store/export")
    src.add_argument("--random", nargs="+", metavar="BACKEND:QUANT")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-m", type=int, default=8)
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--max-prefill", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="directory for --random .pte files (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--threads", type=int, default=None, help="runtime threadpool size (default: the runtime's)")
    args = ap.parse_args(argv)

    if args.store:
        paths = sorted((ROOT / "outputs/store/export").glob("*/model.pte"))
    elif args.pte:
        paths = args.pte
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="export_latency_"))
        out.mkdir(parents=True, exist_ok=True)
        paths = [export_random(s, out, args.max_m, args.chain, args.max_prefill) for s in args.random]

    from executorch.extension.pybindings import portable_lib

    if args.threads:
        portable_lib._unsafe_reset_threadpool(args.threads)
    print(f"runtime threads: {portable_lib._threadpool_get_thread_count()}, torch threads: {torch.get_num_threads()}")
    rows = []
    for path in paths:
        row = measure(Path(path), args.calls, args.warmup)
        for report_file in (Path(path).with_suffix(".json"), Path(path).parent / "manifest.json"):
            if report_file.is_file():
                rep = json.loads(report_file.read_text())
                rep = rep.get("report", rep)
                row["export_s"] = rep.get("timings", {}).get("total_s")
        rows.append(row)
        print(f"\n{path}  {row['backend']}/{row['quant']}  {row['bytes'] / 1e6:.2f} MB  "
              f"export {row.get('export_s', '?')} s  (context {row['context']} tokens)")
        for name, v in row.items():
            if isinstance(v, dict):
                print(f"  {name:22} median {v['median_ms']:8.3f} ms   p10 {v['p10_ms']:8.3f}   p90 {v['p90_ms']:8.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
