"""The draft training loop (pipeline/train_draft.py): vocab map, TTT against inference, a step learns, resume."""

import pytest
import torch

from models import tiny_draft, tiny_target
from pipeline import train_draft as td
from models.draft import predicted_tau

N = 3  # TTT steps in these tests


def test_vocab_map_takes_the_top_ids_sorted_with_d2t_offsets():
    counts = torch.tensor([5, 0, 9, 1, 9, 3, 0, 7])  # ids 2 and 4 tie: both in; 0 (5) beats 5 (3)
    vm = td.build_vocab_map(counts, 4)
    print(f"draft vocab {vm.used.tolist()} covers {100 * vm.coverage:.1f}% of the counted tokens")
    assert vm.used.tolist() == [0, 2, 4, 7]
    assert vm.d2t.tolist() == [0, 1, 2, 4]  # d2t[i] = used[i] - i
    assert torch.equal(torch.arange(4) + vm.d2t, vm.used)
    assert vm.t2d.tolist() == [True, False, True, False, True, False, False, True]
    assert vm.coverage == pytest.approx(30 / 34)
    # a tie at the cut goes to the lower id
    assert td.build_vocab_map(torch.tensor([1, 2, 2, 2]), 2).used.tolist() == [1, 2]
    # V <= Vd: the whole vocab, d2t all zeros
    whole = td.build_vocab_map(counts, 8)
    assert whole.used.tolist() == list(range(8)) and not whole.d2t.any() and whole.t2d.all()
    assert whole.coverage == 1.0


