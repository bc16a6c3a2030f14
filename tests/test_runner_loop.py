"""The speculative loop (runner.generate) on a toy engine whose draft we force to agree or disagree.

The toy is our test double for the Engine interface, not a stand-in for ExecuTorch: a deterministic "target"
whose next token depends on the tokens held in its KV cache at the query position and the one before it
(so a wrong position, a gap or a stale slot changes the answer), and a draft that predicts the target
exactly from (token, feature) unless a forcing rule makes proposal j of round r wrong. Features carry
(token at that target position, position), so the draft also checks it is fed the right feature at the
right position. Every method checks its T range like the exported program's (the runtime would not).
"""


import pytest
import torch

from runner.engine import Engine
from runner.generate import generate, prefill_windows
from runner.policy import AdaptiveChain

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 16


def h(cur: int, prev: int) -> int:
    """The toy target's greedy next token after `cur` (preceded by `prev`)."""
    return (3 * cur + prev + 1) % V


def one_hot_logits(ids, n):
    logits = torch.full((len(ids), n), -10.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


class ToyEngine(Engine):
    def __init__(self, *, vocab=V, max_m=5, default_chain=3, max_seq_len=64, max_prefill=8, min_prefill=4, wrong=None,
                 target_table=None, draft_table=None, draft_vocab=None):
        self.vocab = vocab
        self.meta = dict(max_m=max_m, default_chain=default_chain, max_seq_len=max_seq_len, vocab_size=vocab,
                         draft_vocab_size=vocab, max_prefill_chunk=max_prefill, min_prefill_chunk=min_prefill,
                         sliding_window=None, manifest_hash="toy")
        self.draft_vocab = torch.arange(vocab) if draft_vocab is None else torch.tensor(draft_vocab)
        self.meta["draft_vocab_size"] = len(self.draft_vocab)
        self.meta["d2t"] = self.draft_vocab - torch.arange(len(self.draft_vocab))
        self.wrong = wrong or (lambda round_, j: False)  # force proposal j of round `round_` to be wrong
        self.target_table, self.draft_table = target_table, draft_table  # [V, V] logits (sampling tests)
        self.calls = {"prefill": 0, "target_verify": 0, "target_decode": 0, "draft_decode": 0}
        self.reset()

    def reset(self):
        self.kv = [None] * self.meta["max_seq_len"]
        self.draft_kv = [None] * self.meta["max_seq_len"]
        self.rounds, self.j = 0, 0

    # -- target --------------------------------------------------------------------------------------
    def _target(self, name, tokens, input_pos, lo, hi):
        self.calls[name] += 1
        T = tokens.shape[1]
        assert lo <= T <= hi, f"{name}: T={T} outside the exported range [{lo}, {hi}]"
        pos = input_pos.tolist()
        assert pos == list(range(pos[0], pos[0] + T)), pos
        assert pos[0] == 0 or self.kv[pos[0] - 1] is not None, f"{name}: gap before {pos[0]}"
        for p, t in zip(pos, tokens[0].tolist()):
            self.kv[p] = t
        # like the real cache: slots after the query are masked, so a stale future slot does not matter
        nxt, logits = [], []
        for p in pos:
            cur, prev = self.kv[p], (self.kv[p - 1] if p > 0 else 0)
            if self.target_table is None:
                nxt.append(h(cur, prev))
            else:
                nxt.append(int(self.target_table[cur].argmax()))
        logits = one_hot_logits(nxt, self.vocab) if self.target_table is None else self.target_table[[self.kv[p] for p in pos]]
        feature = torch.tensor([[self.kv[p], p] for p in pos], dtype=torch.float32)[None]
        self.j = 0
        return torch.tensor([nxt]), feature, logits[None]

    def prefill(self, tokens, input_pos):
        ids, feature, logits = self._target("prefill", tokens, input_pos, self.meta["min_prefill_chunk"],
                                            self.meta["max_prefill_chunk"])
        return ids[:, -1:], feature, logits[:, -1]

    def target_verify(self, tokens, input_pos):
        self.rounds += 1
        return self._target("target_verify", tokens, input_pos, 2, self.meta["max_m"])

    def target_decode(self, tokens, input_pos):
        ids, _, logits = self._target("target_decode", tokens, input_pos, 1, 1)
        return ids, logits

    # -- draft ---------------------------------------------------------------------------------------
    def draft_decode(self, tokens, feature, input_pos):
        self.calls["draft_decode"] += 1
        T = tokens.shape[1]
        assert 1 <= T <= max(self.meta["max_prefill_chunk"], self.meta["max_m"]), T
        pos = input_pos.tolist()
        assert pos[0] == 0 or self.draft_kv[pos[0] - 1] is not None, f"draft gap before {pos[0]}"
        assert feature[0, :, 1].tolist() == pos, f"feature positions {feature[0, :, 1].tolist()} != {pos}"
        if T > 1:
            self.j = 0
        ids, logits = [], []
        for i, p in enumerate(pos):
            tok, feat_tok = int(tokens[0, i]), int(feature[0, i, 0])
            self.draft_kv[p] = tok
            if self.draft_table is None:
                guess = h(tok, feat_tok)
                if i == T - 1 and self.wrong(self.rounds, self.j):
                    guess = (guess + 1) % V
                ids.append(guess)
            else:
                ids.append(int(self.draft_vocab[self.draft_table[tok].argmax()]))
        logits = (one_hot_logits(ids, self.vocab) if self.draft_table is None
                  else self.draft_table[[int(t) for t in tokens[0]]])
        self.j += 1
        g = torch.tensor([[t, p + 1] for t, p in zip(tokens[0].tolist(), pos)], dtype=torch.float32)[None]
        return torch.tensor([ids]), g, logits[None]


def greedy_reference(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(h(seq[-1], seq[-2] if len(seq) > 1 else 0))
    return seq[len(prompt):]


PROMPT = [1, 5, 2, 7, 3, 9]


# ---------------------------------------------------------------------------------------------------------
# The forced paths of the round (docs/design.md §4)


def test_forced_full_acceptance_takes_the_bonus_every_round():
    eng = ToyEngine(max_m=5)
    res = generate(eng, PROMPT, chain=4, max_new_tokens=1 + 5 * 4)
    assert res.output_ids == greedy_reference(PROMPT, 21)
    assert res.chain_per_round == [4] * 4 and res.accepted == [4] * 4 and res.emitted == [5] * 4
    assert res.tau == 5 and res.acceptance_rate == 1.0
    assert eng.calls["target_verify"] == 4  # one target forward per round


def test_forced_partial_acceptance():
    eng = ToyEngine(max_m=5, wrong=lambda r, j: j == 2)
    res = generate(eng, PROMPT, chain=4, max_new_tokens=1 + 3 * 6)
    assert res.output_ids == greedy_reference(PROMPT, 19)
    assert res.accepted == [2] * 6 and res.tau == 3
    acc, reach = res.position_counts(4)
    assert res.chain_per_round == [4] * 5 + [2]  # the budget shrinks the last round
    assert acc == [6, 6, 0, 0] and reach == [6, 6, 5, 0]


def test_forced_no_acceptance_still_emits_one_token_per_round():
    eng = ToyEngine(max_m=5, wrong=lambda r, j: j == 0)
    res = generate(eng, PROMPT, chain=3, max_new_tokens=9)
    assert res.output_ids == greedy_reference(PROMPT, 9)
    assert res.accepted == [0] * 8 and res.tau == 1 and res.acceptance_rate == 0


def test_mixed_acceptance_matches_greedy():
    eng = ToyEngine(max_m=8, wrong=lambda r, j: j == (r * 5) % 8)
    res = generate(eng, PROMPT, chain=7, max_new_tokens=40)
    assert res.output_ids == greedy_reference(PROMPT, 40)
    assert 0 < res.acceptance_rate < 1


def test_an_accepted_stop_token_ends_emission():
    ref = greedy_reference(PROMPT, 20)
    stop = ref[2]  # round 1's second proposal when K=4 and all are accepted
    assert stop not in ref[:2]
    res = generate(ToyEngine(max_m=5), PROMPT, chain=4, max_new_tokens=20, stop_ids=[stop])
    assert res.output_ids == ref[:3] and res.stop_reason == "stop_token"
    assert res.accepted == [4] and res.emitted == [2]  # accepted past the stop token, emitted up to it


def test_a_stop_token_as_the_prefill_bonus_ends_before_any_round():
    eng = ToyEngine()
    bonus = greedy_reference(PROMPT, 1)[0]
    res = generate(eng, PROMPT, chain=2, stop_ids=[bonus])
    assert res.output_ids == [bonus] and res.rounds == 0 and eng.calls["draft_decode"] == 0


def test_a_budget_of_one_token_returns_only_the_bonus():
    eng = ToyEngine()
    res = generate(eng, PROMPT, chain=3, max_new_tokens=1)
    assert res.output_ids == greedy_reference(PROMPT, 1) and res.rounds == 0
    assert eng.calls["target_verify"] == 0 and eng.calls["draft_decode"] == 0


def test_the_budget_clips_the_last_round():
    res = generate(ToyEngine(max_m=5), PROMPT, chain=4, max_new_tokens=8)
    assert res.output_ids == greedy_reference(PROMPT, 8) and res.stop_reason == "budget"
    assert res.chain_per_round == [4, 1]  # no point drafting past the budget


# ---------------------------------------------------------------------------------------------------------
# Lossless for every K, every prompt shape


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 30])
def test_every_chain_equals_greedy_for_every_prompt_length(n):
    prompt = [(7 * i + 3) % V for i in range(n)]
    baseline = generate(ToyEngine(), prompt, chain=0, max_new_tokens=20)
    assert baseline.output_ids == greedy_reference(prompt, 20) and baseline.rounds == 19
    for k in range(1, 5):
        eng = ToyEngine(wrong=lambda r, j: (r + j) % 3 == 2)
        assert generate(eng, prompt, chain=k, max_new_tokens=20).output_ids == baseline.output_ids, k


