"""The export stage and its .pte: one program whose target_verify serves every T in [2, max_m].

Each backend is exported ONCE per session: portable is conftest's `tiny_pte` (export_pte on a 2-layer
target, shared with the runner tests), xnnpack runs the export stage itself on a tiny target (2 layers,
hidden 64, vocab 256, max_seq_len 64) and a draft over a 128-token draft vocab with a real d2t, saved as
target/draft artifacts; that target ties its lm_head to its embedding, as the default target does, so the
xnnpack programs are where a second copy of the table would appear. Every test runs the real
executorch.runtime against an eager Speculator with the same weights. int4 lowering takes over a minute
even for this model; EXPORT_TEST_INT4=0 skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

from models import Speculator, load_target, save_speculators, save_target, tiny_draft, tiny_target
from models.quantize import quantize
from models.speculator import chain_methods
from pipeline.store import Artifact
from pipeline.stages import export as export_stage
from pipeline import export_pte as export_lib
from pipeline import pte_segments

pytestmark = pytest.mark.slow  # exports programs

MAX_M, CHAIN, MIN_PREFILL, MAX_PREFILL, MAX_SEQ = 4, 2, 5, 16, 64
BACKENDS = [("portable", "fp32"), ("xnnpack", "fp32")]
if os.environ.get("EXPORT_TEST_INT4", "1") != "0":
    BACKENDS += [("xnnpack", "8da4w_offsets"), ("xnnpack", "8da4w_draft")]


def export_cfg(**over):
    ec = dict(backend="xnnpack", quant="fp32", group_size=32, max_m=MAX_M, default_chain=CHAIN,
              max_prefill_chunk=MAX_PREFILL, min_prefill_chunk=MIN_PREFILL, max_seq_len=MAX_SEQ)
    ec.update(over)
    return OmegaConf.create({"export": ec})


def make_target(seed=0, n_layers=2, **over):
    return tiny_target(seed=seed, n_layers=n_layers, max_seq_len=MAX_SEQ, **over)


def make_draft(target, seed=1, **over):
    draft = tiny_draft(target, seed=seed, draft_vocab_size=128, **over)
    used = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:128].sort().values
    draft.set_vocab_map(used)
    return draft


def save_pair(root, target, draft, name="pair", target_key="t" * 64, draft_upstream=None):
    tdir, ddir = root / f"{name}_target", root / f"{name}_draft"
    save_target(target, tdir)
    (tdir / "tokenizer.json").write_text('{"stand-in": "tokenizer"}')
    save_speculators(draft, ddir)
    t_art = Artifact("target", target_key, tdir, {"upstream": {}, "report": {}})
    d_art = Artifact("draft", "d" * 64, ddir, {"upstream": draft_upstream or {}, "report": {}})
    return t_art, d_art


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    target = make_target(tie_embeddings=True)  # as the default target: lm_head.weight is embed_tokens.weight
    bound = target.cfg.hidden_size ** -0.5  # nn.Linear's init, an untied lm_head's: int4's tolerance is set for it
    torch.nn.init.uniform_(target.embed_tokens.weight, -bound, bound)
    return save_pair(tmp_path_factory.mktemp("artifacts"), target, make_draft(target))


@pytest.fixture(scope="session", params=BACKENDS, ids=lambda p: "-".join(p))
def exported(request, pair, tmp_path_factory):
    """One exported program per backend, as a namespace: path, report, backend, quant, eager() (a fresh
    eager Speculator with the same weights), the export arguments, and the expected manifest hash.

    portable reuses conftest's `tiny_pte` (built with export_pte directly, shared with the runner tests);
    xnnpack (and int4) run the export stage itself on the saved `pair` artifacts.
    """
    backend, quant = request.param
    if backend == "portable":
        t = request.getfixturevalue("tiny_pte")
        spec = t.speculator()
        return types.SimpleNamespace(
            path=t.path, report=t.report, backend=backend, quant=quant, eager=t.speculator, max_m=t.max_m,
            default_chain=t.default_chain, min_prefill_chunk=t.min_prefill_chunk, max_prefill_chunk=t.max_prefill_chunk,
            vocab_size=spec.target.cfg.vocab_size, draft_vocab_size=spec.draft.cfg.draft_vocab_size,
            max_seq_len=spec.target.cfg.max_seq_len, manifest_hash=t.report["manifest_hash"])
    out = tmp_path_factory.mktemp(f"export_{backend}_{quant}")
    # the chains (most of an export's lowering) on the default quantisation and on fp32
    cfg = export_cfg(backend=backend, quant=quant, draft_chains=quant != "8da4w_offsets")
    report = export_stage.run(cfg, {"target": pair[0], "draft": pair[1]}, out)
    facts = export_stage.pairing_facts(pair[0].path, pair[1].path, eager(pair))
    return types.SimpleNamespace(
        path=out / export_stage.PTE, report=report, backend=backend, quant=quant, eager=lambda: eager(pair, quant),
        max_m=MAX_M, default_chain=CHAIN, min_prefill_chunk=MIN_PREFILL, max_prefill_chunk=MAX_PREFILL,
        vocab_size=256, draft_vocab_size=128, max_seq_len=MAX_SEQ, manifest_hash=export_stage.hash_facts(facts))


def eager(pair, quant="fp32"):
    """A fresh eager Speculator with the stage's weights (8da4w_offsets, 8da4w_draft: quantized the same way)."""
    spec = export_stage.load_pair(pair[0].path, pair[1].path)
    quantize(spec, quant, 32)
    return spec


