"""Data-parallel taps and draft training under torchrun (pipeline/distributed.py), on 2 gloo ranks on the CPU.

Real processes: `python -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeline +experiment=smoke
+stage=draft ...`, against one process running the same config, from a fresh seed each session (the seed is in
every assertion message). What must hold:
- the taps 2 ranks write are the 1-rank taps byte for byte (same key, same sha256 of every file);
- the draft 2 ranks train reaches the 1-rank training loss after the same steps of the same global batch, within
  LOSS_RTOL (below), and the same weights within WEIGHT_ATOL;
- rank 0 alone tracks: one job run in MLflow with one child per built stage, one result.json;
- a rank killed mid-taps (and one killed mid-training) fails the job, torchrun naming the rank; the rerun
  resumes (finished shards are not redone, training restarts from rank 0's checkpoint) and reaches the
  1-rank artifacts.

Tolerance. DDP's gradient is the sum of two half-batch gradient sums where one rank sums the whole batch at
once; in float32 (the draft trains without autocast here) the two differ by reassociation only, about 1e-7
relative per gradient entry, and Adam turns that into updates that differ at the same order. Measured over
12 steps: 4e-8 relative in the loss, 2e-7 absolute in the weights. LOSS_RTOL = 1e-5 and WEIGHT_ATOL = 1e-5
leave a factor of 50-100 above that. Against them: the run moves the loss by several percent (checked on the
2-rank run's own curve), and one Adam step moves a weight by up to lr = 4e-3, 400 times WEIGHT_ATOL, so a
batch drawn differently, a learning rate one step off, or a rank's share counted twice would fail them.
The soft-CE loss of this barely trained target is mostly its entropy (about ln 512 per TTT step), so late
steps change the loss little: the weights are the sharper check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline_fakes import seed_mlflow_db

pytestmark = pytest.mark.slow  # torchrun ranks

ROOT = Path(__file__).resolve().parents[1]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
STEPS = 12  # 8 steps an epoch (64 train sequences, global batch 8): the run crosses an epoch
OVERRIDES = ["+experiment=smoke", "+stage=draft", "threads=1", "draft.train.autocast=null",
             "draft.train.checkpoint_every_s=0", f"draft.train.steps={STEPS}", "taps.shard_sequences=16"]
SHARDS = 5  # 4 train shards of 16 sequences, 1 held-out shard


def pipeline(outputs: Path, seed: int, *, ranks: int = 1, extra=(), env=None, tracking=False):
    """`python -m pipeline` (ranks=1) or torchrun with `ranks` processes; outputs under `outputs`."""
    env = {**{k: v for k, v in os.environ.items() if k != "PIPELINE_FAULT"}, "PIPELINE_OUTPUTS": str(outputs),
           "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", **(env or {})}
    launch = [sys.executable, "-m", "pipeline"] if ranks == 1 else \
        [sys.executable, "-m", "pipeline.torchrun", f"--nproc-per-node={ranks}", "-m", "pipeline"]
    args = [*OVERRIDES, f"seed={seed}", *([] if tracking else ["tracking=none"]), *extra]
    proc = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, proc.stdout + proc.stderr


def artifact(outputs: Path, stage: str) -> tuple[Path, dict]:
    (path,) = (outputs / "store" / stage).glob("[0-9a-f]*")
    return path, json.loads((path / "manifest.json").read_text())


def with_target_of(src: Path, dst: Path) -> Path:
    """A fresh outputs dir holding only `src`'s target artifact: the runs below build taps and draft."""
    (dst / "store").mkdir(parents=True)
    shutil.copytree(src / "store" / "target", dst / "store" / "target")
    return dst


@pytest.fixture(scope="module")
def seed():
    return int.from_bytes(os.urandom(3), "little")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, seed):
    out = tmp_path_factory.mktemp("one_rank")
    proc, log = pipeline(out, seed)
    assert proc.returncode == 0, f"seed {seed}\n{log[-5000:]}"
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, one_rank, seed):
    out = with_target_of(one_rank, tmp_path_factory.mktemp("two_ranks"))
    seed_mlflow_db(out)
    proc, log = pipeline(out, seed, ranks=2, tracking=True)
    assert proc.returncode == 0, f"seed {seed}\n{log[-5000:]}"
    return out, log


