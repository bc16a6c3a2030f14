"""The content-addressed store: keys, cache hits, corruption, and concurrent builders."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
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


# --- directories that are not finished artifacts, stale temp dirs, the CLI's root (issue 26) -------------
REPO = Path(__file__).resolve().parents[1]


def _quarantined(root: Path, stage: str, key: str) -> list[Path]:
    return sorted((root / ".quarantine" / stage).glob(f"{key}-*"))


@pytest.mark.parametrize("manifest", [None, '{"stage": "export", "files": {'])
def test_a_directory_without_a_readable_manifest_fails_verify_and_is_set_aside_by_the_build(
        tmp_path, manifest, capsys, caplog):
    """A crash or a user can leave `<stage>/<key>/` without its manifest: verify says so (status 1), and the
    next build moves it to .quarantine/ (never deleting it) instead of failing at the rename."""
    partial = tmp_path / "export" / "abc"
    partial.mkdir(parents=True)
    (partial / "model.pte").write_bytes(b"half a program")
    if manifest is not None:
        (partial / "manifest.json").write_text(manifest)
    problem = "manifest.json missing" if manifest is None else "manifest.json is not valid JSON"

    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "BAD export   abc" in out and problem in out and "verified" not in out
    assert Store(tmp_path).exists("export", "abc") is False

    calls: list = []
    with caplog.at_level("WARNING", logger="pipeline.store"):
        art, cached = Store(tmp_path).get_or_build("export", "abc", build_counting(calls), config={}, upstream={},
                                                   schema_version=1)
    assert not cached and len(calls) == 1 and art.path == partial
    assert (partial / "weights.bin").is_file() and not (partial / "model.pte").exists()
    [moved] = _quarantined(tmp_path, "export", "abc")
    assert (moved / "model.pte").read_bytes() == b"half a program", "set aside, not deleted"
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(partial) in warning and str(moved) in warning and problem in warning
    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 0


def test_a_tampered_artifact_is_refused_verify_says_how_to_repair_and_repair_sets_it_aside(tmp_path, capsys):
    store = Store(tmp_path)
    art, _ = store.get_or_build("draft", "k1", build_counting([]), config={}, upstream={}, schema_version=1)
    store.get_or_build("draft", "k2", build_counting([]), config={}, upstream={}, schema_version=1)
    (art.path / "weights.bin").write_bytes(b"edited")
    with pytest.raises(CorruptArtifact, match="weights.bin sha256 differs") as refused:
        store.load("draft", "k1")
    assert "python -m pipeline.store repair" in str(refused.value) and str(art.path) in str(refused.value)
    with pytest.raises(CorruptArtifact, match="weights.bin sha256 differs"):  # the run stops; nothing is moved
        store.get_or_build("draft", "k1", build_counting([]), config={}, upstream={}, schema_version=1)
    assert (art.path / "weights.bin").read_bytes() == b"edited"

    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "BAD draft    k1  weights.bin sha256 differs" in out and "ok  draft    k2" in out
    assert "python -m pipeline.store repair" in out

    assert store_mod.main(["repair", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    [moved] = _quarantined(tmp_path, "draft", "k1")
    assert f"quarantined {art.path} -> {moved}" in out and "weights.bin sha256 differs" in out
    assert (moved / "weights.bin").read_bytes() == b"edited" and not art.path.exists()
    assert store.load("draft", "k2") is not None, "a good artifact is left where it is"
    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 0
    _, cached = store.get_or_build("draft", "k1", build_counting([]), config={}, upstream={}, schema_version=1)
    assert cached is False and store.load("draft", "k1") is not None


def test_the_cli_refuses_a_root_that_does_not_exist(tmp_path, capsys):
    for command in ("verify", "list", "repair"):
        assert store_mod.main([command, "--root", str(tmp_path / "nope")]) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / "nope") in err and "does not exist" in err


def test_the_cli_default_root_is_pipeline_outputs_store(tmp_path, monkeypatch, capsys):
    Store(tmp_path / "out" / "store").get_or_build("export", "a", build_counting([]), config={}, upstream={},
                                                   schema_version=1)
    monkeypatch.setenv("PIPELINE_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("PIPELINE_STORE", str(tmp_path / "elsewhere"))  # not read any more
    assert store_mod.main(["list"]) == 0
    assert capsys.readouterr().out.split()[:2] == ["export", "a"]
    monkeypatch.delenv("PIPELINE_OUTPUTS")
    monkeypatch.chdir(tmp_path / "out" / "..")
    assert store_mod.main(["verify"]) == 2, "outputs/store under the working directory, which has none"
    assert str(Path("outputs") / "store") in capsys.readouterr().err
    (tmp_path / "out").rename(tmp_path / "outputs")
    assert store_mod.main(["verify"]) == 0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_build_removes_its_own_temp_dir(tmp_path, error):
    store = Store(tmp_path)
    seen = []

    def build(out: Path) -> dict:
        seen.append(out)
        (out / "half.bin").write_text("half")
        raise error("interrupted")

    with pytest.raises(error):
        store.get_or_build("target", "k", build, config={}, upstream={}, schema_version=1)
    assert seen and not seen[0].exists() and list((tmp_path / "target").iterdir()) == []


LIVE_BUILD = """
import sys
from pathlib import Path
from pipeline.store import Store

