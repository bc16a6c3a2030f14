"""The sweep the user runs: `python -m pipeline -m runtime.chain=1,2,4,7 +experiment=smoke`, on Hydra's joblib
launcher (two jobs at a time, as `hydra/launcher=joblib` runs a sweep on one machine).

One subprocess runs the whole smoke pipeline once (target, taps, draft, export built by one job while the job
beside it waits at the store's lock, then taken from the store by the others) and four evaluations from the one
cached .pte. This is the only full
pipeline run of the runner's tests (a few minutes on 2 cores); it checks what the sweep promises: export at
most once, the same .pte (sha256) and lossless output in every job, one MLflow parent with four children
carrying the eval metrics, and the summary (table, plot, best K) on the parent.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole multirun pipeline

ROOT = Path(__file__).resolve().parents[1]
CHAINS = (1, 2, 4, 7)
EVAL_METRICS = ("chain", "max_m", "tokens_per_s", "baseline_tokens_per_s", "speedup", "tau", "acceptance_rate",
                "verify_ms_per_round", "draft_ms_per_round", "prefill_ms", "rounds", "emitted_tokens", "lossless",
                "n_prompts")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    sweep_dir = root / "multirun"
    env = {**os.environ, "PIPELINE_OUTPUTS": str(root / "outputs"), "HYDRA_FULL_ERROR": "1"}
    cmd = [sys.executable, "-m", "pipeline", "-m", f"runtime.chain={','.join(map(str, CHAINS))}", "+experiment=smoke",
           "threads=1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return root, sweep_dir, log


def test_the_sweep_exports_once_and_every_job_reads_the_same_lossless_pte(sweep):
    root, sweep_dir, log = sweep
    job_logs = "".join(p.read_text() for p in sweep_dir.glob("*/pipeline.log"))
    assert job_logs.count("running export") == 1, job_logs[-4000:]
    assert job_logs.count("cached export") == len(CHAINS) - 1
    assert len(list((root / "outputs" / "store" / "export").glob("*/model.pte"))) == 1
    metrics = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/metrics.json"))]
    assert sorted(m["chain"] for m in metrics) == list(CHAINS)
    assert len({m["pte_sha256"] for m in metrics}) == 1
    assert all(m["lossless"] is True for m in metrics)
    assert all(len((p.parent / "generations.jsonl").read_text().splitlines()) == m["n_prompts"]
               for p, m in zip(sorted(sweep_dir.glob("*/metrics.json")), metrics))


def test_mlflow_has_one_parent_and_a_child_per_k_with_the_eval_metrics(sweep):
    root, sweep_dir, _ = sweep
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'outputs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.sweep_dir != ''")
    assert len(parents) == 1
    parent = parents[0]
    children = client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == len(CHAINS)
    by_k = {int(c.data.metrics["chain"]): c.data.metrics for c in children}
    assert sorted(by_k) == list(CHAINS)
    for k, m in by_k.items():
        assert set(EVAL_METRICS) <= set(m) and m["lossless"] == 1.0
        assert {f"acceptance_pos_{i}" for i in range(k)} <= set(m)
    assert parent.data.metrics["best_chain"] in CHAINS
    assert {"summary.md", "summary.png"} <= {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert (sweep_dir / "summary.png").is_file() and "best K" in (sweep_dir / "summary.md").read_text()
