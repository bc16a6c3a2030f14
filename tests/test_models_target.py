"""Target transformer: taps, cached vs stateless agreement, config/taps validation, our checkpoint format."""

import json
import re

import pytest
import torch

from models import TINY, TargetConfig, Transformer, check_taps, default_taps, load_target, save_target, tiny_target
from models.layers import attention_mask

# Variants exercising every option on the cached path (each must still equal a full recompute).
VARIANTS = {
    "plain": {},
    "qwen_like": dict(qkv_bias=True, qk_norm=True, tie_embeddings=True),
    "gemma_like": dict(embed_scale=8.0, logit_softcap=30.0, partial_rotary_factor=0.5),
    "windowed": dict(sliding_window=[4, None, 3, 4], o_bias=True),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def manual_hidden_states(model: Transformer, tokens):
    """Per-layer residual states (HF convention) by running the layers one by one, outside forward()."""
    T = tokens.shape[1]
    pos = torch.arange(T)
    cos, sin = model.rope.tables(pos)
    h = model.embed_tokens(tokens)
    if model.cfg.embed_scale != 1.0:
        h = h * torch.tensor(model.cfg.embed_scale, dtype=h.dtype)
    states = [h]
    for i, layer in enumerate(model.layers):
        h = layer(h, cos, sin, attention_mask(pos, pos, model.cfg.window(i)))
        states.append(h)
    return states


@torch.no_grad()
def test_taps_are_bit_identical_to_per_layer_states():
    model = tiny_target(n_layers=4, tap_layers=(0, 2, 4))
    tokens = torch.randint(0, 256, (2, 10))
    _, taps = model(tokens, taps=True)
    states = manual_hidden_states(model, tokens)
    for tap, idx in zip(taps, (0, 2, 4)):
        assert torch.equal(tap, states[idx])


@torch.no_grad()
def test_taps_leave_logits_unchanged_and_last_only_is_last_row():
    model = tiny_target()
    tokens = torch.randint(0, 256, (2, 12))
    plain = model(tokens)
    with_taps, taps = model(tokens, taps=True)
    assert torch.equal(plain, with_taps)
    assert len(taps) == 3 and all(t.shape == (2, 12, 64) for t in taps)
    last = model(tokens, last_only=True)
    assert last.shape == (2, 1, 256)
    torch.testing.assert_close(last[:, 0], plain[:, -1], rtol=0, atol=1e-6)
    # cached path too
    model.reset_cache()
    c_plain = model(tokens[:1], torch.arange(12))
    model.reset_cache()
    c_taps, _ = model(tokens[:1], torch.arange(12), taps=True)
    assert torch.equal(c_plain, c_taps)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_cached_prefix_then_new_positions_equals_full_recompute(variant):
    model = tiny_target(**VARIANTS[variant])
    prefix = 7
    tokens = torch.randint(0, 256, (1, prefix + 8))
    for T in range(1, 9):
        seq = tokens[:, : prefix + T]
        full, full_taps = model(seq, taps=True)
        model.reset_cache()
        model(seq[:, :prefix], torch.arange(prefix))
        new, new_taps = model(seq[:, prefix:], torch.arange(prefix, prefix + T), taps=True)
        torch.testing.assert_close(new, full[:, prefix:], rtol=1e-5, atol=1e-5)
        for a, b in zip(new_taps, full_taps):
            torch.testing.assert_close(a, b[:, prefix:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_the_exports_attention_and_norms_equal_the_reference(variant):
    """kv_impl "llama_ops" (llama::update_cache / custom_sdpa over a [B, S, kv, hd] cache from the start
    position) with fc-mean norms gives the reference's logits and taps: a prefill, a rejected window
    overwritten by every verify width T, and T=1; and so does the exact call's attention,
    through eagle3::exact_sdpa (`exact`)."""
    from models.layers import set_fc_mean

    ref = tiny_target(**VARIANTS[variant])
    model = tiny_target(**VARIANTS[variant])
    model.set_kv_impl("llama_ops")
    assert set_fc_mean(model, True) > 0
    assert model.layers[0].self_attn.k_cache.shape == (1, model.cfg.max_seq_len, model.cfg.n_kv_heads, model.cfg.head_dim)
    tokens = torch.randint(0, 256, (1, 20))
    for m in (ref, model):
        m(tokens[:, :10], torch.arange(10))
        m(torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)), torch.arange(10, 16))
    for T in range(1, 9):
        want, want_taps = ref(tokens[:, 10:10 + T], torch.arange(10, 10 + T), taps=True)
        for exact in (False, True):
            got, got_taps = model(tokens[:, 10:10 + T], torch.arange(10, 10 + T), taps=True, exact=exact)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(got_taps, want_taps):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    model.set_kv_impl("index_copy")  # and back: the reference's layout
    assert model.layers[0].self_attn.k_cache.shape[2] == model.cfg.max_seq_len


def test_llama_ops_refuse_an_attention_softcap():
    model = tiny_target(attn_logit_softcap=50.0)
    with pytest.raises(ValueError, match="soft-cap"):
        model.set_kv_impl("llama_ops")
    with pytest.raises(ValueError, match="kv_impl"):
        model.set_kv_impl("flash")


@torch.no_grad()
def test_overwriting_rejected_slots_equals_recompute():
    """A verify window after a partial acceptance overwrites stale slots; the result is as if they never were."""
    model = tiny_target()
    tokens = torch.randint(0, 256, (1, 16))
    model.reset_cache()
    model(tokens[:, :10], torch.arange(10))
    model(torch.randint(0, 256, (1, 5)), torch.arange(10, 15))  # a rejected window
    new = model(tokens[:, 10:13], torch.arange(10, 13))
    torch.testing.assert_close(new, model(tokens[:, :13])[:, 10:], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_sliding_window_hides_keys_older_than_the_window():
    model = tiny_target(n_layers=1, tap_layers=None, sliding_window=[4])
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, :5] = (b[0, :5] + 1) % 256  # position 11 sees keys 8..11 only
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, 8:], lb[:, 8:], rtol=0, atol=0)
    assert not torch.allclose(la[:, 5], lb[:, 5])
    mask = attention_mask(torch.tensor([5]), torch.arange(8), 3)
    assert mask.tolist() == [[False, False, False, True, True, True, False, False]]


