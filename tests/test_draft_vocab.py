"""bench/lab/draft_vocab.py's pure parts: coverage of the draft vocabulary on the train and held-out splits, the
acceptance read from measured taus, and the predicted-speedup model, each against numbers computed by hand
from random inputs (no export, no timing)."""

from __future__ import annotations

import pytest
import torch

from bench.lab import draft_vocab as dv


def random_split(V, n, g, weights):
    """A taps-like split: top1 ids drawn from `weights`, a random mask of counted positions."""
    top1 = torch.multinomial(weights, n, replacement=True, generator=g).reshape(4, -1)
    mask = torch.rand(top1.shape, generator=g) < 0.7
    return {"top1": top1, "mask": mask}


def test_coverage_is_the_train_map_measured_on_both_splits(seed):
    g = torch.Generator().manual_seed(seed)
    V, Vd = 40, 12
    weights = torch.rand(V, generator=g) ** 3 + 1e-3
    train, held = random_split(V, 4000, g, weights), random_split(V, 400, g, weights.flip(0) + weights)
    tc, hc = dv.split_counts(train, V), dv.split_counts(held, V)
    # counts by hand: only masked positions count
    tc_hand = [sum(1 for t, m in zip(train["top1"].flatten().tolist(), train["mask"].flatten().tolist())
                   if m and t == i) for i in range(V)]
    assert tc.tolist() == tc_hand, seed
    # the map by hand: the Vd most frequent TRAIN ids (ties to the lower id)
    order = sorted(range(V), key=lambda i: (-tc_hand[i], i))[:Vd]
    hc_list = hc.tolist()
    row = next(r for r in dv.coverage_rows(tc, hc, [Vd, V]) if r["vd"] == Vd)
    assert sorted(row["used"].tolist()) == sorted(order), seed
    assert row["train_coverage"] == pytest.approx(sum(tc_hand[i] for i in order) / sum(tc_hand)), seed
    assert row["held_out_coverage"] == pytest.approx(sum(hc_list[i] for i in order) / sum(hc_list)), seed
    # the held-out split has other frequencies: the train map covers it differently
    assert row["held_out_coverage"] != pytest.approx(row["train_coverage"]), seed
    whole = next(r for r in dv.coverage_rows(tc, hc, [Vd, V]) if r["vd"] == V)
    assert whole["train_coverage"] == 1.0 and whole["held_out_coverage"] == 1.0


def test_held_out_coverage_counts_ids_the_train_split_never_saw():
    train_counts = torch.tensor([9, 0, 5, 0, 1])  # the map of 3 ids is {0, 2, 4}
    held_counts = torch.tensor([2, 6, 1, 1, 0])  # 3 of 10 held-out tokens inside it
    row = dv.coverage_rows(train_counts, held_counts, [3])[0]
    assert row["used"].tolist() == [0, 2, 4]
    assert row["train_coverage"] == 1.0
    assert row["held_out_coverage"] == pytest.approx(0.3)


def test_vd_list_caps_at_the_vocabulary_and_keeps_the_current_size():
    assert dv.vd_list("512,1024,8192,all", 4096, 2048) == [512, 1024, 2048, 4096]
    assert dv.vd_list("100", 50, 3000) == [50]


def test_acceptance_from_taus_inverts_predicted_tau(seed):
    g = torch.Generator().manual_seed(seed)
    alpha = (0.2 + 0.8 * torch.rand(7, generator=g)).tolist()
    taus = {k: dv.predicted_tau(alpha[:k]) for k in range(1, 8)}
    assert dv.acceptance_from_taus(taus) == pytest.approx(alpha), seed
    assert dv.acceptance_from_taus({str(k): v for k, v in taus.items()}) == pytest.approx(alpha), seed


