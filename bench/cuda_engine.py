"""The CUDA engine on one GPU: exactness checks, then the cost of a speculative round at every K by shape.

    python3 -m bench.cuda_engine --out $OUT/cuda_engine.json [--only check,shapes] [--tau tau.json]
    python3 -m bench.cuda_engine --from bench/results/h200-cuda-engine.json --tau bench/results/real-targets-cpu-tau.json
    python3 -m bench.cuda_engine --only preset,gemma --store outputs/store --out $OUT/peers.json
    python3 -m bench.cuda_engine --only preset_shape --out $OUT/preset_shape.json
    LLAMA_CPP_LIB_PATH=<llama.cpp CUDA build>/bin python3 -m bench.cuda_engine --only real --target gemma3_270m \
        --draft DIR --prompts 4 --new-tokens 256 --out $OUT/real.json [--parts ...] [--resume]

check   transformers' greedy (fp32, its own LlamaForCausalLM) against the engine with the kernels off in
        fp32 on the same weights, 64 tokens on several prompts; and the engine in bf16 with graphs (kernels
        off and on) against its own K=0 at every K.
shapes  random weights in the shapes of the supported real targets (bf16 dense, and INT4 on the kernels) and
        of Llama-3-8B (INT4 on the kernels):
        per call, the GPU time of a graph replay (events around many replays, back to back) and the wall
        time of the engine's call (copies in, replay, ids back); per round at each K, the wall time the loop
        sees, the GPU time of its graph (replays back to back) and its host share (the difference). With --tau (a JSON of
        {shape: {K: tau}}, e.g. the CPU sweeps of the same models' trained drafts: greedy acceptance depends
        on the weights, not the device) it prints each shape's predicted speedup tau(K) / (round(K) / decode).
        Random drafts accept almost nothing, so every timed round does the work of a rejected chain: K draft
        steps and one verify of K+1 rows, which is what a round costs whatever it accepts, up to the reseed
        width.
preset  the target and draft a `+experiment=gpu` pipeline left in --store, on the held-out taps' prompts
        (their first held_out_prompt_len tokens, max_new_tokens 256): the engine (bf16, CUDA graphs) at K = 0
        and every K, against the same weights in transformers' LlamaForCausalLM (bf16) with its default cache,
        with a static cache that generate() compiles (`hf_option`), with prompt-lookup decoding and with
        assisted generation (a copy of the target's first ASSISTANT_LAYERS layers as the assistant), all
        greedy, one after another on the same prompts; tokens/s = new tokens / wall time of the whole
        generation (prefill included), and the engine's decode-only rate beside it.
preset_shape  the preset's shape with random weights: the engine's K = 0 against transformers' greedy with its
        default cache and with its compiled static cache.
real    a real preset (--target gemma3_270m | smollm2_135m: the GGUF its package holds, read as the pipeline
        reads it) and its trained draft (--draft, a speculators directory) on the preset's own prompts:
        the engine in bf16 (its K = 0 the quality reference), INT4 on the kernels in exact mode (each
        engine.quant scheme) and bf16 through inductor (engine.compile), at K = 0 and every K,
        each with its load seconds and prefill ms; llama.cpp's CUDA build on the same GGUF (every layer
        offloaded, in a process of its own: bench.llama_run), plain and with prompt lookup;
        transformers on the same GGUF in bf16, default cache and compiled static cache. Whole-generation and
        decode-only tokens/s for each. Quality against the bf16 engine's target: held-out loss over corpus
        windows, the share of greedy tokens that agree over 128 (teacher-forced on the bf16 model's own
        continuation), and free-running tokens until the first difference. --parts picks what runs.
gemma   Gemma 3 270M's real layers (its config: 5 sliding-window layers to 1 global, QK-norm, (1 + w) norms,
        GeGLU, output norms) with random weights through the engine (kernels off and on) at K = 0 and every K,
        and transformers' Gemma3ForCausalLM with random weights (bf16; default and static cache), a 128-token
        prompt and 256 new tokens: the engine's K = 0 against transformers' decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from models import Speculator, Transformer, draft_config_for
from models.choices import CUDA_QUANTS
from models.config import TargetConfig
from models.draft import Eagle3Draft
from runner.cuda_engine import CudaEngine
from runner.generate import generate

MAX_M = 8
WINDOWS = dict(max_m=MAX_M, default_chain=4, max_prefill_chunk=128, min_prefill_chunk=16)

# Real targets by their shapes, as Llama-family configs (the costs are the shapes' bytes and launches).
SHAPES = {
    "smollm2_135m": dict(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         intermediate_size=1536, tie_embeddings=True),
    "gemma3_270m": dict(vocab_size=262144, hidden_size=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
                        intermediate_size=2048, tie_embeddings=True),
    "llama3_8b_int4": dict(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           head_dim=128, intermediate_size=14336, rope_theta=500000.0),
}
DRAFT_VOCAB = 8192
ASSISTANT_LAYERS = 4
NEW_TOKENS = 256
MODES = ("bf16", "bf16_exact", "w4_g128")  # the engine's modes in `preset` (w4_g128: engine.quant's scheme)
PEERS = ("greedy", "prompt_lookup_4", "assisted", "static_compiled")  # transformers' options, in this order

# Gemma 3 270M's config.json (text part) as transformers 4.57 writes it: the real layers, not only the shapes.
GEMMA3_270M = {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
               "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
               "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "sliding_window": 512, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
               "max_position_embeddings": 32768, "tie_word_embeddings": True,
               "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]}


def gemma3_layers() -> dict:
    """TargetConfig fields of GEMMA3_270M, read by the same code that reads a real checkpoint's config."""
    from models.hf import target_config_from_hf

    cfg = target_config_from_hf(GEMMA3_270M, "GEMMA3_270M", max_seq_len=2048)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("max_seq_len", "tap_layers")}


