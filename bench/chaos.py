"""Chaos run: a smoke sweep on an empty store, killed with SIGKILL at random moments, rerun after each kill.

    python -m bench.chaos                      # 10 kills, a fresh directory under /tmp, seed from the clock
    python -m bench.chaos --kills 3 --seed 7 --dir /tmp/chaos

What runs: `python -m pipeline -m +experiment=smoke runtime.chain=1,2,3,4 threads=1` with PIPELINE_OUTPUTS
pointing at its own directory (`<dir>/chaos`), started as a process group and killed (SIGKILL, the group) at a
moment drawn uniformly from [2 s, D], then started again; after the last kill it runs to its end. D is the
duration of the uninterrupted sweep (`<dir>/reference`, run first, which also gives the reference .pte), and
once an attempt has run to its end, that attempt's duration (then the sweep is all cached but for its eval
jobs, and a later kill still lands inside one). Every attempt is bounded (`--attempt-timeout-s`).

Checked at the end (exit 1 when any fails):
- every job that ended ok (its result.json) is lossless (eval.lossless = 1), and the last attempt ran every job ok;
- `python -m pipeline.store verify` exits 0 and names no stale temporary directory;
- MLflow holds each job dir's run once: FINISHED with its metrics (tau, lossless) where the job ended ok, not
  RUNNING where it was killed; no run is left RUNNING and no tracking_pending.json is left;
- the export artifact's model.pte has the sha256 of the uninterrupted build's.
Prints one line per attempt (when it was killed, the job and stage it was in) and the checks; writes the same
as JSON to `<dir>/chaos.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ["-m", "+experiment=smoke", "runtime.chain=1,2,3,4", "threads=1"]
CHAINS = 4


def start(outputs: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PIPELINE_OUTPUTS": str(outputs), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "pipeline", *SWEEP], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def where(log: Path) -> str:
    """The job and stage an attempt was in when it stopped, from its log."""
    text = log.read_text(errors="replace")
    jobs = re.findall(r"#(\d+) : ", text)
    stage = re.findall(r"running (target|taps|draft|export|eval)\b", text)
    lowered = re.findall(r"lowered (\w+): ", text[text.rfind("running export"):]) if "running export" in text else []
    return (f"job {jobs[-1] if jobs else '-'}, {stage[-1] if stage else 'startup'}"
            + (f" ({len(lowered)} method(s) lowered)" if stage and stage[-1] == "export" else ""))


def run_attempt(outputs: Path, log: Path, kill_after: float | None, timeout_s: float) -> dict:
    t0 = time.monotonic()
    proc = start(outputs, log)
    try:
        rc = proc.wait(timeout=kill_after if kill_after is not None else timeout_s)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, killed = proc.wait(), True
        if kill_after is None:
            raise RuntimeError(f"the sweep ran past {timeout_s:.0f} s; see {log}") from None
    return {"seconds": round(time.monotonic() - t0, 1), "killed": killed, "rc": rc, "at": where(log)}


def results(outputs: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((outputs / "multirun").glob("*/*/*/result.json"))]


def pte_sha256(outputs: Path) -> str:
    (pte,) = (outputs / "store" / "export").glob("[0-9a-f]*/model.pte")
    return hashlib.sha256(pte.read_bytes()).hexdigest()


def check(outputs: Path, reference_sha: str, last: dict) -> dict[str, tuple[bool, str]]:
    from pipeline import tracking, tracking_queue

    checks = {}
    done = results(outputs)
    ok = [r for r in done if r["status"] == "ok"]
    lossy = [r["job_dir"] for r in ok if r["stages"]["eval"]["report"].get("lossless") != 1]
    checks["every ok job lossless"] = (not lossy and bool(ok), f"{len(ok)} ok job(s), not lossless: {lossy}")
    final = [r for r in done if Path(r["job_dir"]).parent.name == max(Path(x["job_dir"]).parent.name for x in done)]
    checks["last attempt: every job ok"] = (last["rc"] == 0 and len(final) == CHAINS and
                                            all(r["status"] == "ok" for r in final),
                                            f"rc {last['rc']}, {[r['status'] for r in final]}")
    v = subprocess.run([sys.executable, "-m", "pipeline.store", "verify", "--root", str(outputs / "store")],
                       cwd=ROOT, capture_output=True, text=True)
    checks["pipeline.store verify clean"] = (v.returncode == 0 and "stale" not in v.stdout,
                                             v.stdout.strip().splitlines()[-1] if v.stdout.strip() else v.stderr)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, outputs)
    runs = tracker.client.search_runs([tracker.experiment_id], max_results=10_000)
    by_dir: dict[str, list] = {}
    for run in runs:
        if "job_dir" in run.data.tags:
            by_dir.setdefault(run.data.tags["job_dir"], []).append(run)
    bad = []
    for r in done:
        mine = by_dir.get(r["job_dir"], [])
        if len(mine) != 1:
            bad.append(f"{r['job_dir']}: {len(mine)} runs")
        elif r["status"] == "ok" and (mine[0].info.status != "FINISHED" or mine[0].data.metrics.get("lossless") != 1.0
                                      or "tau" not in mine[0].data.metrics):
            bad.append(f"{r['job_dir']}: {mine[0].info.status}, metrics {sorted(mine[0].data.metrics)[:5]}")
    running = [run.info.run_name for run in runs if run.info.status == "RUNNING"]
    pending = list(outputs.rglob(tracking_queue.PENDING_FILE))
    checks["MLflow: each job once, FINISHED with its metrics"] = (
        not bad and not running and not pending,
        f"{len(runs)} runs, {len(ok)} ok jobs; problems {bad[:3]}, RUNNING {running[:3]}, pending {pending[:3]}")
    sha = pte_sha256(outputs)
    checks[".pte sha256 = uninterrupted build's"] = (sha == reference_sha, f"{sha[:16]} vs {reference_sha[:16]}")
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dir", type=Path, default=None, help="where the reference and the chaos outputs go (empty)")
    p.add_argument("--attempt-timeout-s", type=float, default=1800)
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    base = args.dir or Path(tempfile.mkdtemp(prefix="chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    if any((base / d).exists() for d in ("reference", "chaos")):
        print(f"error: {base} already holds a chaos run; give an empty --dir", file=sys.stderr)
        return 2
    print(f"chaos run in {base}, seed {seed}, {args.kills} kills", flush=True)

    ref = run_attempt(base / "reference", base / "reference.log", None, args.attempt_timeout_s)
    reference_sha = pte_sha256(base / "reference")
    print(f"uninterrupted sweep: {ref['seconds']:.0f} s, rc {ref['rc']}, .pte {reference_sha[:16]}", flush=True)
    bound, attempts = ref["seconds"], []
    while sum(a["killed"] for a in attempts) < args.kills:
        delay = round(rng.uniform(2.0, max(3.0, bound)), 1)
        a = run_attempt(base / "chaos", base / f"attempt-{len(attempts):02d}.log", delay, args.attempt_timeout_s)
        a["kill_after_s"] = delay
        attempts.append(a)
        if not a["killed"]:
            bound = a["seconds"]  # ran to its end: later attempts are at most this long
        print(f"attempt {len(attempts) - 1:2d}: {'killed' if a['killed'] else 'ran to its end'} after "
              f"{a['seconds']:6.1f} s (rc {a['rc']}), in {a['at']}", flush=True)
    last = run_attempt(base / "chaos", base / f"attempt-{len(attempts):02d}.log", None, args.attempt_timeout_s)
    attempts.append(last)
    print(f"attempt {len(attempts) - 1:2d}: final, {last['seconds']:.1f} s, rc {last['rc']}", flush=True)

    checks = check(base / "chaos", reference_sha, last)
    for name, (passed, detail) in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    (base / "chaos.json").write_text(json.dumps({"seed": seed, "reference": ref, "reference_pte_sha256": reference_sha,
                                                 "attempts": attempts, "checks": checks}, indent=1))
    return 0 if all(passed for passed, _ in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
