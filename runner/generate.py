"""EAGLE-3 speculative decoding with a run-time chain length K, written against `runner.engine.Engine`.

The shifted scheme (docs/design.md §4): one target forward per round. The anchor is the newest confirmed token;
it is not yet in the target KV cache and is re-fed as row 0 of the next verify window.

    prompt: chunked prefill -> bonus (emitted), features F[0:L]; anchor = bonus; P = L
            seed the draft with (prompt[1:] + [bonus], F[0:L]) at 0..L-1 -> first proposal, then K-1 steps
    round:  vids, Fv = target_verify([anchor] + props, P..P+K)
            a = leading run where props[j] == vids[j];  new = props[:a] + [vids[a]]  (vids[K]: the free bonus)
            emit(new); reseed the draft with (new, Fv[:a+1]) at P..P+a, then K-1 single steps feeding back g
            anchor = vids[a]; P += a + 1

A greedy round on an engine with chain calls (the .pte's draft_chain_<k>) drafts in one call: the reseed and
the K-1 steps run inside the program, so a round is two calls, draft_chain_<K> and target_verify (`Draft`).

Draft position i pairs token x[i+1] with the feature of target position i and predicts x[i+2]. Rejected
slots are never rolled back: the next verify window starts at P+a+1 and overwrites them, and the causal
mask hides them until then. Reseeding replaces the draft's speculative (g-fed) cache entries with
target-derived ones.

K = 0 is greedy (or sampled) decoding through target_decode, the baseline every speedup is measured
against. At temperature > 0 proposals are sampled from the draft and verified by rejection sampling, so the
output is distributed exactly as the target's own samples.

The exported T ranges are enforced here, not by the runtime (which accepts T below a method's minimum):
prefill chunks lie in [min_prefill, max_prefill], a shorter piece of the prompt goes through target_verify
windows (T in [2, max_m]); K outside [1, max_m-1] is refused. K shrinks
only where drafting cannot pay: near the token budget and the end of the cache. `policy="adaptive"`
picks each round's K from the acceptance seen so far and the measured verify and draft costs.

An engine with `device_rounds` (the optional capability of runner.engine.Engine; runner.cuda_engine has it)
runs a greedy round at a static K itself (K = 0 too): `speculate(k, anchor, P)` drafts, verifies, accepts and
reseeds on its device and returns `new`, one synchronisation per round; the loop around it (budget, stop
tokens, metrics) is this one.

Not here: batching, tree drafts, a prefix cache shared across prompts.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from models.choices import POLICIES
from runner.policy import AdaptiveChain, StaticChain

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# What a generation returns


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]  # emitted tokens, the prefill bonus first
    chain: int  # K asked for (0 = target-only baseline)
    chain_per_round: list[int] = field(default_factory=list)  # K used in each round (budget/cache may shrink it)
    accepted: list[int] = field(default_factory=list)  # accepted proposals a in each round
    emitted: list[int] = field(default_factory=list)  # tokens emitted in each round (a+1 unless stopped)
    round_verify_ms: list[float] = field(default_factory=list)  # the target forward of each round
    round_draft_ms: list[float] = field(default_factory=list)  # the draft forwards of each round (K calls)
    prefill_ms: float = 0.0  # target prefill + draft seeding
    decode_ms: float = 0.0  # wall time of the rounds
    stop_reason: str = ""  # "stop_token" | "budget" | "cache_full" | "caller" (on_tokens returned False)

    @property
    def rounds(self) -> int:
        return len(self.chain_per_round)

    @property
    def verify_ms(self) -> float:
        return sum(self.round_verify_ms)

    @property
    def draft_ms(self) -> float:
        return sum(self.round_draft_ms)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round, excluding the prefill bonus."""
        return sum(self.emitted) / self.rounds if self.rounds else 0.0

    @property
    def drafted(self) -> int:
        return sum(self.chain_per_round)

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / self.drafted if self.drafted else 0.0

    def position_counts(self, n: int) -> tuple[list[int], list[int]]:
        """(accepted at position i, rounds reaching position i) for i < n. A round reaches i when its
        first i proposals were accepted and it drafted more than i."""
        acc = [sum(1 for k, a in zip(self.chain_per_round, self.accepted) if k > i and a > i) for i in range(n)]
        reach = [sum(1 for k, a in zip(self.chain_per_round, self.accepted) if k > i and a >= i) for i in range(n)]
        return acc, reach

    @property
    def decode_tokens(self) -> int:
        return max(len(self.output_ids) - 1, 0)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput after prefill (the prefill bonus excluded)."""
        return self.decode_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------
# Checks: the .pte's bounds are enforced here (the runtime silently accepts T below a method's minimum)


def resolve_chain(meta: dict, chain: int | None) -> int:
    """K from runtime.chain: None -> the .pte's default, 0 -> baseline, else must lie in [1, max_m-1]."""
    k = meta["default_chain"] if chain is None else int(chain)
    if k == 0:
        return 0
    if not 1 <= k <= meta["max_m"] - 1:
        raise ValueError(
            f"chain K={k} is outside the valid range [1, {meta['max_m'] - 1}] of this .pte "
            f"(max_m={meta['max_m']}: target_verify takes K+1 <= max_m rows); use chain=0 for the greedy baseline"
        )
    return k


