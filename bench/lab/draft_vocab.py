"""Benchmark: the draft vocabulary size Vd of a target, chosen by measurement: coverage against step cost.

    python -m bench.lab.draft_vocab --target tiny                     # the embedded default (conf Vd 2048 of 4096)
    python -m bench.lab.draft_vocab --target smollm2_135m             # SmolLM2-135M-Instruct (conf Vd 4096 of 49,152)
    python -m bench.lab.draft_vocab --target tiny --vd 1024,2048,all  # other sizes ("all" = the whole vocabulary V)
    python -m bench.lab.draft_vocab --target smollm2_135m --taps outputs/store/taps/<key> \\
        --pte outputs/store/export/<key>/model.pte --acceptance bench/results/cpu-smollm2-sweep.json#static
    python -m bench.lab.draft_vocab --target tiny --no-timing         # coverage and the model on recorded costs only

Needs the target's taps in the store (`python -m pipeline target=<t> +stage=taps`): the script plans the
preset's cache keys as the pipeline does (pipeline.app.plan_keys) and reads outputs/store/taps/<key>/, or
`--taps DIR`. Vd runs over `--vd` (default 512,1024,2048,4096,8192,16384,all), capped at V, plus the current
config's `draft.draft_vocab_size`. Three parts; the JSON says which numbers are measurements and which the model:

1. Coverage (measured). The draft vocabulary is what the draft stage builds: `build_vocab_map(token_counts(
   top1, mask, V), Vd)` of pipeline/train_draft.py on the TRAIN split of the taps (the Vd ids most often the
   target's argmax at counted positions). Train coverage is that map's own `coverage`; held-out coverage is the
   share of the held-out split's counted argmax tokens inside the same map: the honest one (a token outside
   the map can never be proposed, so it caps the acceptance the eval's held-out prompts can see).
2. Step cost (measured). For each Vd one .pte is exported (pipeline.export_pte.export_pte, the config's
   export.* choices: xnnpack, quant 8da4w_draft = the draft 8da4w and the target fp32, max_m, prefill range) of a
   RANDOM speculator with the target's real shapes (hidden size, heads, head_dim, intermediate size, vocab,
   RoPE, max_seq_len, from the target artifact's config.json) and the draft config's choices, but a 2-layer
   target (the fewest layers that hold three distinct tap layers), which keeps each export short. The draft
   step (`draft_decode`, T=1) does not depend on the target's depth: it runs only the draft's one layer and
   lm_head. All programs are loaded into ONE process and timed side by side as bench.export_latency does
   (its `Bench`: the runtime's own execute(), a 64-token context in the caches, interleaved repetitions,
   medians and 10th percentiles, one thread): draft_decode T=1 back to back (the step of the model below),
   draft_decode T=1 right after a target_verify (the first step of a round, its caches cold; recorded only),
   and target_decode of the same 2-layer program as a unit. Because a 2-layer target_decode is not the real
   target's cost, the draft step is also given relative to the REAL target's decode step: from the real .pte
   (`--pte`, or the preset's export artifact when the store has it), timed in the same process, else from the
   costs already recorded in bench/results/ (tiny: cpu-export-latency.json, random weights of the embedded
   default's full shapes; smollm2_135m: cpu-peers-smollm2_135m.json for the decode step, one thread, and
   cpu-smollm2-sweep.json for verify/decode); the JSON names the source. Such a ratio divides times taken in
   different processes, so it carries the load difference between the two sessions.
3. The choice (a model, not a measurement). Per-position acceptance alpha_i (i = 0..6: position i accepted
   given positions < i were) measured at the CURRENT Vd: from `--acceptance FILE[#SECTION]` (a sweep result:
   tau(K) per K, alpha_k = (tau(k+1) - tau(k)) / (tau(k) - tau(k-1)), tau(0) = 1; or a draft manifest's
   `predicted_acceptance_pos_i`, the inputs of models.draft.predicted_tau), else the preset's draft
   artifact in the store, else the acceptance the last run recorded in `--json` (its
   model.acceptance, which names the sweep it was read from). Then for every Vd and K in 1..7:
       alpha_i(Vd) = min(1, alpha_i(current) * heldout_coverage(Vd) / heldout_coverage(current))
       tau(K, Vd)  = models.draft.predicted_tau(alpha(Vd)[:K])   (tokens per round)
       speedup     = tau(K, Vd) / (verify(K+1) + K * draft_step(Vd))   (costs in units of the real decode step;
                                                                        the baseline emits 1 token per step)
   The scaling assumes the draft is as accurate on the tokens a larger map adds as on those it already has:
   an UPPER BOUND for Vd above the current one (the added tokens are rarer, and a rare token is harder to
   predict), and for Vd below it a pessimistic estimate by the same argument (the dropped tokens are the
   rarest). It also ignores that training a draft with another Vd changes what it learns.

Prints the sources, a grid of predicted speedups (Vd x K), then the table: Vd, train and held-out coverage,
draft step ms, draft/decode ratios, predicted best K and speedup; `*` marks the best Vd, `<` the current one.
Writes the target's entry into `--json` (default bench/results/cpu-draft-vocab.json, other targets kept).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from models import quiet

quiet.install()

from pipeline import train_draft as td  # noqa: E402
from models.draft import predicted_tau  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

RESULTS = ROOT / "bench/results"
DEFAULT_VDS = "512,1024,2048,4096,8192,16384,all"
KS = tuple(range(1, 8))
TARGET_LAYERS = 2  # the fewest layers with three distinct tap layers (models.default_taps(2) = (0, 1, 2))


# --- 1. coverage (pure) ------------------------------------------------------------------------------------
def split_counts(taps: dict, vocab_size: int) -> torch.Tensor:
    """The draft stage's counts of one taps split: how often each id is the target's argmax at a counted position."""
    return td.token_counts(taps["top1"], taps["mask"], vocab_size)


def held_out_coverage(used: torch.Tensor, held_counts: torch.Tensor) -> float:
    """Share of the held-out split's counted argmax tokens that the map `used` (target ids) contains."""
    held_counts = torch.as_tensor(held_counts).to(torch.int64)
    total = int(held_counts.sum())
    return float(held_counts[used].sum()) / total if total else 1.0