def test_one_engine_serves_many_generations_in_sequence():
    """The loop rewrites the caches from position 0, so no reload is needed between runs (as for one .pte)."""
    eng = ToyEngine(wrong=lambda r, j: j == 1)
    first = generate(eng, list(range(20)), chain=3, max_new_tokens=30).output_ids
    for k in (0, 1, 4, 2):
        assert generate(eng, PROMPT, chain=k, max_new_tokens=25).output_ids == greedy_reference(PROMPT, 25)
    assert generate(eng, list(range(20)), chain=3, max_new_tokens=30).output_ids == first


def test_a_full_cache_ends_generation_with_the_same_tokens_as_greedy():
    prompt = PROMPT * 3
    baseline = generate(ToyEngine(max_seq_len=32), prompt, chain=0, max_new_tokens=100)
    assert baseline.stop_reason == "cache_full" and len(baseline.output_ids) == 32 - len(prompt) + 1
    for k in (1, 3, 4):
        res = generate(ToyEngine(max_seq_len=32), prompt, chain=k, max_new_tokens=100)
        assert res.output_ids == baseline.output_ids and res.stop_reason == "cache_full"


# ---------------------------------------------------------------------------------------------------------
# Chunked prefill and its bounds


def test_prefill_windows_respect_the_exported_ranges():
    meta = dict(max_prefill_chunk=8, min_prefill_chunk=4, max_m=5, sliding_window=None)
    assert prefill_windows(meta, 16) == [("prefill", 0, 8), ("prefill", 8, 8)]
    assert prefill_windows(meta, 13) == [("prefill", 0, 8), ("prefill", 8, 5)]
    assert prefill_windows(meta, 11) == [("prefill", 0, 8), ("target_verify", 8, 3)]
    assert prefill_windows(meta, 9) == [("prefill", 0, 8), ("target_verify", 7, 2)]
    assert prefill_windows(meta, 1) == [("target_verify", 0, 2)]
    meta["sliding_window"] = 6  # a window narrower than a chunk: the target's ring caches hold every chunk
    assert prefill_windows(meta, 13) == [("prefill", 0, 8), ("prefill", 8, 5)]


