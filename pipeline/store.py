"""The content-addressed artifact store: one directory per (stage, key), written once, read many times.

An artifact is `<root>/<stage>/<key>/` holding the stage's files and a `manifest.json`:
stage, key, schema_version, config (the resolved config subtrees that entered the key), upstream
({stage: key}), files ({relative path: sha256}), stat ({relative path: [size, mtime_ns]}), versions (python
and libraries), git commit, created_at and report (what the stage's `run` returned).

The key is sha256 over (stage name, schema version, resolved config subtrees, upstream keys) in canonical
JSON, so the same config and the same upstream artifacts always name the same directory and anything else
names a new one.

Invariants:
- A directory under its key with a readable manifest is complete. Stages write into a fresh temporary directory
  `<root>/<stage>/.tmp-<key>-<pid>/`, the manifest is written last, and the directory is renamed into
  place while holding `<root>/.locks/<stage>/<key>.lock`. A second process asking for the same key waits on the
  lock, then finds the finished artifact and logs "cached <stage> <key>"; it never builds it twice.
- A temporary directory exists only while its build holds the key's lock: a build that raises removes its own
  before re-raising, and the next build of the key removes any left by a killed process. One whose pid is
  not a running process, or whose key's lock nobody holds, is stale: `list` and `verify` name it, `repair`
  removes it (taking the lock first, so the temporary directory of a build in progress is never touched).
- Loading verifies every file's sha256 against the manifest (once per load) and refuses an artifact whose
  files were changed, removed or added (CorruptArtifact: the run stops, the directory stays for inspection);
  `python -m pipeline.store verify` does the same for the whole store. An artifact a job does not read (the
  taps of a cached draft) gets the quick check: sizes and modification times against the manifest's `stat`,
  a file hashed only where its time differs (`quick_problems`). `check_artifact` words every
  problem, for `load`, `verify`, `repair` and the quarantine log alike.
- A directory under a key without a readable manifest (missing, or not a JSON object) is not an artifact:
  `verify` reports it, and `get_or_build` moves it, under the lock, to
  `<root>/.quarantine/<stage>/<key>-<UTC timestamp>/` (logging both paths) before building, so the
  build's rename always lands. `repair` quarantines every bad directory, tampered ones too. Nothing in the
  store is deleted except temporary directories and a finished artifact's scratch.
- Resumable work (training checkpoints, shards, lowered methods) lives in `scratch_dir(stage, key)` =
  `<root>/.scratch/<stage>/<key>/`, which survives a crash and is removed once the artifact is in place.
- Before a build writes, its estimated size (a stage's `estimate_bytes`) is checked against the free space
  (NoSpace names the stage, the path, the need and the free space); an OSError while it writes is raised
  again naming the stage and the path. Every file of an artifact has the mode a plain open() gives under the
  process's umask (`apply_umask`).

CLI: `python -m pipeline.store list|verify|repair [--root DIR]` (default root: `$PIPELINE_OUTPUTS/store`, i.e.
`outputs/store` under the working directory, as the pipeline's `paths.store`). `verify` exits 1 when any
artifact is bad; `repair` quarantines bad artifacts and removes stale temporary directories; a root that does
not exist is an error (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import errno
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
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


class NoSpace(OSError):
    """A build whose estimated size does not fit the free space under the store; raised before it writes."""


def free_bytes(path: Path) -> int:
    """Free bytes an unprivileged writer may use on the filesystem holding `path` (or its nearest parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


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


def building() -> bool:
    """Whether a stage is being built in this process (then `scratch_dir()` names its scratch directory)."""
    return _current is not None


def scratch_dir(stage: str | None = None, key: str | None = None) -> Path:
    """Directory for resumable work of (stage, key); defaults to the stage being built right now."""
    if _current is None:
        raise RuntimeError("scratch_dir() without arguments is only valid while a stage is being built")
    store, cur_stage, cur_key = _current
    return store.scratch_dir(stage or cur_stage, key or cur_key)


@dataclass(frozen=True)
class Check:
    """What `check_artifact` found in a directory under a key: its manifest (None when there is no readable
    one: then the directory is not an artifact) and the problems, in the words every report uses."""

    path: Path
    manifest: dict | None
    problems: tuple[str, ...]

    @property
    def incomplete(self) -> bool:
        """No readable manifest: nothing to inspect against, so a build may set it aside and rebuild."""
        return self.manifest is None


def check_artifact(path: Path, *, hash_files: bool | str = True) -> Check:
    """The one source of problem descriptions (load, verify, repair, quarantine): a missing or unreadable
    manifest, or (with `hash_files`) every file that differs from it; no problems for a good artifact.
    `hash_files="quick"`: sizes and modification times against the manifest's `stat`, hashing only a file
    whose time differs (`quick_problems`)."""
    path = Path(path)
    if not path.is_dir():
        return Check(path, None, ("not a directory",))
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return Check(path, None, (f"{MANIFEST} missing",))
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return Check(path, None, (f"{MANIFEST} unreadable ({e})",))
    except json.JSONDecodeError as e:
        return Check(path, None, (f"{MANIFEST} is not valid JSON ({e})",))
    if not isinstance(manifest, dict):
        return Check(path, None, (f"{MANIFEST} is not a JSON object",))
    if hash_files == "quick":
        return Check(path, manifest, tuple(quick_problems(path, manifest)))
    return Check(path, manifest, tuple(verify_files(path, manifest)) if hash_files else ())


@dataclass(frozen=True)
class TempDir:
    """A build's temporary directory `<root>/<stage>/.tmp-<key>-<pid>/`; `stale` with the reason when its
    process is not running or nobody holds its key's lock (then no build is writing it)."""

    stage: str
    key: str
    pid: int | None
    path: Path
    stale: str | None


def pid_alive(pid: int | None) -> bool:
    """Whether `pid` is a live process on this host: a zombie is not (it runs no more code), someone else's
    process is; no pid is none."""
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc: the signal said it exists
        return True
    return state not in ("Z", "X")


def _utc_stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


class Store:
    def __init__(self, root: Path | str = DEFAULT_ROOT):
        self.root = Path(root).absolute()

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def scratch_dir(self, stage: str, key: str) -> Path:
        path = self.root / ".scratch" / stage / key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def lock_path(self, stage: str, key: str) -> Path:
        return self.root / ".locks" / stage / f"{key}.lock"

    def _lock(self, stage: str, key: str) -> FileLock:
        self.lock_path(stage, key).parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.lock_path(stage, key)))

    def _lock_held(self, stage: str, key: str) -> bool:
        """Whether some process holds the key's lock right now (probing it creates nothing)."""
        if not self.lock_path(stage, key).is_file():
            return False
        lock = FileLock(str(self.lock_path(stage, key)))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        except OSError:  # a store we cannot write: assume a build is running rather than call anything stale
            return True
        lock.release()
        return False

    def exists(self, stage: str, key: str) -> bool:
        """A finished artifact (a readable manifest) is under the key; its files are not hashed."""
        return self.manifest(stage, key) is not None

    def manifest(self, stage: str, key: str) -> dict | None:
        """The manifest of a finished artifact, unverified, or None (no directory, or no readable manifest)."""
        return check_artifact(self.path(stage, key), hash_files=False).manifest

    def load(self, stage: str, key: str, verify: bool = True) -> Artifact | None:
        """The finished artifact, or None if there is none (no directory, or one without a readable manifest,
        which `get_or_build` quarantines); raises CorruptArtifact if its files differ from its manifest."""
        path = self.path(stage, key)
        if not os.path.lexists(path):
            return None
        check = check_artifact(path, hash_files=verify)
        if check.incomplete:
            return None
        if check.problems:
            raise CorruptArtifact(corrupt_message(self.root, stage, path, check.problems))
        return Artifact(stage=stage, key=key, path=path, manifest=check.manifest)

    def quarantine(self, stage: str, key: str) -> Path:
        """Move `<stage>/<key>` to `<root>/.quarantine/<stage>/<key>-<UTC timestamp>/` (a fresh name) and
        return where it went. The caller holds the key's lock."""
        parent = self.root / ".quarantine" / stage
        parent.mkdir(parents=True, exist_ok=True)
        dest, n = parent / f"{key}-{_utc_stamp()}", 1
        while os.path.lexists(dest):
            dest, n = parent / f"{key}-{_utc_stamp()}-{n}", n + 1
        os.rename(self.path(stage, key), dest)
        return dest

    def get_or_build(
        self,
        stage: str,
        key: str,
        build: Callable[[Path], dict],
        *,
        config: dict,
        upstream: dict[str, str],
        schema_version: int,
        estimate: Callable[[], int | None] | None = None,
    ) -> tuple[Artifact, bool]:
        """Return (artifact, cached). `build(tmp_dir) -> report` runs at most once per key, store-wide.
        A directory under the key without a readable manifest is quarantined first; one whose files differ
        from its manifest stops the run (CorruptArtifact). `estimate() -> bytes` (the most the build writes,
        scratch included; None: unknown) is checked against the free space before the build starts
        (NoSpace naming the stage, the path, the need and the free space), less what the key's scratch dir
        already holds; an OSError during the build is raised again naming the stage and the path. Every
        file and directory of the artifact takes the process's umask (safetensors writes 0600)."""
        global _current
        found = self.load(stage, key)
        if found is not None:
            log.info("cached %s %s", stage, key)
            return found, True
        (self.root / stage).mkdir(parents=True, exist_ok=True)
        lock = self._lock(stage, key)
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
            final = self.path(stage, key)
            if os.path.lexists(final):  # there, but load found no manifest: not an artifact
                problems = check_artifact(final, hash_files=False).problems
                log.warning("%s; building %s %s again", quarantine_line(final, self.quarantine(stage, key), problems),
                            stage, key)
            for stale in (self.root / stage).glob(f".tmp-{key}-*"):  # left by a killed build; we hold the lock
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.root / stage / f".tmp-{key}-{os.getpid()}"
            if estimate is not None:
                self._check_space(stage, key, tmp, estimate)
            tmp.mkdir()
            try:
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
                apply_umask(tmp)
                manifest["stat"] = file_stats(tmp)  # for `quick_problems`; a rename keeps sizes and times
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
                apply_umask(tmp)
                os.rename(tmp, final)
            except BaseException as e:  # the build's own temp dir goes with it; scratch stays for the rerun
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(e, OSError) and not isinstance(e, NoSpace):
                    raise self._named(e, stage, tmp) from e
                raise
            shutil.rmtree(self.root / ".scratch" / stage / key, ignore_errors=True)
            return Artifact(stage=stage, key=key, path=final, manifest=manifest), False
        finally:
            lock.release()

    def _check_space(self, stage: str, key: str, tmp: Path, estimate: Callable[[], int | None]) -> None:
        try:
            need = estimate()
        except Exception as e:  # a size it cannot tell is no reason to stop the build
            log.warning("%s: could not estimate its size (%s: %s); building without a space check", stage,
                        type(e).__name__, e)
            return
        if need is None:
            return
        scratch = self.root / ".scratch" / stage / key
        need = max(0, int(need) - (_tree_size(scratch) if scratch.is_dir() else 0))
        free = free_bytes(self.root)
        if need > free:
            raise NoSpace(errno.ENOSPC, f"{stage}: building {key} needs about {_human_size(need)} under {tmp.parent} "
                          f"(artifact and scratch, estimated), but only {_human_size(free)} is free there; free "
                          f"space (`python -m pipeline.store list` shows what the store holds) or point "
                          f"paths.outputs at a larger disk")

    def _named(self, e: OSError, stage: str, tmp: Path) -> OSError:
        """`e` again, its message naming the stage, the file (or the build's directory) and the free space."""
        where = e.filename or tmp
        text = f"{e.strerror}: {where}" if e.strerror else f"{e} ({where})"
        msg = f"{stage}: {text} (building into {tmp}; {_human_size(free_bytes(self.root))} free there)"
        try:
            return type(e)(e.errno, msg) if e.errno else type(e)(msg)
        except TypeError:  # a subclass with a constructor of its own
            return OSError(e.errno, msg) if e.errno else OSError(msg)

    @contextlib.contextmanager
    def helping(self, stage: str, key: str) -> Iterator[None]:
        """Run another rank's share of a build that rank 0 holds the lock for: `scratch_dir()` is (stage, key)'s
        scratch directory, as it is inside rank 0's `get_or_build`, and nothing is renamed here."""
        global _current
        previous, _current = _current, (self, stage, key)
        try:
            yield
        finally:
            _current = previous

    def wait_for(self, stage: str, key: str, poll_s: float = 1.0, verify: bool = False) -> Artifact:
        """The artifact under (stage, key), once some process has stored it: a rank other than 0 reading what
        rank 0 builds. While a build holds the key's lock this waits at the lock; before one has started it
        polls. There is no timeout: the process that builds it either stores it or fails, and under torchrun
        a failed rank ends the whole job. `verify=False` by default: the builder hashed every file a moment
        ago, and re-hashing gigabytes of taps once per rank would cost minutes."""
        waited, last_note = 0.0, 0.0
        while True:
            found = self.load(stage, key, verify=verify)
            if found is not None:
                return found
            if waited - last_note >= 300 or waited == 0:
                log.info("waiting for %s %s (another process builds it)", stage, key)
                last_note = waited
            self.lock_path(stage, key).parent.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            with self._lock(stage, key):  # returns at once when nobody builds it yet
                pass
            if self.load(stage, key, verify=verify) is None:
                time.sleep(poll_s)
            waited += time.monotonic() - t0

    def _stage_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def artifacts(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, path) of every entry under a key, finished or not (see `check_artifact`), sorted."""
        for stage_dir in self._stage_dirs():
            for path in sorted(stage_dir.iterdir()):
                if not path.name.startswith("."):
                    yield stage_dir.name, path.name, path

    def temp_dirs(self) -> Iterator[TempDir]:
        """Every build's temporary directory, sorted, each with why it is stale (None while a build runs)."""
        for stage_dir in self._stage_dirs():
            for path in sorted(stage_dir.glob(".tmp-*")):
                key, _, pid_text = path.name[len(".tmp-"):].rpartition("-")
                pid = int(pid_text) if pid_text.isdigit() else None
                key = key if pid is not None else path.name[len(".tmp-"):]
                if not pid_alive(pid):
                    why = f"process {pid} is not running" if pid is not None else "no pid in its name"
                elif not self._lock_held(stage_dir.name, key):
                    why = f"nobody holds {self.lock_path(stage_dir.name, key)}"
                else:
                    why = None
                yield TempDir(stage_dir.name, key, pid, path, why)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give every file under `root` mode 0666 and every directory 0777, less the process's umask: what a plain
    open() makes, whatever a library chose (safetensors' save_file writes 0600, so other users of a shared
    store could not read the weights)."""
    mask = _umask()
    for path in [Path(root), *Path(root).rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def file_stats(root: Path) -> dict[str, list[int]]:
    """{relative posix path: [size, mtime_ns]} of every file under root except the manifest."""
    return {p.relative_to(root).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() != MANIFEST}


def quick_problems(path: Path, manifest: dict) -> list[str]:
    """What a stat of every file tells against the manifest, reading no file whose size and modification time
    are the recorded ones: files missing or added, a size that differs, and the sha256 of a file whose time
    differs (a copy or a touch keeps the bytes). A manifest without `stat` (written before it was recorded)
    gives the listing only."""
    expected, recorded = manifest.get("files", {}), manifest.get("stat", {})
    actual = file_stats(path)
    problems = [f"{name} missing" for name in sorted(set(expected) - set(actual))]
    problems += [f"{name} not in manifest" for name in sorted(set(actual) - set(expected))]
    for name in sorted(set(expected) & set(actual) & set(recorded)):
        (size, mtime), (was_size, was_mtime) = actual[name], recorded[name]
        if size != was_size:
            problems.append(f"{name} is {size} bytes, the manifest records {was_size}")
        elif mtime != was_mtime and sha256_file(path / name) != expected[name]:
            problems.append(f"{name} sha256 differs")
    return problems


def verify_files(path: Path, manifest: dict) -> list[str]:
    """Human-readable differences between the files under `path` and the manifest; [] when they agree."""
    expected = manifest.get("files", {})
    actual = hash_tree(path)
    problems = [f"{name} missing" for name in sorted(set(expected) - set(actual))]
    problems += [f"{name} not in manifest" for name in sorted(set(actual) - set(expected))]
    problems += [f"{name} sha256 differs" for name in sorted(set(expected) & set(actual)) if expected[name] != actual[name]]
    return problems


def repair_hint(root: Path, it: str = "it") -> str:
    return (f"`python -m pipeline.store repair --root {root}` moves {it} to {root / '.quarantine'}/ (or delete "
            f"{it}); the next run rebuilds {it}")


def corrupt_message(root: Path, stage: str, path: Path, problems, *, read: bool = True) -> str:
    """Why `path` is refused (`read`: the run needs it, so it stops) or only reported (the run does not read it)."""
    now = "The run stops so that you can inspect it" if read else "This run does not read it and goes on; inspect it"
    return (f"{stage} artifact {path} does not match its manifest: {'; '.join(problems)}. {now}; then "
            f"{repair_hint(root)}.")


def quarantine_line(path: Path, dest: Path, problems) -> str:
    return f"quarantined {path} -> {dest} ({'; '.join(problems)})"


def default_root() -> Path:
    """The pipeline's `paths.store`: `$PIPELINE_OUTPUTS/store`, `outputs/store` when it is unset."""
    return Path(os.environ.get("PIPELINE_OUTPUTS") or "outputs") / "store"


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.is_dir() \
        else path.lstat().st_size


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _stale_line(t: TempDir) -> str:
    return f"stale temporary dir {t.path} ({t.stale}, {_human_size(_tree_size(t.path))})"