def coverage_rows(train_counts: torch.Tensor, held_counts: torch.Tensor, vds) -> list[dict]:
    """Per Vd: the map the draft stage builds from the TRAIN counts, its train coverage and its held-out coverage."""
    rows = []
    for vd in vds:
        vm = td.build_vocab_map(train_counts, vd)
        rows.append({"vd": vm.size, "train_coverage": vm.coverage,
                     "held_out_coverage": held_out_coverage(vm.used, held_counts), "used": vm.used})
    return rows


def vd_list(spec: str, vocab_size: int, current: int) -> list[int]:
    """`512,1024,all` -> sorted unique sizes capped at V, with the current one (capped) included."""
    vds = {vocab_size if s.strip() == "all" else min(int(s), vocab_size) for s in spec.split(",") if s.strip()}
    return sorted(vds | {min(current, vocab_size)})


# --- 3. the model (pure) -----------------------------------------------------------------------------------
def acceptance_from_taus(taus: dict) -> list[float]:
    """Per-position acceptance alpha_0..alpha_{n-1} from measured tau(K), K = 1..n (contiguous from 1).

    tau(K) = 1 + sum_{k<K} d_k with d_k = prod_{i<=k} alpha_i (models.draft.predicted_tau): d_k =
    tau(k+1) - tau(k) (tau(0) = 1) and alpha_k = d_k / d_{k-1} (d_{-1} = 1). Measured taus come from separate
    runs and are noisy, so d_k is clipped to [0, d_{k-1}] (the chance of accepting more than k proposals cannot
    grow with k); alpha_k = 0 once d_{k-1} = 0. Without clipping, predicted_tau(alpha[:K]) == tau(K)."""
    ks = sorted(int(k) for k in taus if int(k) > 0)
    if ks != list(range(1, len(ks) + 1)) or not ks:
        raise ValueError(f"need tau at K = 1..n contiguous, got K = {ks}")
    alpha, prev_tau, prev_d = [], 1.0, 1.0
    for k in ks:
        tau = float(taus[k] if k in taus else taus[str(k)])
        d = min(max(tau - prev_tau, 0.0), prev_d)
        alpha.append(d / prev_d if prev_d > 0 else 0.0)
        prev_tau, prev_d = max(tau, prev_tau), d
    return alpha


def extend_acceptance(alpha: list[float], n: int) -> tuple[list[float], list[int]]:
    """alpha padded to n positions by repeating its last value; -> (alpha, the positions that were padded)."""
    if not alpha:
        raise ValueError("no acceptance to extend")
    padded = list(range(len(alpha), n))
    return list(alpha[:n]) + [alpha[-1]] * len(padded), padded


