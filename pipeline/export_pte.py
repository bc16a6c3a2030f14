"""Lower one models.Speculator into ONE ExecuTorch program that serves every chain length K in [1, max_m-1].

This is the upstream change in one sentence: target_verify is exported with a dynamic window T in
[2, max_m] instead of a static T = K+1, so K is chosen by the runner at run time and a sweep over K never
re-exports. No Hydra here: `export_pte(...)` is a plain function the export stage (and tests) call.

The program (batch 1; ids int64, floats fp32; H = feature width = draft hidden, V = target vocab,
Vd = draft vocab). Every method returns a list, in this order:

    method          inputs                                            outputs                                       T range
    prefill         tokens[1,T], input_pos[T]                         next_id[1,1], feature[1,T,H], logits[1,V]    [min_prefill_chunk, max_prefill_chunk]
    target_verify   tokens[1,T], input_pos[T]                         ids[1,T], feature[1,T,H], logits[1,T,V]      [2, max_m]
    target_decode   tokens[1,1], input_pos[1]                         ids[1,1], logits[1,1,V]                      1 (the K=0 baseline)
    draft_decode    tokens[1,T], feature[1,T,H], input_pos[T]         ids[1,T] (TARGET vocab), g[1,T,H], logits[1,T,Vd]   [1, max(max_prefill_chunk, max_m)]

Shared state. The methods are traced from thin wrapper modules that all hold the SAME Speculator under the
same attribute name, so every KV-cache buffer has one fully qualified name in all four graphs. With
`MemoryPlanningPass(share_mutable_buffers=True)` and `emit_mutable_buffer_names=True` each name is planned
once for the whole program: prefill, target_verify and target_decode read and write one target cache,
draft_decode owns the draft cache. State lives as long as the loaded program; a second
`Runtime.load_program` starts from a fresh arena (zeros in the Python runtime; the causal mask hides
every slot that was not written, and later writes overwrite rejected slots, so nothing needs a reset).

Constant methods (no inputs; `execute([])` returns a one-element list):

    get_max_m -> int                 largest verify window; the runner accepts K in [1, max_m-1]
    get_chain_len -> int             the default K, export.default_chain (runtime.chain overrides it)
    get_max_seq_len -> int           cache length of target and draft
    get_vocab_size -> int            V
    get_draft_vocab_size -> int      Vd
    get_max_prefill_chunk -> int
    get_min_prefill_chunk -> int     > max_m (see the dispatch rule below)
    get_manifest_hash -> str         64 lowercase hex chars: sha256 tying the program to target, tokenizer,
                                     draft, tap layers and d2t (computed by the export stage; opaque here)
    get_d2t -> Tensor int64[Vd]      target_id = draft_id + d2t[draft_id]
    get_hidden_size -> int           H (extra)
    get_sliding_window -> int        smallest sliding window of any target layer, 0 = none (extra; the
                                     runner keeps prefill chunks within it)
    get_backend -> str               "portable" | "xnnpack" (extra)
    get_quant -> str                 "none" | "int4" (extra)

Bounds. The ExecuTorch runtime REJECTS a T above a method's exported maximum (set_inputs fails with error
0x10) but ACCEPTS a T below its minimum; the runner enforces the lower bounds. input_pos is not
range-checked inside the graph (no data-dependent guards): positions must stay below max_seq_len.

Dispatch rule: written once, as kernels.rule.use_small_m (M <= max_m: the small-M kernels, else the
dense path; docs/design.md §5; torch-free, so reading it loads no Triton). `check_dispatch_windows` refuses any exported target T range whose ends fall on
different sides, so every K resolves to the same kernels and the same numerics: [2, max_m] and T = 1 are
fine by construction, prefill needs min_prefill_chunk > max_m. draft_decode is exempt: its numerics change
acceptance, never the output, and its range [1, max_prefill] must straddle. (XNNPACK and portable have no
such threshold of their own; the check keeps the .pte valid for the kernels' backend as well.)

Backends: "portable" (no delegate) and "xnnpack" (XnnpackPartitioner; with quant="int4" torchao's
8-bit dynamic activation / int4 grouped weight (8da4w) linears, the quantizer config of ExecuTorch's llama
export). Embeddings stay fp32. The report lists, per method, the ops left outside the delegate: with a
dynamic T, XNNPACK takes no reshape with a symbolic dim, no expand (GQA), split (RoPE), index_put (cache
writes), index (RoPE tables), mask ops, embedding or argmax, so each layer is several delegate calls.

Baked at export: weights, d2t, max_m, the T ranges and the metadata above. Not baked: K, sampling, stop
tokens, the prompt. Out of scope here: CUDA/AOTInductor (needs the kernels' triton_ops with fake impls and
ExecuTorch's CudaPartitioner), ExecuTorch's llama custom ops (update_cache / custom_sdpa).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim, export
from tqdm.auto import tqdm

from kernels.rule import SMALL_M_LIMIT, use_small_m

log = logging.getLogger(__name__)

BACKENDS = ("portable", "xnnpack")
QUANTS = ("none", "int4")
TARGET_METHODS = ("prefill", "target_verify", "target_decode")
METHODS = TARGET_METHODS + ("draft_decode",)


# --- the dispatch rule ---------------------------------------------------------------------------------
def check_dispatch_windows(windows: Mapping[str, tuple[int, int]], max_m: int) -> None:
    """Refuse any exported T range [lo, hi] whose ends fall on different sides of the dispatch rule.

    The rule itself is kernels.rule.use_small_m (M <= max_m: small-M kernels, else the dense path),
    monotonic in M, so checking both ends of a range checks all of it.
    """

    for name, (lo, hi) in windows.items():
        if use_small_m(lo, max_m) != use_small_m(hi, max_m):
            raise ValueError(
                f"{name} T range [{lo}, {hi}] straddles the dispatch threshold max_m={max_m}: rows M <= {max_m} "
                f"take the small-M kernels and M > {max_m} the dense path (kernels.rule.use_small_m), so "
                f"results would depend on T. "
                + ("Raise export.min_prefill_chunk above max_m." if name == "prefill" else
                   "Pick max_m so that the range lies on one side of it.")
            )


def check_export_args(*, max_m: int, default_chain: int, min_prefill_chunk: int, max_prefill_chunk: int,
                      max_seq_len: int, backend: str, quant: str, group_size: int) -> None:
    """Every refusal that does not need the model, raised before any tracing or lowering."""
    if backend not in BACKENDS:
        raise ValueError(f"export.backend={backend!r}: supported backends are {BACKENDS}")
    if quant not in QUANTS:
        raise ValueError(f"export.quant={quant!r}: supported are {QUANTS}")
    if quant == "int4" and backend != "xnnpack":
        raise ValueError(f"export.quant=int4 needs export=xnnpack (backend {backend!r} has no int4 linear kernels)")
    if quant == "int4" and (group_size <= 0 or group_size % 2):
        raise ValueError(f"export.group_size={group_size}: int4 groups must be a positive even size (e.g. 32)")
    if not isinstance(max_m, int) or max_m < 2:
        raise ValueError(f"export.max_m={max_m}: the verify window is T in [2, max_m] (K = T-1 >= 1), "
                         f"so max_m must be an int >= 2")
    if max_m > max_seq_len:
        raise ValueError(f"export.max_m={max_m} is larger than the model's max_seq_len={max_seq_len} "
                         f"(a verify window cannot exceed the KV cache)")
    if max_m > SMALL_M_LIMIT:
        raise ValueError(f"export.max_m={max_m}: the small-M kernels take at most {SMALL_M_LIMIT} rows "
                         f"(kernels.rule.SMALL_M_LIMIT), so a verify window is at most that wide")
    if not 1 <= default_chain <= max_m - 1:
        raise ValueError(f"export.default_chain={default_chain}: the default K must lie in [1, max_m-1] = [1, {max_m - 1}]")
    if not min_prefill_chunk <= max_prefill_chunk <= max_seq_len:
        raise ValueError(f"prefill chunk range [{min_prefill_chunk}, {max_prefill_chunk}] must satisfy "
                         f"min <= max <= max_seq_len={max_seq_len}")
    check_dispatch_windows({"target_verify": (2, max_m), "prefill": (min_prefill_chunk, max_prefill_chunk),
                            "target_decode": (1, 1)}, max_m)


# --- one wrapper per method, all around the same Speculator ----------------------------------------
class _TargetMethod(nn.Module):
    def __init__(self, speculator: nn.Module, method: str):
        super().__init__()
        self.speculator = speculator  # same attribute name in every wrapper -> same buffer FQNs
        self.method = method

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor):
        return getattr(self.speculator, self.method)(tokens, input_pos)


class _DraftDecode(nn.Module):
    def __init__(self, speculator: nn.Module):
        super().__init__()
        self.speculator = speculator

    def forward(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor):
        return self.speculator.draft_decode(tokens, feature, input_pos)


def _tokens(T: int):
    return torch.zeros(1, T, dtype=torch.int64), torch.arange(T, dtype=torch.int64)


def _dim(name: str, lo: int, hi: int):
    return None if lo == hi else Dim(name, min=lo, max=hi)


def _sample(lo: int, hi: int) -> int:
    """A sample T inside [lo, hi] that torch.export will not specialise on (0 and 1 are special)."""
    return hi if lo == hi else max(lo, 2)


def method_specs(*, max_m: int, min_prefill_chunk: int, max_prefill_chunk: int, hidden: int) -> dict:
    """{method: (wrapper factory, example args, dynamic_shapes, (T min, T max))}."""
    t_draft = max(max_prefill_chunk, max_m)
    specs = {}
    for name, (lo, hi) in {"prefill": (min_prefill_chunk, max_prefill_chunk), "target_verify": (2, max_m),
                           "target_decode": (1, 1)}.items():
        d = _dim(f"T_{name}", lo, hi)
        specs[name] = (lambda s, n=name: _TargetMethod(s, n), _tokens(_sample(lo, hi)),
                       None if d is None else ({1: d}, {0: d}), (lo, hi))
    T = _sample(1, t_draft)
    d = _dim("T_draft_decode", 1, t_draft)
    tokens, pos = _tokens(T)
    specs["draft_decode"] = (_DraftDecode, (tokens, torch.zeros(1, T, hidden), pos),
                             ({1: d}, {1: d}, {0: d}), (1, t_draft))
    return specs


# --- quantization --------------------------------------------------------------------------------------
def quantize_int4(speculator: nn.Module, group_size: int) -> list[str]:
    """8da4w in place: int8 dynamic per-token activations, int4 weights in groups of `group_size`.

    Every nn.Linear whose in_features is a multiple of group_size (target and draft); embeddings stay fp32.
    Returns the names of the linears left in fp32.
    """
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    skipped = [n for n, m in speculator.named_modules()
               if isinstance(m, nn.Linear) and m.in_features % group_size]
    quantize_(speculator,
              Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and m.in_features % group_size == 0)
    return skipped


# --- lowering --------------------------------------------------------------------------------------
def _partitioners(backend: str) -> list:
    if backend == "portable":
        return []
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    # One partitioner with every precision (fp32 and dynamically quantized int8 x int4). ExecuTorch's llama
    # recipe runs XnnpackDynamicallyQuantizedPartitioner first, which gives every 8da4w linear its own
    # delegate: on the default-size model that doubled the delegate calls (123 vs 58 per decode step),
    # took 1.5x longer to lower and ran ~1.4x slower, with the same ops left outside.
    return [XnnpackPartitioner()]


def _op_name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def graph_ops(program) -> tuple[int, dict[str, int]]:
    """(number of delegate calls, {op: count} of ops that run outside any delegate) of a lowered method."""
    delegates, outside = 0, collections.Counter()
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        name = _op_name(node.target)
        if "executorch_call_delegate" in name:
            delegates += 1
        elif name not in ("aten.sym_size.int", "sym_size.int"):
            outside[name] += 1
    return delegates, dict(sorted(outside.items(), key=lambda kv: (-kv[1], kv[0])))


def constant_methods(speculator: nn.Module, *, max_m: int, default_chain: int, max_prefill_chunk: int,
                     min_prefill_chunk: int, manifest_hash: str, backend: str, quant: str) -> dict:
    """The zero-input methods of the program (names and types in the module docstring)."""
    target, draft = speculator.target.cfg, speculator.draft
    return {
        "get_max_m": max_m,
        "get_chain_len": default_chain,
        "get_max_seq_len": target.max_seq_len,
        "get_vocab_size": target.vocab_size,
        "get_draft_vocab_size": draft.cfg.draft_vocab_size,
        "get_max_prefill_chunk": max_prefill_chunk,
        "get_min_prefill_chunk": min_prefill_chunk,
        "get_manifest_hash": manifest_hash,
        "get_d2t": draft.d2t.detach().cpu().to(torch.int64).clone(),
        "get_hidden_size": draft.cfg.hidden_size,
        "get_sliding_window": min((w for w in (target.sliding_window or ()) if w), default=0),
        "get_backend": backend,
        "get_quant": quant,
    }


@contextlib.contextmanager
def _tracing_mode(speculator: nn.Module):
    """The draft's eager-only cache guard (gaps) is data dependent: off while tracing, restored after."""
    draft = speculator.draft
    saved = getattr(draft, "check_gaps", None)
    draft.check_gaps = False
    try:
        with torch.no_grad():
            yield
    finally:
        if saved is not None:
            draft.check_gaps = saved