def _list(store: Store) -> int:
    for stage, key, path in store.artifacts():
        check = check_artifact(path, hash_files=False)
        if check.incomplete:
            print(f"{stage:8} {key}  not an artifact: {'; '.join(check.problems)}  {path}")
        else:
            created = str(check.manifest.get("created_at", "?"))
            print(f"{stage:8} {key}  {created:25}  {_human_size(_tree_size(path)):>9}  {path}")
    for t in store.temp_dirs():
        if t.stale:
            print(_stale_line(t))
    return 0


def _verify(store: Store) -> int:
    bad = 0
    for stage, key, path in store.artifacts():
        problems = check_artifact(path).problems
        bad += bool(problems)
        print(f"{'BAD' if problems else 'ok ':3} {stage:8} {key}" + (f"  {'; '.join(problems)}" if problems else ""))
    stale = [t for t in store.temp_dirs() if t.stale]
    for t in stale:
        print(_stale_line(t))
    if bad:
        print(f"{bad} bad artifact(s) under {store.root}: a run sets aside one without a readable manifest by "
              f"itself and refuses the others; inspect them, then {repair_hint(store.root, 'them')}")
    else:
        print(f"all artifacts under {store.root} verified")
    if stale:
        print(f"{len(stale)} stale temporary dir(s): `python -m pipeline.store repair --root {store.root}` "
              f"removes them")
    return 1 if bad else 0