def scale_acceptance(alpha: list[float], ratio: float) -> list[float]:
    """alpha_i * ratio, capped at 1 (ratio = held-out coverage(Vd) / held-out coverage(current Vd))."""
    return [min(1.0, a * ratio) for a in alpha]


def predicted_speedup(alpha: list[float], k: int, draft_ratio: float, verify_ratio: dict) -> tuple[float, float]:
    """(tau, speedup) of chain length k: tau = predicted_tau(alpha[:k]) tokens per round, over a round that
    costs verify_ratio[k+1] + k * draft_ratio decode steps (the baseline: one token per decode step)."""
    if len(alpha) < k:
        raise ValueError(f"acceptance known for {len(alpha)} positions, K = {k} needs {k}")
    tau = predicted_tau(alpha[:k])
    return tau, tau / (float(verify_ratio[k + 1]) + k * draft_ratio)


def model_rows(cov: list[dict], current_vd: int, alpha: list[float], draft_ratio: dict, verify_ratio: dict,
               ks=KS) -> list[dict]:
    """Per Vd (of `cov`, with `draft_ratio[vd]` = draft step / real decode step): the scaled acceptance, the
    predicted tau and speedup at each K, and the best K."""
    ref = next(r["held_out_coverage"] for r in cov if r["vd"] == current_vd)
    rows = []
    for r in cov:
        a = scale_acceptance(alpha, r["held_out_coverage"] / ref if ref else 1.0)
        per_k = {k: predicted_speedup(a, k, draft_ratio[r["vd"]], verify_ratio) for k in ks}
        best = max(per_k, key=lambda k: per_k[k][1])
        rows.append({"vd": r["vd"], "acceptance": a, "tau": {k: per_k[k][0] for k in ks},
                     "speedup": {k: per_k[k][1] for k in ks}, "best_k": best, "best_speedup": per_k[best][1]})
    return rows


def near_best(rows: list[dict], tolerance: float = 0.01) -> list[int]:
    """The Vds whose predicted best speedup is within `tolerance` (relative) of the best one's: closer than the
    timing noise of a draft step (a few %) times its share of a round, so the model cannot tell them apart."""
    top = max(r["best_speedup"] for r in rows)
    return [r["vd"] for r in rows if r["best_speedup"] >= top * (1 - tolerance)]


def best_vd(rows: list[dict]) -> int:
    """The Vd with the highest predicted speedup at its best K (ties: the smaller Vd, the cheaper step)."""
    return max(rows, key=lambda r: (r["best_speedup"], -r["vd"]))["vd"]


# --- where the inputs are ----------------------------------------------------------------------------------
def plan(target: str) -> dict:
    """The preset's composed config and the cache keys `python -m pipeline target=<target>` computes."""
    from hydra import compose, initialize_config_dir

    from pipeline import app, stages

    with initialize_config_dir(config_dir=str(app.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"target={target}"])
    mods = {name: stages.load(name, cfg.stage_package) for name in ("target", "taps", "draft", "export")}
    app.add_fingerprints(cfg, mods)
    store = Path(str(cfg.paths.store))
    return {"cfg": cfg, "keys": app.plan_keys(cfg, mods), "store": store if store.is_absolute() else ROOT / store}


def artifact(store: Path, stage: str, key: str) -> Path | None:
    path = store / stage / key
    return path if (path / "manifest.json").is_file() else None


def find_taps(p: dict, given: Path | None) -> tuple[Path, str]:
    """(taps dir, how it was found): --taps, the preset's planned key, or a taps manifest naming its target."""
    if given:
        return given, "given (--taps)"
    keys, store = p["keys"], p["store"]
    exact = artifact(store, "taps", keys["taps"])
    if exact:
        return exact, "the preset's planned taps key"
    found = []
    for m in sorted((store / "taps").glob("*/manifest.json")):
        man = json.loads(m.read_text())
        if (man.get("upstream") or {}).get("target") == keys["target"]:
            found.append((man.get("created_at", ""), m.parent))
    if not found:
        raise SystemExit(f"no taps for this target in {store / 'taps'} (planned key {keys['taps'][:12]}); build them "
                         f"with: python -m pipeline target=<target> +stage=taps, or pass --taps DIR")
    return max(found)[1], f"newest of {len(found)} taps manifests naming target {keys['target'][:12]} (not the preset's key)"


