"""Benchmark: our .pte against its CPU peers on the same prompts, threads and machine, in one process.

    python -m bench.peers                                  # every target it can find: tiny, smollm2_135m, gemma3_270m
    python -m bench.peers --targets tiny --reps 5 --threads 2
    pip install -e '.[peers]'                              # llama-cpp-python (built from source, ~6 min)

Systems (every one decodes the same prompt ids for the same number of new tokens, greedy, no stop token):
- `ours fp32 K=k` / `ours int4 K=k`: the export artifact's .pte through runner.engine.PteEngine and
  runner.generate's loop, K = 0 (target_decode) and every K in [1, max_m-1]; one load per quant.
- `ours fp32 adaptive` / ...: the same .pte with `policy="adaptive"` (K per round in [1, max_m-1], starting
  from the .pte's default K), set beside the best static K, which it is not told.
- `ours int4 exact K=k` / `ours int4 exact adaptive`: the int4 .pte in exact mode (runner.engine.ExactEngine,
  `--exact-width`, default the CPU's 8da4w row tile): every K must give the exact K = 0's tokens (lossless column).
- `hf greedy`, `hf pld k`, `hf assisted`: transformers' `generate` (dynamic cache, eager, fp32: a static cache
  without torch.compile measured slower here, 75 against 125 tokens/s on the embedded target) on the same
  weights read from a GGUF (ours, written by bench.gguf_write; a preset's original); prompt-lookup
  decoding with `prompt_lookup_num_tokens=k`; assisted generation with a copy of the target truncated to its
  first layers (`--assistant-layers`, default max(2, L // 8)) as `assistant_model`.
- `llama.cpp <gguf>` / `llama.cpp <gguf> pld k`: llama-cpp-python's `Llama.generate` over the token ids,
  temperature 0 (greedy sampler), without drafting and with `LlamaPromptLookupDecoding(num_pred_tokens=k)` as
  `draft_model`. GGUFs: for our embedded target the f32 file of the very weights the fp32 .pte holds (and a
  q4_0 one, matching the int4 .pte's bit width); for a preset its original file (SmolLM2's Q4_1, Gemma 3's
  Q4_K_M) and, for the Llama architecture, an f32 file of it dequantised (the weights the fp32 .pte holds).
  Skipped, with the install command, where llama_cpp is missing.

What is timed, per system: decode tokens/s = (new tokens after the first) / (time from the first new token
being available to the last). Ours: GenerationResult.decode_ms (after prefill and the bonus token, until the
budget is reached). transformers: a streamer records when `generate` hands over tokens; the clock starts at
the first hand-over after the prompt (prefill done) and the tokens of that hand-over are not counted.
llama.cpp: the clock starts when `generate` yields its first token (prefill done) and stops at the last.
Prefill is excluded everywhere. Each system runs once untimed (warm-up) before the measured repetitions;
repetitions interleave the systems per prompt (order rotated each repetition), so a burst of load on the
shared machine hits every system alike; the table gives per-system medians over prompts x repetitions and
the ratio of our best .pte row to each row.

Correctness: every output is compared with the reference greedy tokens (the K=0 of our .pte with the fp32 target,
else transformers' greedy, else the eager fp32 target's, untimed): `same` or the length of the common prefix. Float differences between engines can flip a near tie;
a mismatch is reported, not hidden. Our K > 0 rows are also compared with the same .pte's K=0 (lossless).

What 4 bits cost (bench.quality, on unless --quality-windows 0): held-out loss over corpus windows for the fp32
target (eager), each quantised .pte (its own target_verify, windows of max_m rows) and each GGUF (llama.cpp, all
logits of one batched eval), beside each quantised one-token decoder's greedy tokens until its first difference
from the fp32 target's. A preset's GGUF (SmolLM2's Q4_1, Gemma 3's Q4_K_M) is the file its .pte was dequantised
from, so its fp32 target is the GGUF's weights in fp32 and the quantised systems round them again.

Also measured, to explain the gap: model bytes read per decode step (the target's weights as each system
stores them), the rate an fp32 GEMV reads a 256 MB matrix with the same threads, hence each system's bytes
floor per token (bench.bytes_floor); the .pte's per-call cost (a constant method's execute, target_decode's
raw execute against the loop's wall time per token) and its ETDump profile (bench.pte_profile); llama.cpp's
own eval time per token (llama_perf_context) against its Python wall time per token. Load: `uptime`'s load
averages and nproc before and after, and the CPU time other processes took during the measurement (from
/proc/stat minus this process: bench.machine).

Table columns: median decode tokens/s and its range over prompts x repetitions; best/this = our best row's
median over this row's; tau = tokens per round (our K > 0); MB/step = model bytes a forward reads; floor st/s =
forwards per second at the bytes floor; vs ref = `same` or the common prefix with the reference, per prompt.

Writes bench/results/cpu-peers-<target><--suffix>.json and prints one table per target, last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import llama_run
from bench.bytes_floor import gguf_weight_bytes, read_rate, target_weight_bytes
from bench.gguf_write import write_gguf
from bench.hf_run import StreamClock, hf_model_from_gguf, truncated_assistant
from bench.llama_run import PLD_K
from bench.machine import cpu_name, load_between, load_snapshot, public, versions
from bench.pte_profile import pte_call_costs, pte_profile
from bench.quality import FP32_TARGET, eager_greedy, quality
from bench.targets import (PRESETS, ROOT, TARGETS, WORK, gguf_tokenizer, link_dir, make_prompts, pick_exports,
                           store_exports)
from models import quiet
from models.gguf import GGUFError

quiet.install()
log = logging.getLogger("bench.peers")

PEERS_INSTALL = "pip install -e '.[peers]'   (llama-cpp-python==0.3.36, built from source: about 6 minutes)"
RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------------------------------------
# Systems


@dataclass
class Run:
    tokens: list[int]
    decode_tokens: int
    decode_s: float
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class System:
    name: str
    family: str  # ours | transformers | llama.cpp
    run: object  # (prompt_ids, n_new) -> Run
    bytes_per_step: int | None = None  # model bytes read per decode step (a target forward)
    quant: str = ""
    chain: int | None = None  # ours: K, or the largest K the adaptive policy may pick
    policy: str = "static"  # ours: runtime.policy
    runs: list = field(default_factory=list)  # (rep, prompt index, Run)


def ours_systems(pte: Path, quant: str, target_bytes: int, chains: list[int] | None,
                 exact_width: int = 0) -> tuple[list[System], object]:
    """Our rows over one .pte: K = 0 and every K (or `chains`), the adaptive policy, and with `exact_width` the
    same in exact mode (runner.engine.ExactEngine: K = 0 and every K < width, labelled `<quant> exact`, each
    compared with the exact K = 0)."""
    from runner.engine import ExactEngine, PteEngine
    from runner.generate import generate

    engine = PteEngine(pte)

    def runner(eng, k, policy="static"):
        def run(prompt, n):
            res = generate(eng, prompt, chain=k, max_new_tokens=n, policy=policy)
            extra = {"tau": res.tau} if k != 0 else {}
            if k != 0:
                extra.update(verify_ms=res.verify_ms, draft_ms=res.draft_ms, rounds=res.rounds)
            return Run(res.output_ids, res.decode_tokens, res.decode_ms / 1e3, extra)
        return run

    systems = []
    engines = [(engine, quant)] + ([(ExactEngine(engine, exact_width), f"{quant} exact")] if exact_width else [])
    for eng, label in engines:
        max_m = eng.meta["max_m"]
        ks = [0, *range(1, max_m)] if chains is None else [k for k in chains if k < max_m]
        systems += [System(f"ours {label} K={k}", "ours", runner(eng, k), target_bytes, label, k) for k in ks]
        if chains is None:  # the adaptive policy over every K the program serves, from its default K
            systems.append(System(f"ours {label} adaptive", "ours", runner(eng, None, "adaptive"), target_bytes,
                                  label, max_m - 1, "adaptive"))
    return systems, engine


def hf_systems(model, assistant, n_params: int, assistant_layers: int) -> list[System]:
    def runner(**kwargs):
        def run(prompt, n):
            clock = StreamClock()
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     do_sample=False, streamer=clock, **kwargs)
            new = out[0, len(prompt):].tolist()
            marks = clock.marks[1:]  # the first hand-over is the prompt itself
            t0, first = marks[0]
            return Run(new, len(new) - first, marks[-1][0] - t0, {"handovers": len(marks)})
        return run

    f32 = 4 * n_params
    rows = [System("hf greedy", "transformers", runner(), f32, "fp32")]
    rows += [System(f"hf pld k={k}", "transformers", runner(prompt_lookup_num_tokens=k), f32, "fp32")
             for k in PLD_K]
    if assistant is not None:
        rows.append(System(f"hf assisted ({assistant_layers} layers)", "transformers",
                           runner(assistant_model=assistant), f32, "fp32"))
    return rows


def llama_available() -> str | None:
    """None when llama_cpp imports, else why not (with the install command)."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except Exception as e:  # ImportError, or a build that does not load
        return f"llama_cpp is not importable ({type(e).__name__}: {e}); install it with: {PEERS_INSTALL}"
    return None


