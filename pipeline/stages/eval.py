"""The eval stage: speculative decoding from the exported .pte at K = runtime.chain, against the K=0 baseline.

For each prompt, one loaded program serves both runs in sequence (the loop rewrites the caches from position
0, so no reload is needed): the target-only greedy baseline (target_decode) and the speculative run at K.
At temperature 0 the two token sequences must be identical (`lossless`); a mismatch fails the stage with the
first differing position, unless `runtime.allow_mismatch=true`, which records it. At temperature > 0 the
runs are rejection-sampled and equal only in distribution, so `lossless` is null.

Prompts: `runtime.prompts` (one per line, or .jsonl with "prompt"/"text"), or `runtime.n_prompts` windows of
`runtime.prompt_len` tokens cut from the held-out split of `data` at seeded random offsets (never crossing a
document boundary), so they were never trained on.

Writes into the Hydra job directory:
    metrics.json        the names below, also the MLflow metrics of this job (pte_sha256 as a tag)
    generations.jsonl   one line per prompt: prompt, prompt_ids, output_ids, text, tau, lossless, ...
Metrics: chain, max_m, pte_sha256, tokens_per_s, baseline_tokens_per_s, speedup, tau (tokens emitted per
round, the prefill bonus excluded), draft_acceptance_rate, acceptance_pos_<i> (i < K; 0 where no round
reached i), verify_ms_per_round, draft_ms_per_round, prefill_ms (per prompt, target prefill + draft
seeding), rounds, emitted_tokens, lossless, n_prompts. Throughputs are decode tokens (after the prefill
bonus) over decode time, summed over prompts. After a one-prompt warm-up of both runs, which is not counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pipeline import data, tracking
from runner.engine import EagerEngine, PteEngine
from runner.generate import GenerationResult, generate, resolve_chain
from runner.text import read_prompt_file, stop_ids

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
UPSTREAM = ("target", "draft", "export")
CONFIG_KEYS = ("runtime", "export", "data")
CONTENT_ADDRESSED = False
PTE = "model.pte"


# ----------------------------------------------------------------------------------------------------------
# Inputs: the engine, the prompts, the stop tokens


def load_engine(cfg: DictConfig, upstream: dict):
    pte = PteEngine(Path(upstream["export"].path) / PTE)
    if cfg.runtime.engine == "pte":
        return pte
    if cfg.runtime.engine != "eager":
        raise ValueError(f"runtime.engine must be 'pte' or 'eager', got {cfg.runtime.engine!r}")
    from models import Speculator, load_speculators, load_target

    target = load_target(upstream["target"].path)
    draft = load_speculators(upstream["draft"].path, target)
    m = pte.meta  # the same windows as the exported program
    return EagerEngine(Speculator(target, draft), max_m=m["max_m"], chain_len=m["chain_len"],
                       max_prefill_chunk=m["max_prefill_chunk"], min_prefill_chunk=m["min_prefill_chunk"],
                       device=cfg.runtime.get("device") or "cpu", manifest_hash=m["manifest_hash"])


def held_out_prompts(data_cfg: dict, tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """n windows of `length` tokens from the held-out split, at seeded offsets, none crossing an EOS."""
    stream = data.encode(tokenizer, data.split(data.documents(data_cfg), "held_out"))
    eos = data.eos_id(tokenizer)
    ends = np.append(np.flatnonzero(stream == eos) if eos is not None else [], len(stream)).astype(np.int64)
    starts = np.arange(len(stream))
    valid = starts[ends[np.searchsorted(ends, starts)] >= starts + length]  # the window holds no EOS
    if len(valid) < n:
        raise ValueError(f"the held-out split has only {len(valid)} windows of {length} tokens inside one "
                         f"document; lower runtime.prompt_len or runtime.n_prompts")
    picks = np.sort(np.random.default_rng(seed).choice(valid, size=n, replace=False))
    return [stream[s:s + length].tolist() for s in picks]


# ----------------------------------------------------------------------------------------------------------
# The lossless check and the metrics


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def metrics(runs: list[tuple[GenerationResult, GenerationResult]], *, chain: int, max_m: int, pte_sha256: str,
            lossless: bool | None, n_positions: int) -> dict:
    base = [b for b, _ in runs]
    spec = [s for _, s in runs]
    rate = lambda rs: sum(r.decode_tokens for r in rs) / max(sum(r.decode_ms for r in rs) / 1e3, 1e-9)  # noqa: E731
    rounds = sum(r.rounds for r in spec)
    drafted = sum(r.drafted for r in spec)
    tokens_per_s, baseline_tokens_per_s = rate(spec), rate(base)
    out = {
        "chain": chain,
        "max_m": max_m,
        "pte_sha256": pte_sha256,
        "tokens_per_s": tokens_per_s,
        "baseline_tokens_per_s": baseline_tokens_per_s,
        "speedup": tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s else 0.0,
        "tau": sum(sum(r.emitted) for r in spec) / rounds if rounds else 0.0,
        "draft_acceptance_rate": sum(sum(r.accepted) for r in spec) / drafted if drafted else 0.0,
    }
    counts = [r.position_counts(n_positions) for r in spec]
    for i in range(n_positions):
        acc, reach = sum(c[0][i] for c in counts), sum(c[1][i] for c in counts)
        out[f"acceptance_pos_{i}"] = acc / reach if reach else 0.0
    out.update({
        "verify_ms_per_round": sum(r.verify_ms for r in spec) / rounds if rounds else 0.0,
        "draft_ms_per_round": sum(r.draft_ms for r in spec) / rounds if rounds else 0.0,
        "prefill_ms": sum(r.prefill_ms for r in spec) / len(spec),
        "rounds": rounds,
        "emitted_tokens": sum(len(r.output_ids) for r in spec),
        "lossless": lossless,
        "n_prompts": len(runs),
    })
    return out


# ----------------------------------------------------------------------------------------------------------
# The stage


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    from tokenizers import Tokenizer

    rt = cfg.runtime
    export = upstream["export"]
    tokenizer = Tokenizer.from_file(str(Path(upstream["target"].path) / "tokenizer.json"))
    engine = load_engine(cfg, upstream)
    meta = engine.meta
    chain = resolve_chain(meta, rt.chain)  # K out of [1, max_m-1] stops here, naming the range
    expected = export.manifest.get("report", {}).get("manifest_hash")
    if expected and meta["manifest_hash"] != expected:
        raise ValueError(f"{Path(export.path) / PTE} reports manifest hash {meta['manifest_hash'][:16]}... but its "
                         f"export artifact says {expected[:16]}...: the .pte does not belong to these artifacts")
    pte_sha256 = export.manifest.get("files", {}).get(PTE) or hashlib.sha256((Path(export.path) / PTE).read_bytes()).hexdigest()

    if rt.prompts:
        texts = read_prompt_file(Path(rt.prompts))
        prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    else:
        data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
        prompts = held_out_prompts(data_cfg, tokenizer, int(rt.n_prompts), int(rt.prompt_len), int(rt.seed))
        texts = [tokenizer.decode(p) for p in prompts]
    if not prompts:
        raise ValueError("no prompts to evaluate")
    longest = max(len(p) for p in prompts)
    if longest + int(rt.max_new_tokens) > meta["max_seq_len"]:
        log.warning("prompts of up to %d tokens + max_new_tokens=%d exceed max_seq_len=%d: generations stop "
                    "when the cache is full", longest, rt.max_new_tokens, meta["max_seq_len"])

    greedy = float(rt.temperature) <= 0
    kwargs = dict(max_new_tokens=int(rt.max_new_tokens), stop_ids=stop_ids(tokenizer, rt.stop),
                  temperature=float(rt.temperature), seed=int(rt.seed))
    policy = str(rt.policy)
    log.info("eval: %d prompts, K=%d (%s), max_m=%d, engine=%s, .pte %s", len(prompts), chain, policy,
             meta["max_m"], rt.engine, pte_sha256[:12])

    # warm-up (first calls allocate and initialise the delegates), not counted
    generate(engine, prompts[0], chain=0, **{**kwargs, "max_new_tokens": 8})
    if chain:
        generate(engine, prompts[0], chain=chain, policy=policy, **{**kwargs, "max_new_tokens": 8})

    runs, all_equal = [], True
    with open(out / "generations.jsonl", "w") as gens:
        for i, (text, ids) in enumerate(tqdm(list(zip(texts, prompts)), desc=f"eval K={chain}", unit="prompt")):
            base = generate(engine, ids, chain=0, **kwargs)
            spec = generate(engine, ids, chain=chain, policy=policy, **kwargs) if chain else base
            diff = first_difference(base.output_ids, spec.output_ids) if greedy else None
            all_equal &= diff is None
            runs.append((base, spec))
            record = {"prompt": text, "prompt_ids": ids, "output_ids": spec.output_ids,
                      "text": tokenizer.decode(spec.output_ids), "tau": spec.tau,
                      "lossless": (diff is None) if greedy else None, "stop_reason": spec.stop_reason,
                      "tokens_per_s": spec.tokens_per_s, "baseline_tokens_per_s": base.tokens_per_s}
            if policy == "adaptive":
                record["chain_per_round"] = spec.chains
                log.info("prompt %d: adaptive K per round %s", i, spec.chains)
            if diff is not None:
                record["baseline_output_ids"] = base.output_ids
                record["first_difference"] = diff
            gens.write(json.dumps(record) + "\n")
            gens.flush()
            if diff is not None:
                msg = (f"lossless check failed on prompt {i}: the K={chain} output differs from the greedy "
                       f"baseline first at generated token {diff} (baseline "
                       f"{base.output_ids[diff] if diff < len(base.output_ids) else 'ended'}, speculative "
                       f"{spec.output_ids[diff] if diff < len(spec.output_ids) else 'ended'})")
                if not rt.allow_mismatch:
                    raise RuntimeError(msg + "; set runtime.allow_mismatch=true to record it instead")
                log.warning("%s (recorded: runtime.allow_mismatch=true)", msg)

    n_positions = chain if policy == "static" else meta["max_m"] - 1
    result = metrics(runs, chain=chain, max_m=meta["max_m"], pte_sha256=pte_sha256,
                     lossless=all_equal if greedy else None, n_positions=n_positions)
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    log.info("eval K=%d: %.1f tokens/s (baseline %.1f, speedup %.2fx), tau %.2f, acceptance %.2f, lossless %s",
             chain, result["tokens_per_s"], result["baseline_tokens_per_s"], result["speedup"], result["tau"],
             result["draft_acceptance_rate"], result["lossless"])
    tracking.log_artifact(out / "generations.jsonl")
    tracking.log_artifact(out / "metrics.json")
    tracking.set_tags({"pte_sha256": pte_sha256})
    # the report: the same names; lossless as 1/0 so it is an MLflow metric too
    return {**result, "lossless": None if result["lossless"] is None else int(result["lossless"])}


# ----------------------------------------------------------------------------------------------------------
# After a multirun: tokens/s, speedup and tau against K (called by pipeline.callbacks.summarize_sweep)

SUMMARY_COLUMNS = ("chain", "tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "draft_acceptance_rate",
                   "verify_ms_per_round", "draft_ms_per_round", "lossless")


def summarize_sweep(children: list[dict], sweep_dir: Path) -> dict:
    """Table (summary.md) and plot (summary.png) of the sweep's eval jobs against K, logged to the parent
    run, and the best K by speedup over the K=0 baseline measured in the same job. Jobs without an eval report (failed, or +stage=export) are left out."""
    rows = []
    for child in children:
        report = ((child.get("stages") or {}).get("eval") or {}).get("report") or {}
        if child.get("status") == "ok" and "chain" in report:
            rows.append({"job": child.get("job_num"), "overrides": " ".join(child.get("overrides", [])), **report})
    if not rows:
        return {}
    rows.sort(key=lambda r: (r["chain"], r["job"]))
    best = max(rows, key=lambda r: r["speedup"])  # a ratio within one job: robust to load on a shared machine

    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| job | " + " | ".join(SUMMARY_COLUMNS) + " |", "|---" * (len(SUMMARY_COLUMNS) + 1) + "|"]
    lines += ["| " + " | ".join([str(r["job"])] + [fmt(r.get(c)) for c in SUMMARY_COLUMNS]) + " |" for r in rows]
    lines += ["", f"best K = {best['chain']}: {best['tokens_per_s']:.1f} tokens/s, speedup {best['speedup']:.2f}x, "
              f"tau {best['tau']:.2f} (job {best['job']}: {best['overrides']})"]
    shas = sorted({r.get("pte_sha256") for r in rows})
    lines.append(f".pte sha256: {', '.join(str(s) for s in shas)}")
    table = "\n".join(lines)
    sweep_dir = Path(sweep_dir)
    (sweep_dir / "summary.md").write_text(table + "\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["chain"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(ks, [r["tokens_per_s"] for r in rows], "o-", label="speculative")
    axes[0].plot(ks, [r["baseline_tokens_per_s"] for r in rows], "s--", label="K=0 baseline")
    axes[0].set_ylabel("decode tokens/s")
    axes[0].legend()
    axes[1].plot(ks, [r["speedup"] for r in rows], "o-")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_ylabel("speedup over K=0")
    axes[2].plot(ks, [r["tau"] for r in rows], "o-")
    axes[2].plot(ks, [k + 1 for k in ks], ":", color="gray", label="K+1 (every proposal accepted)")
    axes[2].set_ylabel("tau (tokens per round)")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("chain length K")
        ax.grid(alpha=0.3)
    fig.suptitle(f"best K = {best['chain']} ({best['speedup']:.2f}x)")
    fig.tight_layout()
    fig.savefig(sweep_dir / "summary.png", dpi=110)
    plt.close(fig)

    tracking.log_artifact(sweep_dir / "summary.md")
    tracking.log_artifact(sweep_dir / "summary.png")
    return {"best_chain": best["chain"], "best_tokens_per_s": best["tokens_per_s"], "best_speedup": best["speedup"],
            "best_tau": best["tau"]}