def real_shapes(p: dict, taps_dir: Path) -> dict:
    """The real target's TargetConfig fields, from the target artifact the taps were built from."""
    man = json.loads((taps_dir / "manifest.json").read_text())
    key = (man.get("upstream") or {}).get("target") or p["keys"]["target"]
    path = artifact(p["store"], "target", key)
    if path is None:
        raise SystemExit(f"the target artifact {key[:12]} of taps {taps_dir} is not in the store")
    return {"key": key, "config": json.loads((path / "config.json").read_text())}


def read_node(spec: str) -> tuple[object, str]:
    """`FILE#a/b` -> (the JSON node at keys a, b of FILE, a description); FILE relative to bench/results/ or cwd."""
    file, _, section = spec.partition("#")
    path = Path(file)
    if not path.is_file() and (RESULTS / file).is_file():
        path = RESULTS / file
    node = json.loads(path.read_text())
    for part in [s for s in section.split("/") if s]:
        node = node[part]
    where = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    return node, f"{where}" + (f"#{section}" if section else "")


def acceptance_from(node) -> tuple[list[float], str, dict]:
    """(alpha, kind, the numbers it came from) from a JSON node: a draft manifest / report with
    predicted_acceptance_pos_i, a sweep result with `static`, or a {K: tau | {"tau": ...}} table."""
    report = node.get("report", node)
    if "predicted_acceptance_pos_0" in report:
        n = sum(1 for k in report if k.startswith("predicted_acceptance_pos_"))
        alpha = [float(report[f"predicted_acceptance_pos_{i}"]) for i in range(n)]
        return alpha, "draft stage report: predicted_acceptance_pos_i on the held-out taps", {"alpha": alpha}
    table = node.get("static", node)
    taus = {int(k): float(v["tau"] if isinstance(v, dict) else v) for k, v in table.items()
            if str(k).isdigit() and int(k) > 0}
    inputs = {"tau": taus}
    speedups = {int(k): v["speedup"] for k, v in table.items() if str(k).isdigit() and isinstance(v, dict) and "speedup" in v}
    if speedups:  # what the same runs measured end to end: a yardstick for the model's absolute numbers
        inputs["measured_speedup"] = speedups
    return acceptance_from_taus(taus), "measured tau(K) of a sweep: alpha_k = d_k / d_(k-1), d_k = tau(k+1) - tau(k)", \
        inputs


def recorded_acceptance(results: Path, target: str) -> dict | None:
    """The acceptance an earlier run of this script used for `target`, as its result file records it (the
    source it was read from travels with it), or None."""
    if not results.is_file():
        return None
    return json.loads(results.read_text()).get("targets", {}).get(target, {}).get("model", {}).get("acceptance")


def find_acceptance(p: dict, target: str, spec: str | None, results: Path) -> dict:
    """Acceptance at the current Vd: `--acceptance`, else the preset's draft artifact in the store, else what the
    last run recorded in `results`."""
    if spec:
        node, where = read_node(spec)
    else:
        draft = artifact(p["store"], "draft", p["keys"]["draft"])
        if draft is not None:
            node, where = json.loads((draft / "manifest.json").read_text()), str(draft / "manifest.json")
        elif (recorded := recorded_acceptance(results, target)) is not None:
            return dict(recorded, source=f"{recorded['source']} (as recorded in {results.name})")
        else:
            raise SystemExit(f"no acceptance for target {target}: pass --acceptance FILE[#SECTION]")
    alpha, kind, inputs = acceptance_from(node)
    full, padded = extend_acceptance(alpha, max(KS))
    return {"source": where, "kind": kind, "inputs": inputs, "alpha": full, "alpha_padded_positions": padded}


