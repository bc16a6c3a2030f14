"""Training an EAGLE-3 draft head with training-time test (TTT), as plain functions (no Hydra here).

A batch is what the taps stage stores for sequences of T tokens:
    ids    [B,T] int64    the tokens
    taps   [B,T,3Ht]      cat(h_a, h_b, h_c) of the target at each position (fc-ready)
    final  [B,T,Ht]       the target's last residual (before its final norm); Transformer.head() turns it
                          into the target's logits, so the soft labels are exact and need no V-wide storage
    top1   [B,T] int64    the target's argmax at each position (predicts token t+1)
    mask   [B,T] bool     positions whose prediction counts (the generated part of a sequence, say)

Training-time test (docs/design.md §3) over S = T - N slots, step i = 0..N-1, slot t:
    input token   ids[t+1+i]          (at inference: the confirmed token for i = 0, then the draft's own
                                       proposals, which equal the target's greedy tokens when accepted)
    feature       fc(taps[t]) for i = 0, else g of step i-1 at slot t
    position      t + i               (Eagle3Draft.forward_ttt's default)
    attention     step-0 keys at slots <= t plus the keys of steps 1..i at slot t: exactly the draft's
                  KV cache at inference after a seed and i single steps (forward_ttt implements it)
    label         the target at position t+1+i (predicting token t+2+i): soft cross-entropy against its
                  distribution restricted to the draft vocab and renormalised; a slot counts where
                  mask[t+1+i] and the target's argmax lies in the draft vocab
    loss          sum_i decay^i * loss_i;   acc_i = P(to_target(argmax draft) == top1[t+1+i]) over mask
Truncating to T - N slots (rather than padding) gives every step the same slots, so acc_i of different
steps are measured on the same positions and the leading-run ("chain") acceptance is well defined.

Everything a run depends on is in `TrainConfig` and the step number: the batch of step s comes from a
permutation seeded by (seed, epoch of s), the learning rate is a pure function of s, so a run resumed from
`save_checkpoint` (weights, optimizer state, step) continues bit for bit like an uninterrupted one.

Data-parallel (torchrun, `fit`): the batch size is the global batch; N ranks split each step's rows and
DistributedDataParallel sums their gradients, with each rank's loss normalised by the global batch's slot
count (`ttt_loss`), so a step's gradient is the global batch's, up to the order of float additions.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from models import Eagle3Draft
from pipeline import hardware
from pipeline.schedule import warmup_cosine
from models.draft import POSITION_BUCKETS, predicted_tau

Batch = Mapping[str, torch.Tensor]


# --- the draft vocabulary --------------------------------------------------------------------------------
@dataclass(frozen=True)
class VocabMap:
    used: torch.Tensor  # int64[Vd], ascending target ids forming the draft vocab
    d2t: torch.Tensor  # int64[Vd], used[i] - i
    t2d: torch.Tensor  # bool[V]
    coverage: float  # share of the counted target tokens that the draft vocab covers

    @property
    def size(self) -> int:
        return self.used.numel()


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """The draft vocab from target-token counts: the Vd most frequent ids, sorted ascending.

    d2t[i] = used[i] - i (so target_id = draft_id + d2t[draft_id]), t2d marks them. Ties in the counts go
    to the lower id (stable sort), so the map is a function of the counts. When V <= draft_vocab_size the
    draft vocab is the whole vocab and d2t is all zeros.
    """
    counts = torch.as_tensor(counts).to(torch.int64).flatten()
    V = counts.numel()
    if V <= draft_vocab_size:
        used = torch.arange(V)
    else:
        order = torch.sort(counts, descending=True, stable=True).indices
        used = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    total = int(counts.sum())
    coverage = float(counts[used].sum()) / total if total else 1.0
    return VocabMap(used=used, d2t=used - torch.arange(used.numel()), t2d=t2d, coverage=coverage)


def token_counts(top1: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each target id is the target's argmax at a counted position: what the draft must predict."""
    return torch.bincount(top1[mask.bool()].flatten(), minlength=vocab_size)[:vocab_size]


