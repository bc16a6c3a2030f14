"""Data-parallel ranks under torchrun: the process group, who this rank is, barriers, and the test fault hook.

`torchrun --nproc-per-node N -m pipeline ...` starts N copies of the job; torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `init(device)` joins them into one process group:
gloo for `device=cpu`, NCCL for `device=cuda` (each rank on cuda:LOCAL_RANK). Without torchrun (no
WORLD_SIZE, or WORLD_SIZE=1) nothing is initialised and every helper answers as the only rank: rank 0 of 1,
barriers return at once, so the single-process pipeline runs exactly as it does without this module.

Control messages (what rank 0 decided, barriers) go through a separate gloo group even under NCCL, so that a
barrier can be a `monitored_barrier`, which names the rank that failed to arrive. Waits for rank 0's
long rank-0-only work (building the target, say) are not collectives: the other ranks wait at the store's
lock (pipeline.store.Store.wait_for), so the process group's timeout (`PIPELINE_DIST_TIMEOUT_S`, 1800 s)
bounds only waits between ranks that are doing the same work.

A rank that dies (a crash, a SIGKILL, a lost node) ends the job: the ranks still in a collective with it get
an error naming the step they were at, and torchrun tears the others down and prints which rank failed
first, with its exit code (and, where the rank raised, its exception: `record_error`).

`fault_point(stage, n)` is a test-only hook: with `PIPELINE_FAULT=<stage>:<rank>:<n>` in the environment,
rank <rank> SIGKILLs itself when the stage reaches its n-th unit of work (the taps stage after writing its
n-th shard, the draft stage after its n-th step). Unset, it does nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
from typing import Any

log = logging.getLogger(__name__)

TIMEOUT_S = 1800.0  # PIPELINE_DIST_TIMEOUT_S: how long a collective waits for the other ranks
FAULT_ENV = "PIPELINE_FAULT"

_control = None  # the gloo group of control messages and barriers (None: the default group is gloo)
_backend: str | None = None


class RankFailure(RuntimeError):
    """A collective with the other ranks failed: one of them died, hung or disagreed."""


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def launched() -> bool:
    """Whether torchrun started this process as one of several ranks (WORLD_SIZE > 1)."""
    return _env_int("WORLD_SIZE", 1) > 1


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank: RANK under torchrun, 0 without it."""
    return _env_int("RANK", 0) if launched() else 0


def world_size() -> int:
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    return _env_int("LOCAL_RANK", 0) if launched() else 0


def local_world_size() -> int:
    """Ranks on this machine (they share its cores)."""
    return _env_int("LOCAL_WORLD_SIZE", 1) if launched() else 1


def is_main() -> bool:
    return rank() == 0


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def backend() -> str | None:
    """The process group's backend, None without one."""
    return _backend


def device(device: str):
    """The torch device of this rank: cuda:LOCAL_RANK for `device=cuda` under torchrun, else `device`."""
    import torch

    if str(device) == "cuda" and launched():
        return torch.device("cuda", local_rank())
    return torch.device(device)


def timeout_s() -> float:
    return float(os.environ.get("PIPELINE_DIST_TIMEOUT_S") or TIMEOUT_S)


def init(device_name: str) -> bool:
    """Join torchrun's ranks into one process group (gloo on CPU, NCCL on CUDA); True when one was made.
    Without torchrun, or when already initialised, it does nothing."""
    global _control, _backend
    if not launched() or initialized():
        return False
    import torch
    import torch.distributed as dist

    b = backend_for(device_name)
    timeout = dt.timedelta(seconds=timeout_s())
    if b == "nccl":
        torch.cuda.set_device(local_rank())
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank()))
        _control = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        _control = None
    _backend = b
    log.info("rank %d of %d (local rank %d), backend %s", rank(), world_size(), local_rank(), b)
    return True


def teardown() -> None:
    """Leave the process group (a no-op without one)."""
    global _control, _backend
    if initialized():
        import torch.distributed as dist

        dist.destroy_process_group()
    _control, _backend = None, None


def describe() -> dict:
    """What a manifest records about how the artifact was built: world size and backend."""
    return {"world_size": world_size(), "backend": backend() or "none"}


def barrier(what: str) -> None:
    """Wait until every rank reaches this point. A rank that died or does not arrive within the timeout
    fails every other rank with a RankFailure naming `what` (and, under gloo, the rank that is missing)."""
    if not initialized():
        return
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=_control, timeout=dt.timedelta(seconds=timeout_s()))
    except RuntimeError as e:
        raise RankFailure(f"rank {rank()} of {world_size()}: not every rank reached '{what}' (a rank died or "
                          f"hung; torchrun names the one that failed first): {e}") from e


def broadcast(obj: Any, what: str) -> Any:
    """Rank 0's `obj`, on every rank (a picklable object)."""
    if not initialized():
        return obj
    import torch.distributed as dist

    box = [obj if is_main() else None]
    try:
        dist.broadcast_object_list(box, src=0, group=_control)
    except RuntimeError as e:
        raise RankFailure(f"rank {rank()} of {world_size()}: receiving '{what}' from rank 0 failed (rank 0 died "
                          f"or hung): {e}") from e
    return box[0]


def all_sum(values: list[float], what: str) -> list[float]:
    """Element-wise sum of `values` over the ranks (in float64)."""
    if not initialized():
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    try:
        dist.all_reduce(t, group=_control)
    except RuntimeError as e:
        raise RankFailure(f"rank {rank()} of {world_size()}: summing '{what}' over the ranks failed: {e}") from e
    return t.tolist()


def record_error(e: BaseException) -> None:
    """Hand an exception to torchrun's error file, so that its failure summary shows this rank's message
    (Hydra turns an exception into an exit status before torchrun's own `@record` could see it)."""
    if not launched() or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
    except Exception:  # the summary loses the message, nothing else
        log.debug("could not write torchrun's error file", exc_info=True)


def fault_point(stage: str, n: int) -> None:
    """Test-only fault injection: with PIPELINE_FAULT=<stage>:<rank>:<n>, that rank kills itself (SIGKILL,
    as the kernel's OOM killer or a lost node would end it) when `stage` reaches unit of work `n`."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    f_stage, f_rank, f_n = spec.split(":")
    if f_stage == stage and int(f_rank) == rank() and int(f_n) == n:
        log.error("rank %d: %s=%s: killing this process in %s at %d", rank(), FAULT_ENV, spec, stage, n)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
