"""The eval stage: speculative decoding from the exported .pte at K = runtime.chain, against the K=0 baseline.

For each prompt, one loaded program serves both runs in sequence (the loop rewrites the caches from position
0, so no reload is needed): the target-only greedy baseline (target_decode) and the speculative run at K.
At temperature 0 the two token sequences must be identical (`lossless`); a mismatch fails the stage with the
first differing position, unless `runtime.allow_mismatch=true`, which records it. At temperature > 0 the
runs are rejection-sampled and equal only in distribution, so `lossless` is null.

Prompts: `runtime.prompts` (one per line, or .jsonl with "prompt"/"text"; a line with no room for
`runtime.max_new_tokens` within max_seq_len is refused or, with `runtime.prompts_too_long=skip`, left out,
naming the file and the lines: pipeline.validate.prompt_file_lines), or `runtime.n_prompts` prompts of
`runtime.prompt_len` tokens from the held-out split of `data`, so they were never trained on, cut by the
function that cuts the taps' held-out prompts (pipeline.prompts.cut, seeded by `runtime.seed`): windows of
corpus text at seeded places of documents, or with `data.prompt_format=chat` requests built from its
docstrings in the target's chat template. The eval's prompts and the held-out taps on which the draft stage
predicts tau are thereby draws from one distribution.

Engines (`engine=<kind>`, conf/engine/<kind>.yaml, built by runner.build.build_engine through
pipeline.artifacts.load_engine): `pte` runs the .pte through executorch.runtime; `eager` runs the same modules
in PyTorch with the .pte's windows; `cuda` runs them on a GPU with CUDA graphs (runner.cuda_engine) in its own
windows (engine.max_m etc.), reading the target and draft artifacts only (the export stage does not run for it,
and no export.* key reaches it).

Writes into the Hydra job directory:
    metrics.json        the names below, also the MLflow metrics of this job (pte_sha256 as a tag)
    generations.jsonl   one line per prompt: prompt, prompt_ids, output_ids, text, tau, lossless, ...
Metrics: chain, max_m, pte_sha256 ("" on the CUDA engine), tokens_per_s, baseline_tokens_per_s, speedup
(with speedup_min, speedup_max and passes: see Timing), tau (tokens emitted per round, the prefill bonus
excluded), acceptance_rate, acceptance_pos_<i> (i < K; 0 where no round reached i), verify_ms_per_round,
draft_ms_per_round (the draft calls of a round), round_ms (a round's whole wall time, the Python between its
calls included), prefill_ms (per prompt, target prefill + draft seeding), rounds, emitted_tokens, lossless,
n_prompts, exact_width (0: not exact). In exact mode (`engine.exact`, runner.engine.ExactEngine) the baseline
is the exact K=0, whose tokens every K must give, and the program's own T=1 decode (target_decode, outside
exact mode) runs too: target_decode_tokens_per_s, speedup_vs_target_decode. Throughputs are decode tokens (after
the prefill bonus) over decode time, summed over prompts. After a one-prompt warm-up of both runs, which is not counted.

Timing. A pass decodes every prompt at K = 0 and then at K, prompt by prompt, so a slow phase of a shared machine
lands on both; passes repeat until the last three speedups lie within `runtime.repeat_tolerance` of their median,
or `runtime.repeats` passes have run. tokens_per_s, baseline_tokens_per_s and speedup are medians over the
passes (speedup: of each pass's ratio), speedup_min and speedup_max their spread; the tokens, tau and
acceptance are the first pass's (greedy passes decode the same tokens, and each is checked).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pipeline import data, tracking
from models.text import load_chat_template, read_prompt_file, stop_ids
from pipeline.artifacts import PTE, engine_upstream, load_engine, pte_path
from pipeline.prompts import cut
from pipeline.validate import ConfigError, lengths_problem, prompt_file_lines
from runner.engine import ExactEngine
from runner.generate import GenerationResult, generate, resolve_chain

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
UPSTREAM = ("target", "draft", "export")
CONFIG_KEYS = ("runtime", "engine", "export", "data")
CONTENT_ADDRESSED = False


# ----------------------------------------------------------------------------------------------------------
# Inputs: the engine, the prompts, the stop tokens


def upstream_for(cfg: DictConfig) -> tuple[str, ...]:
    return engine_upstream(cfg)


# ----------------------------------------------------------------------------------------------------------
# The lossless check and the metrics


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _rate(results: list[GenerationResult]) -> float:
    """Decode tokens over decode seconds, summed over the generations."""
    return sum(r.decode_tokens for r in results) / max(sum(r.decode_ms for r in results) / 1e3, 1e-9)


def pass_speedups(passes: list[list[tuple[GenerationResult, GenerationResult]]]) -> list[float]:
    """Each pass's K rate over its K = 0 rate: the two alternate prompt by prompt within a pass, so a slow
    phase of the machine lands on both."""
    return [_rate([s for _, s in runs]) / max(_rate([b for b, _ in runs]), 1e-9) for runs in passes]


def settled(passes: list, repeats: int, tolerance: float) -> bool:
    """Whether the eval has timed enough passes over its prompts: `repeats` of them, or fewer once the last
    three speedups lie within `tolerance` (a fraction) of their median."""
    if len(passes) >= repeats:
        return True
    last = pass_speedups(passes)[-3:]
    return len(last) == 3 and max(last) - min(last) <= tolerance * statistics.median(last)


def metrics(passes: list[list[tuple[GenerationResult, GenerationResult]]], *, chain: int, max_m: int,
            pte_sha256: str, lossless: bool | None, n_positions: int, decoded: list[GenerationResult] | None = None,
            exact_width: int = 0) -> dict:
    """The names of the module docstring. Token counts, tau and acceptance come from the first pass (every
    pass decodes the same tokens at temperature 0); the throughputs and the speedup are the medians over the
    passes, with the spread of the speedup beside it."""
    runs = passes[0]
    spec = [s for _, s in runs]
    rounds = sum(r.rounds for r in spec)
    drafted = sum(r.drafted for r in spec)
    speedups = pass_speedups(passes)
    out = {
        "chain": chain,
        "max_m": max_m,
        "pte_sha256": pte_sha256,
        "tokens_per_s": statistics.median(_rate([s for _, s in p]) for p in passes),
        "baseline_tokens_per_s": statistics.median(_rate([b for b, _ in p]) for p in passes),
        "speedup": statistics.median(speedups),
        "speedup_min": min(speedups),
        "speedup_max": max(speedups),
        "passes": len(passes),
        "tau": sum(sum(r.emitted) for r in spec) / rounds if rounds else 0.0,
        "acceptance_rate": sum(sum(r.accepted) for r in spec) / drafted if drafted else 0.0,
    }
    counts = [r.position_counts(n_positions) for r in spec]
    for i in range(n_positions):
        acc, reach = sum(c[0][i] for c in counts), sum(c[1][i] for c in counts)
        out[f"acceptance_pos_{i}"] = acc / reach if reach else 0.0
    every = [s for p in passes for _, s in p]
    every_rounds = sum(r.rounds for r in every)
    out.update({
        "verify_ms_per_round": sum(r.verify_ms for r in every) / every_rounds if every_rounds else 0.0,
        "draft_ms_per_round": sum(r.draft_ms for r in every) / every_rounds if every_rounds else 0.0,
        "round_ms": sum(r.decode_ms for r in every) / every_rounds if every_rounds else 0.0,
        "prefill_ms": sum(r.prefill_ms for r in every) / len(every),
        "rounds": rounds,
        "emitted_tokens": sum(len(r.output_ids) for r in spec),
        "lossless": lossless,
        "n_prompts": len(runs),
        "exact_width": exact_width,
    })
    if decoded:
        rate = out["target_decode_tokens_per_s"] = _rate(decoded)
        out["speedup_vs_target_decode"] = out["tokens_per_s"] / rate if rate else 0.0
    return out


def generation_record(text: str, ids: list[int], base: GenerationResult, spec: GenerationResult, diff: int | None,
                      greedy: bool, tokenizer, policy: str) -> dict:
    """One line of generations.jsonl."""
    record = {"prompt": text, "prompt_ids": ids, "output_ids": spec.output_ids,
              "text": tokenizer.decode(spec.output_ids), "tau": spec.tau,
              "lossless": (diff is None) if greedy else None, "stop_reason": spec.stop_reason,
              "tokens_per_s": spec.tokens_per_s, "baseline_tokens_per_s": base.tokens_per_s}
    if policy == "adaptive":
        record["chain_per_round"] = spec.chain_per_round
    if diff is not None:
        record["baseline_output_ids"] = base.output_ids
        record["first_difference"] = diff
    return record


# ----------------------------------------------------------------------------------------------------------
# The stage


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    from tokenizers import Tokenizer

    rt = cfg.runtime
    export = upstream.get("export")  # None on the CUDA engine, which reads no .pte
    tokenizer = Tokenizer.from_file(str(Path(upstream["target"].path) / "tokenizer.json"))
    engine = load_engine(cfg, upstream)
    meta = engine.meta
    chain = resolve_chain(meta, rt.chain)  # K out of [1, max_m-1] stops here, naming the range
    pte_sha256 = ""
    if export is not None:
        expected = export.manifest.get("report", {}).get("manifest_hash")
        if expected and meta["manifest_hash"] != expected:
            raise ValueError(f"{pte_path(export)} reports manifest hash {meta['manifest_hash'][:16]}... but its "
                             f"export artifact says {expected[:16]}...: the .pte does not belong to these artifacts")
        pte_sha256 = (export.manifest.get("files", {}).get(PTE)
                      or hashlib.sha256(pte_path(export).read_bytes()).hexdigest())

    source = f"max_seq_len={meta['max_seq_len']} of the {cfg.engine.kind} engine"
    if rt.prompts:
        texts = read_prompt_file(Path(rt.prompts))
        prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        keep = prompt_file_lines(Path(rt.prompts), texts, dict(zip(texts, map(len, prompts))).__getitem__,
                                 max_new_tokens=int(rt.max_new_tokens), max_seq_len=meta["max_seq_len"],
                                 source=source, policy=str(rt.get("prompts_too_long") or "error"))
        texts, prompts = [texts[i] for i in keep], [prompts[i] for i in keep]
    else:
        if problem := lengths_problem(int(rt.prompt_len), int(rt.max_new_tokens), meta["max_seq_len"], source):
            raise ConfigError(problem)
        data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
        held_out = data.split(data.documents(data_cfg), "held_out")
        prompts = cut(held_out, tokenizer, int(rt.n_prompts), int(rt.prompt_len), int(rt.seed),
                      data_cfg.get("prompt_format", "plain"), load_chat_template(upstream["target"].path)).tolist()
        texts = [tokenizer.decode(p) for p in prompts]
    if not prompts:
        raise ValueError("no prompts to evaluate")

    greedy = float(rt.temperature) <= 0
    kwargs = dict(max_new_tokens=int(rt.max_new_tokens), stop_ids=stop_ids(tokenizer, rt.stop),
                  temperature=float(rt.temperature), seed=int(rt.seed))
    policy = str(rt.policy)
    log.info("eval: %d prompts, K=%d (%s), max_m=%d, engine=%s%s", len(prompts), chain, policy,
             meta["max_m"], cfg.engine.kind, f", .pte {pte_sha256[:12]}" if pte_sha256 else "")

    # exact mode: the T=1 decode of the same program too, for speed (its tokens may differ from exact K=0's)
    decode_engine = engine.inner if isinstance(engine, ExactEngine) else None
    # warm-up (first calls allocate and initialise the delegates), not counted
    generate(engine, prompts[0], chain=0, **{**kwargs, "max_new_tokens": 8})
    if decode_engine is not None:
        generate(decode_engine, prompts[0], chain=0, **{**kwargs, "max_new_tokens": 8})
    if chain:
        generate(engine, prompts[0], chain=chain, policy=policy, **{**kwargs, "max_new_tokens": 8})

    passes, decoded, all_equal = [], [], True
    bar = tqdm(total=len(prompts), desc=f"eval K={chain}", unit="prompt")
    with open(out / "generations.jsonl", "w") as gens, bar:
        while not passes or not settled(passes, int(rt.repeats), float(rt.repeat_tolerance)):
            runs, first_pass = [], not passes
            bar.reset(total=len(prompts))
            bar.set_postfix_str(f"pass {len(passes) + 1}")
            for i, (text, ids) in enumerate(zip(texts, prompts)):
                base = generate(engine, ids, chain=0, **kwargs)
                spec = generate(engine, ids, chain=chain, policy=policy, **kwargs) if chain else base
                if decode_engine is not None and first_pass:
                    decoded.append(generate(decode_engine, ids, chain=0, **kwargs))
                runs.append((base, spec))
                bar.update()
                diff = first_difference(base.output_ids, spec.output_ids) if greedy else None
                all_equal &= diff is None
                if first_pass:
                    gens.write(json.dumps(generation_record(text, ids, base, spec, diff, greedy, tokenizer, policy))
                               + "\n")
                    gens.flush()
                    if policy == "adaptive":
                        log.info("prompt %d: adaptive K per round %s", i, spec.chain_per_round)
                if diff is not None:
                    msg = (f"lossless check failed on prompt {i}: the K={chain} output differs from the greedy "
                           f"baseline first at generated token {diff} (baseline "
                           f"{base.output_ids[diff] if diff < len(base.output_ids) else 'ended'}, speculative "
                           f"{spec.output_ids[diff] if diff < len(spec.output_ids) else 'ended'})")
                    if not rt.allow_mismatch:
                        raise RuntimeError(msg + "; set runtime.allow_mismatch=true to record it instead")
                    if first_pass:
                        log.warning("%s (recorded: runtime.allow_mismatch=true)", msg)
            passes.append(runs)

    n_positions = chain if policy == "static" else meta["max_m"] - 1
    result = metrics(passes, chain=chain, max_m=meta["max_m"], pte_sha256=pte_sha256,
                     lossless=all_equal if greedy else None, n_positions=n_positions, decoded=decoded,
                     exact_width=meta.get("exact_width", 0))
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    log.info("eval K=%d: %.1f tokens/s (baseline %.1f, speedup %.2fx; %d passes: %.2f-%.2fx), tau %.2f, "
             "acceptance %.2f, lossless %s", chain, result["tokens_per_s"], result["baseline_tokens_per_s"],
             result["speedup"], result["passes"], result["speedup_min"], result["speedup_max"], result["tau"],
             result["acceptance_rate"], result["lossless"])
    if decoded:
        log.info("eval: exact mode at %d rows; the T=1 decode (target_decode) of the same program: %.1f tokens/s "
                 "(speedup against it %.2fx)", result["exact_width"], result["target_decode_tokens_per_s"],
                 result["speedup_vs_target_decode"])
    tracking.log_artifact(out / "generations.jsonl")
    tracking.log_artifact(out / "metrics.json")
    if pte_sha256:
        tracking.set_tags({"pte_sha256": pte_sha256})
    # the report: the same names; lossless as 1/0 so it is an MLflow metric too
    return {**result, "lossless": None if result["lossless"] is None else int(result["lossless"])}