SHAPES["gemma3_270m_layers"] = gemma3_layers()


def random_speculator(shape: dict, max_seq_len: int, seed: int = 0) -> Speculator:
    cfg = TargetConfig(**shape, max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        target = Transformer(cfg)
        draft = Eagle3Draft(draft_config_for(cfg, draft_vocab_size=min(DRAFT_VOCAB, cfg.vocab_size)))
    with torch.no_grad():  # PyTorch's default init: well separated logits, so bf16 noise decides no argmax
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
    return Speculator(target.eval(), draft.eval())


def gpu_preset_shape() -> dict:
    """+experiment=gpu's target shape as its config composes it: the embedded default's model fields
    (conf/target/tiny.yaml) under conf/target/tiny/gpu.yaml's sizes. Plain YAML, no Hydra: the GPU machine has
    PyYAML only; the keys tiny.yaml interpolates (vocab_size, max_seq_len, tap_layers) are set here or left out."""
    import yaml

    conf = Path(__file__).resolve().parents[1] / "conf"
    model = yaml.safe_load((conf / "target/tiny.yaml").read_text())["model"]
    gpu = yaml.safe_load((conf / "target/tiny/gpu.yaml").read_text())["target"]
    shape = {k: v for k, v in model.items() if k not in ("vocab_size", "max_seq_len", "tap_layers")}
    return {**shape, **gpu["model"], "vocab_size": gpu["tokenizer"]["vocab_size"]}


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- check ---------------------------------------------------------------------------------------------------
def check() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.hf import hf_weight_names

    hf_cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).cuda().float().eval()
    cfg = TargetConfig(vocab_size=2048, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                       intermediate_size=512, rope_theta=10000.0, rms_norm_eps=1e-6, max_seq_len=256)
    target = Transformer(cfg)
    state = hf.state_dict()
    target.load_state_dict({ours: state[theirs] for theirs, ours in hf_weight_names(cfg).items()}, strict=False)
    draft = Eagle3Draft(draft_config_for(cfg))
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    out = {"transformers_equal": [], "lossless": {}}
    engine = CudaEngine(Speculator(target, draft), device="cuda", dtype="float32", exact=False, **WINDOWS)
    for seed in range(4):
        ids = prompt(24 + 7 * seed, hf_cfg.vocab_size, seed)
        ours = generate(engine, ids, chain=0, max_new_tokens=64).output_ids
        theirs = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=64, do_sample=False)
        theirs = theirs[0, len(ids):].tolist()
        out["transformers_equal"].append(ours == theirs)
    for kernels in (False, True):
        spec = random_speculator(SHAPES["smollm2_135m"] | dict(n_layers=4), max_seq_len=512, seed=1)
        engine = CudaEngine(spec, device="cuda", kernels=kernels, exact=False, **WINDOWS)
        ok = []
        for seed in range(3):
            ids = prompt(40 + seed, 49152, 10 + seed)
            base = generate(engine, ids, chain=0, max_new_tokens=96).output_ids
            ok.append(all(generate(engine, ids, chain=k, max_new_tokens=96).output_ids == base
                          for k in range(1, MAX_M)))
        out["lossless"]["kernels" if kernels else "dense"] = ok
    return out


