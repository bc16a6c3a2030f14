"""Benchmark: llama.cpp's own EAGLE-3 with OUR draft against our .pte, on the same target weights, greedy, same K.

    python -m bench.llama_build                                    # once: llama.cpp's tools (about 6 minutes)
    python -m bench.llama_eagle3                                   # the store's embedded default, 1 and 2 threads
    python -m bench.llama_eagle3 --store outputs/store --threads 2 --chains 0,4,6 --reps 3 --json F
    python -m bench.llama_eagle3 --export KEY                      # any export's .pte, a real preset's too
    python -m bench.llama_build --cuda && python -m bench.llama_eagle3 --device cuda --draft outputs/store/draft/KEY \
        --prompts 8 --new-tokens 256 --reps 2                      # one GPU: the CUDA engine against llama.cpp CUDA

`--device cuda` (one GPU): ours is the CUDA engine over the draft artifact and its target (runner.build's cuda
engine, its options as `engine=cuda target=<preset>` composes them: `cuda_engine_options`, exact mode), in the
child process the .pte runs in on the CPU; llama.cpp is bench.llama_build's CUDA build with every layer of the
target and the draft on the GPU (`-ngl 99 -ngld 99`). A target converted from a GGUF (a real preset) is compared
on that very file (`target_gguf`: llama.cpp runs its own quantised weights; on the CPU too, with `--export`), its
BOS, EOS and pre-tokenizer taken from it; where llama.cpp's graph of that architecture hands out no layer inputs
(Gemma 3 in 0.3.36: `eagle3_target_supported`) its EAGLE-3 cannot run, and only its K = 0 row is measured.

What runs on each side, per thread count, K = 0 (plain decoding) and K = 1..7 (`--chains`):
- ours: the export artifact's .pte (`export.quant=8da4w_draft` or `fp32`: an fp32 target) through
  runner.engine.PteEngine and runner.generate, K = chain, static policy, greedy, the eval's stop tokens; in a
  child process per thread count that loads the program once (`OMP_NUM_THREADS=1`, the pool sized to the
  threads before the program loads, as bench.round does). Tokens/s = decode tokens / decode time (after prefill and its bonus token).
- llama.cpp, built from the `[peers]` pin's vendored source by bench.llama_build:
  * the target: our target artifact written as a GGUF of architecture llama (bench.gguf_write, f32 by default:
    the very weights the .pte's fp32 target holds), with tokenizer.ggml.pre "gpt-2" (our ByteLevel split), so
    llama.cpp reads the prompt text as our ids (checked with llama-tokenize for every prompt);
  * the draft: our draft artifact (the speculators layout) converted by llama.cpp's own
    `convert_hf_to_gguf.py <draft> --target-model-dir <dir> --outtype f32`; the target directory it wants is
    written from our target artifact (`write_hf_target_dir`: an HF Llama config.json, tokenizer.json and
    tokenizer_config.json, no weights). Its aux-layer ids (`eagle_aux_hidden_state_layer_ids`) become the GGUF's
    `eagle3.target_layers`, which llama.cpp reads as layer inputs (embedding-first, as we count) and d2t (our
    offsets) becomes absolute ids. The converter cannot name the BPE pre-tokenizer of a tokenizer it has no hash
    for ("BPE pre-tokenizer was not recognized"); then, and only for a ByteLevel tokenizer with GPT-2's split,
    the converter runs again with that one function answering "gpt-2" (`convert_draft`, recorded in the JSON);
  * K >= 1: `llama-speculative-simple -m target.gguf -md draft.gguf --spec-type draft-eagle3
    --spec-draft-n-max K --spec-draft-n-min 0 --spec-draft-p-min 0 --temp 0 --top-k 1 -t N -tb N -td N -tbd N`
    (`spec_simple_args`), one process per prompt; it drafts K tokens a round (top-1 of its draft, p-min 0
    stops none) and verifies them greedily. Tokens/s = its `decoded N tokens ... speed` (the decode loop's
    wall time, every generated token: the first round starts from the prompt's last token);
    acceptance = its n_accept / n_drafted;
  * K = 0: `llama-completion ... -no-cnv` (`completion_args`), its `eval time = T ms / N runs`: llama.cpp's
    own time of its one-token decodes (sampling and the loop excluded), so its K = 0 row is a little kinder than
    its K >= 1 rows' wall clock.
  Both get the prompt as a file (`-f`, `--no-escape`) and generate the eval's budget; `llama.cpp` processes run
  without OMP_NUM_THREADS (ggml's own thread count applies).

Prompts: the eval stage's held-out prompts (bench.targets.make_prompts: `runtime.n_prompts` 8 of
`runtime.prompt_len` 64 tokens, seed 0), decoded to bytes for llama.cpp; where llama.cpp tokenizes a prompt's
bytes to other ids, both sides decode llama.cpp's ids (the JSON says which prompts). Budget: 128 new tokens
(`runtime.max_new_tokens`, the bonus included), stopping at EOS on both sides.

Passes: each repetition runs K by K, ours over every prompt and llama.cpp over the same (the side going first
alternates pass by pass), so a burst of load from elsewhere falls on both; a row's tokens/s is the median over
the passes of (tokens summed over prompts / time summed over prompts), its spread in brackets. The load during
the run (bench.machine) is in the JSON.
Text: llama.cpp's generated bytes against ours at the same K (`text = ours`), and each side's K >= 1 against
its own K = 0 (llama.cpp's lossless gate: EAGLE-3 must not change its greedy text).

Writes `--json` (default bench/results/cpu-llama-eagle3.json) and prints, per thread count, K, ours tok/s,
llama.cpp tok/s, ours / llama.cpp, acceptance each (tau: tokens per round), text equal, and each side's best K.
Working files (GGUFs, the HF directory, prompt files) go to outputs/peers/eagle3/<export key>/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import llama_build

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "outputs" / "peers" / "eagle3"
DEFAULT_JSON = RESULTS / "cpu-llama-eagle3.json"
DEFAULT_GPU_JSON = RESULTS / "gpu-llama-eagle3.json"
PRE_UNRECOGNISED = "BPE pre-tokenizer was not recognized"
GPT2_PRE = "gpt-2"  # llama.cpp's name for GPT-2's split (src/llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2)


# ----------------------------------------------------------------------------------------------------------
# Bytes of a token sequence (what llama.cpp prints), and the pre-tokenizer check


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted (a ByteLevel vocabulary's characters -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_DECODER = _byte_decoder()


SPM_SPACE = "\u2581"  # SentencePiece's space (▁)
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece


def byte_level(tokenizer) -> bool:
    """Whether a tokenizer's decoder is ByteLevel (GPT-2's printable-byte vocabulary); otherwise its pieces are
    SentencePiece's (▁ for a space, <0xXX> for a byte), as Gemma's are."""
    state = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
    parts = state.get("decoders") or [state]
    return any(d.get("type") == "ByteLevel" for d in parts)


def piece_bytes(piece: str, is_byte_level: bool) -> bytes:
    """The bytes one vocabulary entry stands for, as llama.cpp's token_to_piece prints it."""
    if is_byte_level:
        return bytes(BYTE_DECODER[c] for c in piece)
    if m := BYTE_PIECE.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    return piece.replace(SPM_SPACE, " ").encode()


