"""Gemma 3 in the one target definition: equality with transformers (stateless, cached, greedy generate), its
config defaults and refusals, our checkpoint round trip, and the exported program against the eager one.

Checkpoints are tiny random Gemma3ForCausalLM models (transformers' Gemma3TextConfig) saved in the test, with
mixed layer_types, windows shorter than the sequences, distinct RoPE bases and query_pre_attn_scalar !=
head_dim. Weights are re-drawn with a larger spread than HF's init (std 0.02) so logits are well separated
and greedy comparisons are not decided by float noise on near ties; norm weights are drawn around 0, so
Gemma's (1 + weight) differs from weight. Seeds are fresh on every run and named in failures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import Speculator, Transformer, load_hf_target, load_target, save_target, tiny_draft  # noqa: E402
from models.hf import GEMMA3_SLIDING_WINDOW_PATTERN, GEMMA3_TEXT_DEFAULTS, rope_settings  # noqa: E402
from models.layers import Attention, attention_mask  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = dict(max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              torch_dtype="float32", attn_implementation="eager")
S, F = "sliding_attention", "full_attention"
# name -> Gemma3TextConfig arguments. "capped" sets both soft-caps: transformers 4.57.6's Gemma 3 applies
# final_logit_softcapping and ignores attn_logit_softcapping (Gemma3Attention.forward does not pass it on).
CASES = {
    "capped": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=[S, F, S, S, F],
                   rope_theta=50_000.0, rope_local_base_freq=20.0, query_pre_attn_scalar=24,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True,
                   attn_logit_softcapping=1.0, final_logit_softcapping=4.0),
    "uncapped": dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, sliding_window=12, layer_types=[F, S, S, F, S, F],
                     rope_theta=1_000_000.0, rope_local_base_freq=500.0, query_pre_attn_scalar=48,
                     tie_word_embeddings=False, attn_logit_softcapping=None, final_logit_softcapping=None),
}
MAX_SEQ = 128


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Spread weights (N(0, 0.15) matrices, N(0, 0.1) biases) and norm weights N(0, 0.3) (Gemma scales by 1 + w)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if "norm" in name else (0.15 if p.dim() == 2 else 0.1)
            p.copy_(torch.randn(p.shape, generator=g) * std)


def make_hf(args: dict, path, seed: int):
    config = transformers.Gemma3TextConfig(**{**COMMON, **args})
    model = transformers.Gemma3ForCausalLM(config).eval()
    randomise(model, seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def gemma(request, tmp_path_factory):
    name, seed = request.param, fresh_seed()
    path = tmp_path_factory.mktemp(f"gemma3_{name}")
    hf = make_hf(CASES[name], path, seed)
    ours, _ = load_hf_target(path, max_seq_len=MAX_SEQ)
    return types.SimpleNamespace(name=name, seed=seed, hf=hf, ours=ours, path=path, vocab=CASES[name]["vocab_size"])


def tokens(vocab, shape, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def rel_err(got, ref):
    return float((got - ref).norm() / ref.norm())


@torch.no_grad()
def test_config_maps_every_gemma_option(gemma):
    c, a = gemma.ours.cfg, CASES[gemma.name]
    window = a["sliding_window"]
    assert c.sliding_window == [window if t == S else None for t in a["layer_types"]]
    assert c.hidden_act == "gelu_pytorch_tanh" and c.norm_unit_offset and c.output_norms and c.qk_norm
    assert c.attn_scale == a["query_pre_attn_scalar"] ** -0.5 != c.head_dim ** -0.5
    assert c.rope_local_theta == a["rope_local_base_freq"] and c.rope_theta == a["rope_theta"]
    assert c.embed_scale == a["hidden_size"] ** 0.5
    assert c.logit_softcap == a["final_logit_softcapping"] and c.attn_logit_softcap is None
    assert c.tie_embeddings == a.get("tie_word_embeddings", True)
    assert c.qkv_bias == c.o_bias == a.get("attention_bias", False)
    assert [c.local_rope(i) for i in range(c.n_layers)] == [t == S for t in a["layer_types"]]


@torch.no_grad()
def test_logits_and_taps_match_transformers(gemma):
    x = tokens(gemma.vocab, (2, 40 + fresh_seed() % 61), fresh_seed())
    out = gemma.hf(x, output_hidden_states=True)
    got, taps = gemma.ours(x, taps=True)
    err = rel_err(got, out.logits)
    assert err < 1e-5, f"{gemma.name} (seed {gemma.seed}): relative error {err:.2e}, T={x.shape[1]}"
    torch.testing.assert_close(got, out.logits, rtol=1e-4, atol=1e-4)
    # taps follow HF's hidden_states index convention (the last HF entry is post-norm)
    for tap, idx in zip(taps, gemma.ours.cfg.taps):
        if idx < gemma.ours.cfg.n_layers:
            torch.testing.assert_close(tap, out.hidden_states[idx], rtol=1e-4, atol=1e-4, msg=f"tap {idx}")


@torch.no_grad()
def test_bfloat16_matches_transformers_bfloat16(gemma):
    """In bfloat16 too (transformers loading the checkpoint in bfloat16): Gemma's norms scale in float32 and
    the embedding scale is a float32 scalar cast to the activations' dtype, as transformers does."""
    hf = transformers.Gemma3ForCausalLM.from_pretrained(gemma.path, dtype=torch.bfloat16,
                                                         attn_implementation="eager").eval()
    ours, _ = load_hf_target(gemma.path, max_seq_len=MAX_SEQ, dtype=torch.bfloat16)
    x = tokens(gemma.vocab, (2, 48), fresh_seed())
    err = rel_err(ours(x).float(), hf(x).logits.float())
    assert err < 1e-3, f"{gemma.name} (seed {gemma.seed}): bfloat16 relative error {err:.2e}"