def llama_systems(path: Path, label: str, threads: int, n_ctx: int, extra_bufts: bool = False) -> list[System]:
    """llama.cpp on `path`, without drafting and with prompt lookup (k in PLD_K), through bench.llama_run."""
    nbytes = gguf_weight_bytes(path)

    def runner(llm):
        def run(prompt, n):
            r = llama_run.timed_generate(llm, prompt, n)
            return Run(r["tokens"], r["decode_tokens"], r["decode_s"], r["perf"])
        return run

    load = lambda draft=None: llama_run.load(path, threads=threads, n_ctx=n_ctx, draft=draft,  # noqa: E731
                                              extra_bufts=extra_bufts)
    rows = [System(f"llama.cpp {label}", "llama.cpp", runner(load()), nbytes, label)]
    rows += [System(f"llama.cpp {label} pld k={k}", "llama.cpp", runner(load(llama_run.prompt_lookup(k))), nbytes,
                    label) for k in PLD_K]
    return rows


# ----------------------------------------------------------------------------------------------------------
# Measurement


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure(systems: list[System], prompts: list[list[int]], n_new: int, reps: int, desc: str) -> None:
    from tqdm import tqdm

    for s in tqdm(systems, desc=f"{desc}: warm-up", unit="system", leave=False, dynamic_ncols=True):
        s.run(prompts[0], min(8, n_new))
    total = reps * len(prompts) * len(systems)
    with tqdm(total=total, desc=f"{desc}: measure", unit="run", dynamic_ncols=True) as bar:
        for rep in range(reps):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for i, prompt in enumerate(prompts):
                for s in order if i % 2 == 0 else order[::-1]:
                    s.runs.append((rep, i, s.run(prompt, n_new)))
                    bar.update()


