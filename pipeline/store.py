"""The content-addressed artifact store: one directory per (stage, key), written once, read many times.

An artifact is `<root>/<stage>/<key>/` holding the stage's files and a `manifest.json`:
stage, key, schema_version, config (the resolved config subtrees that entered the key), upstream
({stage: key}), files ({relative path: sha256}), versions (python and libraries), git commit,
created_at and report (what the stage's `run` returned).

The key is sha256 over (stage name, schema version, resolved config subtrees, upstream keys) in canonical
JSON, so the same config and the same upstream artifacts always name the same directory and anything else
names a new one.

Invariants:
- A directory that exists under its key is complete. Stages write into a fresh temporary directory
  `<root>/<stage>/.tmp-<key>-<pid>/`, the manifest is written last, and the directory is renamed into
  place while holding `<root>/.locks/<stage>/<key>.lock`. A second process asking for the same key waits on the
  lock, then finds the finished artifact and logs "cached <stage> <key>"; it never builds it twice.
- Loading verifies every file's sha256 against the manifest (once per load) and refuses an artifact whose
  files were changed, removed or added; `python -m pipeline.store verify` does the same for the whole store.
- Resumable work (training checkpoints, shards) lives in `scratch_dir(stage, key)` =
  `<root>/.scratch/<stage>/<key>/`, which survives a crash and is removed once the artifact is in place.

CLI: `python -m pipeline.store list|verify [--root DIR]` (default root: ./outputs/store).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DEFAULT_ROOT = Path("outputs") / "store"
LIBRARIES = ("torch", "executorch", "torchao", "tokenizers", "safetensors", "hydra-core", "omegaconf", "mlflow")


class CorruptArtifact(RuntimeError):
    """An artifact whose files do not match its manifest."""


@dataclass(frozen=True)
class Artifact:
    """A finished stage output: read files from `path`, facts from `manifest`."""

    stage: str
    key: str
    path: Path
    manifest: dict

    @property
    def report(self) -> dict:
        return self.manifest.get("report", {})


def cache_key(stage: str, schema_version: int, config: dict, upstream: dict[str, str]) -> str:
    """sha256 of the canonical JSON of everything an artifact is a function of."""
    payload = {"stage": stage, "schema_version": schema_version, "config": config, "upstream": upstream}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, str]:
    """{relative posix path: sha256} of every file under root except the manifest."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST
    }


