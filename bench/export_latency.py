"""Benchmark: export time, .pte size and per-call latency of the exported methods, per backend and quant.

    python -m bench.export_latency --store                 # every model.pte in outputs/store/export/
    python -m bench.export_latency --pte a.pte b.pte       # given files
    python -m bench.export_latency --row-tile              # XNNPACK's GEMM row tile: a linear chain at M=1..16
    python -m bench.export_latency --random xnnpack:fp32 xnnpack:8da4w_offsets portable:fp32 xnnpack:fp32:index_copy
                                                          # export a RANDOM model of the embedded default's
                                                          # size first (conf/target/tiny.yaml), timing it;
                                                          # a third field picks the attention (kv_impl:
                                                          # llama_ops | index_copy), a fourth the norms'
                                                          # mean (fc | mean)

Every program is loaded into ONE process and timed side by side: each repetition times every case of
every program in turn, so a load change on a shared machine hits all of them alike; the rows are the
medians over all repetitions (compare ratios, not absolute times, between runs). One thread in the
ExecuTorch threadpool unless --threads says otherwise; torch's own at one, as runner.engine runs a program.

Latency is the runtime's own `execute()` of the loaded method (inputs are set beforehand and outputs are not
copied, via the pybinding's set_inputs / execute), with a 64-token prefill (and the draft seeded on its
feature) in the caches first so attention sees a realistic context. Rows: target_decode (T=1, the K=0
baseline), target_verify and target_verify_exact (exact mode's call) at every T in [2, max_m], draft_decode
T=1 back to back, draft_decode T=1 right after a target_verify (T=max_m; the round's order, where the target's
weights have just passed through the caches), the draft steps of a round (verify T=K+1 then K draft steps, K =
default chain; mean of the K), prefill at its max chunk. Each row also gives its ratio to target_decode, of
the medians and of the 10th percentiles (on a busy machine the low percentile is the steadier estimate of a
call's own cost). A verify that costs about as much as a decode step is what makes speculation pay
(docs/design.md §5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def default_sized_speculator():
    """Random target + draft with the embedded default's shapes (conf/target/tiny.yaml, the draft vocabulary of
    conf/draft/train.yaml) and the export's cache length (conf/export/xnnpack.yaml)."""
    from omegaconf import OmegaConf

    from models import Speculator, TargetConfig, Transformer, tiny_draft

    conf = OmegaConf.load(ROOT / "conf/target/tiny.yaml")
    max_seq_len = int(OmegaConf.load(ROOT / "conf/export/xnnpack.yaml").max_seq_len)
    draft_vocab = int(OmegaConf.load(ROOT / "conf/draft/train.yaml").draft_vocab_size)
    model = {k: v for k, v in OmegaConf.to_container(conf.model, resolve=False).items()
             if k not in ("vocab_size", "max_seq_len", "tap_layers")}
    torch.manual_seed(0)
    cfg = TargetConfig(vocab_size=conf.tokenizer.vocab_size, max_seq_len=max_seq_len, **model)
    target = Transformer(cfg).eval()
    return Speculator(target, tiny_draft(target, draft_vocab_size=min(draft_vocab, cfg.vocab_size))).eval()


def export_random(spec_str: str, out_dir: Path, max_m: int, chain: int, max_prefill: int) -> Path:
    from pipeline.export_pte import export_pte

    backend, quant, *rest = spec_str.split(":")
    attention = rest[0] if rest else "llama_ops"
    norms = rest[1] if len(rest) > 1 else "fc"
    path = out_dir / f"default_{backend}_{quant}_{attention}_{norms}_m{max_m}.pte"
    t0 = time.perf_counter()
    report = export_pte(default_sized_speculator(), max_m=max_m, default_chain=chain, max_prefill_chunk=max_prefill,
                        min_prefill_chunk=max_m + 1, backend=backend, quant=quant, out_path=path,
                        manifest_hash="0" * 64, attention=attention, fc_norms=norms == "fc")
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return path


def _timed_call(raw, inputs) -> float:
    raw.set_inputs(inputs)
    t0 = time.perf_counter()
    raw.execute()
    return (time.perf_counter() - t0) * 1e3


