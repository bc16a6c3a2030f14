"""`python -m runner`: text from a .pte (or its artifacts on another engine), to see it speculate.

    python -m runner --pte model.pte --tokenizer tokenizer.json --prompt "def main(" --chain 4
    python -m runner --pte model.pte --tokenizer tokenizer.json --prompt-file prompts.txt --chain 0
    python -m runner --pte model.pte --tokenizer tokenizer.json --prompt "def main(" --chain 4 --exact-width 8
    python -m runner --engine cuda --target TARGET_DIR --draft DRAFT_DIR --tokenizer TARGET_DIR/tokenizer.json \
        --max-m 8 --max-prefill-chunk 128 --prompt "def main(" --chain 4

The engine is built by runner.build from the flags that name its options (`--engine` pte, eager or cuda: the
keys of conf/engine/<kind>.yaml).

A .pte with the export artifact's manifest.json beside it is checked against the sha256 recorded there
and refused (exit 2) when it differs; one without a manifest runs with a warning that it is unchecked. Every
refusal (a missing or truncated file, a value out of range) is one line and exit 2 (runner.cli).
Prints each generation, then tau, decode tokens/s and the per-round timings. `--chain` defaults to the
.pte's own get_chain_len; 0 is the baseline, greedy decoding through the same file. (The pipeline's eval stage
does the same from Hydra config, with the lossless check and MLflow.)
"""

from __future__ import annotations

from pathlib import Path

from models.choices import POLICIES
from models.text import read_prompt_file, stop_ids
from runner import cli
from runner.build import add_engine_arguments, build_engine, engine_options
from runner.engine import set_threads
from runner.generate import generate


def report(res, tokenizer) -> str:
    lines = [tokenizer.decode(res.output_ids), "", f"--- chain K={res.chain}  stop: {res.stop_reason}"]
    lines.append(f"tokens {len(res.output_ids)}  rounds {res.rounds}  tau {res.tau:.2f}  "
                 f"acceptance {res.acceptance_rate:.2f}  decode {res.tokens_per_s:.1f} tokens/s")
    if res.rounds:
        lines.append(f"prefill {res.prefill_ms:.1f} ms  per round: verify {res.verify_ms / res.rounds:.2f} ms, "
                     f"draft {res.draft_ms / res.rounds:.2f} ms, total {res.decode_ms / res.rounds:.2f} ms")
    return "\n".join(lines)


def round_table(res) -> str:
    rows = ["round   K   a  emitted  verify_ms  draft_ms"]
    for i, (k, a, n, v, d) in enumerate(zip(res.chain_per_round, res.accepted, res.emitted, res.round_verify_ms,
                                            res.round_draft_ms)):
        rows.append(f"{i:5d} {k:3d} {a:3d} {n:8d} {v:10.2f} {d:9.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(prog="python -m runner", description=__doc__.split("\n")[0])
    add_engine_arguments(p)
    p.add_argument("--tokenizer", required=True, type=Path, help="tokenizer.json (the target stage's)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", type=Path, help="one prompt per line, or .jsonl with a 'prompt' field")
    p.add_argument("--chain", type=cli.integer(0), default=None, help="K in [1, max_m-1]; 0 = greedy baseline; "
                   "default: the .pte's get_chain_len")
    p.add_argument("--policy", choices=POLICIES, default="static")
    p.add_argument("--max-new-tokens", type=cli.integer(1), default=128)
    p.add_argument("--temperature", type=cli.number(0.0), default=0.0)
    p.add_argument("--seed", type=cli.integer(0), default=0)
    p.add_argument("--stop", nargs="*", default=[], help="extra stop tokens (strings or ids)")
    p.add_argument("--rounds", action="store_true", help="print K, accepted, emitted and timings of every round")
    p.add_argument("--threads", type=cli.integer(1), default=None,
                   help="the runtime's CPU threads (default: the cores this process may use)")
    args = p.parse_args(argv)
    try:
        options = engine_options(args)
    except ValueError as e:
        p.error(str(e))

    set_threads(args.threads)
    # first: a file that is no program, differs from its manifest or does not fit the tokenizer is refused
    engine = build_engine(options, pte=args.pte, tokenizer=args.tokenizer, target=args.target, draft=args.draft)
    tokenizer = cli.load_tokenizer(args.tokenizer)
    prompts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompt_file)
    stops = stop_ids(tokenizer, args.stop)
    encoded = [tokenizer.encode(text, add_special_tokens=False).ids for text in prompts]
    check_lengths([len(ids) for ids in encoded], args.max_new_tokens, engine.meta["max_seq_len"])
    for text, ids in zip(prompts, encoded):
        res = generate(engine, ids, chain=args.chain, max_new_tokens=args.max_new_tokens, stop_ids=stops,
                       temperature=args.temperature, seed=args.seed, policy=args.policy)
        print(text + report(res, tokenizer))
        if args.rounds:
            print(round_table(res))
        elif args.policy == "adaptive":
            print(f"K per round: {res.chain_per_round}")
        print()
    return 0


def check_lengths(lengths: list[int], max_new_tokens: int, max_seq_len: int) -> None:
    """Refuse, before any prompt is decoded, the prompts whose tokens and --max-new-tokens exceed the KV cache,
    naming both numbers (a prompt and its answer share the cache)."""
    long = [(n, length) for n, length in enumerate(lengths, 1) if length + max_new_tokens > max_seq_len]
    if long:
        n, length = long[0]
        more = f" (and {len(long) - 1} more prompts)" if len(long) > 1 else ""
        raise ValueError(f"prompt {n} has {length} tokens + --max-new-tokens {max_new_tokens} = "
                         f"{length + max_new_tokens}, more than the {max_seq_len} positions of the KV cache{more}: at "
                         f"most {max(max_seq_len - max_new_tokens, 0)} prompt tokens with this --max-new-tokens")


if __name__ == "__main__":
    cli.run(main)  # a refusal (K out of range, a prompt too long, a missing file) reads as one line