def test_chunked_prefill_feeds_the_draft_the_features_of_every_prompt_position():
    eng = ToyEngine(max_prefill=4, min_prefill=4, max_m=3, default_chain=2)
    prompt = [(5 * i + 1) % V for i in range(15)]  # 4 + 4 + 4 + verify 3 (< min_prefill)
    res = generate(eng, prompt, max_new_tokens=12)
    assert res.chain == 2 and res.output_ids == greedy_reference(prompt, 12)
    assert eng.calls["prefill"] == 3 and eng.calls["draft_decode"] > 0


# ---------------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("k", [-1, 5, 6])
def test_a_chain_outside_the_valid_range_is_refused_with_the_range(k):
    with pytest.raises(ValueError, match=r"outside the valid range \[1, 4\].*max_m=5"):
        generate(ToyEngine(max_m=5), PROMPT, chain=k)


def test_chain_none_means_the_programs_default():
    assert generate(ToyEngine(default_chain=3), PROMPT, chain=None, max_new_tokens=9).chain_per_round[0] == 3


def test_a_prompt_too_long_for_the_cache_is_refused_naming_both_lengths():
    with pytest.raises(ValueError, match=r"prompt of 64 tokens is too long for max_seq_len=64"):
        generate(ToyEngine(max_seq_len=64), [1] * 64, chain=2)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        generate(ToyEngine(), PROMPT, chain=2, policy="greedy")


