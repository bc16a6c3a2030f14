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