@torch.no_grad()
def test_options_change_the_logits(gemma):
    """The comparison above can fail: switching any one Gemma option off (or applying the attention
    soft-cap that transformers' Gemma 3 ignores) moves the logits far outside its tolerance."""
    x = tokens(gemma.vocab, (1, 48), fresh_seed())
    ref = gemma.hf(x).logits
    c = gemma.ours.cfg
    flips = dict(norm_unit_offset=False, output_norms=False, hidden_act="silu", attn_scale=None,
                 rope_local_theta=None, embed_scale=1.0, attn_logit_softcap=1.0, sliding_window=None)
    if c.logit_softcap is not None:
        flips["logit_softcap"] = None
    state = gemma.ours.state_dict()
    for field, value in flips.items():
        other = Transformer(dataclasses.replace(c, **{field: value})).eval()
        other.load_state_dict({k: v for k, v in state.items() if k in other.state_dict()}, strict=False)
        assert rel_err(other(x), ref) > 1e-2, f"{gemma.name}: {field}={value!r} left the logits unchanged"


@torch.no_grad()
def test_cached_path_token_by_token_and_in_chunks(gemma):
    """Our static-cache path equals transformers' full forward, fed one token at a time and in random chunks,
    with a rejected (random) window written ahead of every chunk and then overwritten."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T = 40 + seed % 41
    x = tokens(gemma.vocab, (1, T), seed)
    ref = gemma.hf(x).logits[0]
    model = gemma.ours
    model.reset_cache()
    rows = [model(x[:, p:p + 1], torch.tensor([p]))[0, 0] for p in range(T)]
    torch.testing.assert_close(torch.stack(rows), ref, rtol=1e-4, atol=1e-4, msg=f"token by token (seed {seed})")
    model.reset_cache()
    p, rows = 0, []
    while p < T:
        n = min(T - p, int(torch.randint(1, 18, (1,), generator=g)))
        ahead = min(MAX_SEQ - p, n + 4)
        model(torch.randint(0, gemma.vocab, (1, ahead), generator=g), torch.arange(p, p + ahead))  # rejected
        rows.append(model(x[:, p:p + n], torch.arange(p, p + n))[0])
        p += n
    torch.testing.assert_close(torch.cat(rows), ref, rtol=1e-4, atol=1e-4, msg=f"chunks (seed {seed})")


@torch.no_grad()
def test_greedy_matches_transformers_generate(gemma):
    seed, P, N = fresh_seed(), 16, 72
    prompt = tokens(gemma.vocab, (1, P), seed)
    # an explicit mask: without one generate() masks every prompt token equal to pad_token_id as padding
    ref = gemma.hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=N,
                            min_new_tokens=N, pad_token_id=0)[0, P:]
    model = gemma.ours
    model.reset_cache()
    tok = model(prompt, torch.arange(P), last_only=True)[:, -1].argmax(-1, keepdim=True)
    got = [int(tok)]
    for pos in range(P, P + N - 1):
        tok = model(tok, torch.tensor([pos]))[:, -1].argmax(-1, keepdim=True)
        got.append(int(tok))
    assert len(ref) == N and got == ref.tolist(), f"{gemma.name} (seed {gemma.seed}/{seed}): greedy diverged"


@torch.no_grad()
def test_our_checkpoint_round_trips_gemma_fields(gemma, tmp_path):
    save_target(gemma.ours, tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "config.json").read_text())
    for field in ("hidden_act", "norm_unit_offset", "output_norms", "attn_scale", "attn_logit_softcap",
                  "rope_local_theta", "embed_scale", "logit_softcap"):
        assert saved[field] == getattr(gemma.ours.cfg, field), field
    back = load_target(tmp_path / "t")
    assert back.cfg == gemma.ours.cfg
    x = tokens(gemma.vocab, (1, 30), fresh_seed())
    assert torch.equal(back(x), gemma.ours(x))


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_local_base_freq")  # transformers 5: rope_parameters


def test_defaults_are_gemma3_text_config_defaults():
    ref = transformers.Gemma3TextConfig()
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key == "layer_types" or key in ROPE_KEYS:
            continue  # None means the pattern below; the class fills it in
        assert getattr(ref, key) == value, key
    assert rope_settings(ref.to_dict(), "gemma3_text") == rope_settings(GEMMA3_TEXT_DEFAULTS, "gemma3_text")
    assert rope_settings(GEMMA3_TEXT_DEFAULTS, "gemma3_text")["rope_local_theta"] == 10_000.0
    assert ref._sliding_window_pattern == GEMMA3_SLIDING_WINDOW_PATTERN


@torch.no_grad()
def test_sparse_config_json_takes_the_class_defaults(tmp_path):
    """A config.json that omits keys at their defaults (as published checkpoints do) loads as transformers
    reads it: tied embeddings, query_pre_attn_scalar 256, and the 5:1 layer pattern from sliding_window_pattern."""
    seed = fresh_seed()
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, sliding_window=6, sliding_window_pattern=3)
    hf = make_hf(args, tmp_path, seed)
    d = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "query_pre_attn_scalar", "tie_word_embeddings", "rope_local_base_freq",
                "hidden_activation", "_sliding_window_pattern"):
        d.pop(key, None)
    d["sliding_window_pattern"] = 3
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours, _ = load_hf_target(tmp_path, max_seq_len=64)
    assert ours.cfg.sliding_window == [6, 6, None, 6, 6, None, 6] == [
        6 if t == S else None for t in hf.config.layer_types]
    assert ours.cfg.tie_embeddings and ours.cfg.attn_scale == 256 ** -0.5
    x = tokens(256, (1, 40), seed)
    torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path):
    seed = fresh_seed()
    text = {**CASES["capped"], "num_hidden_layers": 2, "layer_types": [S, F]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config={**COMMON, **text}, vision_config=vision, mm_tokens_per_image=4,
                                       attn_implementation="eager")
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomise(hf, seed)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_target(tmp_path, max_seq_len=64)
    assert ours.cfg.logit_softcap is None  # Gemma3ForConditionalGeneration does not soft-cap its logits
    x = tokens(256, (1, 40), seed)
    ref = hf(input_ids=x).logits
    assert rel_err(ours(x), ref) < 1e-5, f"seed {seed}"


GEMMA_REFUSALS = {
    "use_bidirectional_attention": (lambda d: d.update(use_bidirectional_attention=True),
                                    r"config\.json: use_bidirectional_attention=True: bidirectional"),
    "hidden_activation": (lambda d: d.update(hidden_activation="gelu"),
                          r"config\.json: hidden_activation='gelu': only silu, gelu_pytorch_tanh"),
    "rope_scaling": (lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                     r"config\.json: rope_scaling=.*'yarn' is not implemented"),
    "layer_types": (lambda d: d.update(layer_types=[S, "chunked_attention"]), r"config\.json: layer_types=.*need 2"),
    "sliding_window": (lambda d: d.update(sliding_window=None), r"config\.json: sliding_window=None"),
    "text_config": (lambda d: d.update(model_type="gemma3", text_config={**d, "model_type": "gemma3n_text"}),
                    r"config\.json: text_config\.model_type='gemma3n_text'"),
}


@pytest.mark.parametrize("key", sorted(GEMMA_REFUSALS))
def test_refuses_unsupported_gemma_config(tmp_path, key):
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, sliding_window=4, layer_types=[S, F])
    make_hf(args, tmp_path, fresh_seed())
    d = json.loads((tmp_path / "config.json").read_text())
    edit, message = GEMMA_REFUSALS[key]
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message):
        load_hf_target(tmp_path)


def test_attention_softcap_is_hf_eager_softcap_before_the_mask(seed):
    """Attention.attend with softcap equals transformers' eager attention with softcap (Gemma 2's, the one
    that passes it), with a windowed mask; and the cap changes the result."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    attn = Attention(64, 64, 4, 2, 16, 32, scale=0.3, softcap=2.0).eval()
    q, k, v = torch.randn(1, 4, 20, 16) * 3, torch.randn(1, 2, 20, 16) * 3, torch.randn(1, 2, 20, 16)
    mask = attention_mask(torch.arange(20), torch.arange(20), 6)
    additive = torch.zeros(20, 20).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    hf_module = types.SimpleNamespace(num_key_value_groups=2, training=False, head_dim=16)
    want, _ = eager_attention_forward(hf_module, q, k, v, additive, scaling=0.3, softcap=2.0)
    got = attn.attend(q, k, v, mask).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    uncapped, _ = eager_attention_forward(hf_module, q, k, v, additive, scaling=0.3, softcap=None)
    assert rel_err(got, uncapped) > 1e-2


