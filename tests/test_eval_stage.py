"""The eval stage: its metric names, prompts cut from the held-out split, the lossless check, the sweep summary."""

import json
from pathlib import Path

import pytest

from pipeline import hardware, sweep
from pipeline.stages import eval as eval_stage
from runner.generate import GenerationResult

CONF = Path(__file__).resolve().parents[1] / "conf"

pytestmark = pytest.mark.usefixtures("one_torch_thread")

METRIC_NAMES = {"chain", "max_m", "pte_sha256", "tokens_per_s", "baseline_tokens_per_s", "speedup", "tau",
                "acceptance_rate", "verify_ms_per_round", "draft_ms_per_round", "prefill_ms", "rounds",
                "emitted_tokens", "lossless", "n_prompts", "exact_width", "speedup_min", "speedup_max", "passes",
                "round_ms"}


def fake_run(chain, chain_per_round, accepted, n_out, decode_ms):
    r = GenerationResult(prompt_ids=[1, 2], output_ids=list(range(n_out)), chain=chain, chain_per_round=chain_per_round,
                         accepted=accepted, emitted=[a + 1 for a in accepted], prefill_ms=2.0, decode_ms=decode_ms)
    r.round_verify_ms = [1.0] * len(chain_per_round)
    r.round_draft_ms = [0.5] * len(chain_per_round)
    return r


def test_metrics_have_exactly_the_issue_names():
    base = fake_run(0, [0] * 9, [0] * 9, 10, 90.0)
    spec = fake_run(3, [3, 3, 3], [3, 1, 0], 8, 30.0)  # emits 4 + 2 + 1 after the bonus
    m = eval_stage.metrics([[(base, spec)]], chain=3, max_m=8, pte_sha256="ab", lossless=True, n_positions=3)
    assert set(m) == METRIC_NAMES | {"acceptance_pos_0", "acceptance_pos_1", "acceptance_pos_2"}
    assert m["tau"] == pytest.approx(7 / 3) and m["acceptance_rate"] == pytest.approx(4 / 9)
    assert m["acceptance_pos_0"] == pytest.approx(2 / 3)  # rounds 1, 2 of 3 accepted position 0
    assert m["acceptance_pos_1"] == pytest.approx(1 / 2) and m["acceptance_pos_2"] == pytest.approx(1 / 1)
    assert m["tokens_per_s"] == pytest.approx(7 / 0.030) and m["baseline_tokens_per_s"] == pytest.approx(9 / 0.090)
    assert m["speedup"] == pytest.approx(m["tokens_per_s"] / m["baseline_tokens_per_s"])
    assert m["rounds"] == 3 and m["emitted_tokens"] == 8 and m["n_prompts"] == 1
    assert m["verify_ms_per_round"] == 1.0 and m["draft_ms_per_round"] == 0.5
    assert m["exact_width"] == 0
    json.dumps(m)


def test_exact_mode_reports_the_t1_decode_beside_the_exact_baseline():
    base = fake_run(0, [0] * 9, [0] * 9, 10, 90.0)
    spec = fake_run(3, [3, 3, 3], [3, 1, 0], 8, 30.0)
    decoded = fake_run(0, [0] * 9, [0] * 9, 10, 60.0)
    m = eval_stage.metrics([[(base, spec)]], chain=3, max_m=8, pte_sha256="ab", lossless=True, n_positions=3,
                           decoded=[decoded], exact_width=8)
    assert set(m) == METRIC_NAMES | {"acceptance_pos_0", "acceptance_pos_1", "acceptance_pos_2",
                                     "target_decode_tokens_per_s", "speedup_vs_target_decode"}
    assert m["exact_width"] == 8 and m["target_decode_tokens_per_s"] == pytest.approx(9 / 0.060)
    assert m["speedup_vs_target_decode"] == pytest.approx(m["tokens_per_s"] / m["target_decode_tokens_per_s"])


def test_the_speedup_is_the_median_of_the_passes_with_their_spread():
    """Passes of the same tokens at other speeds (a machine that slows down and recovers): each pass's ratio,
    the median of them, and the spread beside it; tau from the tokens, whatever the speed."""
    speeds = [(90.0, 30.0), (180.0, 45.0), (90.0, 40.0)]  # (K=0 ms, K ms): ratios 3.0, 4.0, 2.25
    passes = [[(fake_run(0, [0] * 9, [0] * 9, 10, b), fake_run(3, [3, 3, 3], [3, 1, 0], 8, k))] for b, k in speeds]
    m = eval_stage.metrics(passes, chain=3, max_m=8, pte_sha256="ab", lossless=True, n_positions=3)
    ratios = [(7 / k) / (9 / b) for b, k in speeds]
    assert m["speedup"] == pytest.approx(sorted(ratios)[1]) and m["passes"] == 3
    assert (m["speedup_min"], m["speedup_max"]) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    assert m["tau"] == pytest.approx(7 / 3) and m["round_ms"] == pytest.approx((30 + 45 + 40) / 9)


