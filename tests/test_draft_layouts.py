"""Public EAGLE-3 draft layouts (speculators, SpecForge, vLLM/AngelSlim/EAGLE-3) load to the same draft, the
aux-layer convention is read explicitly, and a draft fed the layers off by one is refused at load."""

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from models import default_taps, save_speculators, tiny_draft, tiny_target
from models.checkpoint import write_safetensors_dir
from models.draft_layouts import (
    DraftSource,
    aux_layer_verdict,
    check_aux_layers,
    from_tap_layers,
    load_draft,
    to_tap_layers,
)
from pipeline.stages import draft as draft_stage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def flat_config(cfg, architectures, **extra) -> dict:
    """The flat HF Llama config.json SpecForge and vLLM/EAGLE drafts carry."""
    return {"architectures": architectures, "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": False,
            "torch_dtype": "float32", **extra}


def write_layout(draft, path, layout: str) -> None:
    """`draft` written as each public layout stores it (names and config keys as the projects write them)."""
    cfg, state = draft.cfg, draft.state_dict()
    midlayer = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
    path.mkdir(parents=True)
    if layout == "speculators":
        save_speculators(draft, path)
        return
    if layout in ("specforge", "specforge_sharded"):  # SpecForge saves without the frozen embedding
        config = flat_config(cfg, ["LlamaForCausalLMEagle3"], eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(from_tap_layers(cfg.tap_layers, "layer_output")),
            "use_aux_hidden_state": True})
        tensors = {k: v for k, v in midlayer.items() if k != "embed_tokens.weight"}
    elif layout == "vllm":  # vLLM's class, ids at the top level, keys under model. (AngelSlim style)
        config = flat_config(cfg, ["Eagle3LlamaForCausalLM"], eagle_aux_hidden_state_layer_ids=list(cfg.tap_layers))
        tensors = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in state.items()}
    elif layout == "eagle":  # SafeAILab EAGLE-3: a LlamaForCausalLM config, no ids (hard-coded default layers)
        config = flat_config(cfg, ["LlamaForCausalLM"])
        tensors = midlayer
    else:
        raise ValueError(layout)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors_dir(tensors, path, max_shard_bytes=40_000 if layout.endswith("sharded") else None)


@pytest.mark.parametrize("layout, source, key, convention", [
    ("speculators", "speculators", "eagle_aux_hidden_state_layer_ids", "embedding_first"),
    ("specforge", "specforge", "eagle_config.eagle_aux_hidden_state_layer_ids", "layer_output"),
    ("specforge_sharded", "specforge", "eagle_config.eagle_aux_hidden_state_layer_ids", "layer_output"),
    ("vllm", "eagle", "eagle_aux_hidden_state_layer_ids", "embedding_first"),
    ("eagle", "eagle", None, "embedding_first"),
])
@torch.no_grad()
def test_each_layout_loads_back_to_the_same_draft(tmp_path, layout, source, key, convention):
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=64)
    draft.set_vocab_map(torch.arange(0, 256, 4))
    write_layout(draft, tmp_path / layout, layout)
    loaded = load_draft(tmp_path / layout, target)
    file_ids = None if key is None else from_tap_layers(target.cfg.taps, convention)
    assert loaded.source == DraftSource(source, key, file_ids, convention, "layout",
                                        None if key is None else target.cfg.taps)
    assert loaded.cfg == (draft.cfg if key else dataclasses.replace(draft.cfg, tap_layers=None))
    tokens, feats = torch.randint(0, 256, (1, 6)), torch.randn(1, 6, 64)
    draft.reset_cache()
    loaded.reset_cache()
    for a, b in zip(draft(tokens, feats, torch.arange(6)), loaded(tokens, feats, torch.arange(6))):
        assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)


@torch.no_grad()
def test_a_whole_vocab_draft_may_leave_out_d2t_t2d_and_the_embedding(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target)  # draft vocab = the whole vocab
    write_layout(draft, tmp_path / "eagle", "eagle")
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    for k in ("d2t", "t2d", "embed_tokens.weight"):
        del state[k]
    save_file(state, str(tmp_path / "eagle" / "model.safetensors"))
    loaded = load_draft(tmp_path / "eagle", target)
    assert not loaded.d2t.any() and bool(loaded.t2d.all())
    tokens, feats = torch.randint(0, 256, (2, 5)), torch.randn(2, 5, 64)
    for a, b in zip(draft(tokens, feats), loaded(tokens, feats)):
        assert torch.equal(a, b)