# --- labels from the target -------------------------------------------------------------------------------
@torch.no_grad()
def labels(head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], batch: Batch, t2d: torch.Tensor,
           used: torch.Tensor | None, first: int = 0):
    """(probs [B,L,Vd], top1 [B,L], valid [B,L], in_vocab [B,L]) for positions first+1..T-1 (L = T-1-first).

    probs: the target's softmax restricted to the draft vocab (`used`, None = all) and renormalised;
    `head(final, used)` computes only those logits (Transformer.head's `rows`).
    valid: mask (the slot counts for acceptance); in_vocab: valid and the target's argmax is a draft token.
    """
    logits = head(batch["final"][:, 1 + first :].float(), used).float()
    top1 = batch["top1"][:, 1 + first :]
    valid = batch["mask"][:, 1 + first :].bool()
    return torch.softmax(logits, dim=-1), top1, valid, valid & t2d[top1]


def first_slot(mask: torch.Tensor, n_steps: int) -> int:
    """The first slot with a label that counts in any row of the batch (mask [B,T]): slot t's labels are the
    positions t+1 .. t+n_steps, so the slots before it cost the draft nothing but their keys
    (Eagle3Draft.forward_ttt's `first`): a long masked-out prompt costs its keys, not its logits."""
    counted = mask[:, 1:].any(0).nonzero()
    return max(0, int(counted[0]) - (n_steps - 1)) if len(counted) else 0


# --- training-time test -----------------------------------------------------------------------------------
def ttt_logits(draft: Eagle3Draft, ids: torch.Tensor, taps: torch.Tensor, n_steps: int,
               first: int = 0) -> list[torch.Tensor]:
    """Draft logits [B,S-first,Vd] of each TTT step i = 0..n_steps-1 at slots first..S-1, S = T - n_steps."""
    T = ids.shape[1]
    S = T - n_steps
    if S < 1:
        raise ValueError(f"sequences of {T} tokens leave no slot for {n_steps} TTT steps (need T > N)")
    first = min(first, S - 1)
    feature = draft.fuse(taps[:, :S].to(draft.fc.weight.dtype).chunk(3, dim=-1))
    past, out = [], []
    for i in range(n_steps):
        lo = 0 if i == 0 else first  # step 0 reads every slot (its keys), later steps the query slots alone
        logits, feature, kv = draft.forward_ttt(ids[:, 1 + i + lo : 1 + i + S], feature, past, step=i, first=first)
        past.append(kv)
        out.append(logits)
    return out


def ttt_loss(draft: Eagle3Draft, batch: Batch, head: Callable, n_steps: int, decay: float = 0.8,
             used: torch.Tensor | None = None, sum_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
             world: int = 1):
    """(total loss, stats) for one batch: total = sum_i decay^i * loss_i (module docstring).

    stats: lists over steps i of `loss` (mean soft CE over in-vocab slots), `correct` and `count` (acceptance
    over masked slots, an out-of-vocab target argmax counting as a miss), `hits` [n_steps, B, Q] bool for the
    leading-run acceptance at slots first .. S-1 and `first` (first_slot: slots before it have no counted
    label). `used` = draft vocab ids (None when the draft vocab is the whole vocab).

    Data-parallel: `batch` is this rank's slice of the global batch, `sum_ranks` sums a tensor over the
    `world` ranks. loss_i is then world * (this slice's CE sum) / (the global batch's slot count), so that
    DistributedDataParallel's mean of the ranks' gradients is the gradient of the global batch's loss_i, and
    the mean of the ranks' `loss` is the global loss_i: the numbers one rank gets on the whole batch.
    """
    first = min(first_slot(batch["mask"], n_steps), batch["ids"].shape[1] - n_steps - 1)
    probs, top1, valid, in_vocab = labels(head, batch, draft.t2d, used, first)
    step_logits = ttt_logits(draft, batch["ids"], batch["taps"], n_steps, first)
    Q = step_logits[0].shape[1]
    slots = None
    if sum_ranks is not None:  # counted slots of each step over the global batch
        slots = sum_ranks(torch.stack([in_vocab[:, i : i + Q].sum() for i in range(n_steps)]).float())
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    stats = {"loss": [], "correct": [], "count": [], "hits": [], "first": first}
    for i, logits in enumerate(step_logits):
        sl = slice(i, i + Q)  # positions first+1+i .. first+Q+i
        p, t1, v, iv = probs[:, sl], top1[:, sl], valid[:, sl], in_vocab[:, sl]
        logits = logits.float()
        # soft CE per slot, weighted by in_vocab (cheaper than boolean indexing and its backward)
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
        w = iv.to(ce.dtype)
        if slots is None:
            loss_i = (ce * w).sum() / w.sum().clamp(min=1.0)
        else:
            loss_i = (ce * w).sum() / slots[i].clamp(min=1.0) * world
        total = total + decay**i * loss_i
        with torch.no_grad():
            hit = (draft.to_target(logits.max(-1).indices) == t1) & v  # max(): much faster than argmax on CPU bf16
        stats["loss"].append(float(loss_i.detach()))
        stats["correct"].append(int(hit.sum()))
        stats["count"].append(int(v.sum()))
        stats["hits"].append(hit)
    stats["hits"] = torch.stack(stats["hits"])  # [N, B, Q]: slots first .. S-1
    return total, stats