def token_bytes(tokenizer, ids) -> bytes:
    """The bytes a BPE tokenizer's ids stand for (ByteLevel or SentencePiece pieces, `byte_level`), as llama.cpp
    prints them (a control token as its text, an id without a token as nothing)."""
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    is_byte_level = byte_level(tokenizer)
    out = bytearray()
    for i in ids:
        i = int(i)
        if i in added:
            out += added[i].encode()
        elif (tok := tokenizer.id_to_token(i)) is not None:
            out += piece_bytes(tok, is_byte_level)
    return bytes(out)


def llama_prompt_ids(ids: list[int], bos_added: int | None) -> list[int]:
    """The ids whose bytes llama.cpp gets as the prompt: without a leading BOS where its model adds that BOS
    itself (tokenizer.ggml.add_bos_token; `bos_added` is then its id, else None)."""
    return ids[1:] if bos_added is not None and ids[:1] == [bos_added] else list(ids)


def gpt2_split(tokenizer_json: dict) -> bool:
    """Whether a tokenizer.json's pre-tokenizer is ByteLevel with its regex (GPT-2's split) and nothing else: the
    split llama.cpp applies for tokenizer.ggml.pre "gpt-2"."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    return (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
            and (tokenizer_json.get("model") or {}).get("type") == "BPE" and not tokenizer_json.get("normalizer"))


# ----------------------------------------------------------------------------------------------------------
# The target directory llama.cpp's converter wants, and the conversion


def hf_llama_config(cfg, eos: int | None, bos: int | None) -> dict:
    """An HF LlamaForCausalLM config.json of our target's config (models.config.TargetConfig): what
    convert_hf_to_gguf.py reads from --target-model-dir (vocab_size, num_hidden_layers, hidden_size) and what
    transformers' AutoTokenizer needs to open the directory. The plain llama architecture only."""
    from bench.gguf_write import _refuse_non_llama

    _refuse_non_llama(cfg)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
            "max_position_embeddings": cfg.context_length or cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "mlp_bias": False, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}


def hf_gemma3_config(cfg, eos: int | None, bos: int | None) -> dict:
    """An HF Gemma3ForCausalLM (gemma3_text) config.json of our Gemma 3 target's config: the converter reads
    vocab_size, num_hidden_layers and hidden_size; the rest is the model's own, so the directory reads back
    (models.hf.target_config_from_hf) as our target."""
    windows = [w for w in cfg.sliding_window or [] if w is not None]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_activation": cfg.hidden_act,
            "max_position_embeddings": cfg.context_length or cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_local_base_freq": cfg.rope_local_theta,
            "rope_scaling": cfg.rope_scaling, "query_pre_attn_scalar": round((cfg.attn_scale or cfg.head_dim ** -0.5)
                                                                             ** -2, 6),
            "sliding_window": windows[0] if windows else None,
            "layer_types": [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.n_layers)],
            "final_logit_softcapping": cfg.logit_softcap, "attn_logit_softcapping": cfg.attn_logit_softcap,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}


def hf_target_config(cfg, eos: int | None, bos: int | None) -> dict:
    """The HF config.json of our target: Gemma 3's own (`hf_gemma3_config`: its norms and windows say so), else
    a plain Llama's (`hf_llama_config`, which refuses any other architecture)."""
    if cfg.norm_unit_offset and cfg.output_norms:
        return hf_gemma3_config(cfg, eos, bos)
    return hf_llama_config(cfg, eos, bos)