def test_the_conventions_convert_once_and_every_default_names_the_same_hidden_states():
    assert to_tap_layers([1, 3, 5], "layer_output") == (2, 4, 6)
    assert to_tap_layers([1, 3, 5], "embedding_first") == (1, 3, 5)
    assert from_tap_layers(to_tap_layers([4, 9, 20], "layer_output"), "layer_output") == (4, 9, 20)
    for L in range(7, 81):
        specforge = [1, L // 2 - 1, L - 4]  # SpecForge's default, a hook on layers[k]: layer-output
        vllm_eagle = [2, L // 2, L - 3]  # vLLM's and EAGLE-3's, captured before layer k: embedding-first
        assert to_tap_layers(specforge, "layer_output") == default_taps(L)
        assert to_tap_layers(vllm_eagle, "embedding_first") == default_taps(L)
    with pytest.raises(ValueError, match="one of"):
        to_tap_layers([1, 2, 3], "hf")


def test_specforge_ids_are_read_layer_output_and_the_other_reading_is_refused_naming_the_setting(tmp_path):
    target = tiny_target()  # 4 layers, taps (2, 3, 4); SpecForge stores [1, 2, 3]
    write_layout(tiny_draft(target), tmp_path / "sf", "specforge")
    assert json.loads((tmp_path / "sf" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert load_draft(tmp_path / "sf", target, aux_layer_convention="layer_output").cfg.tap_layers == (2, 3, 4)
    with pytest.raises(ValueError, match=r"mismatch in tap layers: specforge layout, eagle_config\."
                                         r"eagle_aux_hidden_state_layer_ids=\[1, 2, 3\] read embedding_first "
                                         r"\(draft\.aux_layer_convention\): hidden states \[1, 2, 3\]; the target's "
                                         r"taps are \[2, 3, 4\]\. Set target\.tap_layers=\[1, 2, 3\] .* or "
                                         r"draft\.aux_layer_convention=layer_output"):
        load_draft(tmp_path / "sf", target, aux_layer_convention="embedding_first")


def rewriting_target(tap_layers):
    """6 layers whose last one rewrites the residual (its MLP output x100): hidden states 5 and 6 disagree."""
    target = tiny_target(n_layers=6, tap_layers=tap_layers)
    with torch.no_grad():
        target.layers[-1].mlp.down_proj.weight.mul_(100.0)
    return target


def exact_draft(target, tap_layers=(2, 4, 6)):
    """A draft whose first position is the target's own head on its third tap (fc picks it; attention and MLP
    add nothing): on sequences of one repeated token it agrees with the target exactly when that tap is the last
    hidden state, and hardly ever on hidden state 5."""
    draft = tiny_draft(target, tap_layers=tap_layers)
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 128:].copy_(torch.eye(64))
        draft.layers[0].self_attn.o_proj.weight.zero_()
        draft.layers[0].mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(target.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    return draft


REPEATS = torch.arange(256).view(-1, 1).repeat(1, 2)  # 256 sequences of one token twice: 256 checked positions


def test_a_checkpoint_counting_layer_output_read_embedding_first_is_refused_naming_the_off_by_one(tmp_path):
    """A speculators file whose top-level ids were copied from SpecForge's layer-output ids ([1, 3, 5] for hidden
    states [2, 4, 6]): read as vLLM reads it, the draft gets hidden states one too low, and the held-out check
    in the draft stage says so; the setting it names loads the draft, agreeing with the target throughout."""
    draft = exact_draft(rewriting_target((2, 4, 6)))
    save_speculators(draft, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    dc = OmegaConf.create({"kind": "load", "path": str(tmp_path / "ckpt"), "aux_layer_convention": "auto"})
    wrong = rewriting_target((1, 3, 5))  # the user set target.tap_layers to what the file seemed to say
    with pytest.raises(ValueError, match=r"does not fit the target: aux layers \[1, 3, 5\] agree [0-4]\.\d%; "
                                         r"shifted by \+1 \(\[2, 4, 6\]\) they agree 100\.0%: the checkpoint "
                                         r"probably counts hidden states layer-output .*; set draft\."
                                         r"aux_layer_convention=layer_output and target\.tap_layers=\[2, 4, 6\]"):
        draft_stage.load(dc, wrong, REPEATS)
    dc.aux_layer_convention = "layer_output"
    loaded, report = draft_stage.load(dc, rewriting_target((2, 4, 6)), REPEATS)
    assert loaded.cfg.tap_layers == (2, 4, 6)
    assert report["layout"] == "speculators" and report["aux_layer_convention"] == "layer_output"
    assert report["aux_layers_file"] == [1, 3, 5] and report["aux_agreement"] == 1.0
    assert report["aux_agreement_minus1"] < 0.05 and "aux_agreement_plus1" not in report  # 7 > 6 layers


def test_the_verdict_names_the_other_shift_and_spares_a_draft_that_agrees_nowhere():
    ours = DraftSource("specforge", "eagle_config.eagle_aux_hidden_state_layer_ids", (2, 4, 6), "layer_output",
                       "layout", (3, 5, 7))
    msg = aux_layer_verdict((3, 5, 7), {(3, 5, 7): 0.01, (4, 6, 8): 0.02, (2, 4, 6): 0.40}, ours)
    assert msg.startswith("aux layers [3, 5, 7] agree 1.0%; shifted by -1 ([2, 4, 6]) they agree 40.0%: the "
                          "checkpoint probably counts hidden states embedding-first")
    assert msg.endswith("set draft.aux_layer_convention=embedding_first and target.tap_layers=[2, 4, 6]")
    no_ids = DraftSource("eagle", None, None, "embedding_first", "layout", None)
    msg = aux_layer_verdict((2, 4, 6), {(2, 4, 6): 0.0, (3, 5, 7): 0.3}, no_ids)
    assert "trained on hidden states [3, 5, 7] (eagle layout, no aux-layer ids" in msg
    assert msg.endswith("set target.tap_layers=[3, 5, 7]")
    assert aux_layer_verdict((2, 4, 6), {(2, 4, 6): 0.01, (3, 5, 7): 0.03}, ours) is None  # untrained: no shift helps
    assert aux_layer_verdict((2, 4, 6), {(2, 4, 6): 0.06, (3, 5, 7): 0.6}, ours) is None  # above 5%: its own layers


@torch.no_grad()
def test_check_aux_layers_reports_the_agreements_of_a_draft_on_its_own_layers():
    target = rewriting_target((2, 4, 6))
    report = check_aux_layers(target, exact_draft(target), REPEATS)
    assert report["aux_agreement"] == 1.0 and report["aux_agreement_minus1"] < 0.05


def test_pickle_weights_are_refused(tmp_path):
    target = tiny_target()
    write_layout(tiny_draft(target), tmp_path / "sf", "specforge")
    for f in tmp_path.joinpath("sf").glob("*.safetensors"):
        f.unlink()
    (tmp_path / "sf" / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model\.bin\); they are not loaded, since "
                                         r"unpickling runs code"):
        load_draft(tmp_path / "sf", target)


def test_an_unknown_layout_is_refused_naming_what_was_found(tmp_path):
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                               "num_hidden_layers": 28}))
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "qwen" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"config\.json: not an EAGLE-3 draft layout this loads: found architectures="
                                         r"\['Qwen3ForCausalLM'\], speculators_model_type=None, num_hidden_layers=28, "
                                         r"1 tensors like \['model\.layers\.0\.self_attn\.q_proj\.weight'\]\. "
                                         r"Loadable: speculators"):
        load_draft(tmp_path / "qwen")


def test_what_our_layer_does_not_compute_is_refused_naming_the_key(tmp_path):
    target = tiny_target()
    write_layout(tiny_draft(target), tmp_path / "sf", "specforge")
    config = json.loads((tmp_path / "sf" / "config.json").read_text())
    for key, value in (("fc_norm", True), ("norm_output", False), ("num_hidden_layers", 2)):
        (tmp_path / "sf" / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=f"{key}={value!r}"):
            load_draft(tmp_path / "sf", target)