def position_acceptance(hits: torch.Tensor, valid_all: torch.Tensor) -> tuple[list[int], list[int]]:
    """(accepted at position i, slots reaching position i) for i < N, over slots whose N labels all count.

    On greedy (generated) data the TTT inputs are the target's own tokens, so a slot's leading run of hits
    is exactly the number of proposals a chain of N started there gets accepted: position i is reached when
    the run is at least i and accepted when it is more than i (the eval's acceptance_pos_<i> counts).
    """
    run = torch.cumprod(hits.to(torch.int64), dim=0).sum(0)[valid_all]  # [slots]
    N = hits.shape[0]
    return [int((run > i).sum()) for i in range(N)], [int((run >= i).sum()) for i in range(N)]


def bucket_name(k: int) -> str:
    """`0_64`, ..., `1024_up`: bucket k of POSITION_BUCKETS in a metric name (predicted_tau_pos_<name>)."""
    lo = POSITION_BUCKETS[k]
    return f"{lo}_{POSITION_BUCKETS[k + 1]}" if k + 1 < len(POSITION_BUCKETS) else f"{lo}_up"


def answer_position(mask: torch.Tensor, first: int, n_slots: int) -> torch.Tensor:
    """int64 [B, n_slots]: the answer position of the first proposal of a chain started at slots first ..

    A chain at slot t proposes token t+2 first; a row's answer starts one past its first counted position
    (the prompt's last, whose prediction is the first generated token), so the proposal is answer token
    t + 1 - first_counted: 0 is the prefill's own token, as in bench.context's `tau_by_position`. A row with
    no counted position has no chain that counts."""
    first_counted = mask.to(torch.int64).argmax(1)  # [B]
    t = torch.arange(first, first + n_slots, device=mask.device)
    return t[None, :] + 1 - first_counted[:, None]


def position_bucket_acceptance(hits: torch.Tensor, valid_all: torch.Tensor,
                               position: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """position_acceptance over the slots of each POSITION_BUCKETS bucket of `position` (answer_position)."""
    edges = list(POSITION_BUCKETS) + [None]
    return [position_acceptance(hits, valid_all & (position >= lo) & (position < hi if hi is not None else True))
            for lo, hi in zip(edges, edges[1:])]


# --- optimisation -----------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 10
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7
    decay: float = 0.8
    seed: int = 0
    autocast: str | None = None  # None | "bfloat16": matmuls in bf16, loss and optimizer in fp32
    long_every: int = 0  # every long_every-th step trains on long_batch_size rows of the long taps (0: never)
    long_batch_size: int = 1


def is_long_step(step: int, c: TrainConfig) -> bool:
    """Step `step` trains on the long taps (sequences at the lengths the draft serves): the last of every
    c.long_every steps, so the schedule, like the rest of a run, is a function of the step."""
    return c.long_every > 0 and step % c.long_every == c.long_every - 1


def lr_at(step: int, c: TrainConfig) -> float:
    return warmup_cosine(step, lr=c.lr, min_lr=c.min_lr, warmup=c.warmup, steps=c.steps)


def make_optimizer(draft: Eagle3Draft, c: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in draft.parameters() if p.requires_grad]  # embed_tokens is frozen
    return torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay, foreach=False)