def build(out: Path) -> dict:
    (out / "half.bin").write_text("half")
    print(out, flush=True)
    sys.stdin.read()  # until the test closes stdin
    (out / "model.pte").write_bytes(b"pte")
    return {}

Store(sys.argv[1]).get_or_build("export", "live", build, config={}, upstream={}, schema_version=1)
"""


def test_stale_temp_dirs_are_listed_and_repaired_and_a_live_build_is_left_alone(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_dead = tmp_path / "export" / f".tmp-gone-{dead.pid}"  # its process has exited
    stale_free = tmp_path / "export" / f".tmp-free-{os.getpid()}"  # a running pid, but nobody holds the lock
    for d in (stale_dead, stale_free):
        d.mkdir(parents=True)
        (d / "half.bin").write_text("half")
    live = subprocess.Popen([sys.executable, "-c", LIVE_BUILD, str(tmp_path)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        live_tmp = Path(live.stdout.readline().strip())
        assert live_tmp == tmp_path / "export" / f".tmp-live-{live.pid}" and live_tmp.is_dir()

        assert store_mod.main(["list", "--root", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"stale temporary dir {stale_dead}" in out and f"stale temporary dir {stale_free}" in out
        assert str(live_tmp) not in out
        assert store_mod.main(["verify", "--root", str(tmp_path)]) == 0, "stale temp dirs waste space, no more"
        out = capsys.readouterr().out
        assert str(stale_dead) in out and str(stale_free) in out and str(live_tmp) not in out
        assert "python -m pipeline.store repair" in out

        assert store_mod.main(["repair", "--root", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"removed {stale_dead}" in out and f"removed {stale_free}" in out
        assert not stale_dead.exists() and not stale_free.exists()
        assert (live_tmp / "half.bin").read_text() == "half", "the running build's temp dir is not touched"
    finally:
        live.stdin.close()
        assert live.wait(timeout=60) == 0
    assert Store(tmp_path).load("export", "live").manifest["files"].keys() == {"half.bin", "model.pte"}
    assert store_mod.main(["verify", "--root", str(tmp_path)]) == 0
    assert "stale temporary dir" not in capsys.readouterr().out


# --- space, write errors and modes (issue 45) -----------------------------------------------------------------
def test_a_build_that_will_not_fit_is_refused_before_it_writes_naming_stage_path_need_and_free(tmp_path):
    store, calls = Store(tmp_path), []
    free = store_mod.free_bytes(tmp_path)
    with pytest.raises(store_mod.NoSpace) as e:
        store.get_or_build("taps", "k" * 64, build_counting(calls), config={}, upstream={}, schema_version=1,
                           estimate=lambda: free + 10**12)
    msg = str(e.value)
    assert msg.startswith("[Errno 28] taps: building " + "k" * 64) and str(tmp_path / "taps") in msg
    assert re.search(r"needs about \d+\.\d GB under .*, but only \d+\.\d [KMG]?B is free there", msg), msg
    assert calls == [] and not list((tmp_path / "taps").iterdir()), "nothing written, nothing half built"


def test_what_the_scratch_dir_already_holds_is_not_needed_again(tmp_path):
    store, calls = Store(tmp_path), []
    with open(store.scratch_dir("taps", "k" * 64) / "shard.bin", "wb") as f:
        f.truncate(2 * 10**12)  # sparse: 2 TB of shards already written, on no disk at all
    art, _ = store.get_or_build("taps", "k" * 64, build_counting(calls), config={}, upstream={}, schema_version=1,
                                estimate=lambda: store_mod.free_bytes(tmp_path) + 10**12)
    assert len(calls) == 1 and art.path.is_dir()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MB tmpfs at tmp_path/disk (needs mount rights: root in a container that allows it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_while_writing_names_the_stage_and_the_file(tiny_disk):
    store = Store(tiny_disk / "store")

    def build(out: Path) -> dict:
        with open(out / "model.pte", "wb") as f:
            f.write(b"\x00" * 2**21)  # 2 MB on a 1 MB disk
        return {}

    with pytest.raises(OSError) as e:
        store.get_or_build("export", "k" * 64, build, config={}, upstream={}, schema_version=1)
    assert e.value.errno == 28
    assert f"export: No space left on device: {tiny_disk / 'store' / 'export'}/.tmp-{'k' * 64}" in str(e.value)
    assert "free there" in str(e.value) and not list((tiny_disk / "store" / "export").iterdir())


def test_artifact_files_take_the_process_umask_whatever_the_writer_chose(tmp_path):
    import torch
    from safetensors.torch import save_file

    def build(out: Path) -> dict:
        save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))  # safetensors writes 0600
        (out / "sub").mkdir(mode=0o700)
        (out / "sub" / "config.json").write_text("{}")
        return {}

    old = os.umask(0o027)
    try:
        art, _ = Store(tmp_path).get_or_build("target", "k" * 64, build, config={}, upstream={}, schema_version=1)
    finally:
        os.umask(old)
    modes = {p.relative_to(art.path).as_posix(): p.stat().st_mode & 0o777 for p in [art.path, *art.path.rglob("*")]}
    assert modes == {".": 0o750, "model.safetensors": 0o640, "sub": 0o750, "sub/config.json": 0o640,
                     "manifest.json": 0o640}


def test_the_quick_check_reads_only_files_whose_size_or_time_moved(tmp_path, monkeypatch):
    store = Store(tmp_path)
    art, _ = store.get_or_build("taps", "k" * 64, build_counting([]), config={}, upstream={}, schema_version=1)
    assert set(art.manifest["stat"]) == set(art.manifest["files"]) == {"weights.bin", "sub/config.json"}
    real, hashed = store_mod.sha256_file, []
    monkeypatch.setattr(store_mod, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    quick = lambda: store_mod.check_artifact(art.path, hash_files="quick").problems  # noqa: E731
    assert quick() == () and hashed == [], "an untouched artifact: stat only"
    weights = art.path / "weights.bin"
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: same bytes, another time
    assert quick() == () and hashed == ["weights.bin"]
    weights.write_bytes(b"\x00\x02" * 100)  # same size, other bytes
    assert quick() == ("weights.bin sha256 differs",)
    hashed.clear()
    with open(weights, "r+b") as f:
        f.truncate(150)
    assert quick() == ("weights.bin is 150 bytes, the manifest records 200",) and hashed == []