def program(path):
    from executorch.runtime import Runtime

    return Runtime.get().load_program(path)


def call(prog, method, *inputs):
    return prog.load_method(method).execute(list(inputs))


def tol(quant):  # int4: the eager reference fakes the integer kernels
    return dict(atol=1e-4, rtol=1e-4) if quant == "fp32" else dict(atol=5e-2, rtol=5e-2)


PROMPT = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(7))


def pos(a, b):
    return torch.arange(a, b, dtype=torch.int64)


# --- the program against the eager module --------------------------------------------------------------
def test_target_verify_matches_eager_for_every_T(exported):
    x = exported
    prog, spec = program(x.path), x.eager()
    with torch.no_grad():
        want = spec.prefill(PROMPT[:, :8], pos(0, 8))
        got = call(prog, "prefill", PROMPT[:, :8], pos(0, 8))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], **tol(x.quant))
        for T in range(2, x.max_m + 1):
            want = spec.target_verify(PROMPT[:, 8:8 + T], pos(8, 8 + T))
            got = call(prog, "target_verify", PROMPT[:, 8:8 + T], pos(8, 8 + T))
            assert got[0].shape == (1, T) and torch.equal(got[0], want[0]), f"T={T}"
            torch.testing.assert_close(got[1], want[1], **tol(x.quant), msg=f"feature T={T}")
            torch.testing.assert_close(got[2], want[2], **tol(x.quant), msg=f"logits T={T}")
        want = spec.target_decode(PROMPT[:, 12:13], pos(12, 13))
        got = call(prog, "target_decode", PROMPT[:, 12:13], pos(12, 13))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], **tol(x.quant))


def test_verify_after_prefill_sees_the_prefill_cache(exported):
    """prefill -> draft_decode -> target_verify in one program equals a full stateless recompute.

    A program whose verify did not see prefill's cache (not shared, or clobbered by draft_decode's
    arena) would match a fresh program instead, which is checked to differ.
    """
    x, M = exported, exported.max_m
    spec, prog = x.eager(), program(x.path)
    with torch.no_grad():
        _, feature, _ = call(prog, "prefill", PROMPT[:, :8], pos(0, 8))
        call(prog, "draft_decode", PROMPT[:, 1:9], feature, pos(0, 8))
        ids, verify_feature, logits = call(prog, "target_verify", PROMPT[:, 8:8 + M], pos(8, 8 + M))
        full_logits = spec.target(PROMPT[:, :8 + M])  # stateless: causal over the whole sequence
        torch.testing.assert_close(logits, full_logits[:, 8:], **tol(x.quant))
        assert torch.equal(ids, full_logits[:, 8:].argmax(-1))
        # the K=0 step continues the same cache
        got = call(prog, "target_decode", PROMPT[:, 8 + M:9 + M], pos(8 + M, 9 + M))
        torch.testing.assert_close(got[1], spec.target(PROMPT[:, :9 + M])[:, -1:], **tol(x.quant))

        _, fresh_feature, fresh_logits = call(program(x.path), "target_verify", PROMPT[:, 8:8 + M], pos(8, 8 + M))
    assert (fresh_logits - logits).abs().max() > 1e-2
    assert (fresh_feature - verify_feature).abs().max() > 1e-2