def test_passes_repeat_until_three_agree_or_the_limit():
    def passes(*ratios):
        return [[(fake_run(0, [0] * 9, [0] * 9, 10, 90.0), fake_run(3, [3], [3], 8, 7 / (r * 9 / 90) * 1e3 / 1e3))]
                for r in ratios]

    assert not eval_stage.settled(passes(2.0, 2.01), repeats=7, tolerance=0.03)  # two are not three
    assert eval_stage.settled(passes(1.5, 2.0, 2.01, 2.02), repeats=7, tolerance=0.03)
    assert not eval_stage.settled(passes(2.0, 2.3, 2.0), repeats=7, tolerance=0.03)
    assert eval_stage.settled(passes(2.0, 2.3, 2.0), repeats=3, tolerance=0.03)
    assert eval_stage.settled(passes(2.0), repeats=1, tolerance=0.0)


def test_first_difference():
    assert eval_stage.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert eval_stage.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert eval_stage.first_difference([1, 2], [1, 2, 3]) == 2


def test_prompt_files_and_stop_tokens(tmp_path):
    from models.text import eos_id, read_prompt_file, stop_ids
    from pipeline import data

    (tmp_path / "p.txt").write_text("def f(x):\n\nclass A:\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "import os"}\n{"text": "x = 1"}\n')
    assert read_prompt_file(tmp_path / "p.txt") == ["def f(x):", "class A:"]
    assert read_prompt_file(tmp_path / "p.jsonl") == ["import os", "x = 1"]
    tok = data.train_tokenizer(["hello world\n" * 50], vocab_size=280)
    assert stop_ids(tok, ["hello", 7]) == [eos_id(tok), tok.token_to_id("hello"), 7]
    with pytest.raises(ValueError, match="not a single token"):
        stop_ids(tok, ["no such token here"])


def test_sweep_summary_table_plot_best_k_and_failed_jobs(tmp_path):
    children = []
    for n, (k, tps, tau, base) in enumerate([(1, 150.0, 1.8, 100.0), (2, 210.0, 2.6, 100.0), (4, 250.0, 3.1, 150.0)]):
        report = {"chain": k, "tokens_per_s": tps, "baseline_tokens_per_s": base, "speedup": tps / base, "tau": tau,
                  "acceptance_rate": 0.7, "verify_ms_per_round": 8.0, "draft_ms_per_round": 2.0,
                  "lossless": 1, "pte_sha256": "abc"}
        children.append({"job_num": n, "overrides": [f"runtime.chain={k}"], "status": "ok",
                         "stages": {"eval": {"report": report}}})
    children.append({"job_num": 3, "overrides": ["runtime.chain=9"], "status": "failed", "stages": {},
                     "error": "ConfigError: runtime.chain=9: an int in [0, 7]\nmore"})
    summary = sweep.summarize(children, tmp_path)
    assert summary == {"best_chain": 2, "best_tokens_per_s": 210.0, "best_speedup": 2.1, "best_tau": 2.6,
                       "failed_jobs": 1}
    text = (tmp_path / "summary.md").read_text()
    assert "best K = 2" in text and "job 3 (runtime.chain=9): failed: ConfigError: runtime.chain=9: an int in [0, 7] more" in text
    assert (tmp_path / "summary.png").stat().st_size > 1000
    assert ".pte sha256: abc" in text
    for child in children[:3]:  # the CUDA engine reads no .pte: the summary names none
        child["stages"]["eval"]["report"]["pte_sha256"] = ""
    sweep.summarize(children, tmp_path)
    assert ".pte sha256" not in (tmp_path / "summary.md").read_text()


def test_a_sweep_summary_is_written_when_every_job_failed(tmp_path):
    failed = [{"job_num": 0, "overrides": ["runtime.chain=100"], "status": "failed", "stages": {}, "error": "boom"}]
    assert sweep.summarize(failed, tmp_path) == {"failed_jobs": 1}
    assert "1 of 1 job(s) failed:\n- job 0 (runtime.chain=100): failed: boom" in (tmp_path / "summary.md").read_text()
    assert not (tmp_path / "summary.png").exists()


# ---------------------------------------------------------------------------------------------------------
# The stage itself, on the shared tiny .pte with fake upstream artifacts (a word-level tokenizer that fits
# the tiny vocab of 256)


WORDS = [f"w{i}" for i in range(254)]  # + <|bos|>, <|eos|> = the tiny vocab of 256


@pytest.fixture(scope="module")
def stage_inputs(tiny_pte, tmp_path_factory):
    import hashlib

    import torch
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from models import save_speculators, save_target
    from pipeline.store import Artifact

    root = tmp_path_factory.mktemp("eval_inputs")
    vocab = {"<|bos|>": 0, "<|eos|>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    spec = tiny_pte.speculator()
    save_target(spec.target, root / "target")
    tok.save(str(root / "target" / "tokenizer.json"))
    save_speculators(spec.draft, root / "draft")
    (root / "export").mkdir()
    (root / "export" / "model.pte").symlink_to(tiny_pte.path)
    sha = hashlib.sha256(tiny_pte.path.read_bytes()).hexdigest()
    upstream = {
        "target": Artifact("target", "t" * 64, root / "target", {}),
        "draft": Artifact("draft", "d" * 64, root / "draft", {}),
        "export": Artifact("export", "e" * 64, root / "export", {"files": {"model.pte": sha}}),
    }
    gen = torch.Generator().manual_seed(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(30):
        ids = torch.randint(0, 254, (300,), generator=gen).tolist()
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(WORDS[j] for j in ids))
    runtime = OmegaConf.load(CONF / "runtime" / "default.yaml")
    base = OmegaConf.create({"device": "cpu",
                             "export": {"backend": "portable", "quant": "fp32", "max_m": tiny_pte.max_m},
                             "data": {"kind": "text", "paths": [str(corpus / "*.txt")], "held_out_fraction": 0.3,
                                      "max_bytes": None, "text_field": "text"},
                             "runtime": runtime})
    base.runtime.update({"n_prompts": 3, "prompt_len": 12, "max_new_tokens": 24})
    return base, upstream, sha


def run_stage(stage_inputs, tmp_path, engine: str = "pte", engine_options: dict | None = None, **runtime):
    """The stage with `runtime` over conf/runtime/default.yaml and `engine_options` over conf/engine/<engine>.yaml."""
    from omegaconf import OmegaConf

    base, upstream, _ = stage_inputs
    options = OmegaConf.merge(OmegaConf.load(CONF / "engine" / f"{engine}.yaml"), engine_options or {})
    cfg = OmegaConf.merge(base, {"engine": options, "runtime": runtime})
    hardware.resolve(cfg)  # `auto` -> this machine's values, as pipeline.app does before any stage
    report = eval_stage.run(cfg, upstream, tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    gens = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    return report, metrics, gens


@pytest.mark.slow  # the stage over an exported program
def test_eval_writes_metrics_and_generations(stage_inputs, tmp_path):
    report, m, gens = run_stage(stage_inputs, tmp_path, chain=4)
    assert set(m) == METRIC_NAMES | {f"acceptance_pos_{i}" for i in range(4)}
    assert m["chain"] == 4 and m["max_m"] == 6 and m["pte_sha256"] == stage_inputs[2]
    assert m["lossless"] is True and m["n_prompts"] == 3 and m["rounds"] > 0
    assert m["tokens_per_s"] > 0 and m["baseline_tokens_per_s"] > 0 and m["prefill_ms"] > 0
    assert report["lossless"] == 1 and {k: v for k, v in report.items() if k != "lossless"} == \
        {k: v for k, v in m.items() if k != "lossless"}
    assert len(gens) == 3
    for g in gens:
        assert {"prompt", "prompt_ids", "output_ids", "text", "tau", "lossless"} <= set(g)
        assert len(g["prompt_ids"]) == 12 and g["lossless"] is True
        assert len(g["output_ids"]) == 24 or g["output_ids"][-1] == 1  # the budget, or <|eos|>
        assert g["text"].split() == [(["<|bos|>", "<|eos|>"] + WORDS)[i] for i in g["output_ids"]]


@pytest.mark.slow  # the stage over an exported program
def test_eval_in_exact_mode_checks_every_k_against_the_exact_k0_and_times_the_t1_decode(stage_inputs, tmp_path):
    _, m, gens = run_stage(stage_inputs, tmp_path, chain=3, engine_options={"exact": True, "exact_width": 4})
    assert m["exact_width"] == 4 and m["max_m"] == 4 and m["lossless"] is True
    assert m["target_decode_tokens_per_s"] > 0 and m["speedup_vs_target_decode"] == pytest.approx(
        m["tokens_per_s"] / m["target_decode_tokens_per_s"])
    assert all(len(g["output_ids"]) == 24 or g["output_ids"][-1] == 1 for g in gens)


@pytest.mark.slow  # the stage over an exported program
def test_eval_prompts_are_cut_as_the_taps_cut_their_held_out_prompts(stage_inputs, tmp_path):
    """The draft stage predicts tau on held-out taps whose prompts pipeline.prompts.cut made; the eval's own
    prompts come from the same function on the same split (seeded by runtime.seed), so both measure one
    distribution."""
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer

    from pipeline import data, prompts

    base, upstream, _ = stage_inputs
    _, _, gens = run_stage(stage_inputs, tmp_path, chain=2, seed=5)
    tok = Tokenizer.from_file(str(upstream["target"].path / "tokenizer.json"))
    held_out = data.split(data.documents(OmegaConf.to_container(base.data)), "held_out")
    assert [g["prompt_ids"] for g in gens] == prompts.cut(held_out, tok, 3, 12, 5, "plain").tolist()
    assert [g["prompt_ids"] for g in gens] != prompts.cut(held_out, tok, 3, 12, 6, "plain").tolist()


@pytest.mark.slow  # the stage over an exported program
def test_eval_from_a_prompt_file_with_the_eager_engine_and_the_default_chain(stage_inputs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4 w5"}\n{"prompt": "w9"}\n')
    _, m, gens = run_stage(stage_inputs, tmp_path, engine="eager", prompts=str(prompts), chain=None)
    assert m["chain"] == 3 and m["n_prompts"] == 2 and m["lossless"] is True
    assert [g["prompt_ids"] for g in gens] == [[3, 4, 5, 6, 7], [11]]


@pytest.mark.slow  # the stage over an exported program
def test_eval_adaptive_policy_logs_k_per_round(stage_inputs, tmp_path):
    _, m, gens = run_stage(stage_inputs, tmp_path, chain=2, policy="adaptive")
    assert m["lossless"] is True and set(f"acceptance_pos_{i}" for i in range(5)) <= set(m)
    for g in gens:
        assert all(0 <= k <= 5 for k in g["chain_per_round"])
        # no round at all only when prefill's token already ended the output (<|eos|> first)
        assert g["chain_per_round"] or g["output_ids"] == [1]
    assert any(g["chain_per_round"] for g in gens)


@pytest.mark.slow  # the stage over an exported program
def test_eval_refuses_a_chain_outside_the_pte_range(stage_inputs, tmp_path):
    with pytest.raises(ValueError, match=r"K=6 is outside the valid range \[1, 5\]"):
        run_stage(stage_inputs, tmp_path, chain=6)


@pytest.mark.slow  # the stage over an exported program
def test_a_lossless_mismatch_fails_loudly_unless_allowed(stage_inputs, tmp_path, monkeypatch):
    real = eval_stage.generate

    def corrupted(engine, ids, *, chain, **kw):
        res = real(engine, ids, chain=chain, **kw)
        if chain:
            res.output_ids[0] = (res.output_ids[0] + 1) % 200
        return res

    monkeypatch.setattr(eval_stage, "generate", corrupted)
    with pytest.raises(RuntimeError, match="lossless check failed on prompt 0.*first at generated token 0"):
        run_stage(stage_inputs, tmp_path, chain=2)
    _, m, gens = run_stage(stage_inputs, tmp_path, chain=2, allow_mismatch=True)
    assert m["lossless"] is False and all(g["lossless"] is False and g["first_difference"] == 0 for g in gens)


@pytest.mark.slow  # the stage over an exported program
def test_prompt_file_lines_too_long_are_refused_or_skipped_naming_file_and_lines(stage_inputs, tmp_path):
    from pipeline.validate import ConfigError

    prompts = tmp_path / "prompts.txt"  # max_seq_len 64 - max_new_tokens 24 = 40 tokens of room
    prompts.write_text("w1 w2 w3\n\n" + " ".join(WORDS[:50]) + "\nw9\n" + " ".join(WORDS[:41]) + "\n")
    with pytest.raises(ConfigError, match=rf"prompt file {prompts}: line\(s\) 3, 5 hold more than 40 tokens.*"
                                          r"max_seq_len=64 .*runtime.prompts_too_long=skip"):
        run_stage(stage_inputs, tmp_path, prompts=str(prompts), chain=2)
    _, m, gens = run_stage(stage_inputs, tmp_path, prompts=str(prompts), chain=2, prompts_too_long="skip")
    assert m["n_prompts"] == 2 and [g["prompt"] for g in gens] == ["w1 w2 w3", "w9"]


@pytest.mark.slow  # the stage over an exported program
def test_prompt_len_without_room_for_max_new_tokens_is_refused_before_any_prompt_is_cut(stage_inputs, tmp_path):
    from pipeline.validate import ConfigError

    with pytest.raises(ConfigError, match=r"runtime.prompt_len=50 \+ runtime.max_new_tokens=24 = 74 exceeds "
                                          r"max_seq_len=64"):
        run_stage(stage_inputs, tmp_path, prompt_len=50, chain=2)