def _repair(store: Store) -> int:
    done = left = 0
    for stage, key, path in store.artifacts():
        if not check_artifact(path).problems:
            continue
        lock = store._lock(stage, key)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"left {path}: {stage} {key} is being built right now")
            left += 1
            continue
        try:
            problems = check_artifact(path).problems  # again, now that no build can finish it under us
            if problems:
                print(quarantine_line(path, store.quarantine(stage, key), problems))
                done += 1
        finally:
            lock.release()
    for t in store.temp_dirs():
        if not t.stale:
            continue
        lock = store._lock(t.stage, t.key)
        try:
            lock.acquire(timeout=0)
        except Timeout:  # a build of that key has started: it removes the dir itself
            print(f"left {t.path}: {t.stage} {t.key} is being built right now")
            left += 1
            continue
        try:  # holding the lock: no build of this key is writing it
            if t.path.exists():
                size = _human_size(_tree_size(t.path))
                shutil.rmtree(t.path)
                print(f"removed {t.path} ({t.stale}, {size})")
                done += 1
        finally:
            lock.release()
    if done or left:
        print(f"repaired {done} thing(s) under {store.root}" + (f"; {left} left: run repair again later" if left else ""))
    else:
        print(f"nothing to repair under {store.root}")
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.store", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("list", "verify", "repair"),
                        help="list: every artifact and stale temporary dir; verify: re-hash every file against "
                             "its manifest (exit 1 when any artifact is bad); repair: quarantine bad artifacts "
                             "and remove stale temporary dirs")
    parser.add_argument("--root", type=Path, default=None,
                        help="the store (default: $PIPELINE_OUTPUTS/store, else outputs/store)")
    args = parser.parse_args(argv)
    store = Store(args.root if args.root is not None else default_root())
    if not store.root.is_dir():
        what = "is not a directory" if os.path.lexists(store.root) else "does not exist"
        print(f"error: the store root {store.root} {what} (set PIPELINE_OUTPUTS to the pipeline's outputs "
              f"directory, or pass --root DIR)", file=sys.stderr)
        return 2
    return {"list": _list, "verify": _verify, "repair": _repair}[args.command](store)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