def write_hf_target_dir(cfg, tokenizer_path: Path, out: Path, specials: dict | None = None) -> Path:
    """`out`/{config.json, tokenizer.json, tokenizer_config.json} for our target (no weights: the converter reads
    only the target's config and tokenizer for a draft). `specials` {bos, eos, add_bos} (ids, a flag) are a
    GGUF target's own (`gguf_specials`); without them BOS is EOS and never added, as bench.gguf_write writes
    the target GGUF."""
    from tokenizers import Tokenizer

    from models.text import eos_id

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    if specials is None:
        eos = eos_id(tokenizer)
        specials = {"bos": eos, "eos": eos, "add_bos": False}
    text = {k: tokenizer.id_to_token(specials[k]) if specials[k] is not None else None for k in ("bos", "eos")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_target_config(cfg, specials["eos"], specials["bos"]), indent=1))
    (out / "tokenizer.json").write_text(Path(tokenizer_path).read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text["bos"], "eos_token": text["eos"],
        "add_bos_token": bool(specials["add_bos"]), "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_seq_len}, indent=1))
    return out


# ----------------------------------------------------------------------------------------------------------
# A GGUF target: the file it came from, what that file says, and whether llama.cpp's EAGLE-3 can run on it


def target_gguf(target_dir: Path, store: Path | None = None) -> Path | None:
    """The GGUF file a target artifact was converted from (pipeline/stages/target.py: target=gguf records the
    file as report.source, and target.package or target.path in its config), None for a target of another kind.
    The recorded file where it still exists, else the package's file again (models.gguf.package_gguf; an
    assembled one into `store`/.gguf, as the target stage assembles it); a GGUFError names what was recorded
    where neither is at hand."""
    from models.gguf import GGUF_CACHE, GGUFError, package_gguf

    manifest = json.loads((Path(target_dir) / "manifest.json").read_text())
    tc = manifest.get("config", {}).get("target", {})
    if tc.get("kind") != "gguf":
        return None
    source = manifest.get("report", {}).get("source") or tc.get("path")
    if source and Path(source).is_file():
        return Path(source)
    if tc.get("package"):
        store = Path(store) if store is not None else Path(target_dir).parent.parent
        return package_gguf(tc["package"], store / GGUF_CACHE)
    raise GGUFError(f"{target_dir}: converted from {source}, which is not on this machine (and no target.package "
                    f"to take it from again)")


def gguf_specials(path: Path) -> dict:
    """{bos, eos, add_bos, architecture, pre} of a GGUF file: its BOS and EOS ids, whether llama.cpp adds the BOS to
    a prompt, its architecture and pre-tokenizer name."""
    from models.gguf import read_header

    meta, _, _ = read_header(path)
    return {"bos": meta.get("tokenizer.ggml.bos_token_id"), "eos": meta.get("tokenizer.ggml.eos_token_id"),
            "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "architecture": meta.get("general.architecture"), "pre": meta.get("tokenizer.ggml.pre")}


def eagle3_target_supported(src: Path, architecture: str) -> bool | None:
    """Whether llama.cpp's graph for the target's architecture hands out its layers' inputs, which its EAGLE-3
    reads as the draft's taps (common/speculative.cpp turns them on with llama_set_embeddings_layer_inp; the
    graph asserts `t_layer_inp[il] != nullptr`, i.e. aborts, where src/models/<arch>.cpp never sets them: Gemma 3
    in 0.3.36). None where the source has no file for the architecture (unknown: try it)."""
    graph = Path(src) / "src" / "models" / f"{architecture}.cpp"
    return "t_layer_inp" in graph.read_text() if graph.is_file() else None


# The converter with TextModel.get_vocab_base_pre answering a given name where llama.cpp has no hash for the
# tokenizer (convert_hf_to_gguf_update.py's list holds published tokenizers only). argv: src dir, the name, then
# the converter's own arguments.
PRE_SHIM = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[0:0] = [src, src + "/gguf-py"]
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        base.logger.warning(f"bench.llama_eagle3: tokenizer.ggml.pre = {pre!r} (the target's)")
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_args(src: Path, draft_dir: Path, hf_dir: Path, out: Path, outtype: str) -> list[str]:
    """llama.cpp's converter on our draft (docs/speculative.md of its source)."""
    return [str(src / "convert_hf_to_gguf.py"), str(draft_dir), "--target-model-dir", str(hf_dir),
            "--outtype", outtype, "--outfile", str(out)]


def convert_draft(src: Path, draft_dir: Path, hf_dir: Path, out: Path, outtype: str = "f32",
                  pre: str = GPT2_PRE) -> dict:
    """Our draft artifact -> a GGUF of architecture eagle3 by llama.cpp's converter. -> {command, seconds,
    pre_tokenizer_shim (None, or the plain run's error that made it needed), metadata (eagle3.*)}. Where the
    converter has no hash for the tokenizer it runs again with `pre` answered (PRE_SHIM): the target GGUF's own
    tokenizer.ggml.pre, which for GPT2_PRE (the one bench.gguf_write writes) must be a ByteLevel tokenizer with
    GPT-2's split. Raises RuntimeError with the converter's error where it fails otherwise."""
    from models.gguf import read_header

    args = converter_args(src, draft_dir, hf_dir, out, outtype)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, not ours
    t0 = time.time()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=src)
    shim = None
    if done.returncode != 0 and PRE_UNRECOGNISED in done.stderr:
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        if pre == GPT2_PRE and not gpt2_split(tok):
            raise RuntimeError(f"llama.cpp's converter does not know this tokenizer's pre-tokenizer and it is not "
                               f"GPT-2's ByteLevel split: {_tail(done.stderr)}")
        shim = _tail(done.stderr, 6)
        done = subprocess.run([sys.executable, "-c", PRE_SHIM, str(src), pre, *args[1:]], capture_output=True,
                              text=True, env=env, cwd=src)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {draft_dir}: {_tail(done.stderr, 25)}")
    meta, tensors, _ = read_header(out)
    return {"command": " ".join(["python", *args]), "seconds": round(time.time() - t0, 1),
            "pre_tokenizer_shim": shim, "architecture": meta.get("general.architecture"),
            "metadata": {k: v for k, v in meta.items() if k.startswith("eagle3.")},
            "tensors": {t.name: list(t.shape) for t in tensors}}


def _tail(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


# ----------------------------------------------------------------------------------------------------------
# llama.cpp's command lines and what they print


GPU_LAYERS = 99  # `-ngl 99`: every layer of these models on the GPU


def gpu_args(gpu_layers: int, draft: bool = False) -> list[str]:
    """The layers llama.cpp's CUDA build offloads (`-ngl`, and `-ngld` for the draft); none on the CPU (0)."""
    if not gpu_layers:
        return []
    return ["-ngl", str(gpu_layers)] + (["-ngld", str(gpu_layers)] if draft else [])


def spec_simple_args(binary, target, draft, prompt_file, k: int, threads: int, new_tokens: int, ctx: int,
                     gpu_layers: int = 0) -> list[str]:
    """llama-speculative-simple, EAGLE-3 at K = k, greedy. It generates n_predict + 1 tokens (its loop ends once
    more than -n were emitted, its drafts cut to what is left), so -n is the budget less one. Log verbosity 4
    (trace, not debug: nothing more inside the loop) prints its draft statistics at the end."""
    t = str(threads)
    return [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-eagle3",
            "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
            "-f", str(prompt_file), "--no-escape", "-n", str(new_tokens - 1), "-c", str(ctx),
            "--temp", "0", "--top-k", "1", "-s", "0", "-t", t, "-tb", t, "-td", t, "-tbd", t,
            *gpu_args(gpu_layers, draft=True), "-lv", "4"]


def completion_args(binary, target, prompt_file, threads: int, new_tokens: int, ctx: int,
                    gpu_layers: int = 0) -> list[str]:
    """llama-completion, plain greedy decoding of `new_tokens` tokens, the prompt not echoed."""
    t = str(threads)
    return [str(binary), "-m", str(target), "-f", str(prompt_file), "--no-escape", "-n", str(new_tokens),
            "-c", str(ctx), "--temp", "0", "--top-k", "1", "-s", "0", "-t", t, "-tb", t, *gpu_args(gpu_layers),
            "-no-cnv", "--no-display-prompt", "--special"]


def tokenize_args(binary, target, prompt_file) -> list[str]:
    """llama-tokenize: the ids of a file's bytes, verbatim (no escapes; no BOS, which our GGUF never adds)."""
    return [str(binary), "-m", str(target), "-f", str(prompt_file), "--no-escape", "--ids", "--log-disable"]


def prompt_file_bytes(prompt: bytes) -> bytes:
    """What to write for `-f` so the tool reads `prompt`: common's -f drops one trailing newline."""
    return prompt + b"\n"


class ParseError(ValueError):
    pass


def _number(pattern: str, text: str, what: str, cast=float):
    m = re.search(pattern, text)
    if m is None:
        raise ParseError(f"no {what} in llama.cpp's output (looked for /{pattern}/); its last lines:\n{_tail(text)}")
    return cast(m.group(1))


def parse_spec_simple(stdout: bytes, stderr: str, prompt: bytes) -> dict:
    """llama-speculative-simple's output -> {text (generated bytes), n_predict, n_drafted, n_accept,
    tokens_per_s, decode_s, rounds}. Its stdout is "\\n\\n", the prompt's pieces, the generated pieces, "\\n\\n"
    after the loop and "\\n\\n" at exit. A round emits its accepted drafts and one token of the target, so
    rounds = n_predict - n_accept. The text may run past the budget: at the end it drafts K tokens even where
    fewer are left (common_speculative_draft truncates a draft only to a positive n_max)."""
    head, tail = b"\n\n" + prompt, b"\n\n\n\n"
    if not stdout.startswith(head):
        raise ParseError(f"llama-speculative-simple's output does not start with the prompt: {stdout[:200]!r}")
    if not stdout.endswith(tail) or len(stdout) < len(head) + len(tail):
        raise ParseError(f"llama-speculative-simple's output does not end as after a finished run: {stdout[-200:]!r}")
    speed = _number(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", stderr, "decode speed")
    n_predict = _number(r"n_predict\s*=\s*(\d+)", stderr, "n_predict", int)
    n_accept = _number(r"n_accept\s*=\s*(\d+)", stderr, "n_accept", int)
    out = {"text": stdout[len(head):-len(tail)], "n_predict": n_predict,
           "n_drafted": _number(r"n_drafted\s*=\s*(\d+)", stderr, "n_drafted", int), "n_accept": n_accept,
           "tokens_per_s": speed, "decode_s": n_predict / speed if speed > 0 else 0.0,
           "rounds": n_predict - n_accept, "draft_ms": None, "acceptance_per_position": None}
    # its draft statistics (log verbosity >= 4): the time its draft() calls took, acceptance by position
    if m := re.search(r"statistics\s+draft-eagle3:.*?dur\(b,g,a\)\s*=\s*[\d.]+,\s*([\d.]+),", stderr):
        out["draft_ms"] = float(m.group(1))
    if m := re.search(r"statistics\s+draft-eagle3:.*?#acc rate/pos\s*=\s*\(([^)]*)\)", stderr):
        out["acceptance_per_position"] = [float(x) for x in m.group(1).split(",") if x.strip()]
    return out


END_OF_TEXT = b" [end of text]\n"


def parse_completion(stdout: bytes, stderr: str, eos_text: bytes | tuple[bytes, ...] = ()) -> dict:
    """llama-completion's output (prompt not displayed, --special) -> {text, eos, n_eval, eval_ms, tokens_per_s}:
    its stdout is the generated pieces, at EOS the end token's text (one of `eos_text`: every stop token's) and
    " [end of text]\\n", then "\\n\\n" at exit; the text is the generated bytes without the end token. Timing: its
    perf counters of one-token decodes (`eval time = T ms / N runs`)."""
    if not stdout.endswith(b"\n\n"):
        raise ParseError(f"llama-completion's output does not end as after a finished run: {stdout[-200:]!r}")
    text = stdout[:-2]
    eos = text.endswith(END_OF_TEXT)
    if eos:
        text = text[:-len(END_OF_TEXT)]
        for end in ((eos_text,) if isinstance(eos_text, bytes) else eos_text):
            if end and text.endswith(end):
                text = text[:-len(end)]
                break
    m = re.search(r"(?<!prompt )eval time\s*=\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)", stderr)
    if m is None:
        raise ParseError(f"no `eval time` in llama-completion's output; its last lines:\n{_tail(stderr)}")
    eval_ms, n_eval = float(m.group(1)), int(m.group(2))
    return {"text": text, "eos": eos, "n_eval": n_eval, "eval_ms": eval_ms,
            "tokens_per_s": n_eval / eval_ms * 1e3 if eval_ms > 0 else 0.0}


def parse_tokenize(stdout: str) -> list[int]:
    """llama-tokenize --ids -> the ids (its last line, a Python list)."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("[")]
    if not lines:
        raise ParseError(f"no id list in llama-tokenize's output: {stdout[-300:]!r}")
    return [int(x) for x in re.findall(r"-?\d+", lines[-1])]


def llama_env() -> dict:
    """The environment of a llama.cpp process: ours without OMP_NUM_THREADS (runner/ sets it to one for
    ExecuTorch's sake; ggml sizes its own OpenMP teams to -t)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def run_parsed(args: list[str], parse, tries: int = 5) -> tuple[dict, int]:
    """(parse(stdout, stderr), retries) of a tool run that printed all it prints. The tools log through
    common/log.cpp's worker thread, whose logger is leaked at exit on purpose ("logs may be lost if not flushed
    before the program exits", common_log_main): now and then a run's last pieces and its closing newlines never
    reach stdout. Such a run fails to parse and is run again (its decode is the same; only the exit races)."""
    for attempt in range(tries):
        try:
            return parse(*run_tool(args)), attempt
        except ParseError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def run_tool(args: list[str], timeout: float = 300) -> tuple[bytes, str]:
    done = subprocess.run(args, capture_output=True, timeout=timeout, env=llama_env(), stdin=subprocess.DEVNULL)
    stderr = done.stderr.decode("utf-8", errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"{Path(args[0]).name} exited with {done.returncode}: {_tail(stderr, 20)}")
    return done.stdout, stderr


# ----------------------------------------------------------------------------------------------------------
# Ours: one pass in a child process


def ours_child(stdin, stdout) -> None:
    """Our side in its own process (module doc): the first line of `stdin` is the set-up {engine (runner.build
    options), artifacts (the paths it reads), threads, prompts, chains, new_tokens, stop_ids} (the engine is
    built once and every K warmed up, then {"ready": threads} is answered), each further line {"chain": K} is
    answered with that K's generation of every prompt."""
    from runner.engine import set_threads

    job = json.loads(stdin.readline())
    threads = set_threads(job["threads"])  # before the program loads (the .pte's pool takes torch's count)
    from runner.build import build_engine
    from runner.generate import generate

    engine = build_engine(job["engine"], **{k: Path(v) for k, v in job["artifacts"].items()})
    prompts, n, stop = job["prompts"], job["new_tokens"], job["stop_ids"]
    for k in job["chains"]:  # warm-up: the first calls of each method initialise its delegates (or kernels)
        generate(engine, prompts[0], chain=k, max_new_tokens=8, stop_ids=stop)
    device = None
    if job["engine"]["kind"] == "cuda":
        import torch

        device = torch.cuda.get_device_name(torch.device(job["engine"]["device"]))
    print(json.dumps({"ready": threads, "device": device}), file=stdout, flush=True)
    for line in stdin:
        if not line.strip():
            break
        k = json.loads(line)["chain"]
        runs = []
        for p in prompts:
            r = generate(engine, p, chain=k, max_new_tokens=n, stop_ids=stop)
            runs.append({"output_ids": r.output_ids, "decode_tokens": r.decode_tokens, "decode_ms": r.decode_ms,
                         "rounds": r.rounds, "drafted": r.drafted, "accepted": sum(r.accepted),
                         "emitted": sum(r.emitted), "eos": r.stop_reason == "stop_token", "draft_ms": r.draft_ms,
                         "verify_ms": r.verify_ms})
        print(json.dumps({"chain": k, "runs": runs}), file=stdout, flush=True)


class OursChild:
    """`python -m bench.llama_eagle3 --child` held open: one load of our engine per thread count, one K at a time
    on request, so our passes interleave with llama.cpp's K by K."""

    def __init__(self, job: dict):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.err = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama_eagle3-child-{os.getpid()}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.llama_eagle3", "--child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env, cwd=ROOT)
        ready = self._ask(job)
        self.threads, self.device = ready["ready"], ready.get("device")

    def _ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise RuntimeError(f"our child process ended (exit {self.proc.wait()}): {_tail(self.err.read(), 20)}")
        return json.loads(line)

    def run(self, k: int) -> list[dict]:
        return self._ask({"chain": k})["runs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.err.close()
        Path(self.err.name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None and self.proc.poll() is None:
            self.proc.kill()
        self.close()


# ----------------------------------------------------------------------------------------------------------
# The summary


def strip_stop(ids: list[int], stop_ids) -> list[int]:
    """`ids` up to (without) the first stop token: llama.cpp prints none."""
    stop = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stop:
            return ids[:i]
    return list(ids)


def first_difference(a: dict, b: dict) -> int | None:
    """The first byte where two generations' texts differ, None where they agree: over the shorter text where
    both ran to the budget (llama-speculative-simple may run a round past it), over all of both where either
    stopped at EOS. a, b: {"text": bytes, "eos": bool}."""
    x, y = a["text"], b["text"]
    if not (a["eos"] or b["eos"]):
        n = min(len(x), len(y))
        x, y = x[:n], y[:n]
    if x == y:
        return None
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def rate(tokens: list[int], seconds: list[float]) -> float:
    return sum(tokens) / sum(seconds) if sum(seconds) > 0 else 0.0


def summarise(passes: dict, chains: list[int]) -> list[dict]:
    """passes: {"ours": [pass], "llama": [pass]}, a pass {K: [per-prompt record with tokens, seconds, text,
    drafted, accepted, rounds]} -> one row per K with each side's median rate over passes and its spread,
    acceptance, tau, and the text checks (first pass: greedy text is the same every pass, checked)."""
    rows = []
    first = {side: p[0] for side, p in passes.items()}
    for k in chains:
        row = {"chain": k}
        for side, side_passes in passes.items():
            if k not in side_passes[0]:  # a side that cannot run this K (llama.cpp's EAGLE-3 on some targets)
                row[side] = None
                continue
            rates = [rate([r["tokens"] for r in p[k]], [r["seconds"] for r in p[k]]) for p in side_passes]
            recs = first[side][k]
            drafted, accepted = sum(r["drafted"] for r in recs), sum(r["accepted"] for r in recs)
            rounds = [r["rounds"] or 0 for r in recs]
            row[side] = {
                "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
                "tokens_per_s_max": max(rates), "passes": len(rates),
                "tokens": sum(r["tokens"] for r in recs), "drafted": drafted, "accepted": accepted,
                "acceptance": accepted / drafted if drafted else None,
                "tau": (accepted + sum(rounds)) / sum(rounds) if k and sum(rounds) else None,
                "same_text_every_pass": all(p[k][i]["text"] == recs[i]["text"] for p in side_passes
                                            for i in range(len(recs))),
                "lossless_vs_own_k0": ([first_difference(z, r) is None for r, z in zip(recs, first[side][0])]
                                       if k and 0 in first[side] else None),
                "reruns": sum(r.get("reruns", 0) for p in side_passes for r in p[k]),
                "round_ms": statistics.median(1e3 * sum(r["seconds"] for r in p[k]) / max(sum(r["rounds"] or 0 for r in p[k]), 1)
                                              for p in side_passes) if k else None,
                "draft_ms_per_round": (statistics.median(sum(r["draft_ms"] for r in p[k]) / max(sum(r["rounds"] or 0 for r in p[k]), 1)
                                                         for p in side_passes)
                                       if k and all(r.get("draft_ms") is not None for p in side_passes for r in p[k])
                                       else None),
            }
        if row["ours"] is None or row["llama"] is None:
            row["text_first_difference"] = row["text_equal"] = row["ratio"] = None
            rows.append(row)
            continue
        ours, llama = first["ours"][k], first["llama"][k]
        row["text_first_difference"] = [first_difference(o, l_) for o, l_ in zip(ours, llama)]
        row["text_equal"] = [d is None for d in row["text_first_difference"]]
        row["ratio"] = row["ours"]["tokens_per_s"] / row["llama"]["tokens_per_s"] if row["llama"]["tokens_per_s"] else None
        rows.append(row)
    return rows


def best(rows: list[dict], side: str, speculative_only: bool = True) -> dict | None:
    cands = [r for r in rows if (r["chain"] or not speculative_only) and r[side] is not None]
    if not cands:
        return None
    r = max(cands, key=lambda r: r[side]["tokens_per_s"])
    return {"chain": r["chain"], "tokens_per_s": r[side]["tokens_per_s"], "tau": r[side]["tau"]}


def table(result: dict) -> str:
    lines = []
    for block in result["runs"]:
        rows, n = block["rows"], result["prompts"]
        where = (f"{result['gpu']}, llama.cpp -t {block['threads']}" if result.get("device") == "cuda"
                 else f"{result['cpu']} ({result['capability']}), {block['threads']} thread(s)")
        lines.append(f"\n== {where}: {n} prompts x {result['new_tokens']} tokens, {result['reps']} passes; ours "
                     f"{result['ours_label']}, llama.cpp {result['llama_label']}")
        if load := block.get("load_during"):
            lines.append(f"   other processes used {load['other_processes_cores']} cores on average meanwhile "
                         f"({load['wall_s']:.0f} s)")
        head = (f"{'K':>2} {'ours tok/s':>18} {'llama.cpp tok/s':>18} {'ours/llama':>10} {'ours acc (tau)':>15} "
                f"{'llama acc (tau)':>15} {'ours ms/round':>13} {'llama ms/round':>14} {'text = ours':>11} "
                f"{'llama = own K=0':>15}")
        lines += [head, "-" * len(head)]
        for r in rows:
            o, l_ = r["ours"], r["llama"]

            def tok(s):
                if s is None:
                    return "-"
                return f"{s['tokens_per_s']:.0f} ({s['tokens_per_s_min']:.0f}-{s['tokens_per_s_max']:.0f})"

            def acc(s):
                if s is None or s["acceptance"] is None:
                    return "-"
                return f"{s['acceptance']:.2f} ({s['tau']:.2f})" if s["tau"] else f"{s['acceptance']:.2f}"

            def per_round(s):
                if s is None or s.get("round_ms") is None:
                    return "-"
                draft = s.get("draft_ms_per_round")
                return f"{s['round_ms']:.2f}" + (f" ({draft:.2f})" if draft is not None else "")

            ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
            own = l_["lossless_vs_own_k0"] if l_ else None
            lossless = "-" if own is None else f"{sum(own)}/{len(own)}"
            equal = "-" if r["text_equal"] is None else f"{sum(r['text_equal'])}/{len(r['text_equal'])}"
            lines.append(f"{r['chain']:>2} {tok(o):>18} {tok(l_):>18} {ratio:>10} {acc(o):>15} {acc(l_):>15} "
                         f"{per_round(o):>13} {per_round(l_):>14} {equal:<11} {lossless:>15}")
        lines.append("   ms/round: decode time per round (in brackets its draft's part: ours the draft_chain call, "
                     "llama.cpp its draft() calls)")
        if note := result.get("llama_eagle3_note"):
            lines.append(f"   llama.cpp K >= 1: {note}")
        bo, bl = block["best"]["ours"], block["best"]["llama"]
        if bo and bl:
            lines.append(f"best: ours K={bo['chain']} {bo['tokens_per_s']:.0f} tok/s, llama.cpp EAGLE-3 K={bl['chain']} "
                         f"{bl['tokens_per_s']:.0f} tok/s: ours / llama.cpp's best = {bo['tokens_per_s'] / bl['tokens_per_s']:.2f}x"
                         + (f" (llama.cpp plain K=0: {block['best']['llama_any']['tokens_per_s']:.0f})"
                            if block["best"]["llama_any"]["chain"] == 0 else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The run


def find_export(store: Path, key: str | None) -> dict:
    """The export artifact to compare on the CPU: `key` (a prefix, any target and export.quant), else the newest
    export of the embedded default whose target is fp32 (quant 8da4w_draft or fp32); with its target and draft
    artifacts."""
    from bench.targets import store_exports, which_target

    exports = store_exports(store) if (store / "export").is_dir() else []
    if key:
        exports = [e for e in exports if e["key"].startswith(key)]
    else:
        exports = [e for e in exports if which_target(e["target_cfg"]) == "tiny"
                   and e["quant"] in ("8da4w_draft", "fp32")]  # store_exports: the current names
    if not exports:
        raise SystemExit(f"no export of {'key ' + key if key else 'the embedded default'} "
                         f"{'' if key else 'with an fp32 target (export.quant 8da4w_draft or fp32) '}in {store}: "
                         f"run `python -m pipeline +stage=export`")
    e = max(exports, key=lambda e: e["created_at"] or "")
    manifest = json.loads((e["path"] / "manifest.json").read_text())
    e["draft_key"] = manifest["upstream"]["draft"]
    e["draft_path"] = store / "draft" / e["draft_key"]
    return e


def find_draft(draft: Path, target: Path | None = None) -> dict:
    """A draft artifact (the speculators layout) for the CUDA engine and its target artifact: `target`, else the
    one its manifest names upstream in the same store; in find_export's shape (key: the draft's)."""
    draft = Path(draft)
    if target is None:
        upstream = json.loads((draft / "manifest.json").read_text())["upstream"]["target"]
        target = draft.parent.parent / "target" / upstream
    tm = json.loads((Path(target) / "manifest.json").read_text())
    return {"key": draft.name, "draft_key": draft.name, "draft_path": draft, "target_key": Path(target).name,
            "target_path": Path(target), "target_cfg": tm["config"].get("target", {}),
            "data_cfg": tm["config"].get("data", {}), "created_at": None, "git_commit": tm.get("git_commit")}


def cuda_engine_options(preset: str | None) -> dict:
    """runner.build's options for the CUDA engine as `engine=cuda target=<preset>` composes them:
    conf/engine/cuda.yaml, then conf/engine/cuda/<preset>.yaml where it exists (the real presets: engine.quant
    w4_g32, a 4096-position cache); exact mode on (the bench's condition: every K gives K = 0's tokens) and the
    default K resolved as pipeline.hardware resolves it."""
    import yaml

    from pipeline.hardware import resolve_default_chain

    conf = ROOT / "conf" / "engine"
    options = yaml.safe_load((conf / "cuda.yaml").read_text())
    options.pop("defaults", None)
    if preset and (own := conf / "cuda" / f"{preset}.yaml").is_file():
        options.update(yaml.safe_load(own.read_text()).get("engine") or {})
    options["exact"] = True
    options["default_chain"] = resolve_default_chain(options["default_chain"], max_m=int(options["max_m"]),
                                                     backend=None, quant=None)
    return options


def ours_engine(inputs: dict, device: str) -> dict:
    """What our child process builds (runner.build.build_engine): {engine: options, artifacts: paths, max_m,
    max_seq_len, label}. cpu: the export's .pte (static K, not exact), in the program's windows; cuda: the
    target and draft artifacts through the CUDA engine (`cuda_engine_options`)."""
    from bench.targets import which_target

    if device == "cpu":
        export = inputs["export"]
        return {"engine": {"kind": "pte", "exact": False, "exact_width": None},
                "artifacts": {"pte": str(inputs["path"] / "model.pte"),
                              "tokenizer": str(inputs["target_path"] / "tokenizer.json")},
                "max_m": int(export["max_m"]), "max_seq_len": export.get("max_seq_len"),
                "label": f".pte {inputs['key'][:12]} (export.quant={inputs['quant']})"}
    options = cuda_engine_options(which_target(inputs["target_cfg"]))
    return {"engine": options, "artifacts": {"target": str(inputs["target_path"]), "draft": str(inputs["draft_path"])},
            "max_m": int(options["max_m"]), "max_seq_len": int(options["max_seq_len"]),
            "label": f"CUDA engine (engine.quant={options['quant']}, exact), draft {inputs['draft_key'][:12]}"}


def prepare(inputs: dict, work: Path, src: Path, draft_outtype: str, target_type: str) -> dict:
    """The target GGUF, the HF target directory, our draft's directory as the converter reads it and the draft
    GGUF, each once per work folder. The target GGUF: the file a GGUF target was converted from (`target_gguf`:
    llama.cpp runs its own quantised file), else our target written as one (bench.gguf_write, `target_type`).
    The draft is not converted where llama.cpp's graph of the target cannot feed an EAGLE-3 draft
    (`eagle3_target_supported`); files["eagle3"] says why."""
    from models import TargetConfig

    work.mkdir(parents=True, exist_ok=True)
    tokenizer_path = inputs["target_path"] / "tokenizer.json"
    source = target_gguf(inputs["target_path"])
    if source is None:  # our own target (the embedded default): as an f32 (or f16) GGUF, once
        from tokenizers import Tokenizer

        from bench.gguf_write import write_gguf
        from models.checkpoint import load_target

        gguf = work / f"target-{target_type}.gguf"
        model = load_target(inputs["target_path"])
        cfg = model.cfg
        if not gguf.is_file():
            print(f"writing {gguf}", flush=True)
            write_gguf(model, Tokenizer.from_file(str(tokenizer_path)), gguf, dtype=target_type, pre=GPT2_PRE)
        specials, pre, architecture = None, GPT2_PRE, "llama"
    else:
        gguf, specials = source, gguf_specials(source)
        cfg = TargetConfig.from_dict(json.loads((inputs["target_path"] / "config.json").read_text()))
        pre, architecture = specials["pre"] or GPT2_PRE, specials["architecture"]
    hf_dir = write_hf_target_dir(cfg, tokenizer_path, work / "target-hf", specials)
    files = {"target_gguf": gguf, "target_written": source is None, "hf_dir": hf_dir, "model_cfg": cfg,
             "bos_added": specials["bos"] if specials and specials["add_bos"] else None, "eagle3": None,
             "draft_gguf": work / f"draft-eagle3-{draft_outtype}.gguf", "conversion": None}
    if eagle3_target_supported(src, architecture) is False:
        files["eagle3"] = (f"not run: llama.cpp's {architecture} graph (src/models/{architecture}.cpp) does not hand "
                           f"out its layers' inputs, which its EAGLE-3 reads as the draft's taps (it would abort)")
        return files
    draft_dir = work / "draft-speculators"  # the artifact's files, without its manifest
    draft_dir.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        link = draft_dir / name
        if not link.exists():
            link.symlink_to((inputs["draft_path"] / name).resolve())
    info_path = work / f"convert-{draft_outtype}.json"
    if files["draft_gguf"].is_file() and info_path.is_file():
        files["conversion"] = json.loads(info_path.read_text())
    else:
        print(f"converting our draft with llama.cpp's convert_hf_to_gguf.py -> {files['draft_gguf']}", flush=True)
        files["conversion"] = convert_draft(src, draft_dir, hf_dir, files["draft_gguf"], draft_outtype, pre)
        info_path.write_text(json.dumps(files["conversion"], indent=1))
    return files


def llama_k(tools: dict, files: dict, prompt_files: list[Path], k: int, threads: int, new_tokens: int, ctx: int,
            eos_text: tuple[bytes, ...] = (), gpu_layers: int = 0) -> list[dict]:
    """llama.cpp at K over every prompt: llama-completion for K = 0, llama-speculative-simple (EAGLE-3) else."""
    recs = []
    for pf in prompt_files:
        prompt = pf.read_bytes()[:-1]
        if k == 0:
            r, again = run_parsed(completion_args(tools["llama-completion"], files["target_gguf"], pf, threads,
                                                  new_tokens, ctx, gpu_layers),
                                  lambda o, e: parse_completion(o, e, eos_text))
            recs.append({"tokens": r["n_eval"], "seconds": r["eval_ms"] / 1e3, "text": r["text"],
                         "drafted": 0, "accepted": 0, "rounds": None, "eos": r["eos"], "reruns": again})
        else:
            r, again = run_parsed(spec_simple_args(tools["llama-speculative-simple"], files["target_gguf"],
                                                   files["draft_gguf"], pf, k, threads, new_tokens, ctx, gpu_layers),
                                  lambda o, e: parse_spec_simple(o, e, prompt))
            recs.append({"tokens": r["n_predict"], "seconds": r["decode_s"], "text": r["text"],
                         "drafted": r["n_drafted"], "accepted": r["n_accept"], "rounds": r["rounds"],
                         "eos": r["n_predict"] < new_tokens, "reruns": again, "draft_ms": r["draft_ms"]})
    return recs


def our_k(runs: list[dict], tokenizer, stop_ids) -> list[dict]:
    return [{"tokens": r["decode_tokens"], "seconds": r["decode_ms"] / 1e3,
             "text": token_bytes(tokenizer, strip_stop(r["output_ids"], stop_ids)),
             "drafted": r["drafted"], "accepted": r["accepted"], "rounds": r["rounds"],
             "eos": r["eos"], "output_ids": r["output_ids"], "draft_ms": r["draft_ms"]} for r in runs]


def write_prompts(tools: dict, files: dict, tokenizer, eval_ids: list[list[int]], prompt_dir: Path
                  ) -> tuple[list[Path], list[list[int]], list[bool]]:
    """Each prompt's bytes as llama.cpp's prompt file (without a BOS its model adds itself), and the ids
    llama-tokenize reads them as -> (prompt files, llama.cpp's ids, whether they are the eval's)."""
    prompt_dir.mkdir(exist_ok=True)
    prompt_files, prompts, same_ids = [], [], []
    for i, ids in enumerate(eval_ids):
        data = token_bytes(tokenizer, llama_prompt_ids(ids, files["bos_added"]))
        raw = prompt_dir / f"prompt-{i}.raw"
        raw.write_bytes(data)
        llama_ids = parse_tokenize(run_tool(tokenize_args(tools["llama-tokenize"], files["target_gguf"], raw))[0]
                                   .decode("utf-8", errors="replace"))
        pf = prompt_dir / f"prompt-{i}.txt"
        pf.write_bytes(prompt_file_bytes(data))
        prompt_files.append(pf)
        prompts.append(llama_ids)
        same_ids.append(llama_ids == ids)
    return prompt_files, prompts, same_ids


def run(args) -> dict:
    import torch
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from bench.machine import cpu_name, load_between, load_snapshot, public
    from bench.targets import make_prompts
    from models.text import load_chat_template, stop_ids as end_stop_ids

    gpu = args.device == "cuda"
    gpu_layers = GPU_LAYERS if gpu else 0
    tools = llama_build.tools(args.llama_cache, cuda=gpu)
    if tools is None:
        if args.no_build:
            raise SystemExit(llama_build.missing_message(args.llama_cache, cuda=gpu))
        print("llama.cpp's tools are not built yet: building them once (bench.llama_build)", flush=True)
        tools = llama_build.build(args.llama_cache, cuda=gpu)
    src = llama_build.source_dir(args.llama_cache)
    if gpu != (args.draft is not None):
        raise SystemExit("--device cuda runs the CUDA engine over --draft DIR (a draft artifact); the CPU runs an "
                         "export's .pte (--export KEY)")
    inputs = find_draft(args.draft, args.target) if gpu else find_export(args.store, args.export)
    ours = ours_engine(inputs, args.device)
    work = args.work / (("cuda-" if gpu else "") + inputs["key"][:16])
    files = prepare(inputs, work, src, args.draft_outtype, args.target_type)
    tokenizer = Tokenizer.from_file(str(inputs["target_path"] / "tokenizer.json"))
    stop = end_stop_ids(tokenizer)
    chains = [k for k in args.chains if k < ours["max_m"]]
    llama_chains = chains if files["eagle3"] is None else [0]
    ctx = int(ours["max_seq_len"] or files["model_cfg"].max_seq_len)  # our engine's cache

    # the eval's prompts (the target's prompt format), as bytes for llama.cpp, and the ids llama.cpp reads them as
    prompt_format = inputs.get("data_cfg", {}).get("prompt_format", "plain")
    eval_ids = make_prompts(tokenizer, prompt_format, load_chat_template(inputs["target_path"]), args.prompts,
                            args.prompt_len, args.seed)
    prompt_files, prompts, same_ids = write_prompts(tools, files, tokenizer, eval_ids, work / "prompts")
    if not all(same_ids):
        print(f"llama.cpp tokenizes {same_ids.count(False)} of {len(same_ids)} prompts to other ids than the "
              f"eval's: both sides decode llama.cpp's ids", file=sys.stderr)

    before = load_snapshot()
    runs, device_name = [], None
    eos_texts = tuple(token_bytes(tokenizer, [t]) for t in stop)
    for threads in args.threads:
        block_before = load_snapshot()
        passes = {"ours": [{} for _ in range(args.reps)], "llama": [{} for _ in range(args.reps)]}
        setup = {"engine": ours["engine"], "artifacts": ours["artifacts"], "prompts": prompts, "chains": chains,
                 "threads": threads, "new_tokens": args.new_tokens, "stop_ids": stop}
        with OursChild(setup) as child, tqdm(total=args.reps * len(chains), desc=f"{threads} thread(s)", unit="K",
                                             dynamic_ncols=True) as bar:
            device_name = child.device
            for rep in range(args.reps):  # K by K, the side that goes first alternating pass by pass
                for k in chains:
                    bar.set_postfix_str(f"pass {rep + 1}, K={k}")
                    for side in (("ours", "llama") if rep % 2 == 0 else ("llama", "ours")):
                        if side == "ours":
                            passes["ours"][rep][k] = our_k(child.run(k), tokenizer, stop)
                        elif k in llama_chains:
                            passes["llama"][rep][k] = llama_k(tools, files, prompt_files, k, threads,
                                                              args.new_tokens, ctx, eos_texts, gpu_layers)
                    bar.update()
        rows = summarise(passes, chains)
        runs.append({"threads": threads, "load_during": load_between(block_before, load_snapshot()), "rows": rows,
                     "best": {"ours": best(rows, "ours"), "llama": best(rows, "llama"),
                              "llama_any": best(rows, "llama", speculative_only=False)},
                     "ours_output_ids": {k: [r["output_ids"] for r in passes["ours"][0][k]] for k in chains}})
    after = load_snapshot()
    stamp = llama_build.stamp_path(args.llama_cache, cuda=gpu)
    result = {
        "command": "python -m bench.llama_eagle3 " + " ".join(args.argv), "device": args.device,
        "cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "nproc": os.cpu_count(),
        "gpu": device_name if gpu else None,
        "python": platform.python_version(), "torch": torch.__version__,
        "llama_cpp": json.loads(stamp.read_text()),
        "threads": args.threads, "prompts": len(prompts), "prompt_len": args.prompt_len,
        "prompt_format": prompt_format, "new_tokens": args.new_tokens, "reps": args.reps, "seed": args.seed,
        "chains": chains, "llama_chains": llama_chains, "llama_eagle3_note": files["eagle3"],
        "inputs": {k: inputs.get(k) for k in ("key", "quant", "created_at", "git_commit", "target_key", "draft_key")},
        "ours_engine": ours["engine"], "ours_label": ours["label"],
        "llama_label": f"{files['target_gguf'].name}" + (f" + {files['draft_gguf'].name}" if files["eagle3"] is None
                                                          else "") + (f", -ngl {gpu_layers}" if gpu_layers else ""),
        "files": {"target_gguf": str(files["target_gguf"]), "target_gguf_written": files["target_written"],
                  "draft_gguf": str(files["draft_gguf"]) if files["conversion"] else None,
                  "hf_target_dir": str(files["hf_dir"])},
        "conversion": files["conversion"],
        "commands": {
            "speculative": " ".join(spec_simple_args("llama-speculative-simple", files["target_gguf"].name,
                                                     files["draft_gguf"].name, "PROMPT", "K", "N",
                                                     args.new_tokens, ctx, gpu_layers)),
            "plain": " ".join(completion_args("llama-completion", files["target_gguf"].name, "PROMPT", "N",
                                              args.new_tokens, ctx, gpu_layers)),
        },
        "timed": {"ours": "decode tokens / decode time (GenerationResult: after prefill and its bonus token)",
                  "llama.cpp K>=1": "llama-speculative-simple's decode speed: generated tokens / the decode loop's "
                                    "wall time",
                  "llama.cpp K=0": "llama-completion's eval time: one-token decodes / their time inside llama.cpp"},
        "prompt_ids": prompts, "prompt_ids_equal_eval": same_ids,
        "load_before": public(before), "load_after": public(after), "load_during": load_between(before, after),
        "runs": runs,
    }
    return result


def jsonable(x):
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def dump(result: dict) -> str:
    """The result as indented JSON with every list of numbers or booleans on one line (token ids stay short)."""
    text = json.dumps(jsonable(result), indent=1)
    return re.sub(r"\[[\s\d.eE+\-,nulltruefalse]*\]", lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "),
                  text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m bench.llama_eagle3", description=__doc__.split("\n")[0],
                                 epilog="Module docstring: what runs on each side and how it is timed.")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: an export's .pte against llama.cpp's CPU build | cuda: the CUDA engine over --draft "
                         "against llama.cpp's CUDA build (bench.llama_build --cuda), every layer offloaded")
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("PIPELINE_OUTPUTS", ROOT / "outputs")) / "store")
    ap.add_argument("--export", default=None, help="cpu: an export key (prefix), any target; default: the newest "
                    "export of the embedded default with an fp32 target")
    ap.add_argument("--draft", type=Path, default=None, help="cuda: a draft artifact's directory (the speculators "
                    "layout), e.g. outputs/store/draft/<key>; its target is the one its manifest names")
    ap.add_argument("--target", type=Path, default=None, help="cuda: the target artifact, where not --draft's own")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (both sides alike; cuda: "
                    "llama.cpp's -t) (default: 1,2 on the cpu, 4 on cuda)")
    ap.add_argument("--chains", default="0,1,2,3,4,5,6,7", help="K values (0: plain decoding)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (runtime.n_prompts)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (runtime.prompt_len)")
    ap.add_argument("--new-tokens", type=int, default=128, help="budget per prompt (runtime.max_new_tokens)")
    ap.add_argument("--seed", type=int, default=0, help="which held-out windows (runtime.seed)")
    ap.add_argument("--reps", type=int, default=3, help="passes per thread count")
    ap.add_argument("--draft-outtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"),
                    help="the converter's --outtype for our draft")
    ap.add_argument("--target-type", default="f32", choices=("f32", "f16"),
                    help="the target GGUF's matrices (f32: the .pte's fp32 target's very weights)")
    ap.add_argument("--llama-cache", type=Path, default=None, help="bench.llama_build's folder")
    ap.add_argument("--no-build", action="store_true", help="fail instead of building llama.cpp's tools")
    ap.add_argument("--work", type=Path, default=WORK, help="working files (GGUFs, prompt files)")
    ap.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON.relative_to(ROOT)} "
                    f"(cuda: {DEFAULT_GPU_JSON.relative_to(ROOT)})")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        ours_child(sys.stdin, sys.stdout)
        return 0
    args.argv = argv
    args.threads = [int(t) for t in (args.threads or ("4" if args.device == "cuda" else "1,2")).split(",")]
    args.chains = sorted({int(k) for k in args.chains.split(",")} | {0})  # K = 0: the lossless reference
    args.json = args.json or (DEFAULT_GPU_JSON if args.device == "cuda" else DEFAULT_JSON)
    result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(dump(result))
    print(table(result))
    conv = result["conversion"]
    if conv:
        print(f"\nour draft, converted by llama.cpp's converter ({conv['seconds']:.0f} s): {conv['command']}\n"
              f"  -> architecture {conv['architecture']}, eagle3.target_layers "
              f"{conv['metadata'].get('eagle3.target_layers')}, d2t {conv['tensors'].get('d2t')}")
        if conv["pre_tokenizer_shim"]:
            print(f"  its plain run stopped at: {conv['pre_tokenizer_shim'].splitlines()[-1].strip()}\n"
                  f"  so it ran again with TextModel.get_vocab_base_pre answering the target's pre-tokenizer "
                  f"(bench.llama_eagle3.PRE_SHIM)")
    else:
        print(f"\nour draft was not converted: llama.cpp's EAGLE-3 {result['llama_eagle3_note']}")
    same = result["prompt_ids_equal_eval"]
    print(f"prompts: llama.cpp reads {sum(same)} of {len(same)} as the eval's ids")
    print(f"\nwrote {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