def summarise(systems: list[System], reference: dict[int, list[int]], n_prompts: int) -> list[dict]:
    own_k0 = {s.quant: {i: r.tokens for rep, i, r in s.runs if rep == 0} for s in systems
              if s.family == "ours" and s.chain == 0}
    rows = []
    for s in systems:
        rates = [r.tokens_per_s for _, _, r in s.runs]
        first = {i: r.tokens for rep, i, r in s.runs if rep == 0}
        prefixes = [common_prefix(first[i], reference[i]) for i in range(n_prompts)]
        stable = all(r.tokens == first[i] for _, i, r in s.runs)
        row = {"system": s.name, "family": s.family, "quant": s.quant, "chain": s.chain, "policy": s.policy,
               "tokens_per_s_median": statistics.median(rates), "tokens_per_s_min": min(rates),
               "tokens_per_s_max": max(rates), "n_runs": len(rates),
               "decode_tokens": sum(r.decode_tokens for _, _, r in s.runs) // len(rates),
               "same_as_reference": all(p == len(reference[i]) for i, p in enumerate(prefixes)),
               "common_prefix_per_prompt": prefixes, "same_across_reps": stable,
               "bytes_per_step": s.bytes_per_step}
        if s.family == "ours" and s.chain:
            base = own_k0.get(s.quant, {})
            row["lossless_vs_own_k0"] = all(first[i] == base.get(i) for i in range(n_prompts)) if base else None
            row["tau"] = statistics.mean(r.extra["tau"] for _, _, r in s.runs)
        rows.append(row)
    return rows


def best_ours(rows: list[dict]) -> dict | None:
    """Our fastest static-K row (the adaptive rows are compared with it, not candidates)."""
    ours = [r for r in rows if r["family"] == "ours" and r.get("policy", "static") == "static"]
    return max(ours, key=lambda r: r["tokens_per_s_median"]) if ours else None