def export_pte(speculator: nn.Module, *, max_m: int, default_chain: int, max_prefill_chunk: int,
               min_prefill_chunk: int, backend: str = "xnnpack", quant: str = "none", group_size: int = 32,
               out_path: Path | str, manifest_hash: str, progress: bool = True) -> dict:
    """Lower `speculator` (a models.Speculator) into one .pte at `out_path`; return a JSON-able report.

    quant="int4" quantizes `speculator` IN PLACE (the stage loads a fresh one; copy first to keep fp32).
    Every argument is checked before tracing starts (ValueError with the offending value).
    """
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.program._program import EdgeProgramManager

    target, draft = speculator.target, speculator.draft
    max_seq_len = target.cfg.max_seq_len
    check_export_args(max_m=max_m, default_chain=default_chain, min_prefill_chunk=min_prefill_chunk,
                      max_prefill_chunk=max_prefill_chunk, max_seq_len=max_seq_len, backend=backend,
                      quant=quant, group_size=group_size)
    if draft.cfg.max_seq_len < max_seq_len:
        raise ValueError(f"draft cache max_seq_len={draft.cfg.max_seq_len} < target max_seq_len={max_seq_len}: "
                         f"draft_decode would run past its cache; load the draft with the target's max_seq_len")
    if not (isinstance(manifest_hash, str) and len(manifest_hash) == 64
            and all(c in "0123456789abcdef" for c in manifest_hash)):
        raise ValueError(f"manifest_hash must be 64 lowercase hex chars (a sha256), got {manifest_hash!r}")

    t_start = time.perf_counter()
    report: dict = {"backend": backend, "quant": quant, "max_m": max_m, "default_chain": default_chain,
                    "min_prefill_chunk": min_prefill_chunk, "max_prefill_chunk": max_prefill_chunk,
                    "max_seq_len": max_seq_len, "manifest_hash": manifest_hash}
    speculator.eval()
    if quant == "int4":
        report["group_size"] = group_size
        report["fp32_linears"] = quantize_int4(speculator, group_size)
        log.info("int4 (8da4w, group %d) applied; linears left fp32: %s", group_size, report["fp32_linears"] or "none")

    specs = method_specs(max_m=max_m, min_prefill_chunk=min_prefill_chunk, max_prefill_chunk=max_prefill_chunk,
                         hidden=draft.cfg.hidden_size)
    report["t_range"] = {name: list(spec[3]) for name, spec in specs.items()}
    compile_config = EdgeCompileConfig(_check_ir_validity=False)
    exported, lowered, timings = {}, {}, {}
    bar = tqdm(total=2 * len(specs), desc=f"export {backend}/{quant}", disable=not progress, leave=False)
    with _tracing_mode(speculator):
        for name, (wrap, args, dynamic_shapes, (lo, hi)) in specs.items():
            bar.set_postfix_str(f"torch.export {name}")
            t0 = time.perf_counter()
            exported[name] = export(wrap(speculator), args, dynamic_shapes=dynamic_shapes, strict=False)
            timings[f"export_{name}_s"] = time.perf_counter() - t0
            log.info("torch.export %s (T in [%d, %d]): %.1f s", name, lo, hi, timings[f"export_{name}_s"])
            bar.update()
    # One method at a time, so progress and the per-method op census are visible; the edge programs are
    # then joined into one manager, whose to_executorch plans the shared buffers across all of them.
    partitioners = _partitioners(backend)
    for name, ep in exported.items():
        bar.set_postfix_str(f"lower {name}")
        t0 = time.perf_counter()
        lowered[name] = to_edge_transform_and_lower(
            {name: ep}, partitioner={name: partitioners} if partitioners else None,
            compile_config=compile_config).exported_program(name)
        timings[f"lower_{name}_s"] = time.perf_counter() - t0
        delegates, outside = graph_ops(lowered[name])
        listing = [f"{op} x{n}" for op, n in outside.items()]
        report.setdefault("delegate_calls", {})[name] = delegates
        report.setdefault("n_ops_outside_delegate", {})[name] = sum(outside.values())
        report.setdefault("ops_outside_delegate", {})[name] = listing  # strings: kept out of the metrics
        log.info("lowered %s: %.1f s, %d delegate calls, %d ops outside the delegate%s", name,
                 timings[f"lower_{name}_s"], delegates, sum(outside.values()),
                 " (portable kernels: no delegate)" if backend == "portable" else
                 ": " + (", ".join(listing) or "none"))
        bar.update()
    bar.close()
    del exported

    constants = constant_methods(speculator, max_m=max_m, default_chain=default_chain,
                                 max_prefill_chunk=max_prefill_chunk, min_prefill_chunk=min_prefill_chunk,
                                 manifest_hash=manifest_hash, backend=backend, quant=quant)
    t0 = time.perf_counter()
    edge = EdgeProgramManager(lowered, constant_methods=constants, compile_config=compile_config)
    program = edge.to_executorch(ExecutorchBackendConfig(
        emit_mutable_buffer_names=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=True),
    ))
    timings["to_executorch_s"] = time.perf_counter() - t0
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(program.buffer)
    timings["total_s"] = time.perf_counter() - t_start
    report["timings"] = {k: round(v, 2) for k, v in timings.items()}
    report["pte_bytes"] = out_path.stat().st_size
    log.info("wrote %s (%.2f MB) in %.1f s", out_path, report["pte_bytes"] / 1e6, timings["total_s"])
    return report