def test_draft_decode_matches_eager_seed_then_single_steps(exported):
    """fp32: the same ids; a quantised draft (the eager reference fakes the integer kernels): logits within
    tolerance and ids that are the argmax of the program's own logits (a near tie may take the other id)."""
    x = exported
    prog, spec = program(x.path), x.eager()

    def check(got, want, where):
        if x.quant == "fp32":
            assert torch.equal(got[0], want[0]), where
        else:
            torch.testing.assert_close(got[2], want[2], **tol(x.quant))
            assert torch.equal(got[0], spec.draft.to_target(got[2].argmax(-1))), where

    with torch.no_grad():
        _, feature, _ = spec.prefill(PROMPT[:, :8], pos(0, 8))
        want = spec.draft_decode(PROMPT[:, 1:9], feature, pos(0, 8))  # seed: T = 8
        got = call(prog, "draft_decode", PROMPT[:, 1:9], feature, pos(0, 8))
        for p in range(8, 11):  # then single steps feeding back g
            check(got, want, f"position {p}")
            torch.testing.assert_close(got[1], want[1], **tol(x.quant))
            tok, g = want[0][:, -1:], want[1][:, -1:]
            want = spec.draft_decode(tok, g, pos(p, p + 1))
            got = call(prog, "draft_decode", tok, g, pos(p, p + 1))
        check(got, want, "last step")
    assert bool(spec.draft.t2d[got[0]].all()), "draft_decode must return TARGET-vocab ids (d2t applied)"


def test_draft_chain_proposes_what_single_draft_decode_steps_propose(exported):
    """draft_chain_<k> is a round's draft in one call: seeding on T rows, then k-1 single steps on its own
    proposals. For every k, at a seed width drawn afresh, the program's chain gives the ids of its own
    draft_decode calls, and the eager Speculator's chain those of its own steps."""
    x = exported
    if not x.report["draft_chains"]:
        pytest.skip("exported without draft_chain_<k> (export.draft_chains=false)")
    prog, spec = program(x.path), x.eager()
    widths = torch.randint(1, x.max_m + 1, (x.max_m - 1,)).tolist()

    def steps(decode, rows, feats, start, k):
        ids, g, _ = decode(rows, feats, pos(start, 16))
        out = [ids[:, -1:]]
        for p in range(16, 16 + k - 1):
            ids, g, _ = decode(out[-1], g[:, -1:], pos(p, p + 1))
            out.append(ids)
        return torch.cat(out, dim=1)

    with torch.no_grad():
        _, feature, _ = spec.prefill(PROMPT[:, :16], pos(0, 16))
        for k, T in zip(range(1, x.max_m), widths):
            start = 16 - T
            rows, feats = PROMPT[:, start + 1:17], feature[:, start:16]
            for decode in (lambda *a: call(prog, "draft_decode", *a), spec.draft_decode):
                if start:  # the draft cache holds the positions before the seed rows
                    decode(PROMPT[:, 1:start + 1], feature[:, :start], pos(0, start))
            want = steps(lambda *a: call(prog, "draft_decode", *a), rows, feats, start, k)
            (got,) = call(prog, f"draft_chain_{k}", rows, feats, pos(start, 16))
            assert got.shape == (1, k) and torch.equal(got, want), (k, T, got, want)
            want = steps(spec.draft_decode, rows, feats, start, k)
            assert torch.equal(spec.draft_chain(rows, feats, pos(start, 16), k), want), (k, T)


def test_window_above_max_m_is_refused_by_the_runtime(exported):
    M = exported.max_m
    prog = program(exported.path)
    with pytest.raises(RuntimeError):
        call(prog, "target_verify", PROMPT[:, :M + 1], pos(0, M + 1))
    with pytest.raises(RuntimeError):
        call(prog, "target_decode", PROMPT[:, :2], pos(0, 2))
    ids = call(prog, "target_verify", PROMPT[:, :M], pos(0, M))[0]  # the program still works
    assert ids.shape == (1, M)


def test_constant_methods_read_back(exported):
    x = exported
    prog, spec = program(x.path), x.eager()
    want = {"get_max_m": x.max_m, "get_chain_len": x.default_chain, "get_max_seq_len": x.max_seq_len,
            "get_vocab_size": x.vocab_size, "get_draft_vocab_size": x.draft_vocab_size,
            "get_max_prefill_chunk": x.max_prefill_chunk, "get_min_prefill_chunk": x.min_prefill_chunk,
            "get_hidden_size": 64, "get_backend": x.backend, "get_quant": x.quant,
            "get_manifest_hash": x.manifest_hash, "get_sliding_window": 0}
    for name, value in want.items():
        assert call(prog, name) == [value], name
    assert x.report["manifest_hash"] == x.manifest_hash and len(x.manifest_hash) == 64
    (d2t,) = call(prog, "get_d2t")
    assert d2t.dtype == torch.int64 and torch.equal(d2t, spec.draft.d2t) and d2t.any()
    assert x.report["t_range"]["target_verify"] == [2, x.max_m]
    assert x.report["t_range"]["prefill"] == [x.min_prefill_chunk, x.max_prefill_chunk]
    assert x.report["t_range"]["draft_decode"] == [1, max(x.max_prefill_chunk, x.max_m)]
    chains = chain_methods(x.max_m) if x.report["draft_chains"] else ()
    methods = export_lib.TARGET_METHODS + ("draft_decode",) + chains
    assert set(x.report["ops_outside_delegate"]) == set(methods)
    assert all(x.report["t_range"][m] == [1, x.max_m] for m in chains)
    assert x.report["attention"] == "llama_ops" and x.report["fc_norms"] is True
    if x.backend == "xnnpack":
        assert all(x.report["delegate_calls"][m] > 0 for m in methods)