def check_prompt(meta: dict, prompt: list[int]) -> None:
    if not prompt:
        raise ValueError("empty prompt: at least one token is needed")
    if len(prompt) >= meta["max_seq_len"]:
        raise ValueError(
            f"prompt of {len(prompt)} tokens is too long for max_seq_len={meta['max_seq_len']} of this .pte "
            f"(at most {meta['max_seq_len'] - 1} prompt tokens leave room to generate)"
        )


# ----------------------------------------------------------------------------------------------------------
# Sampling: greedy at temperature 0, otherwise seeded draws


class Sampler:
    def __init__(self, temperature: float, seed: int):
        self.temperature = float(temperature)
        self.greedy = self.temperature <= 0.0
        self.gen = torch.Generator().manual_seed(int(seed))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        z = logits.detach().to("cpu", torch.float64) / self.temperature  # draws happen on the host generator
        z = (z - z.amax(-1, keepdim=True)).exp()  # (torch.softmax is slower on tiny inputs here)
        return z / z.sum(-1, keepdim=True)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def coin(self) -> float:
        return float(torch.rand((), generator=self.gen, dtype=torch.float64))

    def next_token(self, greedy_id: int, logits: torch.Tensor) -> int:
        return greedy_id if self.greedy else self.draw(self.probs(logits))


# ----------------------------------------------------------------------------------------------------------
# Emission: stop tokens and the token budget


class Emitter:
    """The emitted tokens. `on_tokens(new_ids) -> bool`, when given, sees each emission as it happens; False
    ends the generation there (stop_reason "caller"): a server streams through it, and stops a generation on
    a stop string or when its client has gone."""

    def __init__(self, max_new_tokens: int, stop_ids, on_tokens: Callable[[list[int]], bool] | None = None):
        self.budget = int(max_new_tokens)
        self.stop_ids = set(int(s) for s in stop_ids)
        self.on_tokens = on_tokens
        self.ids: list[int] = []
        self.stop_reason = "budget" if self.budget <= 0 else ""

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.ids)

    def emit(self, tokens: list[int]) -> int:
        """Append tokens up to the first stop token (kept) or the budget; returns how many were emitted."""
        n = 0
        for tok in tokens:
            if self.done:
                break
            self.ids.append(tok)
            n += 1
            if tok in self.stop_ids:
                self.stop_reason = "stop_token"
            elif self.remaining <= 0:
                self.stop_reason = "budget"
        if n and self.on_tokens is not None and not self.on_tokens(self.ids[-n:]) and not self.done:
            self.stop_reason = "caller"
        return n


def _t(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long)


def _pos(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.long)