# --- export ------------------------------------------------------------------------------------------------
MAX_M, CHAIN, MIN_PREFILL, MAX_PREFILL, EXPORT_SEQ = 4, 2, 5, 16, 64


@pytest.fixture(scope="module")
def gemma_pte(tmp_path_factory):
    """A 2-layer Gemma 3 checkpoint (sliding then full layer, window 6, both soft-caps set, plus our own
    attention soft-cap) with a tiny draft, exported with the XNNPACK backend."""
    from pipeline.export_pte import export_pte

    seed = fresh_seed()
    path = tmp_path_factory.mktemp("gemma3_export")
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=6, layer_types=[S, F], rope_theta=10_000.0,
                rope_local_base_freq=50.0, query_pre_attn_scalar=20, final_logit_softcapping=5.0,
                max_position_embeddings=EXPORT_SEQ)
    make_hf(args, path, seed)

    def speculator():
        loaded, _ = load_hf_target(path, max_seq_len=EXPORT_SEQ)
        # our attention soft-cap goes through export too (transformers' Gemma 3 applies none)
        target = Transformer(dataclasses.replace(loaded.cfg, attn_logit_softcap=8.0)).eval()
        target.load_state_dict(loaded.state_dict())
        draft = tiny_draft(target, seed=seed % 1000, draft_vocab_size=128)
        draft.set_vocab_map(torch.randperm(256, generator=torch.Generator().manual_seed(seed))[:128].sort().values)
        return Speculator(target, draft).eval()

    out = path / "model.pte"
    report = export_pte(speculator(), max_m=MAX_M, default_chain=CHAIN, max_prefill_chunk=MAX_PREFILL,
                        min_prefill_chunk=MIN_PREFILL, backend="xnnpack", out_path=out,
                        manifest_hash=hashlib.sha256(b"gemma3").hexdigest(), progress=False,
                        draft_chains=False)  # the target's graph is what these tests check
    return types.SimpleNamespace(path=out, report=report, speculator=speculator, seed=seed)