def test_token_counts_count_the_targets_argmax_at_counted_positions():
    top1 = torch.tensor([[3, 3, 1], [2, 3, 0]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    assert td.token_counts(top1, mask, 5).tolist() == [0, 1, 1, 2, 0]


def test_predicted_tau_and_per_position_acceptance():
    assert predicted_tau([1.0, 1.0, 1.0]) == 4.0
    assert predicted_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert predicted_tau([]) == 1.0
    hits = torch.tensor([[[1, 1, 0]], [[1, 0, 1]], [[0, 1, 1]]], dtype=torch.bool)  # [N=3, B=1, S=3]
    valid = torch.tensor([[True, True, False]])  # leading runs 2 and 1; the third slot does not count
    assert td.position_acceptance(hits, valid) == ([2, 1, 0], [2, 2, 1])


def test_predicted_tau_of_per_position_acceptance_is_one_plus_the_mean_leading_run(seed):
    hits = torch.rand(7, 4, 50) < torch.rand(7, 1, 1)  # per-step hit rates drawn fresh
    valid = torch.rand(4, 50) < 0.8
    accepted, reached = td.position_acceptance(hits, valid)
    alpha = [a / r if r else 0.0 for a, r in zip(accepted, reached)]
    runs = [next((i for i in range(7) if not hits[i, b, s]), 7) for b in range(4) for s in range(50) if valid[b, s]]
    assert predicted_tau(alpha) == pytest.approx(1 + sum(runs) / len(runs)), seed


def make_batch(target, B=2, T=12, vocab=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.cfg.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        final, tapped = target.hidden(ids, None, target.cfg.taps)
        top1 = target.head(final).argmax(-1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :2] = False
    return {"ids": ids, "taps": torch.cat(tapped, -1), "final": final, "top1": top1, "mask": mask}


@pytest.fixture()
def pair():
    target = tiny_target(seed=0, n_layers=3, max_seq_len=32)
    draft = tiny_draft(target, seed=1, draft_vocab_size=200)
    draft.set_vocab_map(torch.cat([torch.arange(150), torch.arange(150, 250, 2)]))
    return target, draft


def soft_ce(logits, probs):
    return -(probs * torch.log_softmax(logits.float(), -1)).sum(-1)


@torch.no_grad()
def test_unrolled_ttt_equals_a_step_by_step_recompute_through_the_draft_cache(pair):
    """TTT step i at slot t = seed the inference-time draft cache with slots 0..t (tokens ids[1..t+1],
    features fc(taps[0..t])), then i single steps feeding back g with tokens ids[t+2..t+1+i] at positions
    t+1..t+i. Loss and acc over the same slots equal ttt_loss's."""
    target, draft = pair
    batch = make_batch(target)
    used = torch.arange(200) + draft.d2t
    head = target.head  # noqa: E731
    loss, stats = td.ttt_loss(draft, batch, head, N, decay=0.8, used=used)
    step_logits = td.ttt_logits(draft, batch["ids"], batch["taps"], N)
    B, T = batch["ids"].shape
    S = T - N
    naive = torch.zeros(N, B, S, 200)
    for b in range(B):
        ids, feats = batch["ids"][b : b + 1], draft.fuse(batch["taps"][b : b + 1].chunk(3, -1))
        for t in range(S):
            draft.reset_cache()
            logits, g = draft(ids[:, 1 : t + 2], feats[:, : t + 1], torch.arange(t + 1))
            naive[0, b, t] = logits[0, -1]
            for i in range(1, N):
                logits, g = draft(ids[:, t + 1 + i : t + 2 + i], g[:, -1:], torch.tensor([t + i]))
                naive[i, b, t] = logits[0, -1]
    draft.reset_cache()
    for i in range(N):
        torch.testing.assert_close(step_logits[i], naive[i], rtol=1e-4, atol=1e-5)
    # the loss from the naive logits, each step against the target at position t+1+i
    tlogits = target.head(batch["final"]).index_select(-1, used)
    total = 0.0
    for i in range(N):
        pos = slice(1 + i, 1 + i + S)
        top1 = batch["top1"][:, pos]
        in_vocab = batch["mask"][:, pos] & draft.t2d[top1]
        ce = soft_ce(naive[i], torch.softmax(tlogits[:, pos], -1))
        loss_i = ce[in_vocab].mean()
        assert stats["loss"][i] == pytest.approx(float(loss_i), rel=1e-4)
        hits = (draft.to_target(naive[i].argmax(-1)) == top1) & batch["mask"][:, pos]
        assert stats["correct"][i] == int(hits.sum()) and stats["count"][i] == int(batch["mask"][:, pos].sum())
        total += 0.8**i * loss_i
    assert float(loss) == pytest.approx(float(total), rel=1e-4)


def test_one_training_step_lowers_the_loss_on_a_fixed_batch(pair):
    target, draft = pair
    batch = make_batch(target, B=4, T=16)
    head = target.head  # noqa: E731
    used = torch.arange(200) + draft.d2t
    c = td.TrainConfig(steps=10, batch_size=4, lr=3e-3, warmup=1, ttt_steps=N)
    opt = td.make_optimizer(draft, c)
    embed = draft.embed_tokens.weight.clone()
    with torch.no_grad():
        before = float(td.ttt_loss(draft, batch, head, N, used=used)[0])
    m = td.train_step(draft, opt, batch, head, c, 0, used)
    with torch.no_grad():
        after = float(td.ttt_loss(draft, batch, head, N, used=used)[0])
    assert m["loss"] == pytest.approx(before, rel=1e-5)
    assert after < before
    assert torch.equal(draft.embed_tokens.weight, embed)  # the embedding is a frozen copy
    assert set(m) >= {"loss", "lr", *(f"loss_{i}" for i in range(N)), *(f"acc_{i}" for i in range(N))}


def test_lr_warms_up_then_decays_to_min_lr():
    c = td.TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    assert td.lr_at(0, c) == pytest.approx(1e-4) and td.lr_at(9, c) == pytest.approx(1e-3)
    assert td.lr_at(55, c) == pytest.approx(5.5e-4) and td.lr_at(100, c) == pytest.approx(1e-4)


def test_an_interrupted_run_resumes_bit_for_bit(tmp_path):
    target = tiny_target(seed=0, n_layers=3, max_seq_len=32)
    data = {k: torch.cat([v, v.flip(0)]) for k, v in make_batch(target, B=3, T=12).items()}  # 6 rows
    head = target.head  # noqa: E731
    c = td.TrainConfig(steps=6, batch_size=2, lr=3e-3, warmup=2, ttt_steps=N, seed=3)

    straight = tiny_draft(target, seed=1)
    td.fit(straight, head, data, None, c, "cpu", progress=False)

    class Interrupt(Exception):
        pass

    def stop_at_4(metrics, step):
        if step == 4:
            raise Interrupt

    ckpt = tmp_path / "state.pt"
    first = tiny_draft(target, seed=1)
    with pytest.raises(Interrupt):  # checkpoint after every step; dies during step 4 (after 3 were saved)
        td.fit(first, head, data, None, c, "cpu", checkpoint=ckpt, checkpoint_every_s=0, log=stop_at_4,
               progress=False)
    assert torch.load(ckpt, weights_only=True)["step"] == 3
    resumed = tiny_draft(target, seed=1)  # a fresh process: same init, then the checkpoint
    out = td.fit(resumed, head, data, None, c, "cpu", checkpoint=ckpt, progress=False)
    assert out["resumed_at"] == 3
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    # weights equal after 3 more AdamW steps means moments and step counts were restored, not re-initialised
    state = torch.load(ckpt, weights_only=True)["opt"]["state"]
    assert state and all(int(s["step"]) == 3 for s in state.values())


@torch.no_grad()
def test_ttt_from_the_first_counted_slot_equals_ttt_over_every_slot(pair):
    """A masked-out prefix (a long prompt) costs its keys only: the logits, losses and hits of the slots that
    have a counted label are those of the full unroll."""
    target, draft = pair
    batch = make_batch(target, B=3, T=20, seed=5)
    batch["mask"][:, :9] = False  # the prompt: positions 0..8
    batch["mask"][1, :11] = False
    used = torch.arange(200) + draft.d2t
    first = td.first_slot(batch["mask"], N)
    assert first == 9 - (N - 1) - 1  # slot t's labels are t+1 .. t+N: the first counted position is 9
    full = td.ttt_logits(draft, batch["ids"], batch["taps"], N)
    part = td.ttt_logits(draft, batch["ids"], batch["taps"], N, first)
    for i in range(N):
        torch.testing.assert_close(part[i], full[i][:, first:], rtol=1e-4, atol=1e-5)
    loss, stats = td.ttt_loss(draft, batch, target.head, N, used=used)
    assert stats["first"] == first and stats["hits"].shape == (N, 3, 20 - N - first)
    # the reference: the full unroll's loss and hits, restricted to nothing (the skipped slots have no label)
    probs, top1, valid, in_vocab = td.labels(target.head, batch, draft.t2d, used)
    S, total = 20 - N, 0.0
    for i in range(N):
        sl = slice(i, i + S)
        ce = soft_ce(full[i], probs[:, sl])
        loss_i = ce[in_vocab[:, sl]].mean()
        assert stats["loss"][i] == pytest.approx(float(loss_i), rel=1e-4)
        hit = (draft.to_target(full[i].argmax(-1)) == top1[:, sl]) & valid[:, sl]
        assert torch.equal(stats["hits"][i], hit[:, first:]) and not hit[:, :first].any()
        total += 0.8**i * loss_i
    assert float(loss) == pytest.approx(float(total), rel=1e-4)


def test_acceptance_by_answer_position_against_a_loop_reference(seed):
    """position_bucket_acceptance(answer_position(...)) counts, per bucket of the answer position of a chain's
    first proposal, what a slot-by-slot loop counts; fresh random hits, masks, prompt lengths and first slot."""
    g = torch.Generator().manual_seed(seed)
    B, T, n = 3, 1200, 4
    prompt = torch.randint(1, 400, (B,), generator=g)  # the first counted position is prompt - 1
    mask = torch.arange(T)[None, :] >= prompt[:, None] - 1
    mask &= torch.rand(B, T, generator=g) < 0.97  # an end token or a hole here and there
    first = int(torch.randint(0, 300, (), generator=g))
    Q = T - n - first
    hits = torch.rand(n, B, Q, generator=g) < 0.7
    valid_all = torch.stack([mask[:, first + 1 + i : first + 1 + i + Q] for i in range(n)]).all(0)
    position = td.answer_position(mask, first, Q)
    got = td.position_bucket_acceptance(hits, valid_all, position)

    edges = list(td.POSITION_BUCKETS) + [10**9]
    want = [([0] * n, [0] * n) for _ in td.POSITION_BUCKETS]
    for b in range(B):
        p = int(mask[b].nonzero()[0]) + 1  # the answer starts one past the first counted position
        for j in range(Q):
            t = first + j
            if not all(mask[b, t + 1 + i] for i in range(n)):
                continue
            a = t + 2 - p  # the chain's first proposal is token t + 2
            k = next(k for k in range(len(td.POSITION_BUCKETS)) if edges[k] <= a < edges[k + 1])
            run = next((i for i in range(n) if not hits[i, b, j]), n)
            for i in range(n):
                want[k][0][i] += run > i
                want[k][1][i] += run >= i
    assert [(list(a), list(r)) for a, r in got] == want, seed
    assert sum(r[0] for _, r in got) == int(valid_all.sum())  # every counted slot lies in one bucket


@torch.no_grad()
def test_held_out_report_names_a_bucket_where_the_answers_reach(pair):
    target, draft = pair
    batch = make_batch(target, B=2, T=30, seed=2)
    batch["mask"][:, :4] = False  # answers of 26 tokens: only [0, 64) is reached
    c = td.TrainConfig(batch_size=2, ttt_steps=N)
    used = torch.arange(200) + draft.d2t
    out = td.evaluate(draft, batch, target.head, c, "cpu", used)
    assert [k for k in out if k.startswith("predicted_tau_pos_")] == ["predicted_tau_pos_0_64"]
    assert out["predicted_tau_pos_0_64"] == pytest.approx(out["predicted_tau"])  # one bucket: the whole
    assert [td.bucket_name(k) for k in range(len(td.POSITION_BUCKETS))] == \
        ["0_64", "64_256", "256_512", "512_1024", "1024_up"]


def test_long_steps_take_the_long_rows_and_resume_bit_for_bit(tmp_path):
    target = tiny_target(seed=0, n_layers=3, max_seq_len=64)
    data = {k: torch.cat([v, v.flip(0)]) for k, v in make_batch(target, B=3, T=12).items()}  # 6 short rows
    long = make_batch(target, B=3, T=40, seed=4)
    long["mask"][:, :30] = False  # a long prompt
    head = target.head  # noqa: E731
    c = td.TrainConfig(steps=6, batch_size=2, lr=3e-3, warmup=2, ttt_steps=N, seed=3, long_every=3,
                       long_batch_size=2)
    assert [s for s in range(6) if td.is_long_step(s, c)] == [2, 5]
    seen = []
    real_step = td.train_step

    def spy(draft, opt, batch, *args, **kwargs):
        seen.append(batch["ids"].shape)
        return real_step(draft, opt, batch, *args, **kwargs)

    straight = tiny_draft(target, seed=1)
    td.train_step = spy
    try:
        td.fit(straight, head, data, None, c, "cpu", progress=False, long=long)
    finally:
        td.train_step = real_step
    assert seen == [(2, 12), (2, 12), (2, 40), (2, 12), (2, 12), (2, 40)]

    class Interrupt(Exception):
        pass

    def stop_at_5(metrics, step):
        if step == 5:
            raise Interrupt

    ckpt = tmp_path / "state.pt"
    with pytest.raises(Interrupt):
        td.fit(tiny_draft(target, seed=1), head, data, None, c, "cpu", checkpoint=ckpt, checkpoint_every_s=0,
               log=stop_at_5, progress=False, long=long)
    resumed = tiny_draft(target, seed=1)
    assert td.fit(resumed, head, data, None, c, "cpu", checkpoint=ckpt, progress=False, long=long)["resumed_at"] == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