# --- without torchrun, and the choices a GPU run will take ----------------------------------------------
def test_without_torchrun_every_helper_answers_as_the_only_rank(monkeypatch):
    from pipeline import distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (distributed.rank(), distributed.world_size(), distributed.local_rank(), distributed.is_main()) == \
        (0, 1, 0, True)
    assert distributed.init("cpu") is False and not distributed.initialized()
    distributed.barrier("nothing")  # returns at once
    assert distributed.broadcast({"a": 1}, "x") == {"a": 1} and distributed.all_sum([1.0, 2.0], "x") == [1.0, 2.0]
    assert distributed.device("cuda") == torch.device("cuda") and distributed.describe() == \
        {"world_size": 1, "backend": "none"}


def test_under_torchrun_cuda_takes_nccl_and_the_local_rank_s_gpu(monkeypatch):
    from pipeline import distributed

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.backend_for("cuda") == "nccl" and distributed.backend_for("cpu") == "gloo"
    assert distributed.device("cuda") == torch.device("cuda", 1)
    assert distributed.device("cpu") == torch.device("cpu")
    assert distributed.rank() == 3 and not distributed.is_main()


def test_other_ranks_never_open_mlflow(monkeypatch, tmp_path):
    from pipeline import tracking

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    t = tracking.open_tracker({"enabled": True, "experiment": "x"}, tmp_path)
    assert not t.enabled and "rank 1" in t.reason and not (tmp_path / "mlflow.db").exists()


def test_a_global_batch_smaller_than_the_ranks_is_refused(monkeypatch):
    from hydra import compose, initialize_config_dir

    from pipeline.app import CONF_DIR
    from pipeline.validate import ConfigError, check_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["draft.train.batch_size=2"])
    check_config(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="draft.train.batch_size=2: at least the 4 ranks"):
        check_config(cfg)


def test_ranks_losses_normalised_by_the_global_batch_give_its_loss_and_gradient(seed):
    """ttt_loss on two halves of a batch, each normalised by the whole batch's slot counts and scaled by
    the 2 ranks, averages (as DDP averages gradients) to the whole batch's loss and gradient."""
    from models import tiny_draft, tiny_target
    from pipeline import train_draft as td

    target = tiny_target(seed=0, n_layers=3, max_seq_len=32)
    draft = tiny_draft(target, seed=1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.cfg.vocab_size, (6, 12), generator=g)
    with torch.no_grad():
        final, tapped = target.hidden(ids, None, target.cfg.taps)
    # uneven slot counts between the halves: few in the first, most in the second
    mask = torch.rand(6, 12, generator=g) < torch.tensor([0.3] * 3 + [0.95] * 3)[:, None]
    batch = {"ids": ids, "taps": torch.cat(tapped, -1), "final": final, "top1": target.head(final).argmax(-1),
             "mask": mask}
    params = [p for p in draft.parameters() if p.requires_grad]

    def loss_and_grads(part, **kw):
        draft.zero_grad()
        loss, _ = td.ttt_loss(draft, part, target.head, 3, 0.8, None, **kw)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    whole_loss, whole_grads = loss_and_grads(batch)
    halves = [{k: v[rows] for k, v in batch.items()} for rows in torch.arange(6).tensor_split(2)]
    counts = []  # what the all-reduce of the slot counts returns: the sum over both halves
    for h in halves:
        _, _, _, in_vocab = td.labels(target.head, h, draft.t2d, None)
        counts.append(torch.stack([in_vocab[:, i : i + 9].sum() for i in range(3)]).float())
    total = counts[0] + counts[1]
    assert counts[0].tolist() != counts[1].tolist(), "the halves count the same slots: the test shows nothing"
    parts = [loss_and_grads(h, sum_ranks=lambda t: total, world=2) for h in halves]
    torch.testing.assert_close((parts[0][0] + parts[1][0]) / 2, whole_loss, rtol=1e-6, atol=0)
    for a, b, w in zip(parts[0][1], parts[1][1], whole_grads):
        torch.testing.assert_close((a + b) / 2, w, rtol=1e-4, atol=1e-7)
    # a rank normalising by its own slots instead (the plain mean of the ranks' means) would not be the same
    own = [loss_and_grads(h)[1] for h in halves]
    assert not all(torch.allclose((a + b) / 2, w, rtol=1e-4, atol=1e-7)
                   for a, b, w in zip(own[0], own[1], whole_grads)), seed


