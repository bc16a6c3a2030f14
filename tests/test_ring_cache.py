"""Sliding-window layers on ring caches (models.target): window + max_t slots, position p in slot p % ring, and
the same tokens and logits as transformers' Gemma 3 over prompts several windows long.

The checkpoint is a tiny random Gemma3ForCausalLM (four layers, one of them global, a 16-token window) whose
prompt is five windows long, so every windowed layer's ring wraps several times: prefilled in chunks of every
width up to max_t, each after a rejected window written ahead, then read in verify windows of every width, on
the eager reference (index_copy), on ExecuTorch's llama ops (and their exact call), and in the exported
program at every K. Seeds are fresh on every run and named in failures.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import Speculator, load_hf_target, tiny_draft  # noqa: E402
from models.target import kv_cache_bytes, ring_slots  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

S, F = "sliding_attention", "full_attention"
WINDOW, MAX_T, SEQ, VOCAB = 16, 8, 128, 256
RING = WINDOW + MAX_T
PROMPT, NEW = 5 * WINDOW, 24
GEMMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=[S, S, F, S],
             rope_theta=10_000.0, rope_local_base_freq=100.0, query_pre_attn_scalar=20, final_logit_softcapping=None,
             max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None, pad_token_id=None,
             torch_dtype="float32", attn_implementation="eager")
TOL = dict(rtol=1e-4, atol=1e-4)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The checkpoint, a prompt of five windows, transformers' greedy continuation and its logits at every position."""
    seed = fresh_seed()
    path = tmp_path_factory.mktemp("ring_gemma3")
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a wider spread than HF's init, so greedy is not decided by float noise on near ties
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.15))
    hf.save_pretrained(path)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=g)
    with torch.no_grad():
        ids = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                          min_new_tokens=NEW, pad_token_id=0)
        logits = hf(ids).logits[0]
    assert ids.shape[1] == PROMPT + NEW
    return types.SimpleNamespace(path=path, seed=seed, ids=ids, logits=logits, prompt=prompt[0].tolist(),
                                 continuation=ids[0, PROMPT:].tolist())


def ring_target(gemma, impl: str):
    target, _ = load_hf_target(gemma.path, max_seq_len=SEQ)
    target.set_kv_impl(impl)
    target.setup_cache(max_t=MAX_T)
    return target


def test_windowed_layers_hold_the_ring_and_global_layers_every_position(gemma):
    for impl, slot_dim in (("index_copy", 2), ("llama_ops", 1)):
        target = ring_target(gemma, impl)
        slots = [layer.self_attn.k_cache.shape[slot_dim] for layer in target.layers]
        assert slots == [RING, RING, SEQ, RING], impl
        assert [layer.self_attn.ring for layer in target.layers] == [True, True, False, True]
        assert target.slot_pos.tolist() == [-1] * RING