class Bench:
    """One loaded program, its caches filled with a prompt, and its cases; `run(case, n)` appends n timings."""

    def __init__(self, path: Path):
        from executorch.runtime import Runtime

        from models.layers import load_llama_ops

        load_llama_ops()  # the llama:: kernels a program may call
        self.path = path
        prog = self.prog = Runtime.get().load_program(path)
        get = lambda name: prog.load_method(name).execute([])[0]  # noqa: E731
        max_m, hidden, vocab = get("get_max_m"), get("get_hidden_size"), get("get_vocab_size")
        max_prefill, min_prefill, chain = get("get_max_prefill_chunk"), get("get_min_prefill_chunk"), get("get_chain_len")
        names = ("prefill", "target_verify", "target_verify_exact", "target_decode", "draft_decode")
        self.m = {name: prog.load_method(name)._method for name in names if name in prog.method_names}
        g = torch.Generator().manual_seed(0)
        P = max(min(64, max_prefill), min_prefill)
        prompt = torch.randint(0, vocab, (1, P), generator=g)
        feature = prog.load_method("prefill").execute([prompt, torch.arange(P)])[1]
        prog.load_method("draft_decode").execute([prompt, feature, torch.arange(P)])  # seed the draft's cache
        self.row = {"file": str(path), "bytes": path.stat().st_size, "backend": get("get_backend"),
                    "quant": get("get_quant"), "max_m": max_m, "chain": chain, "context": P}

        def ids(T):
            return [torch.randint(0, vocab, (1, T), generator=g), torch.arange(P, P + T)]

        tok1, pos1 = ids(1)
        draft_in = [tok1, torch.randn(1, 1, hidden, generator=g), pos1]
        self.cases = {"target_decode T=1": [("target_decode", ids(1), True)]}
        for T in range(2, max_m + 1):
            self.cases[f"target_verify T={T}"] = [("target_verify", ids(T), True)]
        for T in range(2, max_m + 1) if "target_verify_exact" in self.m else ():
            self.cases[f"target_verify_exact T={T}"] = [("target_verify_exact", ids(T), True)]
        self.cases["draft_decode T=1 back to back"] = [("draft_decode", draft_in, True)]
        self.cases["draft_decode T=1 after verify"] = [("target_verify", ids(max_m), False),
                                                       ("draft_decode", draft_in, True)]
        self.cases[f"draft_decode T=1 in a round K={chain}"] = (
            [("target_verify", ids(chain + 1), False)] + [("draft_decode", draft_in, True)] * chain)
        tok, _ = ids(max_prefill)
        self.cases[f"prefill T={max_prefill}"] = [("prefill", [tok, torch.arange(max_prefill)], True)]
        self.times = {name: [] for name in self.cases}

    def run(self, name: str, n: int) -> None:
        for _ in range(n):
            for method, inputs, timed in self.cases[name]:
                ms = _timed_call(self.m[method], inputs)
                if timed:
                    self.times[name].append(ms)

    def result(self, cases=None) -> dict:
        """The program's row with, for each of `cases` (default: all), median / 10th / 90th percentile ms,
        the sample count and the ratios to target_decode T=1 (of the medians and of the 10th percentiles)."""
        row = dict(self.row)
        base = statistics.median(self.times["target_decode T=1"])
        base10 = statistics.quantiles(self.times["target_decode T=1"], n=10)[0]
        for name in cases or self.times:
            ms = self.times[name]
            q = statistics.quantiles(ms, n=10)
            med = statistics.median(ms)
            row[name] = {"median_ms": round(med, 4), "p10_ms": round(q[0], 4), "p90_ms": round(q[-1], 4),
                         "n": len(ms), "x_decode": round(med / base, 4), "x_decode_p10": round(q[0] / base10, 4)}
        return row


