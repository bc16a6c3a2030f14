"""The CUDA engine on one GPU: exactness checks, then the cost of a speculative round at every K by shape.

    python3 -m bench.cuda_engine --out $OUT/cuda_engine.json [--only check,shapes] [--tau tau.json]
    python3 -m bench.cuda_engine --from bench/results/h200-cuda-engine.json --tau bench/results/real-targets-cpu-tau.json

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from models import Speculator, Transformer, draft_config_for
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


def random_speculator(shape: dict, max_seq_len: int, seed: int = 0) -> Speculator:
    cfg = TargetConfig(**shape, max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        target = Transformer(cfg)
        draft = Eagle3Draft(draft_config_for(cfg, draft_vocab_size=min(DRAFT_VOCAB, cfg.vocab_size)))
    with torch.no_grad():  # PyTorch's default init: well separated logits, so bf16 noise decides no argmax
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
    return Speculator(target.eval(), draft.eval())


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
    engine = CudaEngine(Speculator(target, draft), device="cuda", dtype="float32", **WINDOWS)
    for seed in range(4):
        ids = prompt(24 + 7 * seed, hf_cfg.vocab_size, seed)
        ours = generate(engine, ids, chain=0, max_new_tokens=64).output_ids
        theirs = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=64, do_sample=False)
        theirs = theirs[0, len(ids):].tolist()
        out["transformers_equal"].append(ours == theirs)
    for kernels in (False, True):
        spec = random_speculator(SHAPES["smollm2_135m"] | dict(n_layers=4), max_seq_len=512, seed=1)
        engine = CudaEngine(spec, device="cuda", kernels=kernels, **WINDOWS)
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
    engine = CudaEngine(spec, device="cuda", kernels=kernels, **WINDOWS)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="check,shapes")
    ap.add_argument("--out", default=None, help="write the results JSON here (needed unless --from)")
    ap.add_argument("--from", dest="saved", default=None, help="print the tables of a saved results JSON (no GPU)")
    ap.add_argument("--tau", default=None, help="JSON {shape: {K: tau}} to turn round costs into speedups")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--shapes", default=None, help="comma-separated names of SHAPES (default: all)")
    args = ap.parse_args()
    taus = json.load(open(args.tau)) if args.tau else {}
    if args.saved:
        for name, row in json.load(open(args.saved))["shapes"].items():
            print_shape(name, row, taus)
        return
    if not args.out:
        ap.error("--out is needed to measure (or --from to print a saved run)")
    only = set(args.only.split(","))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "max_m": MAX_M}
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
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