def test_acceptance_from_noisy_taus_is_clipped():
    # tau falls at K=3 (noise): no third acceptance; a run chance that grows (K=2) is capped at the previous one
    assert dv.acceptance_from_taus({1: 1.5, 2: 1.75, 3: 1.7}) == pytest.approx([0.5, 0.5, 0.0])
    assert dv.acceptance_from_taus({1: 1.5, 2: 2.2}) == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError):
        dv.acceptance_from_taus({1: 1.5, 3: 2.0})
    assert dv.extend_acceptance([0.7, 0.4], 4) == ([0.7, 0.4, 0.4, 0.4], [2, 3])


def test_predicted_speedup_against_a_hand_computed_case(seed):
    g = torch.Generator().manual_seed(seed)
    alpha = torch.rand(7, generator=g).tolist()
    verify = {T: 1 + float(torch.rand((), generator=g)) for T in range(2, 9)}
    d = 0.1 * float(torch.rand((), generator=g))
    for k in range(1, 8):
        tau = 1.0
        for j in range(k):  # P(more than j proposals accepted) = alpha_0 * ... * alpha_j
            p = 1.0
            for i in range(j + 1):
                p *= alpha[i]
            tau += p
        assert dv.predicted_speedup(alpha, k, d, verify) == pytest.approx((tau, tau / (verify[k + 1] + k * d))), seed


def test_model_rows_scale_acceptance_by_held_out_coverage_and_pick_the_best(seed):
    g = torch.Generator().manual_seed(seed)
    alpha = (0.5 + 0.45 * torch.rand(7, generator=g)).tolist()
    verify = {T: 1.0 + 0.05 * T for T in range(2, 9)}
    cov = [{"vd": 100, "held_out_coverage": 0.6}, {"vd": 200, "held_out_coverage": 0.9},
           {"vd": 400, "held_out_coverage": 1.0}]
    draft = {100: 0.01, 200: 0.02, 400: 0.5}  # the whole vocabulary's step is expensive here
    rows = dv.model_rows(cov, 200, alpha, draft, verify)
    by_vd = {r["vd"]: r for r in rows}
    assert by_vd[200]["acceptance"] == pytest.approx(alpha), seed  # the current Vd keeps the measured acceptance
    assert by_vd[100]["acceptance"] == pytest.approx([a * 0.6 / 0.9 for a in alpha]), seed
    assert by_vd[400]["acceptance"] == pytest.approx([min(1.0, a / 0.9) for a in alpha]), seed
    for r in rows:
        hand = {k: dv.predicted_speedup(r["acceptance"], k, draft[r["vd"]], verify)[1] for k in range(1, 8)}
        assert r["best_k"] == max(hand, key=hand.get), seed
        assert r["best_speedup"] == pytest.approx(max(hand.values())), seed
    assert dv.best_vd(rows) == max(rows, key=lambda r: r["best_speedup"])["vd"], seed
    # equal predictions: the smaller (cheaper) Vd
    assert dv.best_vd([{"vd": 8, "best_speedup": 1.5}, {"vd": 4, "best_speedup": 1.5}]) == 4


def test_near_best_lists_the_sizes_within_the_tolerance():
    rows = [{"vd": 1, "best_speedup": 2.0}, {"vd": 2, "best_speedup": 1.985}, {"vd": 3, "best_speedup": 1.97}]
    assert dv.near_best(rows, 0.01) == [1, 2]
    assert dv.near_best(rows, 0.02) == [1, 2, 3]


def test_without_a_draft_artifact_the_acceptance_is_the_one_its_result_file_records(tmp_path):
    results = dv.RESULTS / "cpu-draft-vocab.json"
    plan = {"store": tmp_path, "keys": {"draft": "absent"}}
    for target in ("tiny", "smollm2_135m"):
        acc = dv.find_acceptance(plan, target, None, results)
        assert len(acc["alpha"]) == max(dv.KS) and "cpu-draft-vocab.json" in acc["source"], target
    with pytest.raises(SystemExit, match="pass --acceptance"):
        dv.find_acceptance(plan, "gemma3_270m", None, results)