@pytest.mark.slow
def test_exported_gemma_methods_match_eager(gemma_pte):
    from executorch.runtime import Runtime

    prog, spec = Runtime.get().load_program(gemma_pte.path), gemma_pte.speculator()
    x = tokens(256, (1, 40), gemma_pte.seed)
    tol = dict(rtol=1e-4, atol=1e-4)

    def call(method, *inputs):
        return prog.load_method(method).execute(list(inputs))

    def pos(a, b):
        return torch.arange(a, b, dtype=torch.int64)

    with torch.no_grad():
        want, got = spec.prefill(x[:, :MAX_PREFILL], pos(0, MAX_PREFILL)), call("prefill", x[:, :MAX_PREFILL],
                                                                               pos(0, MAX_PREFILL))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], **tol)
        torch.testing.assert_close(got[2], want[2], **tol)
        p = MAX_PREFILL
        for T in range(2, MAX_M + 1):  # each verify window lies past the 6-token window of layer 0
            want = spec.target_verify(x[:, p:p + T], pos(p, p + T))
            got = call("target_verify", x[:, p:p + T], pos(p, p + T))
            assert torch.equal(got[0], want[0]), f"T={T} (seed {gemma_pte.seed})"
            torch.testing.assert_close(got[1], want[1], **tol, msg=f"feature T={T}")
            torch.testing.assert_close(got[2], want[2], **tol, msg=f"logits T={T}")
            p += T
        want, got = spec.target_decode(x[:, p:p + 1], pos(p, p + 1)), call("target_decode", x[:, p:p + 1],
                                                                           pos(p, p + 1))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], **tol)
        feature = spec.prefill(x[:, :8], pos(0, 8))[1]
        want, got = spec.draft_decode(x[:, 1:9], feature, pos(0, 8)), call("draft_decode", x[:, 1:9], feature,
                                                                          pos(0, 8))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[2], want[2], **tol)