# --- shapes --------------------------------------------------------------------------------------------------
def gpu_ms(call, reps: int = 50) -> float:
    """Median GPU time of one replay of a captured call, replays back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            call.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def wall_ms(fn, reps: int = 50) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def shape_costs(shape: dict, kernels: bool, context: int, new_tokens: int) -> dict:
    spec = random_speculator(shape, max_seq_len=context + new_tokens + 2 * MAX_M)
    t = time.perf_counter()
    engine = CudaEngine(spec, device="cuda", kernels=kernels, exact=False, **WINDOWS)
    load_s = time.perf_counter() - t
    H = spec.draft.cfg.hidden_size
    P = context  # calls at the end of a full context, as a long generation sees them
    one = torch.ones(1, 1, dtype=torch.long)
    row = {"kernels": kernels, "load_s": load_s, "context": context,
           "decode_gpu_ms": gpu_ms(engine.decode),
           "decode_call_ms": wall_ms(lambda: engine.target_decode(one, torch.tensor([P]))),
           "draft_gpu_ms": gpu_ms(engine.draft[1]),
           "draft_call_ms": wall_ms(lambda: engine.draft_decode(one, torch.zeros(1, 1, H, device="cuda"),
                                                                torch.tensor([P])))}
    row["verify_gpu_ms"] = {T: gpu_ms(engine.verify[T]) for T in range(2, MAX_M + 1)}
    ids = prompt(context, shape["vocab_size"], 0)
    rounds = {}
    for k in range(0, MAX_M):
        generate(engine, ids, chain=k, max_new_tokens=16)  # warm
        r = generate(engine, ids, chain=k, max_new_tokens=new_tokens)
        n = max(r.rounds, 1) if k else max(r.decode_tokens, 1)
        per = r.decode_ms / n
        gpu = row["decode_gpu_ms"] if k == 0 else gpu_ms(engine.rounds[k])
        rounds[k] = {"round_ms": per, "gpu_ms": gpu, "host_ms": per - gpu, "tokens_per_s": r.tokens_per_s,
                     "accepted_per_round": sum(r.accepted) / n if k else 0.0}
    row["rounds"] = rounds
    return row


def print_shape(name: str, row: dict, taus: dict) -> None:
    """One shape's table; with taus[shape][K], the predicted speedup tau(K) / (round(K) / decode)."""
    rounds = {int(k): v for k, v in row["rounds"].items()}
    verify = {int(k): v for k, v in row["verify_gpu_ms"].items()}
    dec = rounds[0]["round_ms"]
    print(f"\n{name} (context {row['context']}, load {row['load_s']:.0f} s): decode gpu "
          f"{row['decode_gpu_ms']*1e3:.0f} us, call {row['decode_call_ms']*1e3:.0f} us; draft step gpu "
          f"{row['draft_gpu_ms']*1e3:.0f} us, call {row['draft_call_ms']*1e3:.0f} us; K=0 "
          f"{rounds[0]['tokens_per_s']:.0f} tokens/s")
    print(f"{'K':>2} {'verify T=K+1 gpu us':>20} {'round gpu us':>12} {'round us':>9} {'host us':>8} "
          f"{'round/decode':>12} {'tau':>5} {'pred. speedup':>13}")
    for k, rd in rounds.items():
        tau = taus.get(name.split("+")[0], {}).get(str(k))
        ratio = rd["round_ms"] / dec
        v = verify.get(k + 1, row["decode_gpu_ms"]) if k else row["decode_gpu_ms"]
        pred = f"{tau / ratio:13.2f}" if tau else f"{'':>13}"
        print(f"{k:>2} {v*1e3:20.0f} {rd['gpu_ms']*1e3:12.0f} {rd['round_ms']*1e3:9.0f} {rd['host_ms']*1e3:8.0f} "
              f"{ratio:12.2f} {(tau or 0):5.2f} {pred}")


# --- preset and gemma: the engine against transformers ------------------------------------------------------
def wall(fn):
    """(fn(), seconds) with the device idle before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def hf_kwargs(model) -> dict:
    """Greedy to the token budget, as the engine here runs: the end token is an id past the vocabulary (None
    breaks prompt lookup in transformers 4.57, and a minimum length is refused by assisted generation)."""
    return dict(do_sample=False, eos_token_id=model.config.vocab_size, pad_token_id=0)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, **kw) -> dict:
    """transformers' generate on each prompt (one warm-up first): tokens/s over the whole generation."""
    run = lambda ids: model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=new_tokens,  # noqa: E731
                                     **hf_kwargs(model), **kw)[0, len(ids):].tolist()
    _, warm_s = wall(lambda: run(prompts[0]))
    outs, secs = [], 0.0
    for ids in prompts:
        out, s = wall(lambda: run(ids))
        outs.append(out)
        secs += s
    return {"tokens_per_s": sum(len(o) for o in outs) / secs, "first_call_s": warm_s, "outputs": outs}


def engine_generate(engine, prompts: list[list[int]], chain: int, new_tokens: int) -> dict:
    """The engine at chain K on each prompt (a short warm-up first): tokens/s over the whole generation, the
    decode-only rate, tau, the median prefill ms (the target over the prompt, then the draft seeded with it)."""
    generate(engine, prompts[0], chain=chain, max_new_tokens=16)  # warm
    outs, secs, decode_tokens, decode_ms, rounds, emitted, prefill = [], 0.0, 0, 0.0, 0, 0, []
    for ids in prompts:
        r, s = wall(lambda: generate(engine, ids, chain=chain, max_new_tokens=new_tokens))
        outs.append(r.output_ids)
        secs += s
        decode_tokens, decode_ms = decode_tokens + r.decode_tokens, decode_ms + r.decode_ms
        rounds, emitted = rounds + r.rounds, emitted + sum(r.emitted)
        prefill.append(r.prefill_ms)
    return {"tokens_per_s": sum(len(o) for o in outs) / secs, "decode_tokens_per_s": decode_tokens / decode_ms * 1e3,
            "tau": emitted / rounds if rounds else 1.0, "prefill_ms": statistics.median(prefill), "outputs": outs}


