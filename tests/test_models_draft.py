"""EAGLE-3 draft head, Speculator methods, speculators checkpoints, draft/target validation."""

import json

import pytest
import torch

from models import (
    Speculator,
    draft_config_for,
    load_speculators,
    save_speculators,
    tiny_draft,
    tiny_target,
    validate_draft,
)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, tiny_draft(target)


def seed_and_chain(draft, tokens, feats, chain_tokens):
    """Seed the draft cache with (tokens, feats), then one single step per chain token feeding back g."""
    draft.reset_cache()
    n = tokens.shape[1]
    logits, g = draft(tokens, feats, torch.arange(n))
    out = [(logits, g)]
    for j, tok in enumerate(chain_tokens):
        logits, g = draft(tok.view(1, 1), g[:, -1:], torch.tensor([n + j]))
        out.append((logits, g))
    return out


@torch.no_grad()
def test_cached_chain_equals_stateless_recompute(pair):
    _, draft = pair
    n, K = 6, 4
    tokens = torch.randint(0, 256, (1, n))
    feats = torch.randn(1, n, 64)
    chain = torch.randint(0, 256, (K,))
    steps = seed_and_chain(draft, tokens, feats, chain)
    all_tokens = torch.cat((tokens, chain.view(1, K)), dim=1)
    all_feats = torch.cat([feats] + [g[:, -1:] for _, g in steps[:-1]], dim=1)
    ref_logits, ref_g = draft(all_tokens, all_feats)  # stateless causal recompute
    torch.testing.assert_close(steps[0][0], ref_logits[:, :n], rtol=1e-5, atol=1e-5)
    for j in range(K):
        torch.testing.assert_close(steps[j + 1][0][:, 0], ref_logits[:, n + j], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(steps[j + 1][1][:, 0], ref_g[:, n + j], rtol=1e-5, atol=1e-5)


def test_draft_cache_refuses_gaps_and_batch_but_allows_overwrite(pair):
    _, draft = pair
    draft.reset_cache()
    with pytest.raises(ValueError, match="batch 1; got batch 2"):
        draft(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, 64), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"gap: write starts at position 1 but the next writable position is 0 \(cache empty\)"):
        draft(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 64), torch.tensor([1]))
    draft(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, 64), torch.arange(8))
    draft(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 64), torch.arange(3, 6))  # reseed: overwrite
    with pytest.raises(ValueError, match=r"starts at position 7 but the next writable position is 6 \(positions 0..5 filled\)"):
        draft(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 64), torch.tensor([7]))
    draft(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 64), torch.tensor([6]))
    with pytest.raises(ValueError, match="overflow"):
        draft(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 64), torch.tensor([7, 128]))
    draft.reset_cache()


@torch.no_grad()
def test_d2t_maps_draft_ids_to_target_ids():
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=32)
    used = torch.sort(torch.randperm(256)[:32]).values
    draft.set_vocab_map(used)
    assert torch.equal(draft.to_target(torch.arange(32)), used)
    assert int(draft.t2d.sum()) == 32 and bool(draft.t2d[used].all())
    validate_draft(draft, target.cfg)
    spec = Speculator(target, draft)
    spec.reset()
    ids, g, logits = spec.draft_decode(torch.randint(0, 256, (1, 5)), torch.randn(1, 5, 64), torch.arange(5))
    assert logits.shape == (1, 5, 32) and g.shape == (1, 5, 64)
    assert torch.equal(ids, used[logits.argmax(-1)])


def naive_ttt_reference(draft, tokens_per_step, feature0):
    """Per (step i, slot t): softmax over step-0 keys at slots <= t and keys of steps 1..i at slot t."""
    layer, attn = draft.layers[0], draft.layers[0].self_attn
    rep = attn.n_heads // attn.n_kv_heads
    B, T = feature0.shape[:2]
    K, V, outs, feat = [], [], [], feature0
    for i, tokens in enumerate(tokens_per_step):
        cos, sin = draft.rope.tables(torch.arange(T) + i)
        x, residual = layer.attn_input(draft.embed_tokens(tokens), feat)
        q, k, v = attn.project(x, cos, sin)
        K.append(k.repeat_interleave(rep, 1))
        V.append(v.repeat_interleave(rep, 1))
        out = torch.zeros_like(q)
        for t in range(T):
            kk = torch.stack([K[0][:, :, s] for s in range(t + 1)] + [K[j][:, :, t] for j in range(1, i + 1)], 2)
            vv = torch.stack([V[0][:, :, s] for s in range(t + 1)] + [V[j][:, :, t] for j in range(1, i + 1)], 2)
            p = torch.softmax((q[:, :, t : t + 1] @ kk.transpose(-2, -1)) * attn.scale, dim=-1)
            out[:, :, t] = (p @ vv)[:, :, 0]
        g = layer.finish(residual, attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)))
        outs.append((draft.logits(g), g))
        feat = g
    return outs