def measure_all(paths: list[Path], calls: int, warmup: int, reps: int,
                cases: list[list[str]] | None = None) -> list[dict]:
    """Time the cases of every program (`cases[i]` for paths[i], default all; target_decode T=1 always, as the
    unit), interleaved: `reps` repetitions of `calls // reps` calls each."""
    benches = [Bench(Path(p)) for p in paths]
    chosen = [list(b.cases) if cases is None else list(dict.fromkeys(["target_decode T=1", *cases[i]]))
              for i, b in enumerate(benches)]
    for b, names in zip(benches, chosen):
        for name in names:
            b.run(name, warmup)
        b.times = {name: [] for name in names}
    per = max(1, calls // reps)
    for _ in range(reps):
        for b, names in zip(benches, chosen):
            for name in names:
                b.run(name, per if "prefill" not in name else max(1, per // 10))
    return [b.result(names) for b, names in zip(benches, chosen)]


def row_tile(quants=("fp32", "8da4w"), max_rows: int = 16, reps: int = 30) -> dict:
    """The XNNPACK GEMM row tile: a chain of 24 linears 512 -> 512 (24 MB fp32, more than the caches hold)
    lowered with a dynamic M in [1, max_rows], timed at every M; -> {quant: [p10 time(M) / time(1)]}.
    A step in the curve is a second pass of the micro-kernel over the rows, which reads the weights again."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torch import nn
    from torch.export import Dim, export

    from models.quantize import quantize_8da4w

    methods = {}
    for quant in quants:
        torch.manual_seed(0)
        chain = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(24))).eval()
        if quant == "8da4w":
            quantize_8da4w(chain, 32)
        ep = export(chain, (torch.randn(1, 4, 512),), dynamic_shapes=({1: Dim("M", min=1, max=max_rows)},),
                    strict=False)
        buf = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
        path = Path(tempfile.mkdtemp(prefix="row_tile_")) / f"{quant}.pte"
        path.write_bytes(buf)
        methods[quant] = Runtime.get().load_program(path).load_method("forward")._method
    times = {(q, m): [] for q in methods for m in range(1, max_rows + 1)}
    for _ in range(reps):
        for q, method in methods.items():
            for m in range(1, max_rows + 1):
                x = [torch.randn(1, m, 512)]
                for _ in range(5):
                    times[(q, m)].append(_timed_call(method, x))
    out = {}
    for q in methods:
        p10 = {m: statistics.quantiles(times[(q, m)], n=10)[0] for m in range(1, max_rows + 1)}
        out[q] = {"m1_p10_ms": round(p10[1], 4), "ratio_to_m1": [round(p10[m] / p10[1], 2) for m in p10]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--pte", nargs="+", type=Path)
    src.add_argument("--store", action="store_true", help="every model.pte under outputs/store/export")
    src.add_argument("--random", nargs="+", metavar="BACKEND:QUANT")
    src.add_argument("--row-tile", action="store_true", help="time a linear chain at M = 1..16 rows (fp32, 8da4w)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-m", type=int, default=8)
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--max-prefill", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="directory for --random .pte files (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--reps", type=int, default=10, help="interleaved repetitions (calls are split among them)")
    ap.add_argument("--threads", type=int, default=1, help="the runtime threadpool size (torch runs at one thread, as in runner.engine)")
    args = ap.parse_args(argv)

    if args.row_tile:
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(args.threads)
        torch.set_num_threads(1)  # as runner.engine runs a program: the pool has the threads
        from pipeline.hardware import cpu_fingerprint

        result = {"machine": cpu_fingerprint(), "load_avg_1min": os.getloadavg()[0], **row_tile()}
        for q in ("fp32", "8da4w"):
            print(f"{q:5} T=1 {result[q]['m1_p10_ms']:.3f} ms; time(M)/time(1), M = 1..16: {result[q]['ratio_to_m1']}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    if args.store:
        paths = sorted((ROOT / "outputs/store/export").glob("*/model.pte"))
    elif args.pte:
        paths = args.pte
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="export_latency_"))
        out.mkdir(parents=True, exist_ok=True)
        paths = [export_random(s, out, args.max_m, args.chain, args.max_prefill) for s in args.random]

    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(args.threads)
    torch.set_num_threads(1)  # as runner.engine runs a program: the pool has the threads
    print(f"runtime threads: {portable_lib._threadpool_get_thread_count()}, torch threads: {torch.get_num_threads()}, "
          f"load: {os.getloadavg()[0]:.2f}")
    rows = []
    for path, row in zip(paths, measure_all(paths, args.calls, args.warmup, args.reps)):
        for report_file in (Path(path).with_suffix(".json"), Path(path).parent / "manifest.json"):
            if report_file.is_file():
                rep = json.loads(report_file.read_text())
                rep = rep.get("report", rep)
                row["export_s"] = rep.get("timings", {}).get("total_s")
                if "delegate_calls" in rep:
                    row["delegate_calls"] = rep["delegate_calls"]
                    row["n_ops_outside_delegate"] = rep["n_ops_outside_delegate"]
                    row["ops_outside_delegate"] = rep["ops_outside_delegate"]
        rows.append(row)
        print(f"\n{path}  {row['backend']}/{row['quant']}  {row['bytes'] / 1e6:.2f} MB  "
              f"export {row.get('export_s', '?')} s  (context {row['context']} tokens)")
        for name, v in row.items():
            if isinstance(v, dict) and "median_ms" in v:
                print(f"  {name:34} median {v['median_ms']:8.3f} ms  x{v['x_decode']:5.2f}   "
                      f"p10 {v['p10_ms']:8.3f} ms  x{v['x_decode_p10']:5.2f}   p90 {v['p90_ms']:8.3f}")
        if "delegate_calls" in row:
            print(f"  delegate calls {row['delegate_calls']}, ops outside {row['n_ops_outside_delegate']}")
    if args.json:
        from pipeline.hardware import cpu_fingerprint

        args.json.write_text(json.dumps({"machine": cpu_fingerprint(), "load_avg_1min": os.getloadavg()[0],
                                         "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