# --- 2 gloo ranks against 1 process -----------------------------------------------------------------------
def test_two_ranks_write_the_taps_one_rank_writes_byte_for_byte(one_rank, two_ranks, seed):
    out2, log = two_ranks
    (p1, m1), (p2, m2) = artifact(one_rank, "taps"), artifact(out2, "taps")
    assert p1.name == p2.name, "the number of ranks entered the taps key"
    assert "rank 1 of 2: running its share of taps" in log, log[-3000:]
    assert m1["files"] == m2["files"], f"seed {seed}"  # sha256 of every shard and of taps.json
    assert sum(n.endswith(".safetensors") for n in m2["files"]) == SHARDS
    for name in m2["files"]:
        if name.endswith(".safetensors"):
            a, b = load_file(str(p1 / name)), load_file(str(p2 / name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (m1["report"]["world_size"], m1["report"]["backend"]) == (1, "none")
    assert (m2["report"]["world_size"], m2["report"]["backend"]) == (2, "gloo")
    assert m2["report"]["train_tokens"] == m1["report"]["train_tokens"]


def test_two_ranks_train_the_draft_to_the_loss_of_one(one_rank, two_ranks, seed):
    out2, log = two_ranks
    (p1, m1), (p2, m2) = artifact(one_rank, "draft"), artifact(out2, "draft")
    assert p1.name == p2.name, "the number of ranks entered the draft key"
    assert "rank 1 of 2: running its share of draft" in log
    r1, r2 = m1["report"], m2["report"]
    assert (r2["world_size"], r2["backend"], r2["steps"]) == (2, "gloo", STEPS)
    assert r2["train_loss"] == pytest.approx(r1["train_loss"], rel=LOSS_RTOL), f"seed {seed}"
    w1, w2 = load_file(str(p1 / "model.safetensors")), load_file(str(p2 / "model.safetensors"))
    worst = max(float((w1[k].float() - w2[k].float()).abs().max()) for k in w1)
    assert worst <= WEIGHT_ATOL, f"seed {seed}: weights differ by {worst}"

    # the tolerance is tight against what training does: the run moves the loss by far more than it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out2 / 'mlflow.db'}")
    (draft_run,) = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id],
                                      filter_string="tags.stage = 'draft'")
    curve = [m.value for m in sorted(client.get_metric_history(draft_run.info.run_id, "loss"), key=lambda m: m.step)]
    assert len(curve) == STEPS and curve[-1] == pytest.approx(r2["train_loss"], rel=1e-6)
    assert abs(curve[-1] - curve[0]) > 1000 * LOSS_RTOL * abs(curve[-1]), curve


def test_only_rank_0_tracks_and_records_the_job(two_ranks):
    out2, _ = two_ranks
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out2 / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id])
    stage_runs = sorted(r.data.tags.get("stage", "") for r in runs if r.data.tags.get("stage"))
    jobs = [r for r in runs if not r.data.tags.get("stage")]
    assert stage_runs == ["draft", "taps"] and len(jobs) == 1, [r.info.run_name for r in runs]
    assert {r.data.tags["mlflow.parentRunId"] for r in runs if r.data.tags.get("stage")} == {jobs[0].info.run_id}
    assert jobs[0].data.metrics["draft.world_size"] == 2.0
    job_dirs = sorted((out2 / "runs").glob("*/*"))  # each rank is a Hydra job; rank 1's dir says so
    assert sorted(d.name.endswith("-rank1") for d in job_dirs) == [False, True], job_dirs
    (recorded,) = [d for d in job_dirs if (d / "result.json").exists()]
    assert not recorded.name.endswith("-rank1")
    result = json.loads((recorded / "result.json").read_text())
    assert result["status"] == "ok" and set(result["stages"]) == {"target", "taps", "draft"}


