"""The one engine factory: `build_engine(options, ...)` builds the engine `options["kind"]` names
(models.choices.ENGINES) with its other options as that engine's arguments.

The options are the keys of conf/engine/<kind>.yaml, which the eval and serve stages pass
(pipeline.artifacts.load_engine), and the flags of `python -m runner` and `python -m runner.serve`
(`add_engine_arguments`, `engine_options`), which set the same keys; bench/ builds its engines here too. So an
engine is built one way whoever asks for it. One builder per engine, whose keyword arguments are its config
file's keys and whose positional arguments are the artifacts it reads:

- `pte_engine(pte, tokenizer)`: the exported program through executorch.runtime, checked against its manifest
  and the tokenizer (runner.cli.load_pte: a refusal is one line);
- `eager_engine(pte, tokenizer, target, draft)`: the target and draft artifacts as models.Speculator in PyTorch
  on `device`, in the windows of the program exported from them (its meta is the .pte's);
- `cuda_engine(target, draft)`: the target and draft artifacts as CUDA graphs on one GPU (runner.cuda_engine), in
  its own windows (max_m, default_chain, the prefill chunk range), its weights as `quant` names
  (models.choices.CUDA_QUANTS). It reads no .pte, so no export setting reaches it.

Exact mode (`exact`): every target call at one width through a call whose rows do not depend on it, so every K
gives K=0's tokens bit for bit: `exact_width` rows through runner.engine.ExactEngine on the .pte and eager engines,
max_m rows inside the cuda engine (whose captured graphs are the max_m-row calls). Its one default is the config's
`exact: auto` (conf/engine/<kind>.yaml), which depends on the engine and the machine (pipeline.hardware resolves
it before any stage runs); the builders have none: the factory takes every option, resolved, and refuses an
option left out or `auto`, naming the key. The command lines turn exact mode on only when asked
(`--exact-width W`, `--exact`).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Mapping
from pathlib import Path

from models.choices import CUDA_COMPILES, CUDA_QUANTS, ENGINES


def _exact(engine, exact: bool, exact_width: int | None):
    """`engine` itself, or in exact mode at `exact_width` rows (runner.engine.ExactEngine)."""
    if not exact:
        return engine
    if exact_width is None:
        raise ValueError("engine.exact=true needs engine.exact_width (the rows of every target call)")
    from runner.engine import ExactEngine

    return ExactEngine(engine, int(exact_width))


def pte_engine(pte, tokenizer, *, exact: bool, exact_width: int | None, verified: bool = False):
    """The .pte (runner.engine.PteEngine) with `tokenizer` checked against it; `verified`: the caller (the
    store) has re-hashed the file against its manifest already."""
    from runner.cli import load_pte

    return _exact(load_pte(Path(pte), Path(tokenizer), verified=verified), exact, exact_width)


def eager_engine(pte, tokenizer, target, draft, *, device: str, exact: bool, exact_width: int | None,
                 verified: bool = False):
    """models.Speculator over the target and draft artifacts on `device` (runner.engine.EagerEngine), in the
    windows of `pte`, the program exported from the same artifacts."""
    from models import Speculator, load_speculators, load_target
    from runner.cli import load_pte
    from runner.engine import EagerEngine

    m = load_pte(Path(pte), Path(tokenizer), verified=verified).meta
    model = load_target(target, max_seq_len=m["max_seq_len"])
    engine = EagerEngine(Speculator(model, load_speculators(draft, model)), max_m=m["max_m"],
                         default_chain=m["default_chain"], max_prefill_chunk=m["max_prefill_chunk"],
                         min_prefill_chunk=m["min_prefill_chunk"], device=device, manifest_hash=m["manifest_hash"])
    return _exact(engine, exact, exact_width)


def cuda_engine(target, draft, *, max_m: int, default_chain: int, max_prefill_chunk: int, max_seq_len: int,
                min_prefill_chunk: int | None, device: str, quant: str, compile: str, exact: bool):
    """runner.cuda_engine.CudaEngine over the target and draft artifacts, its graphs captured for the windows
    given (`min_prefill_chunk` None: max_m + 1) over caches of `max_seq_len` positions, its weights as `quant`
    names (models.choices.CUDA_QUANTS); an unknown scheme is refused before any weights are read."""
    if quant not in CUDA_QUANTS:
        raise ValueError(f"engine.quant={quant!r}: expected one of {', '.join(CUDA_QUANTS)}")
    if compile not in CUDA_COMPILES:
        raise ValueError(f"engine.compile={compile!r}: expected one of {', '.join(CUDA_COMPILES)}")
    from models import Speculator, load_speculators, load_target
    from runner.cuda_engine import CudaEngine

    model = load_target(target, max_seq_len=int(max_seq_len))
    kernels = dict(CUDA_QUANTS[quant] or {})
    if kernels.pop("file", False):  # the target's linears its GGUF holds in more than 4 bits stay bf16
        from models.gguf import read_weight_types
        from models.quantize import file_dense

        kernels["target_dense"] = file_dense(model, read_weight_types(target), f"engine.quant={quant}",
                                             "engine.quant=w4_g32")
    return CudaEngine(Speculator(model, load_speculators(draft, model)), max_m=int(max_m),
                      default_chain=int(default_chain), max_prefill_chunk=int(max_prefill_chunk),
                      min_prefill_chunk=int(max_m) + 1 if min_prefill_chunk is None else int(min_prefill_chunk),
                      device=device, kernels=bool(kernels), **kernels, exact=bool(exact), compile=compile)


BUILDERS = {"pte": pte_engine, "eager": eager_engine, "cuda": cuda_engine}  # kind (models.choices.ENGINES) -> builder


def options_of(kind: str) -> tuple[str, ...]:
    """The options an engine takes (its config file's keys besides `kind`), every one of them required."""
    params = inspect.signature(BUILDERS[kind]).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name != "verified")