def test_only_the_cache_and_attention_ops_stay_outside_xnnpack_per_layer(exported):
    """Each layer of an xnnpack method leaves exactly its two cache writes and its attention outside the
    delegate (norms, RoPE, views and GQA run inside it), so the delegate calls are about one per layer
    plus a fixed few, whatever T. target_verify_exact's attention is eagle3::exact_sdpa, which takes the rows'
    positions and needs no mask."""
    x = exported
    if x.backend != "xnnpack":
        pytest.skip("the portable program has no delegate")
    n_layers = {"prefill": 2, "target_verify": 2, "target_verify_exact": 2, "target_decode": 2, "draft_decode": 1}
    n_layers |= {name: k for k, name in enumerate(chain_methods(x.max_m), start=1)}  # one draft layer per step
    for method, listing in x.report["ops_outside_delegate"].items():
        ops = dict(item.rsplit(" x", 1) for item in listing)
        ours, theirs = "eagle3.exact_sdpa.default", "llama.custom_sdpa.default"
        attention, other = (ours, theirs) if method == "target_verify_exact" else (theirs, ours)
        assert int(ops[attention]) == n_layers[method] and other not in ops, (method, listing)
        assert int(ops["auto_functionalized_v2"]) == 2 * n_layers[method], (method, listing)  # update_cache
        assert "aten.where.self" not in ops, (method, listing)
        for op in ("aten.index_put.default", "aten.expand_copy.default", "aten.mean.dim",
                   "aten.view_copy.default", "aten.split_with_sizes_copy.default"):
            assert op not in ops, (method, op, listing)
        # a chain step's argmax (outside) splits its layer's delegate from its lm_head's: two calls a step
        bound = 2 * n_layers[method] + 1 if method.startswith("draft_chain_") else n_layers[method] + 3
        assert x.report["delegate_calls"][method] <= bound, (method, x.report["delegate_calls"])


# --- the embedding table is stored once --------------------------------------------------------------
def test_the_program_stores_the_embedding_table_once(exported):
    """The table's bytes occur once in the file, whichever backend and quantisation.

    xnnpack/none: the lookup (outside the delegate) and the tied lm_head (an XNNPACK linear) read the same
    bytes, the lm_head's named-data entry a range of the constant segment, and the data segments hold no
    more than the module's distinct tensors (a second copy in any layout would add the table's bytes).
    int4: the lm_head's int4 weights differ from the fp32 table, which the constant segment holds once.
    """
    x = exported
    spec = x.eager()
    table = spec.target.embed_tokens.weight.detach().contiguous()
    data = x.path.read_bytes()
    assert data.count(table.numpy().tobytes()) == 1
    assert spec.draft.embed_tokens.weight is spec.target.embed_tokens.weight
    layout = pte_segments.data_layout(data)
    assert x.report["pte_bytes"] == len(data) and x.report["pte_shared_bytes"] == layout["named_data_shared"]
    if x.backend == "xnnpack" and x.quant == "fp32":
        assert spec.target.lm_head.weight is spec.target.embed_tokens.weight
        assert layout["named_data_shared"] >= table.nbytes
        seen, distinct = set(), 0  # the KV caches are planned memory, not stored data
        for name, t in list(spec.named_parameters()) + list(spec.named_buffers()):
            if not name.endswith("_cache") and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                distinct += t.nbytes
        assert layout["constant"] + layout["named_data"] < distinct + table.nbytes // 2, (layout, distinct)