def batch_rows(step: int, n_rows: int, c: TrainConfig, batch_size: int | None = None, stream: int = 0) -> torch.Tensor:
    """Row indices of step `step`: epoch = step // steps_per_epoch, a fresh permutation per (seed, stream,
    epoch); `stream` 1 is the long taps' (step = the long step's number), `batch_size` its rows."""
    batch_size = batch_size or c.batch_size
    per_epoch = max(1, n_rows // batch_size)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(c.seed * 1_000_003 + epoch + stream * 7_919_000_003)
    perm = torch.randperm(n_rows, generator=g)
    if n_rows < batch_size:
        return perm
    return perm[k * batch_size : (k + 1) * batch_size]


def take(data: Batch, rows: torch.Tensor, device) -> dict[str, torch.Tensor]:
    return {k: v[rows].to(device, non_blocking=True) for k, v in data.items()}


def autocast_ctx(device: torch.device, kind: str | None):
    if not kind:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, kind))


class TTTLoss(torch.nn.Module):
    """ttt_loss as a module's forward, so that DistributedDataParallel can wrap it (DDP synchronises the
    gradients of what its wrapped module's forward computed). Holds the draft; `head` is the frozen target's."""

    def __init__(self, draft: Eagle3Draft, head: Callable, c: TrainConfig, used: torch.Tensor | None,
                 sum_ranks: Callable[[torch.Tensor], torch.Tensor] | None, world: int):
        super().__init__()
        self.draft = draft
        self._head, self._c, self._used, self._sum, self._world = head, c, used, sum_ranks, world

    def forward(self, batch: Batch):
        return ttt_loss(self.draft, batch, self._head, self._c.ttt_steps, self._c.decay, self._used,
                        self._sum, self._world)


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks of the default process group (a new tensor)."""
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def train_step(draft: Eagle3Draft, opt: torch.optim.Optimizer, batch: Batch, head: Callable, c: TrainConfig,
               step: int, used: torch.Tensor | None = None, ddp: torch.nn.Module | None = None) -> dict:
    """One optimizer step at learning rate lr_at(step). Returns loss, loss_i, acc_i, lr, grad_norm.

    `ddp`: a DistributedDataParallel(TTTLoss(draft, ...)) and `batch` this rank's slice of the global batch;
    the gradients are then the global batch's, and the numbers returned are the global batch's (summed over
    the ranks), the same on every rank."""
    lr = lr_at(step, c)
    for group in opt.param_groups:
        group["lr"] = lr
    draft.train()
    device = batch["ids"].device
    with autocast_ctx(device, c.autocast):
        loss, stats = ttt_loss(draft, batch, head, c.ttt_steps, c.decay, used) if ddp is None else ddp(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], c.grad_clip)
    opt.step()
    N = c.ttt_steps
    numbers = [float(loss.detach()), *stats["loss"], *stats["correct"], *stats["count"]]
    if ddp is not None:
        world = ddp.module._world
        numbers = sum_over_ranks(torch.tensor(numbers, dtype=torch.float64, device=device)).tolist()
        numbers[: 1 + N] = [v / world for v in numbers[: 1 + N]]  # each rank's loss is its share times world
    out = {"loss": numbers[0], "lr": lr, "grad_norm": float(grad_norm)}
    for i in range(N):
        out[f"loss_{i}"] = numbers[1 + i]
        out[f"acc_{i}"] = numbers[1 + N + i] / max(1, numbers[1 + 2 * N + i])
    return out


@torch.no_grad()
def evaluate(draft: Eagle3Draft, data: Batch, head: Callable, c: TrainConfig, device,
             used: torch.Tensor | None = None, batch_size: int | None = None, autocast: str | None = None) -> dict:
    """Held-out metrics over all rows of `data`: loss_i, acc_i, predicted_acceptance_pos_i and predicted_tau
    (models.draft.predicted_tau of the per-position acceptance a chain of N would see on these taps), and per
    bucket of the answer position a chain starts at (answer_position, POSITION_BUCKETS) that the rows reach,
    predicted_tau_pos_<bucket> and slots_pos_<bucket> (the chains it pools).

    `autocast` None evaluates in float32, as the exported draft runs (training-time evals pass c.autocast).
    """
    was_training = draft.training
    draft.eval()
    N = c.ttt_steps
    n_rows = data["ids"].shape[0]
    bs = batch_size or c.batch_size
    loss_sum = [0.0] * N
    correct, count = [0] * N, [0] * N
    accepted, reached = [0] * N, [0] * N
    by_bucket = [([0] * N, [0] * N) for _ in POSITION_BUCKETS]
    for start in range(0, n_rows, bs):
        batch = take(data, torch.arange(start, min(n_rows, start + bs)), device)
        with autocast_ctx(torch.device(device), autocast):
            _, stats = ttt_loss(draft, batch, head, N, c.decay, used)
        first, Q = stats["first"], stats["hits"].shape[-1]
        mask = batch["mask"].bool()
        # slots whose N labels (positions t+1 .. t+N) all count
        valid_all = torch.stack([mask[:, first + 1 + i : first + 1 + i + Q] for i in range(N)]).all(0)
        acc_i, reach_i = position_acceptance(stats["hits"], valid_all)
        buckets = position_bucket_acceptance(stats["hits"], valid_all, answer_position(mask, first, Q))
        for i in range(N):
            accepted[i] += acc_i[i]
            reached[i] += reach_i[i]
            for (b_acc, b_reach), (a, r) in zip(by_bucket, buckets):
                b_acc[i] += a[i]
                b_reach[i] += r[i]
            loss_sum[i] += stats["loss"][i] * stats["count"][i]
            correct[i] += stats["correct"][i]
            count[i] += stats["count"][i]
    draft.train(was_training)
    acc = [correct[i] / max(1, count[i]) for i in range(N)]
    out = {f"acc_{i}": acc[i] for i in range(N)}
    out.update({f"loss_{i}": loss_sum[i] / max(1, count[i]) for i in range(N)})
    alpha = [accepted[i] / reached[i] if reached[i] else 0.0 for i in range(N)]
    out.update({f"predicted_acceptance_pos_{i}": alpha[i] for i in range(N)})
    out["predicted_tau"] = predicted_tau(alpha) if reached[0] else float("nan")
    for k, (b_acc, b_reach) in enumerate(by_bucket):
        if b_reach[0]:  # a bucket the held-out answers reach
            out[f"predicted_tau_pos_{bucket_name(k)}"] = predicted_tau([a / r if r else 0.0 for a, r in zip(b_acc, b_reach)])
            out[f"slots_pos_{bucket_name(k)}"] = b_reach[0]
    out["slots"] = count[0]
    return out


# --- checkpoints ------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, draft: Eagle3Draft, opt: torch.optim.Optimizer, step: int) -> None:
    """Weights, optimizer state and the number of steps done, written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, draft: Eagle3Draft, opt: torch.optim.Optimizer, device=None) -> int:
    """Restore a `save_checkpoint` into `draft` and `opt`; returns the number of steps done."""
    state = torch.load(path, map_location=device, weights_only=True)
    draft.load_state_dict(state["draft"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def fit(draft: Eagle3Draft, head: Callable, train: Batch, held_out: Batch | None, c: TrainConfig, device, *,
        checkpoint: Path | None = None, checkpoint_every_s: float = 60.0, eval_every: int | None = None,
        log: Callable[[dict, int], None] | None = None, log_every: int = 1, used: torch.Tensor | None = None,
        progress: bool = True, long: Batch | None = None) -> dict:
    """Train for c.steps steps (resuming from `checkpoint` if it exists), evaluating every `eval_every` steps
    (default: once per epoch of `train`) and at the end. Returns the last held-out metrics plus run facts
    (`loss`: the last step's training loss). With `long` (the long taps) every c.long_every-th step
    (is_long_step) trains on c.long_batch_size of its rows instead: the draft meets the positions and
    attention spans it serves at length, while most steps stay on the many short sequences.

    In a process group of N ranks (pipeline.distributed) `c.batch_size` stays the global batch: every rank
    draws the same rows for a step (batch_rows) and trains on its N-th of them (tensor_split) through
    DistributedDataParallel, so the step's gradient, its learning rate and the rows an epoch visits are
    those of one rank. Every rank resumes from the same checkpoint, which rank 0 alone writes; only rank 0
    evaluates the held-out taps (pass held_out=None on the others) and shows progress."""
    from pipeline import distributed

    device = torch.device(device)
    opt = make_optimizer(draft, c)
    start = 0
    if checkpoint is not None and Path(checkpoint).is_file():
        start = load_checkpoint(checkpoint, draft, opt, device)
    rank, world = distributed.rank(), distributed.world_size()
    ddp = None
    if distributed.initialized() and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        first = distributed.broadcast(start, "the step the draft resumes at")
        if first != start:
            raise distributed.RankFailure(f"draft: rank {rank} resumes at step {start}, rank 0 at step {first}: "
                                          f"the ranks read different checkpoints ({checkpoint})")
        # DDP broadcasts rank 0's weights and buffers on construction (they are equal already: same seed,
        # same checkpoint) and averages the gradients of every backward.
        ddp = DistributedDataParallel(TTTLoss(draft, head, c, used, sum_over_ranks, world),
                                      device_ids=[device.index] if device.type == "cuda" else None,
                                      forward_sync_buffers=False)  # buffers (d2t, t2d, caches) never change
        progress = progress and distributed.is_main()
    n_rows = train["ids"].shape[0]
    per_epoch = max(1, n_rows // c.batch_size)
    eval_every = eval_every or per_epoch
    log = log or (lambda metrics, step: None)
    held: dict = {}
    t0 = last_save = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(range(start, c.steps), initial=start, total=c.steps, desc="draft", mininterval=2.0,
               dynamic_ncols=True, disable=not progress)
    ema, m = None, {}
    governor = hardware.ThreadGovernor(device, what="draft training")
    for step in bar:
        step_t0 = time.perf_counter()
        source = long if long is not None and is_long_step(step, c) else train
        if source is train:
            rows = batch_rows(step, n_rows, c)
        else:
            rows = batch_rows(step // c.long_every, source["ids"].shape[0], c, c.long_batch_size, stream=1)
        if ddp is not None:
            rows = rows.tensor_split(world)[rank]
        batch = take(source, rows, device)
        m = train_step(draft, opt, batch, head, c, step, used, ddp)
        governor.tick(time.perf_counter() - step_t0)
        done = step + 1
        distributed.fault_point("draft", done)
        ema = m["loss"] if ema is None else 0.9 * ema + 0.1 * m["loss"]
        bar.set_postfix(loss=f"{ema:.3f}", acc0=f"{m['acc_0']:.2f}", held0=f"{held.get('acc_0', float('nan')):.2f}")
        if done % log_every == 0 or done == c.steps:
            log(m, done)
        if held_out is not None and (done % eval_every == 0 or done == c.steps):
            held = evaluate(draft, held_out, head, c, device, used, autocast=c.autocast)
            log({f"held_out_{k}": v for k, v in held.items()} | {"epoch": done / per_epoch}, done)
        if checkpoint is not None and done < c.steps and time.perf_counter() - last_save > checkpoint_every_s \
                and rank == 0:
            save_checkpoint(checkpoint, draft, opt, done)
            last_save = time.perf_counter()
    bar.close()
    governor.close()
    return {"held_out": held, "resumed_at": start, "train_seconds": time.perf_counter() - t0,
            "epochs": c.steps / per_epoch, "loss": m.get("loss")}