def hf_llama(target: Transformer, n_layers: int | None = None):
    """Our Llama-family target as transformers' LlamaForCausalLM with the same weights (the first n_layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.hf import hf_weight_names

    c = dataclasses.replace(target.cfg, n_layers=n_layers or target.cfg.n_layers, tap_layers=None)
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
            if "rope_parameters" in LlamaConfig().to_dict() else {"rope_theta": c.rope_theta})
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                         head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.rms_norm_eps,
                         tie_word_embeddings=c.tie_embeddings, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, **rope)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_cfg)
    ours = target.state_dict()
    missing, _ = hf.load_state_dict({t: ours[o] for t, o in hf_weight_names(c).items()}, strict=False)
    if set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' model has weights ours does not fill: {sorted(missing)[:5]}")
    hf.tie_weights()
    return hf.to(torch.bfloat16).eval()


def hf_option(hf, name: str, assistant=None) -> dict:
    """Sets transformers' model up for one of its generation options and returns generate()'s extra arguments.

    static_compiled is transformers' own recipe: a static cache, under which generate() compiles the decoding
    step itself (its CompileConfig: inductor, CUDA graphs). It changes hf's generation config for good, so it
    runs last. Compiling `hf.forward` by hand (`torch.compile(mode="reduce-overhead")`, the older recipe) does
    not run on torch 2.11 with this static cache: its graphs are dropped for the cache's mutated counters, then
    the process crashes (bench/results/h200-gpu-preset.json, `preset_shape`)."""
    if name == "prompt_lookup_4":
        return {"prompt_lookup_num_tokens": 4}
    if name == "assisted":
        return {"assistant_model": assistant}
    if name == "static_compiled":
        hf.generation_config.cache_implementation = "static"
    return {}


def preset(out: dict, save, store: str, n_prompts: int, hf_prompts: int,
           modes: tuple[str, ...] = MODES, peers: tuple[str, ...] = PEERS) -> None:
    from safetensors import safe_open

    from models import load_speculators, load_target
    from pipeline.artifacts import taps_index
    from pipeline.store import Store

    built = Store(store)

    def artifact(stage):
        found = [path for s, key, path in built.artifacts() if s == stage and built.exists(s, key)]
        if len(found) != 1:
            raise SystemExit(f"{store}/{stage}: one artifact expected (the gpu preset's), found {len(found)}")
        return found[0]

    taps = artifact("taps")
    index = taps_index(taps)
    prompts = []
    for shard in index["shards"]["held_out"]:
        with safe_open(str(taps / shard), framework="pt") as f:
            prompts += f.get_tensor("ids")[:, : index["held_out_prompt_len"]].tolist()
    prompts = prompts[:n_prompts]
    target = load_target(artifact("target"))
    spec = Speculator(target, load_speculators(artifact("draft"), target))
    out.update({"n_prompts": len(prompts), "hf_prompts": hf_prompts, "prompt_len": len(prompts[0]),
                "new_tokens": NEW_TOKENS, "engine": {}, "transformers": {}})
    hf = hf_llama(target)  # before the engine moves the target to the GPU in bf16
    small = hf_llama(target, ASSISTANT_LAYERS)
    # bf16 decoding at T = 1 / every target call at max_m rows (bit-exact across K) / the INT4 kernels at T = 1
    for mode in modes:
        engine = CudaEngine(spec, device="cuda", exact=mode == "bf16_exact", kernels=mode == "w4_g128", **WINDOWS)
        rows = out["engine"][mode] = {}
        for k in range(MAX_M):
            rows[k] = engine_generate(engine, prompts, k, NEW_TOKENS)
            rows[k]["equal_to_k0"] = [a == b for a, b in zip(rows[k]["outputs"], rows[0]["outputs"])]
            print(f"preset engine {mode} K={k}: {rows[k]['tokens_per_s']:.0f} tokens/s, tau {rows[k]['tau']:.2f}, "
                  f"equal to K=0 on {sum(rows[k]['equal_to_k0'])} of {len(prompts)}", flush=True)
            save()
        del engine
    sub, base = prompts[:hf_prompts], out["engine"][modes[0]][0]["outputs"][:hf_prompts]

    def peer(name, model, **kw):
        row = out["transformers"][name] = hf_generate(model, sub, NEW_TOKENS, **kw)
        # bf16 on other kernels: how long the outputs agree with the engine's greedy
        row["agree_tokens"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                               for x, y in zip(row["outputs"], base)]
        print(f"preset transformers {name}: {row['tokens_per_s']:.0f} tokens/s (first call {row['first_call_s']:.0f} s)",
              flush=True)
        save()

    for name in peers:
        peer(f"assisted_{ASSISTANT_LAYERS}_layers" if name == "assisted" else name, hf, **hf_option(hf, name, small))


def preset_shape(out: dict, save, prompt_len: int = 64) -> None:
    """The gpu preset's shape with random weights: the engine's K=0 (bf16, graphs) against transformers' greedy
    with its default cache and with its compiled static cache. Greedy to a fixed token budget reads the same
    bytes and launches the same kernels whatever the weights, so these rates are the trained preset's
    (`preset` measures the rest)."""
    shape = gpu_preset_shape()
    spec = random_speculator(shape, 512)
    prompts = [prompt(prompt_len, shape["vocab_size"], seed) for seed in range(2)]
    hf = hf_llama(spec.target)  # before the engine moves the target to bf16
    engine = CudaEngine(spec, device="cuda", exact=False, kernels=False, **WINDOWS)
    row = engine_generate(engine, prompts, 0, NEW_TOKENS)
    out.update({"shape": shape, "prompt_len": prompt_len, "new_tokens": NEW_TOKENS,
                "engine_k0": {k: v for k, v in row.items() if k != "outputs"}, "transformers": {}})
    print(f"preset shape engine K=0: {row['tokens_per_s']:.0f} tokens/s", flush=True)
    save()
    del engine
    for name in ("greedy", "static_compiled"):
        r = hf_generate(hf, prompts, NEW_TOKENS, **hf_option(hf, name))
        out["transformers"][name] = {k: v for k, v in r.items() if k != "outputs"}
        print(f"preset shape transformers {name}: {r['tokens_per_s']:.0f} tokens/s (first call {r['first_call_s']:.0f} s)",
              flush=True)
        save()


def hf_gemma3():
    """transformers' Gemma3ForCausalLM of GEMMA3_270M's config, random weights, bf16 on the GPU."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**{k: v for k, v in GEMMA3_270M.items() if k != "model_type"})
    with torch.device("cuda"):
        return Gemma3ForCausalLM(cfg).to(torch.bfloat16).eval()