def test_share_constant_bytes_keeps_a_delegated_lm_head_and_one_table(tmp_path):
    """A head-only program (lookup, norm, tied lm_head) where the table is nearly the whole file: after
    share_constant_bytes the file holds it once, the lm_head is still an XNNPACK delegate, outputs are
    unchanged, and a second pass finds nothing left to share."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    V, H = 4096, 64

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, H)
            self.lm_head = torch.nn.Linear(H, V, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, tokens):
            h = self.embed(tokens)
            return self.lm_head(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.manual_seed(0)
    head = Head().eval()
    tokens = torch.tensor([[3, V - 1]])
    with torch.no_grad():
        ep = torch.export.export(head, (tokens,), strict=False)
        want = head(tokens)
    lowered = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    delegates, outside = export_lib.graph_ops(lowered.exported_program())
    assert delegates >= 1 and not any("linear" in op or "mm" in op for op in outside), outside
    before = lowered.to_executorch().buffer
    table = head.embed.weight.detach().numpy().tobytes()
    assert before.count(table) == 2  # the lookup's constant and the delegate's named data
    after, shared = pte_segments.share_constant_bytes(before)
    assert after.count(table) == 1 and [n for _, n in shared] == [len(table)]
    assert len(after) < len(table) * 1.5 < len(before)
    assert pte_segments.share_constant_bytes(after) == (after, [])
    (tmp_path / "before.pte").write_bytes(before)
    (tmp_path / "after.pte").write_bytes(after)
    (got,) = call(program(tmp_path / "after.pte"), "forward", tokens)
    assert torch.equal(got, call(program(tmp_path / "before.pte"), "forward", tokens)[0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_draft_reads_the_targets_embedding_when_equal():
    target = make_target()
    spec = Speculator(target, make_draft(target))
    assert spec.draft.embed_tokens.weight is target.embed_tokens.weight
    other = make_draft(target)
    with torch.no_grad():
        other.embed_tokens.weight.add_(1.0)  # a draft with a table of its own keeps it
    spec = Speculator(target, other)
    assert spec.draft.embed_tokens.weight is not target.embed_tokens.weight


def test_a_draft_saved_in_bfloat16_loads_and_exports_with_a_float32_target(tmp_path):
    """A draft as a GPU run can leave it (weights in bfloat16) loads on the CPU into the float32 draft, takes
    the target's own embedding (the stored one is its bfloat16 rounding: one table in the program, as for a
    float32 draft), and exports: the program's draft_decode computes the bfloat16 weights' draft."""
    import json

    from safetensors.torch import load_file

    from models import load_speculators

    target = make_target(tie_embeddings=True)
    bound = target.cfg.hidden_size ** -0.5
    torch.nn.init.uniform_(target.embed_tokens.weight, -bound, bound)
    trained = make_draft(target, seed=int.from_bytes(os.urandom(2), "little")).to(torch.bfloat16)
    t_art, d_art = save_pair(tmp_path, target, trained, name="bf16")
    stored = load_file(str(d_art.path / "model.safetensors"))
    assert stored["fc.weight"].dtype == stored["embed_tokens.weight"].dtype == torch.bfloat16
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    config = json.loads((d_art.path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and "cuda" not in json.dumps(config)
    assert not torch.equal(stored["embed_tokens.weight"].float(), target.embed_tokens.weight), \
        "the bfloat16 table differs from the target's: the check below can fail"

    draft = load_speculators(d_art.path, target)
    assert all(t.dtype == torch.float32 for t in draft.parameters())
    assert torch.equal(draft.fc.weight, stored["fc.weight"].float())
    assert torch.equal(draft.embed_tokens.weight, target.embed_tokens.weight)
    assert Speculator(target, draft).draft.embed_tokens.weight is target.embed_tokens.weight
    other = make_target(seed=5, tie_embeddings=True)
    with pytest.raises(ValueError, match="embed_tokens differs from the target's"):
        load_speculators(d_art.path, other)

    out = tmp_path / "export"
    out.mkdir()
    export_stage.run(export_cfg(backend="portable"), {"target": t_art, "draft": d_art}, out)
    spec = export_stage.load_pair(t_art.path, d_art.path)
    prog = program(out / export_stage.PTE)
    with torch.no_grad():
        feature = spec.prefill(PROMPT[:, :8], pos(0, 8))[1]
        want = spec.draft_decode(PROMPT[:, 1:9], feature, pos(0, 8))
    got = call(prog, "draft_decode", PROMPT[:, 1:9], feature, pos(0, 8))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[2], want[2], **tol("fp32"))


# --- refusals before any lowering ----------------------------------------------------------------------
@pytest.fixture
def no_lowering(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("lowering started although the configuration should have been refused")

    monkeypatch.setattr(export_lib, "export", fail)
    monkeypatch.setattr(export_stage, "export_pte", fail)


@pytest.mark.parametrize("over, match", [
    (dict(max_m=1), r"max_m=1.*>= 2"),
    (dict(max_m=MAX_SEQ + 1, min_prefill_chunk=MAX_SEQ + 2), r"max_m=65 is larger than .*max_seq_len=64"),
    (dict(max_m=17, min_prefill_chunk=18, max_prefill_chunk=20), r"max_m=17: the small-M kernels take at most 16"),
    (dict(min_prefill_chunk=MAX_M), r"prefill T range \[4, 16\] straddles the dispatch threshold"),
    (dict(min_prefill_chunk=2), r"straddles the dispatch threshold max_m=4"),
    (dict(default_chain=MAX_M), r"default_chain=4.*\[1, 3\]"),
    (dict(default_chain=0), r"default_chain=0"),
    (dict(backend="portable", quant="8da4w_offsets"), r"8da4w_offsets needs export=xnnpack"),
    (dict(backend="cuda"), r"backend='cuda'"),
    (dict(max_prefill_chunk=MAX_SEQ + 1), r"max_seq_len=64"),
    (dict(max_seq_len=MAX_M - 1), r"max_m=4 is larger than .*max_seq_len=3"),
])
def test_bad_export_config_is_refused_before_lowering(over, match, pair, tmp_path, no_lowering):
    with pytest.raises(ValueError, match=match):
        export_stage.run(export_cfg(**over), {"target": pair[0], "draft": pair[1]}, tmp_path)


def test_export_pte_checks_its_arguments_before_tracing(pair, tmp_path, no_lowering):
    spec = eager(pair)
    common = dict(default_chain=1, max_prefill_chunk=16, min_prefill_chunk=5, out_path=tmp_path / "m.pte",
                  manifest_hash="0" * 64)
    with pytest.raises(ValueError, match="max_m"):
        export_lib.export_pte(spec, max_m=1, **common)
    with pytest.raises(ValueError, match="straddles"):
        export_lib.export_pte(spec, max_m=8, **{**common, "min_prefill_chunk": 8})
    with pytest.raises(ValueError, match="manifest_hash"):
        export_lib.export_pte(spec, max_m=4, **{**common, "manifest_hash": "not-a-hash"})


def test_dispatch_windows_follow_the_kernels_rule():
    check = export_lib.check_dispatch_windows
    check({"target_verify": (2, 8), "prefill": (9, 128), "target_decode": (1, 1)}, 8)
    with pytest.raises(ValueError, match=r"target_verify T range \[2, 8\] straddles .* max_m=4"):
        check({"target_verify": (2, 8)}, 4)
    with pytest.raises(ValueError, match="min_prefill_chunk"):
        check({"prefill": (8, 128)}, 8)


@pytest.mark.parametrize("case, match", [
    ("other_target", r"embed_tokens differs"),
    ("taps", r"tap layers"),
    ("hidden", r"hidden size"),
    ("vocab", r"vocab"),
    ("lineage", r"built for target"),
])
def test_draft_that_does_not_fit_the_target_is_refused_before_lowering(case, match, tmp_path, no_lowering):
    target = make_target(n_layers=3) if case == "taps" else make_target()  # 2 layers allow only taps (0, 1, 2)
    if case == "other_target":  # same shapes, trained for another target (its embedding copy differs)
        draft = make_draft(make_target(seed=5))
    elif case == "taps":
        draft = make_draft(target, tap_layers=(0, 1, 2))  # the target's are (1, 2, 3)
    elif case == "hidden":
        draft = make_draft(make_target(hidden_size=32, head_dim=8))
    elif case == "vocab":
        draft = make_draft(make_target(vocab_size=512))
    else:
        draft = make_draft(target)
    upstream = {"target": "x" * 64} if case == "lineage" else None
    t_art, d_art = save_pair(tmp_path, target, draft, draft_upstream=upstream)
    with pytest.raises(ValueError, match=match):
        export_stage.run(export_cfg(), {"target": t_art, "draft": d_art}, tmp_path / "out")


def test_a_cache_longer_than_the_targets_trained_context_is_refused_before_lowering(tmp_path, no_lowering):
    target = make_target(context_length=MAX_SEQ)
    t_art, d_art = save_pair(tmp_path, target, make_draft(target))
    with pytest.raises(ValueError, match=rf"export.max_seq_len={2 * MAX_SEQ} exceeds the {MAX_SEQ} positions"):
        export_stage.run(export_cfg(max_seq_len=2 * MAX_SEQ), {"target": t_art, "draft": d_art}, tmp_path / "out")


@torch.no_grad()
def test_the_cache_length_is_the_exports_and_changes_no_token(pair):
    """The stage loads the pair at export.max_seq_len: both caches and RoPE tables that long, the weights the
    artifacts' own, and a greedy decode at a drawn prompt the same tokens as at the artifacts' length."""
    from runner.engine import EagerEngine
    from runner.generate import generate

    short, long = export_stage.load_pair(pair[0].path, pair[1].path), export_stage.load_pair(
        pair[0].path, pair[1].path, 3 * MAX_SEQ)
    assert short.target.cfg.max_seq_len == MAX_SEQ and long.target.cfg.max_seq_len == 3 * MAX_SEQ
    assert long.draft.cfg.max_seq_len == 3 * MAX_SEQ
    assert long.target.layers[0].self_attn.k_cache.shape[2] == 3 * MAX_SEQ
    for (name, a), (_, b) in zip(short.state_dict().items(), long.state_dict().items()):
        assert torch.equal(a, b), name
    prompt = torch.randint(0, 256, (int(torch.randint(4, 20, ())),)).tolist()
    decoded = [generate(EagerEngine(spec, max_m=MAX_M, default_chain=CHAIN, max_prefill_chunk=MAX_PREFILL,
                                    min_prefill_chunk=MIN_PREFILL), prompt, chain=k, max_new_tokens=24).output_ids
               for spec in (short, long) for k in (0, CHAIN)]
    assert decoded[0] == decoded[1] == decoded[2] == decoded[3]


def test_stage_loads_the_stored_target_unchanged(pair):
    spec = export_stage.load_pair(pair[0].path, pair[1].path)
    stored = load_target(pair[0].path)
    assert torch.equal(spec.target.embed_tokens.weight, stored.embed_tokens.weight)


def test_sliding_window_constant_is_the_smallest_window():
    args = dict(max_m=4, default_chain=1, max_prefill_chunk=16, min_prefill_chunk=5, manifest_hash="0" * 64,
                backend="portable", quant="fp32")
    for window, want in (([8, None], 8), (None, 0)):
        target = make_target(sliding_window=window)
        spec = Speculator(target, make_draft(target))
        assert export_lib.constant_methods(spec, **args)["get_sliding_window"] == want


def test_draft_gap_guard_is_off_only_while_tracing(pair):
    spec = eager(pair)
    with export_lib._tracing_mode(spec):
        assert not spec.draft.check_gaps
    assert spec.draft.check_gaps


def test_the_export_path_reads_the_dispatch_rule_without_triton():
    code = "import sys, pipeline.export_pte; print('triton' in sys.modules, 'kernels.dispatch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --- a killed export resumes (issue 45) --------------------------------------------------------------------
def test_an_interrupted_export_lowers_only_the_rest_and_writes_the_same_bytes(tiny_pte, tmp_path, monkeypatch):
    """Each lowered method is kept in the scratch dir: a run (one process) that stops at the fourth method leaves
    three, the rerun lowers the rest in two forked processes, and its .pte equals, byte for byte, conftest's,
    exported in one go without scratch."""
    import executorch.exir

    args = dict(max_m=tiny_pte.max_m, default_chain=tiny_pte.default_chain, backend="portable",
                max_prefill_chunk=tiny_pte.max_prefill_chunk, min_prefill_chunk=tiny_pte.min_prefill_chunk,
                manifest_hash=tiny_pte.report["manifest_hash"], progress=False, scratch=tmp_path)
    real, lowered = executorch.exir.to_edge_transform_and_lower, []

    def lower(programs, *a, **kw):
        (name,) = programs
        if name == "target_decode" and "interrupt" in lowered:
            raise KeyboardInterrupt("killed while lowering target_decode")
        lowered.append(name)
        return real(programs, *a, **kw)

    monkeypatch.setattr(executorch.exir, "to_edge_transform_and_lower", lower)
    monkeypatch.setattr(export_lib, "lowering_workers", lambda: 1)
    lowered.append("interrupt")
    with pytest.raises(KeyboardInterrupt):
        export_lib.export_pte(tiny_pte.speculator(), out_path=tmp_path / "model.pte", **args)
    assert sorted(p.name for p in tmp_path.glob("*.lowered.pt2")) == ["prefill.lowered.pt2",
                                                                      "target_verify.lowered.pt2",
                                                                      "target_verify_exact.lowered.pt2"]
    lowered.clear()
    monkeypatch.setattr(export_lib, "lowering_workers", lambda: 2)
    report = export_lib.export_pte(tiny_pte.speculator(), out_path=tmp_path / "model.pte", **args)
    assert not lowered, "the workers lower; this process only loads what they saved"
    assert report["methods_resumed"] == ["prefill", "target_verify", "target_verify_exact"]
    assert report["lowering_processes"] == 2
    assert {f"lower_{name}_s" for name in ("target_decode", "draft_decode", *chain_methods(tiny_pte.max_m))} <= set(
        report["timings"]) and "lower_prefill_s" not in report["timings"], "the rerun lowers only what was not saved"
    assert report["delegate_calls"] == tiny_pte.report["delegate_calls"]
    assert (tmp_path / "model.pte").read_bytes() == tiny_pte.path.read_bytes()


def test_methods_loaded_one_by_one_share_one_copy_of_equal_weights():
    """Fresh tensors each call: equal name, shape, dtype and values become one object; anything else stays."""
    from pipeline.export_pte import share_weights

    w, b = torch.randn(64, 32), torch.randn(32)
    first = types.SimpleNamespace(state_dict={"w": w, "b": b}, constants={"c": torch.arange(5)})
    second = types.SimpleNamespace(state_dict={"w": w.clone(), "b": b + 1}, constants={"c": torch.arange(5)})
    seen: dict = {}
    assert share_weights(first, seen) == 0
    assert share_weights(second, seen) == w.numel() * 4 + 5 * 8
    assert second.state_dict["w"] is first.state_dict["w"] and second.constants["c"] is first.constants["c"]
    assert second.state_dict["b"] is not first.state_dict["b"] and torch.equal(second.state_dict["b"], b + 1)


def test_a_resumed_xnnpack_export_reads_each_shared_weight_file_once_and_a_missing_one_lowers_again(
        tiny_pte, tmp_path, monkeypatch):
    """XNNPACK's weights are kept beside the saved methods as one `<sha256>.named` file per distinct buffer, so the
    target methods, which hold the same weights, share files; the program emitted from them is the one an export
    without saved files writes, and a method whose weight file is gone (or damaged) is lowered again, which
    writes the file back for the methods after it. (Two methods, to keep CI short.)"""
    import json
    import zipfile

    specs = export_lib.method_specs
    monkeypatch.setattr(export_lib, "method_specs", lambda **kw: {
        name: spec for name, spec in specs(**kw).items() if name in ("target_verify", "target_decode")})
    args = dict(max_m=tiny_pte.max_m, default_chain=tiny_pte.default_chain, backend="xnnpack",
                max_prefill_chunk=tiny_pte.max_prefill_chunk, min_prefill_chunk=tiny_pte.min_prefill_chunk,
                manifest_hash=tiny_pte.report["manifest_hash"], progress=False)
    first = export_lib.export_pte(tiny_pte.speculator(), out_path=tmp_path / "a.pte", scratch=tmp_path, **args)
    index = {}
    for saved in tmp_path.glob(f"*{export_lib.LOWERED_SUFFIX}"):
        with zipfile.ZipFile(saved) as z:
            name = next(n for n in z.namelist() if n.endswith("named_data"))
            index[saved.name.removesuffix(export_lib.LOWERED_SUFFIX)] = [d for ds in json.loads(z.read(name)).values()
                                                                       for d in ds]
    files = {p.name.removesuffix(export_lib.NAMED_DATA_SUFFIX) for p in tmp_path.glob(f"*{export_lib.NAMED_DATA_SUFFIX}")}
    referenced = [d for ds in index.values() for d in ds]
    assert set(referenced) == files and len(files) < len(referenced), "methods with equal weights share files"
    in_memory = export_lib.export_pte(tiny_pte.speculator(), out_path=tmp_path / "m.pte", **args)
    assert in_memory["delegate_calls"] == first["delegate_calls"]
    assert (tmp_path / "m.pte").read_bytes() == (tmp_path / "a.pte").read_bytes(), "the saved files change no byte"

    order = list(first["delegate_calls"])
    gone = next(d for d in index[order[0]] if sum(d in ds for ds in index.values()) > 1)
    (tmp_path / f"{gone}{export_lib.NAMED_DATA_SUFFIX}").unlink()
    again = export_lib.export_pte(tiny_pte.speculator(), out_path=tmp_path / "b.pte", scratch=tmp_path, **args)
    assert again["methods_resumed"] == order[1:], "the first user of the missing file lowers again, the rest resume"
    assert (tmp_path / f"{gone}{export_lib.NAMED_DATA_SUFFIX}").is_file()
    assert (tmp_path / "b.pte").read_bytes() == (tmp_path / "a.pte").read_bytes()