# ---------------------------------------------------------------------------------------------------------
# Adaptive chain length


def test_adaptive_policy_is_lossless_and_keeps_k_in_range():
    eng = ToyEngine(max_m=8, wrong=lambda r, j: j == r % 4)
    res = generate(eng, PROMPT, chain=3, max_new_tokens=50, policy="adaptive")
    assert res.output_ids == greedy_reference(PROMPT, 50)
    assert all(1 <= k <= 7 for k in res.chain_per_round)


@pytest.mark.parametrize("accept_upto, expect", [(7, 7), (1, 1)])
def test_adaptive_policy_converges_to_the_best_k(accept_upto, expect):
    """Verify 10 ms + 1 ms per row, draft 1 ms per step: with every proposal accepted the longest chain
    wins; with only the first accepted, K=1 (2 tokens / 13 ms beats 2 tokens / 14 ms + ...)."""
    policy = AdaptiveChain(max_k=7, start_k=3)
    chosen = []
    for _ in range(300):
        k = policy.choose()
        chosen.append(k)
        policy.update(k, min(k, accept_upto), verify_ms=10 + (k + 1), draft_ms=k * 1.0)
    late = chosen[100:]
    assert max(set(late), key=late.count) == expect
    assert late.count(expect) > 0.8 * len(late)  # exploring other K now and then, not more


def test_adaptive_policy_costs_are_robust_to_noisy_timings():
    """Verify cost is non-decreasing in T even when a noisy sample says otherwise; an untried larger window
    is read at the largest tried one; a spike is clipped."""
    policy = AdaptiveChain(max_k=7, start_k=3, memory=1.0)
    for k, ms in ((1, 10.0), (3, 9.0), (3, 9.0), (5, 14.0), (1, 10.0)):
        policy.update(k, 0, verify_ms=ms, draft_ms=k * 1.0)
    costs = policy.verify_costs()
    assert costs[2] == costs[4] == pytest.approx(9.5) and costs[6] == 14.0
    assert policy.verify_cost(8) == 14.0 and policy.verify_cost(5) == pytest.approx(9.5)
    policy.update(5, 0, verify_ms=1000.0, draft_ms=5.0)
    assert policy.verify_costs()[6] == pytest.approx((14 + 28) / 2)


