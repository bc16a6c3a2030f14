"""Cheap stand-in stages for testing the pipeline frame (store, app, tracking) without training anything.

`write_fake_stages(dir, names)` writes a package `fakestages` under `dir`; run the app with
`stage_package=fakestages` and `dir` on PYTHONPATH. Each content-addressed fake writes one file and reports
`value`; the fake eval reports the runtime chain it was given, and fails at chain 5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (UPSTREAM, CONFIG_KEYS), as the real stages declare them but without `data` (its fingerprint reads
# the corpus) and `seed`.
SPECS = {
    "target": ((), ("target",)),
    "taps": (("target",), ("taps",)),
    "draft": (("taps",), ("draft",)),
    "export": (("target", "draft"), ("export",)),
    "eval": (("export",), ("runtime",)),
}

STAGE = '''
import json
from pipeline import tracking

SCHEMA_VERSION = 1
UPSTREAM = {upstream!r}
CONFIG_KEYS = {keys!r}
CONTENT_ADDRESSED = {content_addressed!r}


def run(cfg, upstream, out):
    {body}
'''

BODY = {
    "content": '''tracking.log_metrics({{"step_metric": 1.0}}, step=1)
    (out / "{name}.json").write_text(json.dumps({{u: a.key for u, a in upstream.items()}}))
    return {{"value": 1.0}}''',
    "eval": '''chain = cfg.runtime.chain or 0
    if chain == 5:
        raise RuntimeError("fake eval failure at K=5")
    (out / "metrics.json").write_text(json.dumps({{"chain": chain}}))
    return {{"chain": chain, "tau": 1.0 + chain, "tokens_per_s": 10.0 * (1 + chain), "baseline_tokens_per_s": 10.0,
            "speedup": 1.0 + chain}}''',
}


def write_fake_stages(root: Path, names=tuple(SPECS)) -> Path:
    pkg = Path(root) / "fakestages"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name in names:
        upstream, keys = SPECS[name]
        body = BODY["eval" if name == "eval" else "content"].format(name=name)
        (pkg / f"{name}.py").write_text(STAGE.format(upstream=upstream, keys=keys, body=body,
                                                     content_addressed=name != "eval"))
    return pkg


def run_app(args: list[str], fakes_dir: Path, outputs: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    """`python -m pipeline stage_package=fakestages paths.outputs=<outputs> *args` in a subprocess."""
    if "tracking=none" not in args and not (Path(outputs) / "mlflow.db").exists():
        seed_mlflow_db(outputs)
    env = dict(os.environ, PYTHONPATH=f"{fakes_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    flags = [a for a in args if a.startswith("-")]  # Hydra's flags (-m) must precede the overrides
    overrides = [a for a in args if not a.startswith("-")]
    cmd = [sys.executable, "-m", "pipeline", *flags, "stage_package=fakestages", f"paths.outputs={outputs}", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


_template_db: Path | None = None


def seed_mlflow_db(outputs: Path) -> None:
    """Copy an already-initialised MLflow SQLite store into `outputs` (creating one runs MLflow's ~50 schema
    migrations, 5-15 s on this machine; the copy takes milliseconds). The template is made once per process."""
    global _template_db
    import shutil
    import tempfile

    from pipeline import tracking

    if _template_db is None:
        template_dir = Path(tempfile.mkdtemp(prefix="mlflow-template-"))
        tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, template_dir)
        _template_db = template_dir / "mlflow.db"
    Path(outputs).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template_db, Path(outputs) / "mlflow.db")