def table(result: dict) -> str:
    rows, best = result["rows"], result["best_ours"]
    head = (f"{'system':34} {'tok/s':>8} {'min-max':>13} {'best/this':>9} {'tau':>5} {'MB/step':>8} "
            f"{'floor st/s':>11} {'vs ref':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{best['tokens_per_s_median'] / r['tokens_per_s_median']:.2f}x" if best else "-"
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else ""
        mb = r["bytes_per_step"] / 1e6 if r["bytes_per_step"] else None
        floor = f"{1e3 / r['bytes_floor_ms']:.0f}" if r.get("bytes_floor_ms") else ""
        same = "same" if r["same_as_reference"] else "prefix " + "/".join(map(str, r["common_prefix_per_prompt"]))
        if r.get("lossless_vs_own_k0") is False:
            same += " (!= own K=0)"
        lines.append(f"{r['system']:34} {r['tokens_per_s_median']:8.1f} "
                     f"{r['tokens_per_s_min']:6.0f}-{r['tokens_per_s_max']:<6.0f} {ratio:>9} {tau:>5} "
                     f"{'-' if mb is None else format(mb, '8.1f'):>8} {floor:>11} {same:>10}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# One target


def bench_target(target: str, args, exports: list[dict], skipped: list[str]) -> dict | None:
    from tokenizers import Tokenizer

    from models import load_target
    from models.gguf import package_gguf

    picked = pick_exports(exports, target)
    WORK.mkdir(parents=True, exist_ok=True)
    ggufs: dict[str, Path] = {}  # label -> file, the first is the one transformers loads
    target_model = None
    if target == "tiny":
        if not picked:
            skipped.append(f"{target}: every system (no export artifact of the embedded default in the store; "
                           f"build one with: python -m pipeline +stage=export threads=1)")
            return None
        first = next(iter(picked.values()))
        tdir = first["target_path"]
        target_model = load_target(tdir)
        tokenizer = Tokenizer.from_file(str(tdir / "tokenizer.json"))
        chat_template, prompt_format = None, "plain"
        for dtype in args.gguf_types.split(","):
            path = WORK / f"tiny-{first['target_key'][:12]}-{dtype}.gguf"
            if not path.is_file():
                write_gguf(target_model, tokenizer, path, dtype=dtype, name="eagle3-tiny-target")
            ggufs[dtype] = path
    else:
        package, label, prompt_format = PRESETS[target]
        try:
            original = package_gguf(package, WORK)
        except ValueError as e:
            skipped.append(f"{target}: every system ({e})")
            return None
        tokenizer, chat_template = gguf_tokenizer(link_dir(original))
        ggufs[label] = original
        if picked:  # every export of this target shares one target artifact: its bytes per step
            target_model = load_target(next(iter(picked.values()))["target_path"])
        if args.f32_gguf and target_model is not None:
            path = WORK / f"{target}-dequantised-f32.gguf"
            try:
                if not path.is_file():
                    write_gguf(target_model, tokenizer, path, dtype="f32", name=f"{target} ({label} dequantised)")
                ggufs["f32"] = path
            except GGUFError as e:
                skipped.append(f"{target}: llama.cpp f32 rows ({e})")
    for quant in args.quants:
        if quant not in picked:
            skipped.append(f"{target}: ours {quant} (no xnnpack quant={quant}"
                           f" export artifact of this target in the store"
                           + (f": the preset pipeline takes ~40 minutes here, python -m pipeline target={target} "
                              f"+stage=export export.quant={quant}" if target != "tiny" else
                              f": python -m pipeline +stage=export export.quant={quant} threads=1") + ")")

    prompts = make_prompts(tokenizer, prompt_format, chat_template, args.prompts, args.prompt_len, args.seed)
    n_ctx = args.prompt_len + args.new_tokens + 16 + max(PLD_K)

    systems: list[System] = []
    engines = {}
    for quant in [q for q in args.quants if q in picked]:
        e = picked[quant]
        pte = e["path"] / "model.pte"
        nbytes = target_weight_bytes(target_model, quant, int(e["export"].get("group_size", 32))) \
            if target_model is not None else None
        width = 0
        if quant not in FP32_TARGET and args.exact_width != "0":  # exact mode where a row's rounding can flip a token
            from pipeline.hardware import resolve_exact_width

            width = resolve_exact_width(args.exact_width if args.exact_width == "auto" else int(args.exact_width),
                                        max_m=int(e["export"]["max_m"]), backend="xnnpack", quant=quant,
                                        engine="pte")
        rows, engine = ours_systems(pte, quant, nbytes, args.chains, width)
        systems += rows
        engines[quant] = (engine, e)

    assistant_layers = None
    if "hf" not in args.skip:
        hf_model = hf_model_from_gguf(link_dir(next(iter(ggufs.values()))))
        n_layers = hf_model.config.num_hidden_layers
        a_layers = args.assistant_layers or max(2, n_layers // 8)
        assistant_layers = f"{a_layers} of {n_layers}"
        systems += hf_systems(hf_model, truncated_assistant(hf_model, a_layers),
                              sum(p.numel() for p in hf_model.parameters()), a_layers)
    else:
        skipped.append(f"{target}: transformers rows (--skip hf)")

    why = llama_available()
    if why is not None:
        skipped.append(f"{target}: llama.cpp rows ({why})")
    elif "llama" in args.skip:
        skipped.append(f"{target}: llama.cpp rows (--skip llama)")
    else:
        for label, path in ggufs.items():
            systems += llama_systems(path, label, args.threads, n_ctx, args.llama_extra_bufts)

    # the reference: our fp32 target's K=0, else transformers greedy, else the eager fp32 target (untimed)
    ref_system = next((s for s in systems if s.family == "ours" and s.chain == 0 and s.quant in FP32_TARGET), None) \
        or next((s for s in systems if s.name == "hf greedy"), None)
    before = load_snapshot()
    measure(systems, prompts, args.new_tokens, args.reps, target)
    after = load_snapshot()
    call_costs = {q: pte_call_costs(eng, prompts[0]) for q, (eng, _) in engines.items()}
    profiles = {q: pte_profile(e["path"] / "model.pte", args.prompt_len) for q, (_, e) in engines.items()}
    rates = {n: read_rate(args.threads, n) for n in sorted({s.bytes_per_step for s in systems if s.bytes_per_step})}
    memory_rate = read_rate(args.threads)
    if ref_system is not None:
        reference = {i: r.tokens for rep, i, r in ref_system.runs if rep == 0}
    else:
        reference = eager_greedy(target_model, prompts, args.new_tokens)
    rows = summarise(systems, reference, len(prompts))
    for r in rows:
        if r["bytes_per_step"]:
            r["bytes_floor_ms"] = round(r["bytes_per_step"] / rates[r["bytes_per_step"]] * 1e3, 4)
    best = best_ours(rows)
    held_out = None
    if args.quality_windows:
        windows = make_prompts(tokenizer, "plain", None, args.quality_windows, args.quality_len, args.seed + 1)
        held_out = quality(target_model, engines, ggufs, rows, windows, args.threads,
                           llama_available() is None and "llama" not in args.skip, args.new_tokens)

    per_token = {}
    for r in rows:
        per_token[r["system"]] = round(1e3 / r["tokens_per_s_median"], 3)
    llama_internal = {}  # rows without drafting: every decode is one token, timed inside llama.cpp
    for s in systems:
        if s.family == "llama.cpp" and "pld" not in s.name:
            inside = statistics.median(r.extra["eval_ms"] / max(r.extra["n_eval"], 1) for _, _, r in s.runs)
            wall = statistics.median(r.decode_s * 1e3 / r.decode_tokens for _, _, r in s.runs)
            llama_internal[s.name] = {"decode_ms_inside_llama_cpp": round(inside, 4),
                                      "decode_ms_wall": round(wall, 4),
                                      "python_side_ms_per_token": round(wall - inside, 4),
                                      "evals_per_run": statistics.median(r.extra["n_eval"] for _, _, r in s.runs)}
    result = {
        "target": target,
        "command": " ".join(sys.argv),
        "threads": args.threads, "prompts": len(prompts), "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "reps": args.reps, "seed": args.seed, "prompt_format": prompt_format,
        "machine": {"cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                    "versions": versions()},
        "load_before": public(before), "load_after": public(after), "load_during": load_between(before, after),
        "read_rate_gb_s": {"256 MB (memory)": round(memory_rate / 1e9, 2),
                           **{f"{n / 1e6:.1f} MB": round(v / 1e9, 2) for n, v in rates.items()}},
        "reference": ref_system.name if ref_system is not None else "eager fp32 target (untimed)",
        "timed": {
            "ours": "GenerationResult.decode_ms: from after prefill and the bonus token to the last token; "
                    "decode tokens = new tokens - 1",
            "transformers": "streamer hand-overs: from the first hand-over after the prompt to the last; its "
                            "tokens are not counted",
            "llama.cpp": "from the first token generate() yields to the last; decode tokens = new tokens - 1",
        },
        "exports": {q: {"key": e["key"], "created_at": e["created_at"], "git_commit": e["git_commit"],
                        "pte_bytes": e["report"].get("pte_bytes"), "max_m": e["export"].get("max_m"),
                        "target_decode_delegate_calls": (e["report"].get("delegate_calls") or {}).get("target_decode"),
                        "target_decode_ops_outside_delegate":
                            (e["report"].get("n_ops_outside_delegate") or {}).get("target_decode")}
                    for q, (_, e) in engines.items()},
        "ggufs": {label: {"file": p.name, "bytes": p.stat().st_size, "bytes_per_step": gguf_weight_bytes(p)}
                  for label, p in ggufs.items()},
        "assistant_layers": assistant_layers,
        "llama_cpp_extra_buffer_types": args.llama_extra_bufts,
        "pte_call_costs": call_costs,
        "pte_target_decode_profile": profiles,
        "llama_cpp_internal": llama_internal,
        "ms_per_token": per_token,
        "best_ours": best,
        "rows": rows,
        "quality": held_out,
        "skipped": [s for s in skipped if s.startswith(target + ":")],
        "prompt_ids": prompts,
        "reference_tokens": [reference[i] for i in range(len(prompts))],
    }
    result["analysis"] = analysis(result)
    return result


def analysis(result: dict) -> dict:
    """Our K=0 and best rows and every peer row as time per token; for the rows that decode one token per forward,
    split into the bytes floor (bytes per step at the rate an fp32 GEMV reads that many bytes here) and the rest
    (compute and per-call overhead)."""
    out = {}
    for r in result["rows"]:
        if r["family"] == "ours" and r["chain"] != 0 and r["system"] != (result["best_ours"] or {}).get("system"):
            continue
        ms = 1e3 / r["tokens_per_s_median"]
        entry = {"ms_per_token": round(ms, 3)}
        one_token = r["chain"] in (None, 0) and not any(w in r["system"] for w in ("pld", "assisted"))
        if r.get("bytes_floor_ms") and one_token:  # a speculative row reads the weights once for several tokens
            entry.update(bytes_floor_ms=r["bytes_floor_ms"], rest_ms=round(ms - r["bytes_floor_ms"], 3),
                         bytes_per_step=r["bytes_per_step"])
        out[r["system"]] = entry
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--threads", type=int, default=2, help="torch, ExecuTorch and llama.cpp threads alike")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quants", default="8da4w_draft,8da4w_offsets",
                    help="our .pte rows: export.quant values (8da4w_draft's target is fp32 too)")
    ap.add_argument("--exact-width", default="auto", help="exact-mode rows of the int4 .pte at this width "
                    "(runtime.exact_width; auto: the CPU's 8da4w row tile; 0: none)")
    ap.add_argument("--quality-windows", type=int, default=16,
                    help="held-out corpus windows for the loss of each quantised system against fp32 (0: none)")
    ap.add_argument("--quality-len", type=int, default=192, help="tokens per quality window")
    ap.add_argument("--chains", default=None, help="our K values (default 0 and every K in [1, max_m-1])")
    ap.add_argument("--assistant-layers", type=int, default=None,
                    help="layers of the truncated assistant (default max(2, L // 8))")
    ap.add_argument("--gguf-types", default="f32,q4_0", help="GGUFs written of the embedded target for llama.cpp")
    ap.add_argument("--no-f32-gguf", dest="f32_gguf", action="store_false",
                    help="skip the f32 GGUF of a preset's target dequantised (llama.cpp on the fp32 .pte's bytes)")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its AMX / repacked buffers (they segfault here: "
                         "bench.llama_run.extra_buffer_types)")
    ap.add_argument("--skip", default="", help="comma-separated families to skip: hf, llama")
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("PIPELINE_OUTPUTS", ROOT / "outputs")) / "store")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--suffix", default="", help="appended to each result's file name (cpu-peers-<target><suffix>.json)")
    args = ap.parse_args(argv)
    args.chains = None if args.chains is None else [int(k) for k in args.chains.split(",")]
    args.skip = set(filter(None, args.skip.split(",")))
    args.quants = [q for q in args.quants.split(",") if q]

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    with quiet.native_stderr(re.compile(r"^\[(cpuinfo_utils|threadpool)\.cpp:\d+\]")):  # CPU probe, pool size
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(args.threads)

    if llama_available() is not None:
        print(f"llama.cpp rows will be skipped: {llama_available()}", file=sys.stderr)
    exports = store_exports(args.store) if (args.store / "export").is_dir() else []
    skipped: list[str] = []
    results = []
    for target in args.targets.split(","):
        if target not in TARGETS:
            print(f"error: unknown target {target!r} (known: {', '.join(TARGETS)})", file=sys.stderr)
            return 2
        result = bench_target(target, args, exports, skipped)
        if result is None:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"cpu-peers-{target}{args.suffix}.json"
        path.write_text(json.dumps(result, indent=1))
        results.append((result, path))
    for result, path in results:
        lb, la, ld = result["load_before"], result["load_after"], result["load_during"]
        print(f"\n== {result['target']}: {result['prompts']} prompts x {result['reps']} reps, {result['prompt_len']} "
              f"prompt ids -> {result['new_tokens']} new tokens, {result['threads']} threads; reference "
              f"{result['reference']}; fp32 GEMV read rate (GB/s) by size {result['read_rate_gb_s']}")
        print(f"   load before {lb['loadavg']} / after {la['loadavg']} (nproc {lb['nproc']}); during: machine "
              f"{ld['machine_busy_cores']} cores busy, this process {ld['this_process_cores']}, others "
              f"{ld['other_processes_cores']}")
        print(table(result))
        best = result["best_ours"]
        if best:
            print(f"best of ours: {best['system']} at {best['tokens_per_s_median']:.1f} tokens/s")
        for q, c in result["pte_call_costs"].items():
            print(f"   .pte {q}: constant method execute {c['constant_method_execute_ms']:.3f} ms, target_decode "
                  f"execute {c['target_decode_execute_ms']:.3f} ms, with input/output copies "
                  f"{c['target_decode_with_io_ms']:.3f} ms")
        print("   time per token (one-token decoders: = bytes floor, bytes per step / GEMV read rate at that size, + the "
              "rest: compute, per-call overhead):")
        for name, a in result["analysis"].items():
            floor = (f" = floor {a['bytes_floor_ms']:.3f} ms ({a['bytes_per_step'] / 1e6:.1f} MB) + rest "
                     f"{a['rest_ms']:.3f} ms" if "bytes_floor_ms" in a else "")
            print(f"     {name:34} {a['ms_per_token']:.3f} ms{floor}")
        for q, pr in result["pte_target_decode_profile"].items():
            outside = ", ".join(f"{n} {v:.2f}" for n, v in list(pr["outside_delegate_by_op_ms"].items())[:4])
            print(f"   .pte {q} target_decode (ETDump, per token): execute {pr['execute_ms']:.2f} ms = XNNPACK "
                  f"{pr['delegate_ms']:.2f} ms in {pr['delegate_calls']} delegate calls (GEMMs {pr['gemm_ms']:.2f} ms)"
                  f" + {pr['outside_delegate_ms']:.2f} ms in {pr['outside_delegate_ops']} portable ops ({outside})")
        if q := result["quality"]:
            print(f"   what quantisation costs: held-out loss (nats/token, {q['windows']} corpus windows of "
                  f"{q['window_tokens']} tokens; fp32 target {q.get('fp32_loss', '-')}) and greedy tokens until the "
                  f"first difference from the fp32 target's, per prompt of {result['new_tokens']}:")
            for name, v in q["systems"].items():
                loss = f"{v['loss']:.4f} ({v['loss_vs_fp32']:+.4f})" if "loss_vs_fp32" in v else \
                    f"{v['loss']:.4f}" if "loss" in v else "-"
                agree = "/".join(map(str, v.get("tokens_until_first_difference", [])))
                print(f"     {name:34} loss {loss:>18}   {agree}")
        for k, v in result["llama_cpp_internal"].items():
            print(f"   {k}: {v['decode_ms_inside_llama_cpp']:.3f} ms per one-token decode inside llama.cpp, "
                  f"{v['decode_ms_wall']:.3f} ms per token in Python ({v['evals_per_run']:.0f} decodes per run)")
        print(f"   wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if skipped:
        print("\nnot run:")
        for s in skipped:
            print(f"  - {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