@torch.no_grad()
def test_forward_ttt_attention_pattern_matches_naive_reference(pair):
    _, draft = pair
    B, T, N = 2, 7, 4
    tokens = [torch.randint(0, 256, (B, T)) for _ in range(N)]
    feat = torch.randn(B, T, 64)
    ref = naive_ttt_reference(draft, tokens, feat)
    past = []
    for i in range(N):
        logits, g, kv = draft.forward_ttt(tokens[i], feat, past, step=i)
        torch.testing.assert_close(logits, ref[i][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, ref[i][1], rtol=1e-5, atol=1e-5)
        past.append(kv)
        feat = g
    with pytest.raises(ValueError, match="step=1 but len\\(past_kv\\)=4"):
        draft.forward_ttt(tokens[0], feat, past, step=1)


@torch.no_grad()
def test_forward_ttt_from_a_first_slot_equals_the_full_unroll_there(pair):
    """Querying slots first.. only (step 0 over every slot for its keys, later steps over the query slots) gives
    the full unroll's logits and g at those slots: a long prompt needs its keys, not its queries."""
    _, draft = pair
    B, T, N, first = 2, 9, 3, 4
    tokens = [torch.randint(0, 256, (B, T)) for _ in range(N)]
    feat0 = torch.randn(B, T, 64)
    full, part, feat, pfeat = [], [], feat0, feat0
    for i in range(N):
        logits, feat, kv = draft.forward_ttt(tokens[i], feat, [x[2] for x in full], step=i)
        full.append((logits, feat, kv))
        inputs = tokens[i] if i == 0 else tokens[i][:, first:]
        logits, pfeat, kv = draft.forward_ttt(inputs, pfeat, [x[2] for x in part], step=i, first=first)
        part.append((logits, pfeat, kv))
        torch.testing.assert_close(logits, full[i][0][:, first:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pfeat, full[i][1][:, first:], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_forward_ttt_step_equals_inference_time_cache(pair):
    """Step i at slot t == the cached draft after a seed over 0..t and i single steps at t+1..t+i."""
    _, draft = pair
    T, N = 6, 3
    tokens = [torch.randint(0, 256, (1, T)) for _ in range(N)]
    feats, gs, past = torch.randn(1, T, 64), [], []
    feat = feats
    for i in range(N):
        _, g, kv = draft.forward_ttt(tokens[i], feat, past)
        past.append(kv)
        gs.append(g)
        feat = g
    for t in (0, 3, T - 1):
        draft.reset_cache()
        _, g = draft(tokens[0][:, : t + 1], feats[:, : t + 1], torch.arange(t + 1))
        torch.testing.assert_close(g[:, t], gs[0][:, t], rtol=1e-5, atol=1e-5)
        for i in range(1, N):
            _, g = draft(tokens[i][:, t : t + 1], gs[i - 1][:, t : t + 1], torch.tensor([t + i]))
            torch.testing.assert_close(g[:, 0], gs[i][:, t], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_speculator_verify_after_prefill_equals_recompute_and_alignment(pair):
    target, draft = pair
    spec = Speculator(target, draft)
    prompt = torch.randint(0, 256, (1, 8))
    # greedy continuation by stateless recompute
    seq = prompt
    for _ in range(6):
        seq = torch.cat((seq, target(seq)[:, -1:].argmax(-1)), dim=1)
    greedy = seq[:, 8:]
    spec.reset()
    next_id, feature, last = spec.prefill(prompt, torch.arange(8))
    assert next_id.dtype == torch.int64 and next_id.shape == (1, 1) and feature.shape == (1, 8, 64)
    assert int(next_id) == int(greedy[0, 0])  # alignment pin: prefill's token is greedy[0]
    full, taps = target(seq, taps=True)
    torch.testing.assert_close(last, full[:, 7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feature, draft.fuse(taps)[:, :8], rtol=1e-5, atol=1e-5)
    K = 4
    ids, fv, logits = spec.target_verify(greedy[:, :K], torch.arange(8, 8 + K))
    assert torch.equal(ids, greedy[:, 1 : K + 1])  # verify over greedy[:K] returns greedy[1:K+1]
    torch.testing.assert_close(logits, full[:, 8 : 8 + K], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fv, draft.fuse(taps)[:, 8 : 8 + K], rtol=1e-5, atol=1e-5)
    ids1, logits1 = spec.target_decode(greedy[:, K : K + 1], torch.tensor([8 + K]))
    assert int(ids1) == int(greedy[0, K + 1]) and logits1.shape == (1, 1, 256)


@torch.no_grad()
def test_speculator_methods_export_with_dynamic_T(pair):
    from torch.export import Dim, export

    target, draft = pair
    spec = Speculator(target, draft)

    class Verify(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.spec = spec

        def forward(self, tokens, input_pos):
            return self.spec.target_verify(tokens, input_pos)

    class DraftDecode(Verify):
        def forward(self, tokens, feature, input_pos):
            return self.spec.draft_decode(tokens, feature, input_pos)

    T = Dim("T", min=2, max=8)
    spec.reset()
    ev = export(Verify(), (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                dynamic_shapes=({1: T}, {0: T})).module()
    ed = export(DraftDecode(), (torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 64), torch.arange(3)),
                dynamic_shapes=({1: T}, {1: T}, {0: T})).module()
    assert draft.valid_len == 0  # the eager-only gap guard did not run while tracing
    tokens = torch.randint(0, 256, (1, 12))
    spec.reset()
    ref = [spec.target_verify(tokens[:, :5], torch.arange(5)), spec.target_verify(tokens[:, 5:7], torch.arange(5, 7))]
    got = [ev(tokens[:, :5], torch.arange(5)), ev(tokens[:, 5:7], torch.arange(5, 7))]
    for r, o in zip(ref, got):
        assert torch.equal(r[0], o[0])
        torch.testing.assert_close(r[2], o[2], rtol=1e-5, atol=1e-5)
    feats = torch.randn(1, 8, 64)
    spec.reset()
    r = spec.draft_decode(tokens[:, :8], feats, torch.arange(8))
    o = ed(tokens[:, :8], feats, torch.arange(8))
    assert torch.equal(r[0], o[0])
    torch.testing.assert_close(r[1], o[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shard", [None, 40_000])
@torch.no_grad()
def test_speculators_checkpoint_round_trip(tmp_path, shard):
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=64, norm_before_residual=True)
    draft.set_vocab_map(torch.arange(0, 256, 4))
    save_speculators(draft, tmp_path, max_shard_bytes=shard, verifier="tiny")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(target.cfg.taps)
    assert cfg["transformer_layer_config"]["hidden_size"] == 64 and cfg["norm_before_residual"] is True
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "layers.0.hidden_norm.weight" in index["weight_map"] and "d2t" in index["weight_map"]
    else:
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert {"fc.weight", "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight",
                "layers.0.mlp.gate_proj.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight",
                "d2t", "t2d"} <= keys
    loaded = load_speculators(tmp_path, target)
    assert loaded.cfg == draft.cfg
    tokens, feats = torch.randint(0, 256, (1, 6)), torch.randn(1, 6, 64)
    draft.reset_cache()
    loaded.reset_cache()
    for a, b in zip(draft(tokens, feats, torch.arange(6)), loaded(tokens, feats, torch.arange(6))):
        assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)


def test_validate_draft_names_the_mismatch():
    target = tiny_target()
    good = draft_config_for(target.cfg)
    validate_draft(good, target.cfg)
    cases = {
        "hidden size": dict(target_hidden_size=32),
        "vocab": dict(vocab_size=300, draft_vocab_size=300),
        "tap layers": dict(tap_layers=(1, 2, 3)),
    }
    for field, override in cases.items():
        with pytest.raises(ValueError, match=f"mismatch in {field}"):
            validate_draft(draft_config_for(target.cfg, **override), target.cfg)
    with pytest.raises(ValueError, match=r"mismatch in tap layers: tap_layers \[1, 2, 9\] invalid"):
        validate_draft(draft_config_for(target.cfg, tap_layers=(1, 2, 9)), target.cfg)
    draft = tiny_draft(target, draft_vocab_size=8)
    draft.d2t[5] = 250  # draft id 5 -> target id 255 is fine, 7 -> 257 is not
    draft.d2t[7] = 250
    with pytest.raises(ValueError, match="d2t out of range: draft id 7 maps to target id 257"):
        validate_draft(draft, target.cfg)
    draft.d2t.zero_()
    draft.d2t[1] = -1  # draft ids 0 and 1 both -> 0
    with pytest.raises(ValueError, match="d2t is not one-to-one"):
        validate_draft(draft, target.cfg)
    draft.d2t.zero_()
    draft.t2d[100] = True
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        validate_draft(draft, target.cfg)
    with pytest.raises(ValueError, match="mismatch in tap layers"):
        Speculator(target, tiny_draft(target, tap_layers=(0, 1, 2)))


def test_load_speculators_refusals(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target()
    save_speculators(tiny_draft(target), tmp_path)
    other = tiny_target(hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="mismatch in hidden size"):
        load_speculators(tmp_path, other)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    state["layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'layers\.0\.mlp\.extra\.weight'"):
        load_speculators(tmp_path, target)
    del state["layers.0.mlp.extra.weight"]
    state["fc.weight"] = torch.zeros(64, 64)
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'fc\.weight' has shape \(64, 64\), expected \(64, 192\)"):
        load_speculators(tmp_path, target)
    del state["fc.weight"]
    save_file(state, str(f))
    with pytest.raises(ValueError, match="missing tensor 'fc.weight'"):
        load_speculators(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "eagle"}))
    with pytest.raises(ValueError, match=r"config\.json: speculators_model_type is 'eagle', expected 'eagle3'"):
        load_speculators(tmp_path, target)


@torch.no_grad()
def test_load_speculators_without_embedding_takes_the_targets(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target()
    draft = tiny_draft(target)
    save_speculators(draft, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["embed_tokens.weight"], state["t2d"]
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_speculators(tmp_path, target)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)
    assert bool(loaded.t2d.all())
    with pytest.raises(ValueError, match="missing tensor 'embed_tokens.weight'"):
        load_speculators(tmp_path, target.cfg)