def test_cached_forward_refuses_batch_and_overflow():
    model = tiny_target(max_seq_len=16)
    with pytest.raises(ValueError, match="batch 2, but the KV cache is for batch 1"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.arange(3))
    with pytest.raises(ValueError, match="beyond the cache"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.tensor([15, 16]))


def test_default_taps_are_valid_for_every_depth_and_vllms_where_that_is_valid():
    for n_layers in range(3, 65):
        taps = TargetConfig(n_layers=n_layers).taps  # validated: 3 strictly ascending ints in [0, L]
        assert taps == check_taps(default_taps(n_layers), n_layers)
        if n_layers >= 7:
            assert taps == (2, n_layers // 2, n_layers - 3), n_layers
    assert TargetConfig(n_layers=60).taps == (2, 30, 57) and TargetConfig(n_layers=6).taps == (2, 3, 4)
    assert TargetConfig(n_layers=3).taps == (1, 2, 3)


def test_bad_taps_are_refused():
    with pytest.raises(ValueError, match=r"\[2, 2, 1\] invalid for a 4-layer target"):
        TargetConfig(n_layers=4, tap_layers=[2, 2, 1])
    for bad in ([3, 2, 1], [1, 1, 2], [0, 1, 5], [1, 2], [1.0, 2, 3], [-1, 0, 1]):
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            TargetConfig(n_layers=4, tap_layers=bad)
    assert check_taps([0, 2, 4], 4) == (0, 2, 4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        TargetConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="'yarn' is not implemented"):
        TargetConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_config_dict_round_trip_and_unknown_key():
    cfg = TargetConfig(**{**TINY.to_dict(), "sliding_window": [None, 4, None, 4], "tap_layers": [1, 2, 3]})
    d = json.loads(json.dumps(cfg.to_dict()))
    assert TargetConfig.from_dict(d) == cfg
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        TargetConfig.from_dict({**d, "bogus": 1})


@pytest.mark.parametrize("tied", [False, True])
@torch.no_grad()
def test_save_load_target_round_trip(tmp_path, tied):
    model = tiny_target(tie_embeddings=tied, qkv_bias=True)
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    save_target(model, tmp_path / "ckpt", tokenizer_path=tok)
    assert (tmp_path / "ckpt" / "tokenizer.json").exists()
    loaded = load_target(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    tokens = torch.randint(0, 256, (2, 9))
    assert torch.equal(loaded(tokens), model(tokens))
    if tied:
        assert loaded.lm_head.weight is loaded.embed_tokens.weight


def test_load_target_refuses_bad_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_target()
    save_target(model, tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'layers\.1\.mlp\.up_proj\.weight' has shape"):
        load_target(tmp_path)
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.weight'"):
        load_target(tmp_path)


def test_a_truncated_weights_file_is_refused_naming_the_file(tmp_path):
    save_target(tiny_target(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=re.escape(f"{weights} is not a readable safetensors file")):
        load_target(tmp_path)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_head_rows_are_those_columns_of_the_full_head(softcap):
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    model = Transformer(TargetConfig(logit_softcap=softcap, tie_embeddings=True)).eval()
    h = torch.randn(2, 5, model.cfg.hidden_size, generator=g)
    rows = torch.randperm(model.cfg.vocab_size, generator=g)[:37]
    with torch.no_grad():
        torch.testing.assert_close(model.head(h, rows), model.head(h)[..., rows], rtol=1e-5, atol=1e-5)