def gemma(out: dict, save, context: int = 128) -> None:
    out.update({"context": context, "new_tokens": NEW_TOKENS, "engine": {}, "transformers": {}})
    ids = [prompt(context, GEMMA3_270M["vocab_size"], s) for s in range(2)]
    for kernels in (False, True):
        spec = random_speculator(SHAPES["gemma3_270m_layers"], max_seq_len=context + NEW_TOKENS + 2 * MAX_M)
        engine = CudaEngine(spec, device="cuda", kernels=kernels, exact=False, **WINDOWS)
        rows = out["engine"]["kernels" if kernels else "dense"] = {}
        for k in (0, 3, 5, 7):
            rows[k] = engine_generate(engine, ids, k, NEW_TOKENS)
            print(f"gemma engine {'kernels' if kernels else 'dense'} K={k}: {rows[k]['tokens_per_s']:.0f} tokens/s",
                  flush=True)
            save()
        del engine, spec
        torch.cuda.empty_cache()
    hf = hf_gemma3()
    for name in ("default_cache", "static_cache"):
        hf.generation_config.cache_implementation = "static" if name == "static_cache" else None
        row = out["transformers"][name] = hf_generate(hf, ids, NEW_TOKENS)
        row["compiled"] = hasattr(hf, "_compiled_call")  # transformers compiles a static cache's forward itself
        print(f"gemma transformers {name}: {row['tokens_per_s']:.0f} tokens/s (first call {row['first_call_s']:.0f} s)",
              flush=True)
        save()


# --- real: a real GGUF target and its trained draft against transformers and llama.cpp ----------------------
REAL_CHAINS = tuple(range(MAX_M))
# the engine's modes in `real`: part name -> (label, CudaEngine options); bf16 first, the quality reference
REAL_MODES = {"bf16": ("bf16", {}),
              **{quant: (f"{quant} exact", dict(kernels=True, exact=True, **options))
                 for quant, options in CUDA_QUANTS.items() if options},  # engine.quant's INT4 schemes
              "bf16_inductor": ("bf16 inductor", dict(compile="inductor"))}
REAL_PARTS = (*REAL_MODES, "llama", "quality", "hf", "hf_default")
QUALITY_WINDOWS, QUALITY_LEN, AGREE_TOKENS = 16, 192, 128


def real_target(name: str, draft_dir: str):
    """(fp32 Speculator on the CPU, GGUF path, tokenizer, chat template, preset) of a real preset
    (conf/target/<name>.yaml: its package, the cache length its export takes, tap layers, prompt format) and a
    trained draft."""
    import yaml

    from bench.targets import PRESETS, WORK
    from models import load_speculators
    from models.gguf import package_gguf, read_gguf

    preset = yaml.safe_load((Path(__file__).resolve().parents[1] / f"conf/target/{name}.yaml").read_text())
    tc = preset["target"]
    path = package_gguf(PRESETS[name][0], WORK)
    taps = tc.get("tap_layers")
    g = read_gguf(path, max_seq_len=preset["export"]["max_seq_len"], tap_layers=None if taps is None else tuple(taps),
                  progress=False)
    spec = Speculator(g.model, load_speculators(draft_dir, g.model))
    return spec, path, g.tokenizer, g.chat_template, preset


def timed_engine(spec: Speculator, **kw) -> tuple[CudaEngine, float]:
    """A CudaEngine over a copy of `spec` (engines move and rewrite their Speculator) and its load seconds:
    the move, the kernels' quantisation, compilation, warm-up and graph capture."""
    import copy

    t = time.perf_counter()
    engine = CudaEngine(copy.deepcopy(spec), device="cuda", **WINDOWS, **{"exact": False, **kw})
    torch.cuda.synchronize()
    return engine, time.perf_counter() - t


