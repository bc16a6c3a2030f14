"""bench/ stays runnable: every module of bench/ and bench/lab/ imports (so a broken import fails here, not on the
next device run), and every script a user runs (a module with a `__main__` block) answers `python -m bench.X --help`
from the repository root; the other modules of bench/ are the parts those scripts share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"}
SCRIPTS = sorted(m for m, p in MODULES.items() if 'if __name__ == "__main__":' in p.read_text())
PARTS = sorted(set(MODULES) - set(SCRIPTS))
LAB = sorted(p.stem for p in (ROOT / "bench" / "lab").glob("*.py") if p.stem != "__init__")


def test_bench_holds_the_user_facing_scripts_and_lab_the_investigations():
    assert {"sweep", "export_latency", "peers", "serve", "cuda_engine", "kernels"} <= set(SCRIPTS)
    assert {"gguf_write", "quality", "pte_profile", "hf_run", "targets"} <= set(PARTS)
    assert {"width_invariance", "draft_vocab", "sass", "ncu_int4", "kernel_tune"} <= set(LAB)


def test_every_bench_and_lab_module_imports():
    """One fresh interpreter imports them all (some install log filters at import, which this process keeps out
    of); it reports each module that fails with its exception."""
    modules = [f"bench.{m}" for m in sorted(MODULES)] + [f"bench.lab.{m}" for m in LAB]
    code = ("import importlib, json, traceback\nfailed = {}\n"
            f"for m in {modules!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception:\n        failed[m] = traceback.format_exc(limit=3)\n"
            "print(json.dumps(failed))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{m}:\n{tb}" for m, tb in failed.items())


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_answers_help_from_the_repository_root(script):
    res = subprocess.run([sys.executable, "-m", f"bench.{script}", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout


def test_tau_by_position_pools_each_round_where_its_first_token_falls():
    """bench.context: a round counts in the bucket of the answer position its first token takes (the prefill's
    token is position 0), checked against a count made token by token on drawn rounds."""
    import random
    from types import SimpleNamespace

    from bench.context import BUCKETS, tau_by_position

    rng = random.Random()
    results = [SimpleNamespace(emitted=[rng.randint(1, 7) for _ in range(rng.randint(40, 200))]) for _ in range(3)]
    want = {b: [0, 0] for b in BUCKETS}
    for r in results:
        at = 1
        for e in r.emitted:
            bucket = [b for b in BUCKETS if b <= at][-1]
            want[bucket][0] += e
            want[bucket][1] += 1
            at += e
    got = tau_by_position(results)
    assert list(got) == ["0-64", "64-256", "256-512", "512-1024", "1024-"]
    for (key, value), b in zip(got.items(), BUCKETS):
        s, n = want[b]
        assert value == (s / n if n else None), key