def test_a_killed_rank_fails_the_job_naming_it_and_the_rerun_resumes(tmp_path, one_rank, seed):
    out = with_target_of(one_rank, tmp_path / "out")
    # rank 1 is SIGKILLed after writing its first taps shard (train-00001; rank 1 owns shards 1 and 3)
    proc, log = pipeline(out, seed, ranks=2, env={"PIPELINE_FAULT": "taps:1:1"})
    assert proc.returncode != 0, log[-3000:]
    assert "rank 1: PIPELINE_FAULT=taps:1:1" in log
    root_cause = log[log.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "SIGKILL" in root_cause, log[-3000:]
    assert not list((out / "store" / "taps").glob("*")), "a failed build left something under the key"
    (scratch,) = (out / "store" / ".scratch" / "taps").glob("*")
    done = sorted(p.name for p in scratch.glob("*.safetensors"))
    assert "train-00001.safetensors" in done and "train-00003.safetensors" not in done, done

    # the rerun takes the finished shards as they are; now rank 1 dies after 5 draft steps
    proc, log = pipeline(out, seed, ranks=2, env={"PIPELINE_FAULT": "draft:1:5"})
    # rank 0 may fail first, on the connection its killed peer reset; torchrun then names rank 0 as the root cause
    # and lists rank 1's SIGKILL among the other failures
    assert proc.returncode != 0 and "rank 1: PIPELINE_FAULT=draft:1:5" in log, log[-3000:]
    assert "SIGKILL" in log[log.index("Failures"):] if "Failures" in log else "SIGKILL" in log, log[-3000:]
    path, manifest = artifact(out, "taps")
    assert manifest["report"]["shards_resumed"] == len(done)
    assert manifest["files"] == artifact(one_rank, "taps")[1]["files"], f"seed {seed}"
    assert list((out / "store" / ".scratch" / "draft").glob("*/train_state.pt"))

    proc, log = pipeline(out, seed, ranks=2)
    assert proc.returncode == 0, log[-5000:]
    report = artifact(out, "draft")[1]["report"]
    assert report["resumed_at"] in (4, 5), report  # rank 0 checkpoints every step; it may be one step ahead
    assert report["train_loss"] == pytest.approx(artifact(one_rank, "draft")[1]["report"]["train_loss"],
                                                 rel=LOSS_RTOL), f"seed {seed}"
    assert not list((out / "store" / ".scratch" / "draft").glob("*/train_state.pt"))


LISTENERS = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:  # the sockets this job listens on: the agent's (torchrun) and every rank's
    agent = os.getppid()
    pids = {agent, *(int(c) for t in os.listdir(f"/proc/{agent}/task")
                     for c in open(f"/proc/{agent}/task/{t}/children").read().split())}
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile (the listing's own)
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:
                print("LISTEN", f[1].split(":")[0], flush=True)
dist.barrier()
dist.destroy_process_group()
"""
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def listeners(tmp_path, launcher):
    script = tmp_path / "listeners.py"
    script.write_text(LISTENERS)
    r = subprocess.run([sys.executable, "-m", *launcher, "--nproc-per-node=2", str(script)], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return {line.split()[1] for line in r.stdout.splitlines() if line.startswith("LISTEN")}


def test_the_launcher_keeps_every_socket_of_the_job_on_loopback(tmp_path):
    """torchrun's own stores listen on every interface even with a loopback rendezvous (so the README does not
    run torchrun on one machine); pipeline.torchrun binds them, and the ranks' gloo sockets, to 127.0.0.1."""
    plain = listeners(tmp_path, ["torch.distributed.run", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"])
    assert plain - LOOPBACK, "torchrun 2.13 binds its store to every interface (else the launcher is not needed)"
    ours = listeners(tmp_path, ["pipeline.torchrun"])
    assert ours and ours <= LOOPBACK, ours