def recorded_real_costs(target: str, quant: str) -> dict:
    """The real target's decode ms and verify(T)/decode from bench/results/ (not measured by this run)."""
    if target == "tiny":
        data = json.loads((RESULTS / "cpu-export-latency.json").read_text())
        row = next(r for r in data["rows"] if r["quant"] == quant and "llama_ops" in r["file"])
        return {"source": f"bench/results/cpu-export-latency.json, row {row['file']} ({row.get('variant', '')}): "
                          f"{data['what']}",
                "decode_ms": row["target_decode T=1"]["median_ms"], "decode_p10_ms": row["target_decode T=1"]["p10_ms"],
                "verify_over_decode": {T: row[f"target_verify T={T}"]["x_decode"] for T in range(2, 9)},
                "draft_step_ms_current_vd": row["draft_decode T=1 back to back"]["median_ms"], "threads": data["threads"]}
    if target == "smollm2_135m":
        peers = json.loads((RESULTS / "cpu-peers-smollm2_135m.json").read_text())
        sweep = json.loads((RESULTS / "cpu-smollm2-sweep.json").read_text())
        return {"source": f"decode: bench/results/cpu-peers-smollm2_135m.json pte_call_costs.{quant}."
                          f"target_decode_execute_ms (the runtime's execute of the real .pte, {peers['threads']} thread); "
                          f"verify(K+1)/decode: bench/results/cpu-smollm2-sweep.json verify_over_decode (eval rounds, "
                          f"{sweep['threads']} threads, each job's own K = 0 as the unit)",
                "decode_ms": peers["pte_call_costs"][quant]["target_decode_execute_ms"],
                "verify_over_decode": {int(k) + 1: v for k, v in sweep["verify_over_decode"].items()},
                "draft_step_ms_current_vd": None, "threads": peers["threads"]}
    raise SystemExit(f"no recorded real-target costs for {target}: pass --pte (the target's exported .pte)")


# --- 2. step cost (measured) -------------------------------------------------------------------------------
def source_digest() -> str:
    files = ["pipeline/export_pte.py", "models/draft.py", "models/target.py", "models/speculator.py", "models/layers.py"]
    return hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in files)).hexdigest()[:16]


def random_speculator(target_config: dict, n_layers: int, used: torch.Tensor, draft_overrides: dict):
    """A random target with the real shapes but `n_layers` layers, and a random draft over the map `used`."""
    from models import Speculator, TargetConfig, Transformer, tiny_draft

    fields = dict(target_config, n_layers=n_layers, tap_layers=None)
    if fields.get("sliding_window"):
        fields["sliding_window"] = list(fields["sliding_window"])[:n_layers]
    torch.manual_seed(0)
    target = Transformer(TargetConfig.from_dict(fields)).eval()
    draft = tiny_draft(target, seed=1, draft_vocab_size=used.numel(), **draft_overrides)
    if used.numel() < target.cfg.vocab_size:
        draft.set_vocab_map(used)
    return Speculator(target, draft).eval()


def export_vd(target_config: dict, n_layers: int, used: torch.Tensor, draft_overrides: dict, export_args: dict,
              out_dir: Path) -> tuple[Path, dict, bool]:
    """Export (or reuse, same spec and sources) the random speculator of one Vd; -> (path, report, reused)."""
    from pipeline.export_pte import export_pte

    spec = {"target": target_config, "n_layers": n_layers, "vd": used.numel(), "draft": draft_overrides,
            "export": export_args, "used_sha": hashlib.sha256(used.numpy().tobytes()).hexdigest()[:16],
            "sources": source_digest()}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = out_dir / f"vd{used.numel()}_{digest}.pte"
    side = path.with_suffix(".json")
    if path.is_file() and side.is_file():
        return path, json.loads(side.read_text()), True
    t0 = time.perf_counter()
    report = export_pte(random_speculator(target_config, n_layers, used, draft_overrides), out_path=path,
                        manifest_hash="0" * 64, progress=False, **export_args)
    report = {"export_s": round(time.perf_counter() - t0, 1), "bytes": path.stat().st_size, "spec": spec,
              "fp32_linears": report.get("fp32_linears")}
    side.write_text(json.dumps(report, indent=1))
    return path, report, False


def measure(programs: dict[str, tuple[Path, list[str]]], calls: int, warmup: int, reps: int) -> dict:
    """{name: {case: summary}} for the given cases of each program, all loaded in this process and timed
    interleaved (bench/export_latency.measure_all)."""
    from bench.export_latency import measure_all

    names = list(programs)
    with quiet.native_stderr():
        rows = measure_all([programs[n][0] for n in names], calls, warmup, reps, [programs[n][1] for n in names])
    keep = ("file", "bytes", "quant", "max_m")
    return {n: {k: v for k, v in row.items() if k in keep or k in programs[n][1]} for n, row in zip(names, rows)}


STEP = "draft_decode T=1 back to back"
COLD = "draft_decode T=1 after verify"
DECODE = "target_decode T=1"


