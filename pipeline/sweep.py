"""The summary of a multirun: every job's `result.json`, a table and a plot against K, the best K.

Each job writes `<job dir>/result.json` (pipeline.app); after the sweep, the Hydra callback
(pipeline.callbacks) reads them all with `read_results` and hands them to `summarize`, which writes
`summary.md` and `summary.png` into the sweep directory and returns the numbers the parent MLflow run logs.
The summary is written whatever happened to the jobs: a failed job is listed with its error.
The best K is the one with the highest speedup: a ratio measured within one job against its own K=0
baseline, so it holds on a shared machine whose load changes between jobs.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import tracking

RESULT_FILE = "result.json"
COLUMNS = ("chain", "tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "acceptance_rate",
           "verify_ms_per_round", "draft_ms_per_round", "lossless")


def read_results(sweep_dir: Path) -> list[dict]:
    """Every job's result.json under the sweep directory, ordered by job number."""
    results = [json.loads(p.read_text()) for p in Path(sweep_dir).rglob(RESULT_FILE)]
    return sorted(results, key=lambda r: r.get("job_num", 0))


def eval_rows(results: list[dict]) -> list[dict]:
    """One row per job that finished an eval: its eval report plus `job` and `overrides`, sorted by K."""
    rows = []
    for result in results:
        report = ((result.get("stages") or {}).get("eval") or {}).get("report") or {}
        if result.get("status") == "ok" and "chain" in report:
            rows.append({"job": result.get("job_num"), "overrides": " ".join(result.get("overrides", [])), **report})
    return sorted(rows, key=lambda r: (r["chain"], r["job"]))


def table(rows: list[dict]) -> str:
    """The rows as a markdown table of COLUMNS."""
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| job | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += ["| " + " | ".join([str(r["job"])] + [fmt(r.get(c)) for c in COLUMNS]) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], best: dict, path: Path) -> None:
    """tokens/s, speedup and tau against K, one panel each."""
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def failed_lines(results: list[dict]) -> list[str]:
    """One line per job that did not end ok: its number, overrides and its error on one line."""
    return [f"- job {r.get('job_num')} ({' '.join(r.get('overrides', []))}): failed: "
            f"{' '.join((r.get('error') or 'no error recorded').split())[:400]}"
            for r in results if r.get("status") != "ok"]


def summarize(results: list[dict], sweep_dir: Path) -> dict:
    """summary.md (and summary.png when a job finished an eval) of the sweep, logged to the active (parent)
    run; returns {best_chain, best_tokens_per_s, best_speedup, best_tau} of the eval jobs (none without
    one) and failed_jobs."""
    rows, failed = eval_rows(results), failed_lines(results)
    parts, metrics = [], {"failed_jobs": len(failed)}
    if rows:
        best = max(rows, key=lambda r: r["speedup"])
        shas = sorted({str(r["pte_sha256"]) for r in rows if r.get("pte_sha256")})  # none on the CUDA engine
        parts += [table(rows), "",
                  f"best K = {best['chain']}: {best['tokens_per_s']:.1f} tokens/s, speedup {best['speedup']:.2f}x, "
                  f"tau {best['tau']:.2f} (job {best['job']}: {best['overrides']})"]
        parts += [f".pte sha256: {', '.join(shas)}"] if shas else []
        metrics.update({"best_chain": best["chain"], "best_tokens_per_s": best["tokens_per_s"],
                        "best_speedup": best["speedup"], "best_tau": best["tau"]})
    if failed:
        parts += ["", f"{len(failed)} of {len(results)} job(s) failed:", *failed]
    sweep_dir = Path(sweep_dir)
    text = "\n".join(parts).strip()
    (sweep_dir / "summary.md").write_text(text + "\n")
    print(text)
    tracking.log_artifact(sweep_dir / "summary.md")
    if rows:
        plot(rows, best, sweep_dir / "summary.png")
        tracking.log_artifact(sweep_dir / "summary.png")
    return metrics