def engine_rows(engine, prompts, chains, new_tokens, log, save) -> dict:
    """engine_generate at each K (prefill ms per prompt beside), each compared with the K = 0 row."""
    rows = {}
    for k in chains:
        rows[k] = engine_generate(engine, prompts, k, new_tokens)
        rows[k]["equal_to_k0"] = [a == b for a, b in zip(rows[k]["outputs"], rows[chains[0]]["outputs"])]
        log(f"K={k}: {rows[k]['tokens_per_s']:.0f} tokens/s, decode {rows[k]['decode_tokens_per_s']:.0f}, "
            f"tau {rows[k]['tau']:.2f}, equal to K=0 on {sum(rows[k]['equal_to_k0'])}/{len(prompts)}")
        save()
    return rows


def hf_decode(model, prompts, new_tokens: int) -> dict:
    """transformers' generate (its generation config as set): whole-generation tokens/s, then the decode-only
    rate from a second pass with bench.hf_run's StreamClock (from the first token handed over after the
    prompt to the last; the same shapes, so a compiled static cache does not compile again)."""
    from bench.hf_run import StreamClock

    row = hf_generate(model, prompts, new_tokens)
    tokens = secs = 0.0
    for ids in prompts:
        clock = StreamClock()
        model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=new_tokens, streamer=clock,
                       **hf_kwargs(model))
        (t0, first), (t1, _) = clock.marks[1], clock.marks[-1]  # marks[0] is the prompt handed over
        tokens, secs = tokens + new_tokens - first, secs + t1 - t0
    row["decode_tokens_per_s"] = tokens / secs
    return row


def our_logits(target):
    """`ids -> every row's logits` (numpy float32) of a stateless forward of our target, for llama_run.quality."""
    device = next(target.parameters()).device
    return torch.no_grad()(lambda ids: target(torch.tensor([ids], device=device))[0].float().cpu().numpy())


def real(out: dict, save, name: str, draft_dir: str, n_prompts: int, new_tokens: int, parts: set[str]) -> None:
    """A real preset's GGUF and its trained draft on one GPU (module doc, `real`)."""
    from bench import llama_run
    from bench.hf_run import hf_model_from_gguf
    from bench.peers import PEERS_INSTALL, common_prefix
    from bench.targets import PRESETS, make_prompts

    log = lambda msg: print(f"real {name}: {msg}", flush=True)  # noqa: E731
    t = time.perf_counter()
    spec, path, tokenizer, template, preset = real_target(name, draft_dir)
    prompt_len = preset["runtime"]["prompt_len"]
    prompts = make_prompts(tokenizer, PRESETS[name][2], template, n_prompts, prompt_len, seed=0)
    out.update({"gguf": path.name, "draft": str(draft_dir), "n_prompts": n_prompts, "prompt_len": prompt_len,
                "new_tokens": new_tokens, "target_load_s": round(time.perf_counter() - t, 1)})
    for key in ("engine", "load_s", "prefill_ms", "transformers", "quality"):  # a resumed run keeps its rows
        out.setdefault(key, {})
    out["engine"] = {mode: {int(k): row for k, row in rows.items()} for mode, rows in out["engine"].items()}
    log(f"target and draft read in {out['target_load_s']} s; {n_prompts} prompts of {prompt_len} tokens")
    windows = make_prompts(tokenizer, "plain", None, QUALITY_WINDOWS, QUALITY_LEN, seed=1)
    quality = "quality" in parts
    # bf16 first: its K = 0 outputs are the reference the other systems' agreement is taken against
    reference = lambda: out["engine"].get("bf16", {}).get(0, {}).get("outputs")  # noqa: E731
    agree = lambda: [p + o[:AGREE_TOKENS] for p, o in zip(prompts, reference())] if reference() else None  # noqa: E731
    for part, (mode, kw) in REAL_MODES.items():
        if part not in parts:
            continue
        try:
            engine, out["load_s"][mode] = timed_engine(spec, **kw)
            log(f"engine {mode} loaded in {out['load_s'][mode]:.1f} s")
            out["engine"][mode] = engine_rows(engine, prompts, REAL_CHAINS, new_tokens,
                                              lambda m: log(f"{mode} {m}"), save)
        except Exception as e:  # noqa: BLE001 -- one engine's failure is a finding; the peers still run
            out.setdefault("errors", {})[mode] = f"{type(e).__name__}: {e}"
            log(f"engine {mode} failed: {out['errors'][mode]}")
            torch.cuda.empty_cache()
            continue
        out["prefill_ms"][mode] = out["engine"][mode][0]["prefill_ms"]
        if quality and agree() and mode != "bf16 inductor":  # the same weights as bf16's
            label = f"ours {mode.removesuffix(' exact')}"
            out["quality"][label] = llama_run.quality(our_logits(engine.spec.target), windows, agree(), prompt_len)
            log(f"quality {mode}: {out['quality'][label]}")
        del engine
        torch.cuda.empty_cache()
        save()
    base = reference()
    if "llama" in parts and importlib.util.find_spec("llama_cpp"):
        # llama.cpp's CUDA build in a process without torch (bench.llama_run: they abort in one process)
        job = {"path": str(path), "prompts": prompts, "new_tokens": new_tokens, "gpu_layers": -1, "threads": 4}
        if quality and agree():
            job.update(windows=windows, agree=agree(), prompt_len=prompt_len)
        try:
            got = llama_run.in_child(job)
        except Exception as e:  # noqa: BLE001 -- as an engine's: a finding, the rest still runs
            got = {"load_s": None, "rows": {}}
            out.setdefault("errors", {})["llama.cpp"] = f"{type(e).__name__}: {e}"
            log(f"llama.cpp failed: {out['errors']['llama.cpp']}")
        out["llama_load_s"], out["llama.cpp"] = got["load_s"], got["rows"]
        for label, row in got["rows"].items():
            log(f"{label}: {row['tokens_per_s']:.0f} tokens/s, decode {row['decode_tokens_per_s']:.0f}")
        if "quality" in got:
            out["quality"][f"llama.cpp {PRESETS[name][1]}"] = got["quality"]
        save()
    elif "llama" in parts:
        log(f"llama.cpp skipped: llama_cpp is not installed ({PEERS_INSTALL})")
    bf16_quality = out["quality"].get("ours bf16")
    for row in out["quality"].values() if bf16_quality else ():
        row["loss_vs_bf16"] = round(row["loss"] - bf16_quality["loss"], 4)
    options = [o for o, part in (("greedy", "hf_default"), ("static_compiled", "hf")) if part in parts]
    hf = hf_model_from_gguf(path).to("cuda", torch.bfloat16) if options else None
    for option in options:  # static_compiled last: it sets hf's cache for good
        hf_option(hf, option)
        sub = prompts if option == "static_compiled" else prompts[:2]  # the default cache decodes slowly
        row = out["transformers"][option] = hf_decode(hf, sub, new_tokens)
        log(f"transformers {option}: {row['tokens_per_s']:.0f} tokens/s, decode {row['decode_tokens_per_s']:.0f} "
            f"(first call {row['first_call_s']:.0f} s)")
        save()
    if base:  # free-running greedy: tokens until the first difference from the bf16 engine's K = 0
        int4 = [rows.get(0) for mode, rows in out["engine"].items() if mode.startswith("w4_")]
        for row in [*int4, *out.get("llama.cpp", {}).values(),
                    *out["transformers"].values()]:
            if row:
                row["tokens_until_first_difference"] = [common_prefix(a, b) for a, b in zip(row["outputs"], base)]
        save()