# --- main ----------------------------------------------------------------------------------------------------
def table(cov: list[dict], costs: dict, rows: list[dict], current: int, best: int) -> str:
    head = (f"{'Vd':>7} {'train cov':>10} {'held cov':>10} {'draft ms':>9} {'(p10)':>7} {'/2L dec':>8} "
            f"{'/real dec':>9} {'best K':>6} {'speedup':>8}")
    lines = [head, "-" * len(head)]
    for c, m in zip(cov, rows):
        step = costs.get(c["vd"], {})
        ms = f"{step['median_ms']:>9.4f} {step['p10_ms']:>7.4f} {step['x_decode']:>8.4f}" if step else \
            f"{'-':>9} {'-':>7} {'-':>8}"
        mark = ("*" if c["vd"] == best else " ") + ("<" if c["vd"] == current else " ")
        lines.append(f"{c['vd']:>7} {100 * c['train_coverage']:>9.3f}% {100 * c['held_out_coverage']:>9.3f}% {ms} "
                     f"{m['draft_ratio'] if step else '-':>9{'.4f' if step else ''}} {m['best_k']:>6} "
                     f"{m['best_speedup']:>7.3f}x {mark}")
    return "\n".join(lines)


def grid(rows: list[dict]) -> str:
    head = f"{'Vd':>7} " + " ".join(f"{'K=' + str(k):>6}" for k in KS) + "   (predicted speedup; tau at the best K)"
    lines = [head]
    for m in rows:
        lines.append(f"{m['vd']:>7} " + " ".join(f"{m['speedup'][k]:>6.3f}" for k in KS)
                     + f"   tau {m['tau'][m['best_k']]:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="a conf/target preset: tiny | smollm2_135m | ...")
    ap.add_argument("--vd", default=DEFAULT_VDS, help="draft vocabulary sizes; 'all' = the whole vocabulary")
    ap.add_argument("--taps", type=Path, default=None, help="the taps artifact dir (default: found in the store)")
    ap.add_argument("--pte", type=Path, default=None,
                    help="the real target's .pte for its decode and verify costs (default: the preset's export "
                         "artifact if in the store, else the costs recorded in bench/results/)")
    ap.add_argument("--acceptance", default=None, metavar="FILE[#SECTION]",
                    help="acceptance at the current Vd: a sweep result (tau per K) or a draft manifest")
    ap.add_argument("--no-timing", action="store_true", help="no exports and no timing: the draft ratios are unknown")
    ap.add_argument("--target-layers", type=int, default=TARGET_LAYERS)
    ap.add_argument("--out", type=Path, default=None, help="where the .pte files go (reused when the spec matches)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=RESULTS / "cpu-draft-vocab.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pipeline.artifacts import load_taps, taps_index
    from pipeline.export_pte import windows

    p = plan(args.target)
    cfg = p["cfg"]
    current = int(cfg.draft.draft_vocab_size)
    taps_dir, taps_how = find_taps(p, args.taps)
    index = taps_index(taps_dir)
    shapes = real_shapes(p, taps_dir)
    V = int(shapes["config"]["vocab_size"])
    vds = vd_list(args.vd, V, current)
    current = min(current, V)
    print(f"{args.target}: V = {V}, current draft_vocab_size = {current}; taps {taps_dir} ({taps_how})")

    # 1. coverage, from the draft stage's own functions
    counts = {split: split_counts(load_taps(taps_dir, split), V) for split in ("train", "held_out")}
    cov = coverage_rows(counts["train"], counts["held_out"], vds)
    seen = counts["train"] > 0  # a map larger than this set grows by ids never the target's argmax in train
    seen_share = held_out_coverage(torch.nonzero(seen).flatten(), counts["held_out"])

    acc = find_acceptance(p, args.target, args.acceptance, args.json)  # before the minutes of exports: a bad source fails now

    # 2. costs
    ec = cfg.export
    export_args = dict(windows(ec), backend=str(ec.backend), quant=str(ec.quant),
                       group_size=int(ec.get("group_size", 32)))
    draft_overrides = {"norm_before_residual": bool(cfg.draft.get("norm_before_residual", False))}
    if cfg.draft.get("intermediate_size"):
        draft_overrides["intermediate_size"] = int(cfg.draft.intermediate_size)
    real_pte = args.pte
    if real_pte is None:
        exp = artifact(p["store"], "export", p["keys"]["export"])
        real_pte = exp / "model.pte" if exp and (exp / "model.pte").is_file() else None
    measured, exports = {}, {}
    if not args.no_timing:
        out = args.out or Path(tempfile.gettempdir()) / f"draft_vocab_{args.target}"
        out.mkdir(parents=True, exist_ok=True)
        programs = {}
        for c in cov:
            path, rep, reused = export_vd(shapes["config"], args.target_layers, c["used"], draft_overrides, export_args, out)
            exports[c["vd"]] = {k: rep[k] for k in ("export_s", "bytes")} | {"file": str(path)}
            print(f"  Vd {c['vd']:>6}: {path.name} {rep['bytes'] / 1e6:.1f} MB "
                  f"({'reused' if reused else 'exported in %.0f s' % rep['export_s']})", flush=True)
            programs[c["vd"]] = (path, [DECODE, STEP, COLD])
        if real_pte is not None:
            programs["real"] = (real_pte, [DECODE, STEP] + [f"target_verify T={T}" for T in range(2, export_args["max_m"] + 1)])
        with quiet.native_stderr(re.compile(r"^\[(cpuinfo_utils|threadpool)\.cpp:\d+\]")):  # CPU probe, pool size
            from executorch.extension.pybindings import portable_lib

            portable_lib._unsafe_reset_threadpool(args.threads)
        load0 = os.getloadavg()[0]
        print(f"timing {len(programs)} programs: runtime threads {portable_lib._threadpool_get_thread_count()}, "
              f"torch threads {torch.get_num_threads()}, load {load0:.2f}", flush=True)
        measured = measure(programs, args.calls, args.warmup, args.reps)
        load1 = os.getloadavg()[0]

    if "real" in measured:
        r = measured["real"]
        real = {"source": f"measured in this process: {real_pte}", "decode_ms": r[DECODE]["median_ms"],
                "decode_p10_ms": r[DECODE]["p10_ms"],
                "verify_over_decode": {T: r[f"target_verify T={T}"]["x_decode"] for T in range(2, export_args["max_m"] + 1)},
                "draft_step_ms_current_vd": r[STEP]["median_ms"], "threads": args.threads}
    else:
        real = recorded_real_costs(args.target, export_args["quant"])
    verify = {int(T): float(v) for T, v in real["verify_over_decode"].items()}

    # 3. the model
    steps = {vd: measured[vd][STEP] for vd in measured if vd != "real"}
    draft_ratio = {c["vd"]: (steps[c["vd"]]["median_ms"] / real["decode_ms"]) if c["vd"] in steps else 0.0
                   for c in cov}
    rows = model_rows(cov, current, acc["alpha"], draft_ratio, verify)
    for m in rows:
        m["draft_ratio"] = draft_ratio[m["vd"]]
    best = best_vd(rows)

    result = {
        "target": args.target,
        "command": "python -m bench.lab.draft_vocab " + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
                    "torch": torch.__version__},
        "threads": args.threads,
        "vocab_size": V,
        "current_vd": current,
        "current_vd_from": "conf: draft.draft_vocab_size of the composed preset config",
        "best_vd": best,
        "best": next({"vd": m["vd"], "k": m["best_k"], "speedup": round(m["best_speedup"], 4)} for m in rows if m["vd"] == best),
        "within_1pct_of_best": near_best(rows),
        "at_current_vd": next({"vd": m["vd"], "k": m["best_k"], "speedup": round(m["best_speedup"], 4)} for m in rows
                              if m["vd"] == current),
        "provenance": {
            "measured by this run": "measured.coverage (the taps in the store) and measured.step_cost (the .pte files "
                                    "exported and timed here)"
                                    + ("; real_target_costs (the real .pte, timed here)" if "real" in measured else ""),
            "recorded by earlier runs": ("" if "real" in measured else "real_target_costs (see its source); ")
                                        + "model.acceptance (see its source)",
            "model": "model.rows: the scaled acceptance, tau, speedup and best K per Vd, and best_vd",
        },
        "taps": {"path": str(taps_dir), "found": taps_how, "key": taps_dir.name, "target_key": shapes["key"],
                 "source": index.get("source"), "counted_tokens": {s: int(c.sum()) for s, c in counts.items()},
                 "distinct_argmax_ids": {s: int((c > 0).sum()) for s, c in counts.items()},
                 "held_out_share_of_ids_seen_in_train": round(seen_share, 6)},
        "measured": {
            "coverage": {
                "what": "build_vocab_map(token_counts(train top1, mask, V), Vd) (pipeline/train_draft.py, as the draft "
                        "stage): train_coverage = its coverage of the train split's counted argmax tokens; "
                        "held_out_coverage = the share of the held-out split's counted argmax tokens inside that map",
                "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items() if k != "used"} for c in cov]},
            "step_cost": {
                "what": (f"random speculators of the real shapes with a {args.target_layers}-layer target, export "
                         f"{export_args}, one per Vd, loaded in one process and timed interleaved ({args.reps} "
                         f"repetitions, {args.calls} calls per case, {args.threads} thread); x_decode = over the same "
                         f"program's {args.target_layers}-layer target_decode (median / median, p10 / p10). "
                         f"'{STEP}' is the step of the model; '{COLD}' (after a target_verify T=max_m) is the first "
                         f"step of a round"),
                "load_avg_1min": [round(load0, 2), round(load1, 2)] if measured else None,
                "exports": exports,
                "per_vd": {vd: v for vd, v in measured.items() if vd != "real"},
                "real_pte": measured.get("real"),
            } if measured else None,
        },
        "real_target_costs": dict(real, **{"measured_here": "real" in measured}),
        "model": {
            "what": "alpha_i(Vd) = min(1, alpha_i(current Vd) * held_out_coverage(Vd) / held_out_coverage(current Vd)); "
                    "tau(K) = models.draft.predicted_tau(alpha(Vd)[:K]); speedup(K) = tau(K) / (verify(K+1)/decode "
                    "+ K * draft_step(Vd)/decode), decode = the REAL target's decode step. The scaling assumes the draft "
                    "is as accurate on tokens a larger map adds as on those it has: an upper bound above the current "
                    "Vd, pessimistic below it; it ignores that a draft trained with another Vd learns differently. "
                    "Predictions, not measurements",
            "acceptance": acc,
            "verify_over_decode": verify,
            "rows": [{"vd": m["vd"], "draft_over_real_decode": round(m["draft_ratio"], 5),
                      "acceptance": [round(a, 4) for a in m["acceptance"]],
                      "tau": {k: round(v, 4) for k, v in m["tau"].items()},
                      "speedup": {k: round(v, 4) for k, v in m["speedup"].items()},
                      "best_k": m["best_k"], "best_speedup": round(m["best_speedup"], 4)} for m in rows],
        },
    }
    if args.json:
        data = json.loads(args.json.read_text()) if args.json.is_file() else {}
        data.setdefault("what", "bench/lab/draft_vocab.py: the draft vocabulary size per target, coverage against step "
                                "cost (see the script's docstring); per target: measured.* are measurements, model.* "
                                "predictions")
        data.setdefault("targets", {})[args.target] = result
        args.json.write_text(json.dumps(data, indent=1) + "\n")

    print(f"\nacceptance at Vd {current}: {acc['source']} ({acc['kind']}): "
          + " ".join(f"{a:.3f}" for a in acc["alpha"])
          + (f" (positions {acc['alpha_padded_positions']} repeat the last measured one)" if acc["alpha_padded_positions"] else ""))
    print(f"real target decode {real['decode_ms']:.3f} ms, verify/decode T=2..8 "
          + " ".join(f"{verify[T]:.2f}" for T in range(2, 9)) + f": {real['source']}")
    if real.get("draft_step_ms_current_vd") and current in steps:
        print(f"cross-check, draft step at Vd {current}: {steps[current]['median_ms']:.4f} ms here (2-layer program), "
              f"{real['draft_step_ms_current_vd']:.4f} ms in the real-shaped program of the source")
    measured_speedup = acc["inputs"].get("measured_speedup")
    if measured_speedup:
        at = next(m for m in rows if m["vd"] == current)
        print(f"yardstick at Vd {current}, speedup K = {', '.join(map(str, sorted(measured_speedup)))}: measured end to end "
              + " ".join(f"{measured_speedup[k]:.2f}" for k in sorted(measured_speedup)) + "; model "
              + " ".join(f"{at['speedup'][k]:.2f}" for k in sorted(measured_speedup) if k in at["speedup"])
              + " (the model leaves out the runner's per-round overhead; compare Vds by it, not absolute speedups)")
    print("\n" + grid(rows))
    if not steps:
        print("\n--no-timing: the draft steps are counted as free, so the model prefers the largest coverage")
    print(f"\n{args.target}: draft step against the real decode step ({real['decode_ms']:.3f} ms); "
          f"* = best predicted Vd, < = current ({current})")
    print(table(cov, steps, rows, current, best))
    print(f"train taps: {int(seen.sum())} distinct argmax ids, the ids of {100 * seen_share:.2f}% of the held-out "
          f"tokens; a larger map adds ids in id order (count ties go to the lower id), ids the draft met only in soft "
          f"labels, so its scaled acceptance is the loosest there")
    print(f"best predicted Vd {best} (current {current}); within 1% of the best: "
          + ", ".join(map(str, near_best(rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