class Inputs:
    """The tokens [1, T] and positions [T] of a round's calls, in tensors made once per generation and
    filled through numpy. Beside a draft step of ~50 µs, each torch op the loop runs between calls costs
    several µs (more than in isolation: the calls evict the interpreter's caches), so the rounds build no
    tensor of their own (bench.round measures the loop's share). An engine reads its inputs during the call
    and keeps none (runner.engine), so one buffer serves every call."""

    def __init__(self, n: int):
        self.n = n
        self._tok, self._pos, self._arange = np.zeros((1, n), np.int64), np.zeros(n, np.int64), np.arange(n)
        tok, pos = torch.from_numpy(self._tok), torch.from_numpy(self._pos)
        self.tok = [tok[:, :t] for t in range(n + 1)]
        self.pos = [pos[:t] for t in range(n + 1)]

    def __call__(self, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(ids)
        if n == 1:  # a draft step or a decode: two scalar stores
            self._tok[0, 0], self._pos[0] = ids[0], start
        else:
            self._tok[0, :n] = ids
            np.add(self._arange[:n], start, out=self._pos[:n])
        return self.tok[n], self.pos[n]


# ----------------------------------------------------------------------------------------------------------
# Prefill: the prompt in chunks <= max_prefill; a piece shorter than the exported minimum goes through
# target_verify windows (T in [2, max_m]) instead. No chunk is wider than the widest call the target's ring
# caches are sized for (max(max_prefill, max_m), models.target), so a chunk never evicts a key it needs.


@dataclass
class Prefilled:
    next_id: int  # greedy token after the prompt
    logits: torch.Tensor  # [V] at the last prompt position
    features: torch.Tensor | None  # [L, H] fc(taps) at every prompt position (None if not asked for)


def prefill_windows(meta: dict, n: int) -> list[tuple[str, int, int]]:
    """The calls that cover positions [0, n): (method, start, length), lengths within each method's range.
    A verify window of one token reaches back one position (rewriting that slot with the same K/V); a
    one-token prompt is padded to two (the padded slot is overwritten by the first round)."""
    chunk = meta["max_prefill_chunk"]
    windows = []
    for start in range(0, n, chunk):
        length = min(chunk, n - start)
        if length >= meta["min_prefill_chunk"]:
            windows.append(("prefill", start, length))
            continue
        for s in range(start, start + length, meta["max_m"]):
            m = min(meta["max_m"], start + length - s)
            if m >= 2:
                windows.append(("target_verify", s, m))
            elif s > 0:
                windows.append(("target_verify", s - 1, 2))
            else:
                windows.append(("target_verify", 0, 2))  # one-token prompt: pad
    return windows


def prefill(engine, prompt: list[int], *, features: bool) -> Prefilled:
    n = len(prompt)
    padded = prompt + prompt[-1:]  # only the one-token pad reads past the prompt
    feats = None
    for method, start, length in prefill_windows(engine.meta, n):
        tokens, pos = _t(padded[start:start + length]), _pos(start, length)
        last = min(n - 1 - start, length - 1)  # row of the last prompt token in this window
        if method == "prefill":
            next_id, feature, logits = engine.prefill(tokens, pos)
            next_id, logits = int(next_id.reshape(-1)[0]), logits.reshape(-1)
        else:
            ids, feature, logits = engine.target_verify(tokens, pos)
            next_id, logits = int(ids[0, last]), logits[0, last]
        if features:
            feats = feature.new_empty(n, feature.shape[-1]) if feats is None else feats
            feats[start:start + last + 1] = feature[0, : last + 1]
    return Prefilled(next_id, logits, feats)


# ----------------------------------------------------------------------------------------------------------
# The draft: seed (or reseed) from target features, then single steps feeding back its own g


class Draft:
    """Proposals of one round: target-vocab ids, and (when sampling) the draft's distribution over the
    target vocab at each proposal, q[j] [V].

    Greedy on an engine with chain calls (`draft_chains`), a round's draft is one call: `seed` feeds all but
    the last max_m rows at once and keeps those (a round's reseed: all a+1 of them) for `propose(k)`, whose
    draft_chain_<k> seeds on them and takes the k-1 steps in the program. Otherwise `seed` feeds every row and
    proposes the first token, and `propose` takes k-1 draft_decode steps, one call each."""

    def __init__(self, engine, sampler: Sampler, inputs: Inputs):
        self.engine, self.sampler, self.inputs = engine, sampler, inputs
        meta = engine.meta
        self.max_t = max(meta["max_prefill_chunk"], meta["max_m"])
        self.d2t = meta["d2t"]
        self.target_ids = torch.arange(self.d2t.numel()) + self.d2t  # draft id -> target id
        self.vocab = meta["vocab_size"]
        self.in_chain = engine.draft_chains and sampler.greedy
        self.pending = None  # (tokens, features, start) the next draft_chain call seeds on
        self.first = None  # step by step: the seeded proposal (token, q)

    def _propose(self, ids: torch.Tensor, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.sampler.greedy:
            return ids.tolist()[0][-1], None
        q_draft = self.sampler.probs(logits.reshape(-1, logits.shape[-1])[-1])
        q = torch.zeros(self.vocab, dtype=q_draft.dtype).index_add_(0, self.target_ids, q_draft)
        return int(self.target_ids[self.sampler.draw(q_draft)]), q

    def seed(self, tokens: list[int], features: torch.Tensor, start: int) -> None:
        """Feed (tokens[i], features[0, i]) at positions start+i (in chunks), or keep the last rows for the
        round's chain call (class docstring)."""
        n = len(tokens)
        if self.in_chain:
            keep = min(n, self.inputs.n)
            if n > keep:
                self._feed(tokens[:n - keep], features[:, :n - keep], start)
            self.pending = (tokens[n - keep:], features[:, n - keep:], start + n - keep)
        else:
            self.first = self._propose(*self._feed(tokens, features, start))

    def _feed(self, tokens: list[int], features: torch.Tensor, start: int):
        """draft_decode over the rows -> the last call's (ids, logits); keeps the last row's g."""
        n = len(tokens)
        if n <= self.inputs.n:  # a round's reseed (a + 1 rows): one call on the reused inputs
            tok, pos = self.inputs(tokens, start)
            ids, g, logits = self.engine.draft_decode(tok, features, pos)
        else:
            for s in range(0, n, self.max_t):
                m = min(self.max_t, n - s)
                ids, g, logits = self.engine.draft_decode(_t(tokens[s:s + m]), features[:, s:s + m], _pos(start + s, m))
        self.g, self.next_pos = g[:, -1:], start + n
        return ids, logits

    def propose(self, k: int) -> tuple[list[int], list]:
        """K proposals (and their q when sampling): one chain call, or the seeded proposal then K-1 single
        steps (token = last proposal, feature = last g)."""
        if self.in_chain:
            tokens, features, start = self.pending
            tok, pos = self.inputs(tokens, start)
            return self.engine.draft_chain(k, tok, features, pos).tolist()[0], [None] * k
        props, qs = [self.first[0]], [self.first[1]]
        for _ in range(k - 1):
            tokens, pos = self.inputs(props[-1:], self.next_pos)
            ids, self.g, logits = self.engine.draft_decode(tokens, self.g, pos)  # T = 1: g is [1, 1, H]
            self.next_pos += 1
            tok, q = self._propose(ids, logits)
            props.append(tok)
            qs.append(q)
        return props, qs


# ----------------------------------------------------------------------------------------------------------
# Verification: greedy (leading run of matches) or rejection sampling


def accept_greedy(props: list[int], vids: list[int]) -> list[int]:
    """props[:a] + [vids[a]] with a = the leading run where props[j] == vids[j]."""
    a = 0
    while a < len(props) and props[a] == vids[a]:
        a += 1
    return props[:a] + [vids[a]]


def accept_sampled(props: list[int], qs: list[torch.Tensor], p_logits: torch.Tensor, sampler: Sampler) -> list[int]:
    """Rejection sampling: accept x_j with min(1, p_j(x)/q_j(x)); on the first rejection draw from
    normalize(max(p_j - q_j, 0)); if all K are accepted draw the bonus from p_K. Exact in distribution."""
    p = sampler.probs(p_logits)  # [K+1, V]
    for j, (x, q) in enumerate(zip(props, qs)):
        if sampler.coin() * q[x] < p[j, x]:  # u < p/q without dividing by q
            continue
        residual = (p[j] - q).clamp_min(0)
        return props[:j] + [sampler.draw(residual if residual.sum() > 0 else p[j])]
    return props + [sampler.draw(p[len(props)])]


# ----------------------------------------------------------------------------------------------------------
# The verify windows' costs, which the adaptive chain policy (runner/policy.py) starts from


def measure_window_costs(engine, reps: int = 3) -> dict[int, float]:
    """{T: ms} of one target_verify call at every window T in [2, max_m] on this engine, the best of `reps`
    after a warm-up call, at positions 0..T-1 (which the next generation's prefill rewrites). Measured once
    per engine and kept on it: the verify cost is a step function of T on a CPU (XNNPACK's GEMM takes 7 or 8
    rows a pass on AVX-512, 6 or 3 on AVX2, and a window one row past a pass reads the weights again), which
    the adaptive policy must know before it has tried a window."""
    cached = getattr(engine, "window_costs", None)
    if cached is not None:
        return cached
    costs = {}
    for t in range(2, engine.meta["max_m"] + 1):
        tokens, pos = _t([0] * t), _pos(0, t)
        engine.target_verify(tokens, pos)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.target_verify(tokens, pos)
            best = min(best, (time.perf_counter() - t0) * 1e3)
        costs[t] = best
    engine.window_costs = costs
    return costs


# ----------------------------------------------------------------------------------------------------------
# One round


def target_step(engine, sampler: Sampler, inputs: Inputs, anchor: int, P: int) -> list[int]:
    """K = 0: one target forward of the anchor at P, one new token (the baseline's whole loop)."""
    ids, logits = engine.target_decode(*inputs([anchor], P))
    return [sampler.next_token(ids.tolist()[0][0], logits.reshape(-1))]


def speculative_round(engine, draft: Draft, sampler: Sampler, inputs: Inputs, anchor: int, P: int,
                      k: int) -> tuple[list[int], torch.Tensor, float, float]:
    """Draft K proposals, verify [anchor] + props at P..P+K in ONE target forward, accept a leading run.
    Returns new = props[:a] + [correction or bonus], verify's features [1, K+1, H] (to reseed the draft), and
    the ms of the draft steps and of the verify call."""
    t0 = time.perf_counter()
    props, qs = draft.propose(k)
    t1 = time.perf_counter()
    vids, fv, logits = engine.target_verify(*inputs([anchor] + props, P))
    t2 = time.perf_counter()
    new = accept_greedy(props, vids.tolist()[0]) if sampler.greedy else accept_sampled(props, qs, logits[0], sampler)
    return new, fv, (t1 - t0) * 1e3, (t2 - t1) * 1e3


# ----------------------------------------------------------------------------------------------------------
# The loop


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block. Reference counting still frees everything the loop
    drops (a round makes no cycles); what is paused is the periodic walk over every tracked object, which in a
    process holding a pipeline's or a server's objects takes milliseconds and would land inside a round (a
    4-5% slower decode in the pipeline's eval than in a bare process)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def generate(
    engine,
    prompt_ids: list[int],
    *,
    chain: int | None = None,
    max_new_tokens: int = 128,
    stop_ids=(),
    temperature: float = 0.0,
    seed: int = 0,
    policy: str = "static",
    on_tokens: Callable[[list[int]], bool] | None = None,
) -> GenerationResult:
    """Generate from `prompt_ids`: K = chain (None = the .pte's default; 0 = target-only baseline).
    `on_tokens(new_ids)` sees the prefill bonus, then each round's tokens, as they are emitted; returning
    False stops the generation after that round (stop_reason "caller")."""
    meta = engine.meta
    k_max = resolve_chain(meta, chain)
    prompt = [int(t) for t in prompt_ids]
    check_prompt(meta, prompt)
    if policy not in POLICIES:
        raise ValueError(f"unknown chain policy {policy!r}: use one of {', '.join(POLICIES)}")
    result = GenerationResult(prompt_ids=prompt, output_ids=[], chain=k_max)
    sampler = Sampler(temperature, seed)
    out = Emitter(max_new_tokens, stop_ids, on_tokens)
    # before the prefill: measuring writes the cache at positions 0..max_m-1
    window_costs = measure_window_costs(engine) if policy == "adaptive" and k_max > 0 else None
    engine.reset()

    # Prompt: target prefill (the bonus token), then seed the draft with (prompt[1:] + [bonus], F[0:L]).
    t0 = time.perf_counter()
    pre = prefill(engine, prompt, features=k_max > 0)
    anchor, P = sampler.next_token(pre.next_id, pre.logits), len(prompt)
    out.emit([anchor])
    # an engine with device rounds runs a whole greedy round at a static K itself, with one synchronisation
    on_device = engine.device_rounds and sampler.greedy and policy == "static"
    inputs = Inputs(meta["max_m"])
    if k_max > 0 and not out.done:
        draft = Draft(engine, sampler, inputs)
        draft.seed(prompt[1:] + [anchor], pre.features[None], 0)
        chooser = (AdaptiveChain(meta["max_m"] - 1, k_max, window_costs=window_costs)
                   if policy == "adaptive" else StaticChain(k_max))
        if on_device:
            engine.begin_rounds(draft.first[0], draft.g)
    result.prefill_ms = (time.perf_counter() - t0) * 1e3

    t_decode = time.perf_counter()
    with collector_paused():  # a cyclic collection over a large heap would land inside a round
        while not out.done:
            t_round = time.perf_counter()
            room = meta["max_seq_len"] - 1 - P  # a verify window writes P..P+K
            if room < 0:
                out.stop_reason = "cache_full"
                break
            # no drafting past the budget or the cache: K = 0 is a target_decode step
            k = 0 if k_max == 0 else min(chooser.choose(), room, out.remaining - 1)
            draft_ms = 0.0
            if on_device:  # draft steps, verify and reseed in one call: all of it counts as verify
                new = engine.speculate(k, anchor, P)
                verify_ms = (time.perf_counter() - t_round) * 1e3
            elif k == 0:
                new = target_step(engine, sampler, inputs, anchor, P)
                verify_ms = (time.perf_counter() - t_round) * 1e3
            else:
                new, fv, draft_ms, verify_ms = speculative_round(engine, draft, sampler, inputs, anchor, P, k)
            a = len(new) - 1

            n = out.emit(new)  # up to the first stop token, within the budget
            anchor, P = new[-1], P + a + 1
            if k > 0 and not out.done and not on_device:  # reseed the draft from verify's features (no rollback)
                t_seed = time.perf_counter()
                draft.seed(new, fv[:, : a + 1], P - a - 1)
                draft_ms += (time.perf_counter() - t_seed) * 1e3
                # the policy prices a round as the loop pays it: everything but the verify call is the draft's
                chooser.update(k, a, verify_ms, (time.perf_counter() - t_round) * 1e3 - verify_ms)
            result.chain_per_round.append(k)
            result.accepted.append(a)
            result.emitted.append(n)
            result.round_verify_ms.append(verify_ms)
            result.round_draft_ms.append(draft_ms)
    result.decode_ms = (time.perf_counter() - t_decode) * 1e3

    result.output_ids = out.ids
    result.stop_reason = out.stop_reason
    if policy == "adaptive" and k_max > 0:
        log.info("adaptive K per round: %s", result.chain_per_round)
    return result