def build_engine(options: Mapping, *, pte=None, tokenizer=None, target=None, draft=None, verified: bool = False):
    """The engine `options["kind"]` names, built by its builder (module doc) from the other options and the
    artifacts it reads (paths; the ones it does not read are ignored). Refused with a ValueError naming the
    key: an unknown kind, an option the engine does not take, an unresolved `auto`, an artifact it needs, an
    option left out."""
    options = dict(options)
    kind = options.pop("kind", None)
    if kind not in ENGINES:
        raise ValueError(f"engine.kind={kind!r}: expected one of {', '.join(ENGINES)}")
    build = BUILDERS[kind]
    allowed = options_of(kind)
    if unknown := [k for k in options if k not in allowed]:
        raise ValueError(f"engine={kind} takes no {', '.join(unknown)}: its options are {', '.join(allowed)}")
    if auto := [k for k, v in options.items() if v == "auto" and (k != "exact_width" or options.get("exact"))]:
        raise ValueError(f"engine.{auto[0]}='auto': expected a value; `auto` depends on the machine and is resolved "
                         "by the pipeline (pipeline.hardware.resolve) before the engine is built")
    given = {"pte": pte, "tokenizer": tokenizer, "target": target, "draft": draft}
    reads = [p.name for p in inspect.signature(build).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    if missing := [name for name in reads if given[name] is None]:
        raise ValueError(f"engine={kind} reads {', '.join(reads)}; missing: {', '.join(missing)}")
    if left_out := [k for k in allowed if k not in options]:
        raise ValueError(f"engine={kind} needs {', '.join(f'engine.{k}' for k in left_out)} (its options are the "
                         f"keys of conf/engine/{kind}.yaml, which holds their defaults)")
    if "verified" in inspect.signature(build).parameters:
        options["verified"] = verified
    return build(*(given[name] for name in reads), **options)


# ----------------------------------------------------------------------------------------------------------
# The command lines' engine flags: the same options as conf/engine/<kind>.yaml


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--engine and the flags of its options and artifacts, as `python -m runner` and `python -m runner.serve`
    both take them (the default K of the cuda engine is the command's --chain)."""
    from runner import cli

    p.add_argument("--engine", choices=ENGINES, default="pte", help="pte: the .pte | eager: the target and draft "
                   "artifacts in PyTorch, in the .pte's windows | cuda: CUDA graphs on one GPU, no .pte")
    p.add_argument("--pte", type=Path, help="the .pte (--engine pte, eager)")
    p.add_argument("--exact-width", type=cli.integer(2), default=None, metavar="W",
                   help="--engine pte, eager: exact mode (engine.exact_width), every target call W rows, a row's bits "
                        "independent of its call, so every K gives K=0's tokens bit for bit (an 8da4w target); "
                        "W in [2, max_m], K <= W-1")
    p.add_argument("--device", default=None, help="--engine eager (default cpu), cuda (default cuda): the torch device")
    art = p.add_argument_group("--engine eager, cuda: the target and draft artifacts")
    art.add_argument("--target", type=Path, help="the target artifact's directory")
    art.add_argument("--draft", type=Path, help="the draft artifact's directory")
    cuda = p.add_argument_group("--engine cuda: its call windows (the default K is --chain) and weights")
    cuda.add_argument("--max-m", type=cli.integer(2), help="the widest verify call (K <= max_m - 1)")
    cuda.add_argument("--max-prefill-chunk", type=cli.integer(1))
    cuda.add_argument("--min-prefill-chunk", type=cli.integer(1), help="default: max_m + 1")
    cuda.add_argument("--max-seq-len", type=cli.integer(2), default=2048,
                      help="its KV caches: prompt + answer tokens (engine.max_seq_len)")
    cuda.add_argument("--quant", choices=tuple(CUDA_QUANTS), default="bf16",
                      help="the weights: bf16, or 4-bit on the INT4 GPU kernels (engine.quant, "
                           "models.choices.CUDA_QUANTS)")
    cuda.add_argument("--compile", choices=CUDA_COMPILES, default="none",
                      help="torch.compile the dense engine's calls before capture (engine.compile)")
    cuda.add_argument("--exact", action="store_true",
                      help="exact mode (engine.exact): every target call max_m rows, a row's bits independent of its "
                           "call, so every K gives K=0's tokens bit for bit; without it: T=1 decode, T=K+1 verify")


def engine_options(args: argparse.Namespace) -> dict:
    """The options `build_engine` takes, from the flags of `add_engine_arguments`; a ValueError names the flags
    the chosen engine lacks."""
    needs = {"pte": ("pte",), "eager": ("pte", "target", "draft"),
             "cuda": ("target", "draft", "max_m", "max_prefill_chunk", "chain")}[args.engine]
    if missing := [f"--{k.replace('_', '-')}" for k in needs if getattr(args, k) is None]:
        raise ValueError(f"--engine {args.engine} needs {' '.join(missing)}")
    if args.engine == "cuda":
        return {"kind": "cuda", "max_m": args.max_m, "default_chain": args.chain,
                "max_prefill_chunk": args.max_prefill_chunk, "min_prefill_chunk": args.min_prefill_chunk,
                "max_seq_len": args.max_seq_len,
                "device": args.device or "cuda", "quant": args.quant, "compile": args.compile, "exact": args.exact}
    options = {"kind": args.engine, "exact": args.exact_width is not None, "exact_width": args.exact_width}
    if args.engine == "eager":
        options["device"] = args.device or "cpu"
    return options

