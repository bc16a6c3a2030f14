"""The content-addressed store: keys, cache hits, corruption, and concurrent builders."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from pipeline import store as store_mod
from pipeline.store import CorruptArtifact, Store, cache_key

CONFIG = {"target": {"n_layers": 2, "hidden_size": 64}}


def build_counting(calls: list):
    def build(out: Path) -> dict:
        calls.append(out)
        (out / "weights.bin").write_bytes(b"\x00\x01" * 100)
        (out / "sub").mkdir()
        (out / "sub" / "config.json").write_text("{}")
        return {"loss": 1.5}
    return build


def test_same_config_gives_same_key_and_a_cache_hit(tmp_path):
    key = cache_key("target", 1, CONFIG, {})
    assert key == cache_key("target", 1, json.loads(json.dumps(CONFIG)), {})
    assert key != cache_key("target", 2, CONFIG, {}), "schema version is part of the key"
    assert key != cache_key("target", 1, {"target": {"n_layers": 3, "hidden_size": 64}}, {})
    assert key != cache_key("taps", 1, CONFIG, {"target": key}), "stage name and upstream keys are part of the key"

    store, calls = Store(tmp_path), []
    first, cached1 = store.get_or_build("target", key, build_counting(calls), config=CONFIG, upstream={},
                                        schema_version=1)
    second, cached2 = store.get_or_build("target", key, build_counting(calls), config=CONFIG, upstream={},
                                         schema_version=1)
    assert (cached1, cached2) == (False, True) and len(calls) == 1
    assert first.path == second.path == tmp_path / "target" / key
    m = second.manifest
    assert m["stage"] == "target" and m["key"] == key and m["config"] == CONFIG and m["report"] == {"loss": 1.5}
    assert set(m["files"]) == {"weights.bin", "sub/config.json"}
    assert "torch" in m["versions"] and m["created_at"]
    assert not list((tmp_path / "target").glob(".tmp-*")), "the temp dir was renamed into place"


def test_key_is_independent_of_dict_order():
    a = {"x": 1, "y": {"b": 2, "a": 3}}
    b = {"y": {"a": 3, "b": 2}, "x": 1}
    assert cache_key("s", 1, a, {"u": "k"}) == cache_key("s", 1, b, {"u": "k"})


@pytest.mark.parametrize("tamper", ["modify", "delete", "add"])
def test_corrupted_artifact_is_detected(tmp_path, tamper, capsys):
    store = Store(tmp_path)
    art, _ = store.get_or_build("draft", "k1", build_counting([]), config={}, upstream={}, schema_version=1)
    if tamper == "modify":
        (art.path / "weights.bin").write_bytes(b"\x00\x02" * 100)
    elif tamper == "delete":
        (art.path / "sub" / "config.json").unlink()
    else:
        (art.path / "extra.txt").write_text("x")
    with pytest.raises(CorruptArtifact, match="does not match its manifest"):
        store.load("draft", "k1")
    with pytest.raises(CorruptArtifact):
        store.get_or_build("draft", "k1", build_counting([]), config={}, upstream={}, schema_version=1)
    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 1
    assert "BAD" in capsys.readouterr().out


def test_cli_lists_and_verifies(tmp_path, capsys):
    store = Store(tmp_path)
    for key in ("a", "b"):
        store.get_or_build("export", key, build_counting([]), config={}, upstream={}, schema_version=1)
    assert store_mod.main(["list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()] == [["export", "a"], ["export", "b"]]
    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 0
    assert "verified" in capsys.readouterr().out


def test_failed_build_leaves_no_artifact_and_keeps_scratch(tmp_path):
    store = Store(tmp_path)

    def build(out: Path) -> dict:
        (store_mod.scratch_dir() / "ckpt.pt").write_text("step 5")
        (out / "half.bin").write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        store.get_or_build("target", "k", build, config={}, upstream={}, schema_version=1)
    assert store.load("target", "k") is None
    assert (store.scratch_dir("target", "k") / "ckpt.pt").read_text() == "step 5", "scratch survives a crash"

    def resume(out: Path) -> dict:
        step = (store_mod.scratch_dir() / "ckpt.pt").read_text()
        (out / "done.txt").write_text(step)
        return {"resumed_from": step}

    art, cached = store.get_or_build("target", "k", resume, config={}, upstream={}, schema_version=1)
    assert not cached and art.report == {"resumed_from": "step 5"}
    assert not (tmp_path / ".scratch" / "target" / "k").exists(), "scratch is removed after success"
    assert not list((tmp_path / "target").glob(".tmp-*")), "the failed temp dir was cleaned up"


def _race(root: str, barrier, log_path: str) -> None:
    def build(out: Path) -> dict:
        with open(log_path, "a") as f:
            f.write("built\n")
        time.sleep(1.0)  # long enough that the others arrive while the lock is held
        (out / "model.pte").write_bytes(b"pte")
        return {}

    barrier.wait()
    art, cached = Store(root).get_or_build("export", "same-key", build, config={}, upstream={}, schema_version=1)
    with open(log_path, "a") as f:
        f.write(f"{'cached' if cached else 'fresh'} {art.path}\n")


def test_racing_processes_produce_one_artifact(tmp_path):
    ctx = mp.get_context("spawn")
    n = 3
    barrier = ctx.Barrier(n)
    log_path = tmp_path / "log.txt"
    procs = [ctx.Process(target=_race, args=(str(tmp_path / "store"), barrier, str(log_path))) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = log_path.read_text().splitlines()
    assert lines.count("built") == 1, lines
    results = [line.split() for line in lines if line != "built"]
    assert sorted(r[0] for r in results) == ["cached", "cached", "fresh"]
    assert len({r[1] for r in results}) == 1
    assert [p.name for p in (tmp_path / "store" / "export").iterdir() if p.is_dir()] == ["same-key"]
    assert Store(tmp_path / "store").load("export", "same-key") is not None