def dir_fingerprint(root: Path) -> str:
    """sha256 over the relative path, size and modification time of every file under root: cheap (no file
    is read), and it changes when a file is replaced, edited, added or removed. For inputs outside the
    store (a checkpoint directory) whose change must change a cache key."""
    h = hashlib.sha256()
    root = Path(root)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def git_commit(cwd: Path | None = None) -> str:
    """HEAD's sha (with '-dirty' when the tree has changes), or 'unknown' outside a repository."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        sha = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# The build in progress in this process, so a stage can ask for its scratch dir without knowing its key.
_current: tuple[Store, str, str] | None = None


def scratch_dir(stage: str | None = None, key: str | None = None) -> Path:
    """Directory for resumable work of (stage, key); defaults to the stage being built right now."""
    if _current is None:
        raise RuntimeError("scratch_dir() without arguments is only valid while a stage is being built")
    store, cur_stage, cur_key = _current
    return store.scratch_dir(stage or cur_stage, key or cur_key)


class Store:
    def __init__(self, root: Path | str = DEFAULT_ROOT):
        self.root = Path(root).absolute()

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def scratch_dir(self, stage: str, key: str) -> Path:
        path = self.root / ".scratch" / stage / key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def exists(self, stage: str, key: str) -> bool:
        return (self.path(stage, key) / MANIFEST).is_file()

    def manifest(self, stage: str, key: str) -> dict | None:
        """The manifest of a finished artifact, unverified, or None."""
        path = self.path(stage, key) / MANIFEST
        return json.loads(path.read_text()) if path.is_file() else None

    def load(self, stage: str, key: str, verify: bool = True) -> Artifact | None:
        """The finished artifact, or None if there is none; raises CorruptArtifact if it was tampered with."""
        path = self.path(stage, key)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise CorruptArtifact(f"{stage} {key}: manifest.json is not valid JSON ({e})") from e
        if verify:
            problems = verify_files(path, manifest)
            if problems:
                raise CorruptArtifact(
                    f"{stage} artifact {path} does not match its manifest: {'; '.join(problems)}. "
                    f"Delete the directory to rebuild it."
                )
        return Artifact(stage=stage, key=key, path=path, manifest=manifest)

    def get_or_build(
        self,
        stage: str,
        key: str,
        build: Callable[[Path], dict],
        *,
        config: dict,
        upstream: dict[str, str],
        schema_version: int,
    ) -> tuple[Artifact, bool]:
        """Return (artifact, cached). `build(tmp_dir) -> report` runs at most once per key, store-wide."""
        found = self.load(stage, key)
        if found is not None:
            log.info("cached %s %s", stage, key)
            return found, True
        (self.root / stage).mkdir(parents=True, exist_ok=True)
        (self.root / ".locks" / stage).mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / ".locks" / stage / f"{key}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("waiting for %s %s: another process is building it", stage, key)
            lock.acquire()
        try:
            found = self.load(stage, key)
            if found is not None:
                log.info("cached %s %s", stage, key)
                return found, True
            for stale in (self.root / stage).glob(f".tmp-{key}-*"):  # left by a crashed build; we hold the lock
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.root / stage / f".tmp-{key}-{os.getpid()}"
            tmp.mkdir()
            global _current
            previous, _current = _current, (self, stage, key)
            try:
                report = build(tmp)
            finally:
                _current = previous
            manifest = {
                "stage": stage,
                "key": key,
                "schema_version": schema_version,
                "config": config,
                "upstream": upstream,
                "files": hash_tree(tmp),
                "versions": library_versions(),
                "git_commit": git_commit(Path(__file__).parent),
                "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "report": report if report is not None else {},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            os.rename(tmp, self.path(stage, key))
            shutil.rmtree(self.root / ".scratch" / stage / key, ignore_errors=True)
            return Artifact(stage=stage, key=key, path=self.path(stage, key), manifest=manifest), False
        finally:
            lock.release()

    def artifacts(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, path) of every finished artifact, sorted."""
        if not self.root.is_dir():
            return
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for path in sorted(stage_dir.iterdir()):
                if path.is_dir() and not path.name.startswith(".") and (path / MANIFEST).is_file():
                    yield stage_dir.name, path.name, path


def verify_files(path: Path, manifest: dict) -> list[str]:
    """Human-readable differences between the files under `path` and the manifest; [] when they agree."""
    expected = manifest.get("files", {})
    actual = hash_tree(path)
    problems = [f"{name} missing" for name in sorted(set(expected) - set(actual))]
    problems += [f"{name} not in manifest" for name in sorted(set(actual) - set(expected))]
    problems += [f"{name} sha256 differs" for name in sorted(set(expected) & set(actual)) if expected[name] != actual[name]]
    return problems


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.store", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("list", "verify"))
    parser.add_argument("--root", default=os.environ.get("PIPELINE_STORE", str(DEFAULT_ROOT)))
    args = parser.parse_args(argv)
    store = Store(args.root)
    bad = 0
    for stage, key, path in store.artifacts():
        manifest = json.loads((path / MANIFEST).read_text())
        if args.command == "list":
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            print(f"{stage:8} {key}  {manifest.get('created_at', '?'):25}  {_human_size(size):>9}  {path}")
        else:
            problems = verify_files(path, manifest)
            bad += bool(problems)
            print(f"{'BAD' if problems else 'ok ':3} {stage:8} {key}" + (f"  {'; '.join(problems)}" if problems else ""))
    if args.command == "verify":
        print(f"{bad} corrupted artifact(s) under {store.root}" if bad else f"all artifacts under {store.root} verified")
    return 1 if bad else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
