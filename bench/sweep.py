"""Benchmark: the chain-length sweep on the embedded default, as a table of K, tau, tokens/s and speedup.

    python -m bench.sweep                           # K = 1..7 on the default pipeline (stages from the store)
    python -m bench.sweep --chains 2,4 -- +experiment=smoke export=portable   # anything after -- goes to Hydra

Runs `python -m pipeline -m runtime.chain=...` (Hydra's basic launcher: one job at a time, so the jobs do not
share the cores they are timed on), reads each job's metrics.json and prints the table with the per-round
breakdown (verify ms, draft ms, the round's whole wall time) that explains it, with each job's passes and the
spread of their speedups; `--json F` writes the rows and the CPU. Goal on the default with XNNPACK on this
machine: speedup >= 2.0x at the best K and tau >= 3 at K = 4 on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_SPEEDUP, GOAL_TAU_AT_4 = 2.0, 3.0


def run_sweep(chains: str, overrides: list[str], sweep_dir: Path) -> None:
    cmd = [sys.executable, "-m", "pipeline", "-m", f"runtime.chain={chains}", f"hydra.sweep.dir={sweep_dir}",
           *overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def read_metrics(sweep_dir: Path) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in sweep_dir.glob("*/metrics.json")]
    return sorted(rows, key=lambda m: m["chain"])


def table(rows: list[dict]) -> str:
    head = f"{'K':>3} {'tau':>6} {'tok/s':>8} {'base tok/s':>10} {'speedup':>8} {'passes':>13} {'accept':>7} " \
           f"{'verify ms':>9} {'draft ms':>8} {'round ms':>8} {'lossless':>8}"
    lines = [head, "-" * len(head)]
    for m in rows:
        spread = f"{m['passes']}: {m['speedup_min']:.2f}-{m['speedup_max']:.2f}"
        lines.append(f"{m['chain']:>3} {m['tau']:>6.2f} {m['tokens_per_s']:>8.1f} {m['baseline_tokens_per_s']:>10.1f} "
                     f"{m['speedup']:>7.2f}x {spread:>13} {m['acceptance_rate']:>7.2f} {m['verify_ms_per_round']:>9.2f} "
                     f"{m['draft_ms_per_round']:>8.2f} {m['round_ms']:>8.2f} {str(m['lossless']):>8}")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    best = max(rows, key=lambda m: m["speedup"])
    at4 = next((m for m in rows if m["chain"] == 4), None)
    lines = [f"best K = {best['chain']}: speedup {best['speedup']:.2f}x (goal >= {GOAL_SPEEDUP}x) "
             f"{'ok' if best['speedup'] >= GOAL_SPEEDUP else 'SHORT'}"]
    if at4:
        lines.append(f"tau at K=4 = {at4['tau']:.2f} (goal >= {GOAL_TAU_AT_4}) "
                     f"{'ok' if at4['tau'] >= GOAL_TAU_AT_4 else 'SHORT'}")
    # Why: a round costs verify(K+1) + K draft steps and yields tau tokens; the baseline pays one T=1 step
    # per token. speedup ~= tau * t_step / (t_verify + t_draft).
    base_ms = 1e3 / best["baseline_tokens_per_s"]
    round_ms = best["verify_ms_per_round"] + best["draft_ms_per_round"]
    lines.append(f"breakdown at K={best['chain']}: baseline step {base_ms:.2f} ms; round = verify "
                 f"{best['verify_ms_per_round']:.2f} ms + draft {best['draft_ms_per_round']:.2f} ms = {round_ms:.2f} ms "
                 f"for tau {best['tau']:.2f} tokens -> {round_ms / max(best['tau'], 1e-9):.2f} ms/token "
                 f"(ideal speedup at this tau with free drafting: {best['tau'] * base_ms / best['verify_ms_per_round']:.2f}x)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chains", default="1,2,3,4,5,6,7")
    p.add_argument("--sweep-dir", type=Path, default=None, help="re-read an existing sweep instead of running")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and the CPU they ran on here")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every job (after --)")
    args = p.parse_args()
    sweep_dir = args.sweep_dir
    if sweep_dir is None:
        sweep_dir = ROOT / "bench" / ".work" / time.strftime("sweep-%Y%m%d-%H%M%S")
        run_sweep(args.chains, args.overrides, sweep_dir)
    rows = read_metrics(sweep_dir)
    if not rows:
        print(f"no metrics.json under {sweep_dir}", file=sys.stderr)
        return 1
    print(f"\nsweep {sweep_dir} ({rows[0]['n_prompts']} held-out prompts, .pte {rows[0]['pte_sha256'][:12]})")
    print(table(rows))
    print(verdict(rows))
    if args.json:
        from pipeline.hardware import cpu_fingerprint

        args.json.write_text(json.dumps({"machine": cpu_fingerprint(), "overrides": args.overrides, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