def test_kv_cache_bytes_are_the_allocated_buffers(gemma):
    target = ring_target(gemma, "index_copy")
    for max_t in (MAX_T, None):
        target.setup_cache(max_t=max_t)
        kinds = {"sliding": 0, "global": 0}
        for i, layer in enumerate(target.layers):
            attn = layer.self_attn
            kinds["sliding" if target.cfg.window(i) else "global"] += attn.k_cache.nbytes + attn.v_cache.nbytes
        assert kv_cache_bytes(target.cfg, SEQ, torch.float32, max_t) == kinds, max_t
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, fp32: bytes a position
    assert kinds == {"sliding": 3 * SEQ * per_layer, "global": SEQ * per_layer}  # flat: every layer every position
    assert kv_cache_bytes(target.cfg, SEQ, torch.bfloat16, MAX_T) == {"sliding": 3 * RING * per_layer // 2,
                                                                      "global": SEQ * per_layer // 2}
    assert ring_slots(target.cfg, RING, MAX_T) is None  # a ring no shorter than the cache stays flat


def test_a_call_wider_than_the_ring_allows_is_refused(gemma):
    target = ring_target(gemma, "index_copy")
    with pytest.raises(ValueError, match=rf"9 rows.*max_t={MAX_T}"):
        target(torch.zeros(1, MAX_T + 1, dtype=torch.long), torch.arange(MAX_T + 1))


@pytest.mark.parametrize("impl,exact", [("index_copy", False), ("llama_ops", False), ("llama_ops", True)])
@torch.no_grad()
def test_chunked_prefill_and_verify_windows_give_transformers_logits(gemma, impl, exact):
    """The prompt in chunks of widths 1..max_t, each after a rejected window of up to max_t random rows written
    where it goes, then transformers' greedy continuation read in verify windows of widths 1..max_t: every row's
    logits are transformers' (fp32 tolerance) and every row's argmax is transformers' next token."""
    target, seed = ring_target(gemma, impl), fresh_seed()
    g = torch.Generator().manual_seed(seed)
    ids, n = gemma.ids, PROMPT + NEW
    rows, p, width = [], 0, 0
    while p < n:
        width = width % MAX_T + 1  # 1, 2, .., max_t, 1, ..
        if p < PROMPT:
            width = min(width, PROMPT - p)
            ahead = int(torch.randint(1, MAX_T + 1, (1,), generator=g))
            target(torch.randint(0, VOCAB, (1, ahead), generator=g), torch.arange(p, p + ahead), exact=exact)
        width = min(width, n - p)
        rows.append(target(ids[:, p:p + width], torch.arange(p, p + width), exact=exact)[0])
        p += width
    got = torch.cat(rows)
    where = f"{impl}{' exact' if exact else ''} (seeds {gemma.seed}/{seed})"
    torch.testing.assert_close(got, gemma.logits, **TOL, msg=where)
    assert got[PROMPT - 1:-1].argmax(-1).tolist() == gemma.continuation, where
    assert target.slot_pos.tolist() == [n - RING + (s - n) % RING for s in range(RING)]  # the last RING positions


@pytest.mark.parametrize("impl", ["index_copy", "llama_ops"])
@torch.no_grad()
def test_greedy_decoding_gives_transformers_tokens(gemma, impl):
    target = ring_target(gemma, impl)
    prompt, P = gemma.ids[:, :PROMPT], PROMPT
    for p in range(0, P, MAX_T):
        logits = target(prompt[:, p:p + MAX_T], torch.arange(p, min(p + MAX_T, P)))
    tok = logits[:, -1].argmax(-1, keepdim=True)
    got = [int(tok)]
    for pos in range(P, P + NEW - 1):
        tok = target(tok, torch.tensor([pos]))[:, -1].argmax(-1, keepdim=True)
        got.append(int(tok))
    assert got == gemma.continuation, f"{impl} (seed {gemma.seed})"


@pytest.mark.slow
def test_the_exact_kernel_gives_a_ring_the_flat_caches_bits(tmp_path):
    """eagle3::exact_sdpa in a program: rows over a ring of window + 4 slots equal, bit for bit, the rows over the
    flat cache it was cut from (the same keys in the same order), before the ring wraps and after several wraps."""
    from executorch.runtime import Runtime

    from models.layers import load_llama_ops

    load_llama_ops()

    class Attend(torch.nn.Module):
        def __init__(self, ring):
            super().__init__()
            self.ring = ring

        def forward(self, q, k, v, pos):
            return torch.ops.eagle3.exact_sdpa(q, k, v, pos, WINDOW, 0.125, self.ring)

    g = torch.Generator().manual_seed(fresh_seed())
    k, v = torch.randn(2, 1, 96, 2, 64, generator=g)
    q, pos = torch.randn(1, 4, 4, 64, generator=g), torch.tensor([3, 91, 94, 95])
    ring = WINDOW + 4
    keep = torch.arange(96)[-ring:]  # the ring after writing 0..95: position p at slot p % ring
    k_ring, v_ring = torch.zeros(1, ring, 2, 64), torch.zeros(1, ring, 2, 64)
    k_ring[:, keep % ring], v_ring[:, keep % ring] = k[:, keep], v[:, keep]
    early = torch.zeros(1, ring, 2, 64), torch.zeros(1, ring, 2, 64)  # the ring after writing 0..3 only
    early[0][:, :4], early[1][:, :4] = k[:, :4], v[:, :4]

    def run(r, *inputs):
        from executorch.exir import to_edge

        ep = torch.export.export(Attend(r), inputs, strict=False)
        path = tmp_path / f"attend_{r}.pte"
        path.write_bytes(to_edge(ep).to_executorch().buffer)
        return Runtime.get().load_program(path).load_method("forward").execute(list(inputs))[0]

    flat = run(0, q, k, v, pos)
    assert torch.equal(run(ring, q[:, 1:], k_ring, v_ring, pos[1:]), flat[:, 1:])
    assert torch.equal(run(ring, q[:, :1], *early, pos[:1]), flat[:, :1])
    torch.testing.assert_close(flat, torch.ops.eagle3.exact_sdpa(q, k, v, pos, WINDOW, 0.125), rtol=1e-5, atol=1e-6)


# --- the exported program ----------------------------------------------------------------------------------
MAX_M, MIN_PREFILL = 4, 5


@pytest.fixture(scope="module")
def ring_pte(gemma, tmp_path_factory):
    """The checkpoint with a random draft, exported with XNNPACK: prefill T in [5, 8], verify T in [2, 4]."""
    from pipeline.export_pte import export_pte

    target, _ = load_hf_target(gemma.path, max_seq_len=SEQ)
    out = tmp_path_factory.mktemp("ring_pte") / "model.pte"
    report = export_pte(Speculator(target, tiny_draft(target, seed=gemma.seed % 1000)).eval(), max_m=MAX_M,
                        default_chain=2, max_prefill_chunk=MAX_T, min_prefill_chunk=MIN_PREFILL, backend="xnnpack",
                        out_path=out, manifest_hash="0" * 64, progress=False, draft_chains=False)
    return types.SimpleNamespace(path=out, report=report)


@pytest.mark.slow
def test_the_program_holds_ring_caches(ring_pte):
    """The .pte's planned buffers: the windowed layers' K/V over RING slots, the global layer's over SEQ."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(ring_pte.path.read_bytes()).program
    plan = next(p for p in program.execution_plan if p.name == "prefill")
    sizes = {v.val.extra_tensor_info.fully_qualified_name: list(v.val.sizes) for v in plan.values
             if getattr(v.val, "extra_tensor_info", None) is not None and v.val.extra_tensor_info.fully_qualified_name}
    for i, slots in enumerate([RING, RING, SEQ, RING]):
        for name in ("k_cache", "v_cache"):
            assert sizes[f"speculator.target.layers.{i}.self_attn.{name}"] == [1, slots, 2, 16], (i, name, sizes)
    assert sizes["speculator.target.slot_pos"] == [RING]
    assert ring_pte.report["ring_slots"] == RING
    assert ring_pte.report["kv_cache_bytes"] == {"sliding": 3 * RING * 256, "global": SEQ * 256}


@pytest.mark.slow
def test_the_program_decodes_transformers_tokens_at_every_k(gemma, ring_pte):
    """A prompt five windows long (over three rings): K = 0 gives transformers' greedy tokens; every K, with the
    random draft (nearly every proposal rejected) and with an oracle draft (every one accepted), and exact mode
    give the same tokens."""
    from runner.engine import ExactEngine, PteEngine
    from runner.generate import generate

    from oracle import Oracle

    pte = PteEngine(ring_pte.path)
    base = generate(pte, gemma.prompt, chain=0, max_new_tokens=NEW)
    assert base.output_ids == gemma.continuation, f"seed {gemma.seed}"
    for k in range(1, MAX_M):
        assert generate(pte, gemma.prompt, chain=k, max_new_tokens=NEW).output_ids == base.output_ids, k
        oracle = Oracle(pte, gemma.prompt + base.output_ids)
        assert generate(oracle, gemma.prompt, chain=k, max_new_tokens=NEW).output_ids == base.output_ids, k
    exact = ExactEngine(pte, MAX_M)
    for k in (0, MAX_M - 1):
        assert generate(exact, gemma.prompt, chain=k, max_new_tokens=NEW).output_ids == base.output_ids, k


@pytest.mark.parametrize("exact", [False, True])
def test_the_cuda_engines_dense_path_runs_rings(exact):
    """runner.cuda_engine's dense path (its buffers and calls run eagerly on a CPU) on a windowed target: rings,
    and every K gives the target's own greedy tokens over a prompt of three rings (the GPU kernels on rings:
    tests/test_kernels_sdpa_ring.py)."""
    from models import tiny_target
    from runner.cuda_engine import CudaEngine
    from runner.generate import generate

    def speculator():
        target = tiny_target(seed=3, n_layers=3, max_seq_len=SEQ, sliding_window=[WINDOW, None, WINDOW])
        return Speculator(target, tiny_draft(target, seed=4))

    engine = CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, exact=exact, max_m=MAX_M,
                        default_chain=2, max_prefill_chunk=MAX_T, min_prefill_chunk=MIN_PREFILL)
    assert [layer.self_attn.k_cache.shape[2] for layer in engine.spec.target.layers] == [RING, SEQ, RING]
    prompt = torch.randint(0, VOCAB, (3 * RING,), generator=torch.Generator().manual_seed(fresh_seed())).tolist()
    target, seq = speculator().target, list(prompt)
    with torch.no_grad():
        for _ in range(16):
            seq.append(int(target(torch.tensor([seq]))[0, -1].argmax()))
    for k in range(MAX_M):
        assert generate(engine, prompt, chain=k, max_new_tokens=16).output_ids == seq[len(prompt):], k