@pytest.mark.parametrize("tile", [3, 6, 7])
def test_adaptive_policy_never_tries_a_window_past_the_row_tile_that_costs_more_per_token(tile):
    """A CPU verify costs a step function of T (1.2 decode steps within XNNPACK's row tile, twice that one row
    past it). With the measured window costs the policy prices an untried window before trying it, so with
    acceptance that makes the extra position worth less than the extra pass it never picks K = tile."""
    window = {t: 10.0 * (1.2 if t <= tile else 2.4) for t in range(2, 9)}
    policy = AdaptiveChain(max_k=7, start_k=1, window_costs=window)
    chosen = []
    for _ in range(200):
        k = policy.choose()
        chosen.append(k)
        a = 0
        while a < k and a < 7 and (len(chosen) * 7 + a) % 10 < 7:  # about 70% acceptance per position
            a += 1
        policy.update(k, a, verify_ms=window[k + 1] * 1.1, draft_ms=k * 0.3)  # this machine is 10% slower
    assert max(chosen) <= tile - 1, sorted(set(chosen))
    assert policy.verify_cost(tile + 1) == pytest.approx(window[tile + 1] * 1.1)  # scaled to what was measured


def test_window_costs_are_measured_once_before_the_prefill_and_keep_the_output_greedy():
    eng = ToyEngine(max_m=6, wrong=lambda r, j: j == r % 3)
    res = generate(eng, PROMPT, chain=2, max_new_tokens=30, policy="adaptive")
    assert sorted(eng.window_costs) == [2, 3, 4, 5, 6] and all(ms > 0 for ms in eng.window_costs.values())
    costs = dict(eng.window_costs)
    assert res.output_ids == greedy_reference(PROMPT, 30)
    generate(eng, PROMPT, chain=2, max_new_tokens=30, policy="adaptive")
    assert eng.window_costs == costs  # kept on the engine: measured once


# ---------------------------------------------------------------------------------------------------------
# Rejection sampling: the emitted distribution is the target's


def test_rejection_sampling_matches_the_target_distribution():
    """Markov target p(next | cur) and a different draft q over a reduced draft vocab (d2t): the joint law of
    the first two tokens after the bonus must equal the target's, to Monte-Carlo error."""
    n_vocab = 6
    gen = torch.Generator().manual_seed(0)
    target_table = torch.randn(n_vocab, n_vocab, generator=gen) * 1.5
    draft_vocab = [0, 2, 3, 5]
    draft_table = target_table[:, draft_vocab] + torch.randn(n_vocab, 4, generator=gen)
    temperature = 0.8
    p = torch.softmax(target_table.double() / temperature, -1)
    prompt = [1, 4]
    # the law of (t1, t2) after the bonus b: sum_b p(b | 4) p(t1 | b) p(t2 | t1)
    law = torch.einsum("b,bi,ij->ij", p[4], p, p)
    n = 3000
    counts = torch.zeros(n_vocab, n_vocab, dtype=torch.float64)
    eng = ToyEngine(vocab=n_vocab, max_m=3, min_prefill=2, target_table=target_table,
                    draft_table=draft_table, draft_vocab=draft_vocab)
    rejected = 0
    for seed in range(n):
        res = generate(eng, prompt, chain=2, max_new_tokens=4, temperature=temperature, seed=seed)
        counts[res.output_ids[1], res.output_ids[2]] += 1
        rejected += res.accepted[0] < res.chain_per_round[0]
    tv = 0.5 * (counts / n - law).abs().sum().item()
    assert tv < 0.06, tv
    assert 0 < rejected < n  # both paths (accept, resample from the residual) were exercised
    # the same seed gives the same sample
    a = generate(eng, prompt, chain=2, max_new_tokens=8, temperature=temperature, seed=7).output_ids
    assert generate(eng, prompt, chain=2, max_new_tokens=8, temperature=temperature, seed=7).output_ids == a