def print_peers(result: dict) -> None:
    if "real" in result:
        print_real(result["real"])
    for name in ("preset", "gemma"):
        if name not in result:
            continue
        r = result[name]
        engines = {f"engine {kind} K={k}": v for kind, rows in r["engine"].items() for k, v in rows.items()}
        first = next(iter(r["engine"].values()), {})  # the preset's bf16 engine, Gemma's dense one
        base = first.get("0")
        print(f"\n{name}: tokens/s over whole generations ({r['new_tokens']} new tokens), side by side")
        print(f"{'system':>34} {'tokens/s':>9} {'decode tok/s':>12} {'tau':>5} {'x K=0':>6} {'= K=0':>6}")
        for label, row in engines.items():
            x = row["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
            eq = row.get("equal_to_k0")
            print(f"{label:>34} {row['tokens_per_s']:9.0f} {row['decode_tokens_per_s']:12.0f} {row['tau']:5.2f} "
                  f"{x:6.2f} {f'{sum(eq)}/{len(eq)}' if eq else '':>6}")
        for label, row in r["transformers"].items():
            x = row["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
            print(f"{'transformers ' + label:>34} {row['tokens_per_s']:9.0f} {'':>12} {'':>5} {x:6.2f}"
                  f"  (first call {row['first_call_s']:.0f} s)")


def print_real(r: dict) -> None:
    """The `real` table: every system's whole-generation and decode-only tokens/s, against transformers'
    compiled static cache and llama.cpp's best row; then what INT4 and the GGUF cost in quality."""
    rows = {f"ours {mode} K={k}": v for mode, ks in r["engine"].items() for k, v in ks.items()}
    rows.update({f"transformers {k}": v for k, v in r["transformers"].items()})
    rows.update(r.get("llama.cpp", {}))
    hf = r["transformers"].get("static_compiled", {}).get("tokens_per_s")
    llama = max((v["tokens_per_s"] for v in r.get("llama.cpp", {}).values()), default=None)
    print(f"\nreal {r['gguf']}: {r['n_prompts']} prompts of {r['prompt_len']} tokens, {r['new_tokens']} new tokens, "
          f"whole generation (prefill included) and decode only")
    print(f"{'system':>44} {'tokens/s':>9} {'decode':>8} {'tau':>5} {'x hf':>6} {'x llama':>7} {'= K=0':>6} "
          f"{'1st diff':>9}")
    for label, row in rows.items():
        eq, diff = row.get("equal_to_k0"), row.get("tokens_until_first_difference")
        print(f"{label:>44} {row['tokens_per_s']:9.0f} {row['decode_tokens_per_s']:8.0f} "
              f"{row['tau'] if 'tau' in row else float('nan'):5.2f} "
              f"{row['tokens_per_s'] / hf if hf else float('nan'):6.2f} "
              f"{row['tokens_per_s'] / llama if llama else float('nan'):7.2f} "
              f"{f'{sum(eq)}/{len(eq)}' if eq else '':>6} {','.join(map(str, diff)) if diff else '':>9}")
    print("load s:", {**r["load_s"], **({"llama.cpp": r["llama_load_s"]} if "llama_load_s" in r else {}),
                      **{f"transformers {k} first call": round(v["first_call_s"], 1)
                         for k, v in r["transformers"].items()}})
    print("prefill ms (median):", {k: round(v, 1) for k, v in r["prefill_ms"].items()})
    for name, q in r.get("quality", {}).items():
        print(f"quality {name:>20}: loss {q['loss']:.4f} ({q.get('loss_vs_bf16', 0):+.4f} vs bf16), "
              f"greedy agreement {q['greedy_agreement']:.3f} over {AGREE_TOKENS} tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="check,shapes")
    ap.add_argument("--out", default=None, help="write the results JSON here (needed unless --from)")
    ap.add_argument("--from", dest="saved", default=None, help="print the tables of a saved results JSON (no GPU)")
    ap.add_argument("--tau", default=None, help="JSON {shape: {K: tau}} to turn round costs into speedups")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--shapes", default=None, help="comma-separated names of SHAPES (default: all)")
    ap.add_argument("--store", default=None, help="preset: the store a +experiment=gpu pipeline left")
    ap.add_argument("--prompts", type=int, default=16, help="preset: held-out prompts for the engine")
    ap.add_argument("--hf-prompts", type=int, default=4, help="preset: of those, the ones transformers runs")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="preset: the engine's modes (bf16: at T = 1; bf16_exact: every call at max_m rows; "
                         "w4_g128: the INT4 kernels); transformers' outputs are compared with the first")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"preset: transformers' options, of {PEERS}")
    ap.add_argument("--target", default=None, help="real: a real preset (gemma3_270m, smollm2_135m)")
    ap.add_argument("--draft", default=None, help="real: the preset's trained draft (a speculators directory)")
    ap.add_argument("--parts", default=",".join(REAL_PARTS), help=f"real: what to run, of {REAL_PARTS}")
    ap.add_argument("--resume", action="store_true",
                    help="real: start from --out's saved run (same target, draft and prompts); the parts run now "
                         "replace their own rows, the others stay")
    args = ap.parse_args()
    for flag, chosen, known in (("--modes", args.modes, MODES), ("--peers", args.peers, PEERS),
                                ("--parts", args.parts, REAL_PARTS)):
        if unknown := set(chosen.split(",")) - set(known):
            ap.error(f"{flag}: unknown {sorted(unknown)}; expected a comma-separated subset of {', '.join(known)}")
    taus = json.load(open(args.tau)) if args.tau else {}
    if args.saved:
        saved = json.load(open(args.saved))
        for name, row in saved.get("shapes", {}).items():
            print_shape(name, row, taus)
        print_peers(saved)
        return
    if not args.out:
        ap.error("--out is needed to measure (or --from to print a saved run)")
    only = set(args.only.split(","))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "max_m": MAX_M}
    if args.resume and Path(args.out).exists():
        result = {**json.load(open(args.out)), **result}
    if "check" in only:
        result["check"] = check()
        print("check:", json.dumps(result["check"]))
    if "shapes" in only:
        result["shapes"] = {}
        runs = [(name, kernels) for name in (args.shapes.split(",") if args.shapes else SHAPES)
                for kernels in ((True,) if name.endswith("int4") else (False, True))]
        for name, kernels in runs:
            row = shape_costs(SHAPES[name], kernels, args.context, args.new_tokens)
            name = f"{name}{'+kernels' if kernels else ''}"
            result["shapes"][name] = row
            torch.cuda.empty_cache()
            print_shape(name, row, taus)
    def save():  # after every measurement, so that a run cut off by its time limit still reports
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if "preset" in only:
        preset(result.setdefault("preset", {}), save, args.store, args.prompts, args.hf_prompts,
               tuple(args.modes.split(",")), tuple(p for p in PEERS if p in args.peers.split(",")))
    if "preset_shape" in only:
        preset_shape(result.setdefault("preset_shape", {}), save)
    if "gemma" in only:
        gemma(result.setdefault("gemma", {}), save)
    if "real" in only:
        if not (args.target and args.draft):
            ap.error("--only real needs --target and --draft")
        real(result.setdefault("real", {}), save, args.target, args.draft, args.prompts, args.new_tokens,
             set(args.parts.split(",")))
    save()
    print_peers(json.loads(json.dumps(result)))  # the keys as a saved file has them


if __name__ == "__main__":
    main()
