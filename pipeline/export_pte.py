"""Lower one models.Speculator into ONE ExecuTorch program that serves every chain length K in [1, max_m-1].

The program's methods, described here and nowhere else (README.md and docs/design.md point here). Batch 1; ids
int64, floats fp32; H = the draft's hidden size (the feature's width), V = the target's vocabulary, Vd = the draft's.
Every method returns a list, in this order; T is the call's rows, dynamic within the range given:

    prefill(tokens[1,T], input_pos[T]) -> next_id[1,1], feature[1,T,H], logits[1,V]
        T in [min_prefill_chunk, max_prefill_chunk]: the prompt, in chunks
    target_decode(tokens[1,1], input_pos[1]) -> ids[1,1], logits[1,1,V]
        T = 1: the K = 0 baseline
    target_verify(tokens[1,T], input_pos[T]) -> ids[1,T], feature[1,T,H], logits[1,T,V]
        T in [2, max_m]: a round's anchor and K proposals
    target_verify_exact(tokens[1,T], input_pos[T]) -> as target_verify
        T in [2, max_m]; its attention (eagle3::exact_sdpa) gives a row the same bits in any call: exact mode's
        every target call, at engine.exact_width rows (runner.engine.ExactEngine)
    draft_decode(tokens[1,T], feature[1,T,H], input_pos[T]) -> ids[1,T] (target vocab), g[1,T,H], logits[1,T,Vd]
        T in [1, max(max_prefill_chunk, max_m)]: the draft seeded on the prompt, a reseed, or one step
    draft_chain_<k>(tokens[1,T], feature[1,T,H], input_pos[T]) -> ids[1,k] (target vocab)
        T in [1, max_m]; one per k in [1, max_m-1] with export.draft_chains: draft_decode's seeding on the T rows,
        then k-1 steps on its own proposals, a greedy round's draft in one call (Speculator.draft_chain)

The target methods share one KV cache, the draft methods another: every method wraps the same Speculator under the
same attribute name, so each cache buffer has one name in every graph, planned once for the program
(`share_mutable_buffers`). A method writes K/V at input_pos, which must be contiguous and below max_seq_len, and
attends to keys at or before each row's position, so nothing is rolled back: a later call overwrites a rejected slot.
The target's windowed layers keep their keys in ring caches of window + max(max_prefill_chunk, max_m) slots
(models.target), which no call of the exported ranges overruns.
The runtime refuses a T above a method's range but not below it; the runner enforces the lower bounds.

Constant methods (no inputs; `execute([])` returns a one-element list): get_max_m, get_chain_len (the default K,
export.default_chain), get_max_seq_len, get_vocab_size (V), get_draft_vocab_size (Vd), get_max_prefill_chunk,
get_min_prefill_chunk, get_manifest_hash (64 hex chars tying the program to its target, tokenizer and draft; the
export stage computes it), get_d2t (int64[Vd]: target id = draft id + d2t[draft id]), get_hidden_size (H),
get_sliding_window (the smallest window of any target layer, 0 for none), get_backend (export.backend), get_quant
(export.quant: fp32 | 8da4w_draft | 8da4w_offsets | 8da_file, models.quantize).

Baked: the weights, d2t, max_m, the T ranges and the constants. Chosen at run time: K, the policy, sampling, stop
tokens, the prompt. No target range straddles the dispatch rule (kernels.rule.use_small_m, docs/design.md §5:
`check_dispatch_windows`). The graphs attend through ExecuTorch's llama ops (models.layers), so the .pte needs them
registered where it loads (runner.engine.PteEngine does it), and each weight is stored once (pipeline.pte_segments).
`export_pte(...)` takes no Hydra config: the export stage and the tests call it.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import operator
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim, export
from tqdm.auto import tqdm

from kernels.rule import SMALL_M_LIMIT, use_small_m
from models import quiet
from models.choices import EXPORT_BACKENDS, EXPORT_QUANTS
from models.quantize import GroupOffsetLinear, linear_bits, quantize
from models.speculator import chain_methods
from models.target import kv_cache_bytes, ring_slots
from pipeline.pte_segments import data_layout, share_constant_bytes

log = logging.getLogger(__name__)

TARGET_METHODS = ("prefill", "target_verify", "target_verify_exact", "target_decode")


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


DEFAULT_CHAIN = 6  # the largest default K (`default_chain: auto`, pipeline.hardware): the best K of the measured
# round on the embedded default (bench.round, docs/results.md: K = 6 at one thread; K = 5 and 6 within noise at two)


def windows(ec) -> dict:
    """The call windows the export config fixes: max_m, default_chain (resolved from `auto` by
    pipeline.hardware before any key is computed) and the prefill chunk range (`min_prefill_chunk` None =
    max_m + 1). The .pte is lowered for them (the cuda engine has its own, conf/engine/cuda.yaml)."""
    max_m = int(ec.max_m)
    min_prefill = int(ec.min_prefill_chunk) if ec.get("min_prefill_chunk") is not None else max_m + 1
    return dict(max_m=max_m, default_chain=int(ec.default_chain), max_prefill_chunk=int(ec.max_prefill_chunk),
                min_prefill_chunk=min_prefill)


def check_export_args(*, max_m: int, default_chain: int, min_prefill_chunk: int, max_prefill_chunk: int,
                      max_seq_len: int, backend: str, quant: str, group_size: int, draft_chains: bool = True) -> None:
    """Every refusal that does not need the model, raised before any tracing or lowering."""
    if not isinstance(draft_chains, bool):
        raise ValueError(f"export.draft_chains={draft_chains!r}: expected true or false")
    if backend not in EXPORT_BACKENDS:
        raise ValueError(f"export.backend={backend!r}: expected one of {', '.join(EXPORT_BACKENDS)}")
    if quant not in EXPORT_QUANTS:
        raise ValueError(f"export.quant={quant!r}: expected one of {', '.join(EXPORT_QUANTS)}")
    if quant != "fp32" and backend != "xnnpack":
        raise ValueError(f"export.quant={quant} needs export=xnnpack (backend {backend!r} has no 8da4w linear kernels)")
    if quant != "fp32" and (group_size <= 0 or group_size % 2):
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
    check_dispatch_windows({"target_verify": (2, max_m), "target_verify_exact": (2, max_m),
                            "prefill": (min_prefill_chunk, max_prefill_chunk),
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


class _DraftChain(nn.Module):
    def __init__(self, speculator: nn.Module, k: int):
        super().__init__()
        self.speculator = speculator
        self.k = k

    def forward(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor):
        return self.speculator.draft_chain(tokens, feature, input_pos, self.k)


def _tokens(T: int):
    return torch.zeros(1, T, dtype=torch.int64), torch.arange(T, dtype=torch.int64)


def _dim(name: str, lo: int, hi: int):
    return None if lo == hi else Dim(name, min=lo, max=hi)


def _sample(lo: int, hi: int) -> int:
    """A sample T inside [lo, hi] that torch.export will not specialise on (0 and 1 are special)."""
    return hi if lo == hi else max(lo, 2)


def method_specs(*, max_m: int, min_prefill_chunk: int, max_prefill_chunk: int, hidden: int,
                 draft_chains: bool = True) -> dict:
    """{method: (wrapper factory, example args, dynamic_shapes, (T min, T max))}; the draft_chain_<k> when asked."""
    t_draft = max(max_prefill_chunk, max_m)
    specs = {}
    for name, (lo, hi) in {"prefill": (min_prefill_chunk, max_prefill_chunk), "target_verify": (2, max_m),
                           "target_verify_exact": (2, max_m), "target_decode": (1, 1)}.items():
        d = _dim(f"T_{name}", lo, hi)
        specs[name] = (lambda s, n=name: _TargetMethod(s, n), _tokens(_sample(lo, hi)),
                       None if d is None else ({1: d}, {0: d}), (lo, hi))
    T = _sample(1, t_draft)
    d = _dim("T_draft_decode", 1, t_draft)
    tokens, pos = _tokens(T)
    specs["draft_decode"] = (_DraftDecode, (tokens, torch.zeros(1, T, hidden), pos),
                             ({1: d}, {1: d}, {0: d}), (1, t_draft))
    T = _sample(1, max_m)
    tokens, pos = _tokens(T)
    for k, name in enumerate(chain_methods(max_m) if draft_chains else (), start=1):
        d = _dim(f"T_{name}", 1, max_m)
        specs[name] = (lambda s, k=k: _DraftChain(s, k), (tokens, torch.zeros(1, T, hidden), pos),
                       ({1: d}, {1: d}, {0: d}), (1, max_m))
    return specs


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


def pick_attention(speculator: nn.Module, attention: str) -> str:
    """The cached attention the program runs: `attention` ("llama_ops" | "index_copy", models.layers), except
    that a model with a soft-capped attention layer (llama::custom_sdpa has no soft-cap) keeps "index_copy"."""
    from models.layers import KV_IMPLS, Attention

    if attention not in KV_IMPLS:
        raise ValueError(f"attention={attention!r}: supported are {KV_IMPLS}")
    if attention == "llama_ops" and any(m.softcap is not None for m in speculator.modules() if isinstance(m, Attention)):
        log.info("attention soft-cap present: the program keeps the index_copy attention")
        return "index_copy"
    return attention


@contextlib.contextmanager
def _export_graph(speculator: nn.Module, attention: str, fc_norms: bool):
    """While tracing: every Attention of `speculator` on `attention`, every RMSNorm's mean as a linear when
    `fc_norms` (models.layers); back to what they were after (caches reallocated empty both ways)."""
    from models.layers import Attention, RMSNorm, set_fc_mean, set_kv_impl

    saved = {m: m.kv_impl for m in speculator.modules() if isinstance(m, Attention)}
    norms = {m: m.mean_weight for m in speculator.modules() if isinstance(m, RMSNorm)}
    set_kv_impl(speculator, attention)
    set_fc_mean(speculator, fc_norms)
    try:
        yield
    finally:
        for m, was in saved.items():
            if m.kv_impl != was:
                m.set_kv_impl(was)
        for m, was in norms.items():
            m.mean_weight = was


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


# --- resumable lowering: one file per lowered method -------------------------------------------------
LOWERED_SUFFIX = ".lowered.pt2"
# A delegate's named data (XNNPACK's weights) as one file per distinct buffer, named by its sha256: methods
# that share weights share the file, and each is read once.
NAMED_DATA_SUFFIX = ".named"
# exir's serde logs what it skips (the lowered module's unknown fields, ops it re-resolves) at WARNING on both
# calls: facts of its internals, not of the program.
SERDE_LOGGER = "executorch.exir.serde.export_serialize"


def _lowered_version() -> str:
    import importlib.metadata

    return f"torch {torch.__version__}, executorch {importlib.metadata.version('executorch')}"


def _delegates(program) -> list:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    return [(name, m) for name, m in program.graph_module.named_modules() if isinstance(m, LoweredBackendModule)]


def _write_once(path: Path, data) -> None:
    if not path.is_file():
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        tmp.replace(path)


def save_lowered(program, path: Path) -> None:
    """One lowered method (an edge ExportedProgram with its delegates) written atomically with exir's serde,
    tagged with the library versions that lowered it and with which of its tensors require grad (the serde
    drops the flag, and the emitter writes it into the program).

    The delegates' bulk stays out of the serde's JSON, which base64-encodes every byte and needs about 4x a
    file's size to read it back (15.9 GB for one of Gemma 3's 4.2 GB target methods): their named data goes
    to `<sha256>.named` files beside `path`, and the weights of each delegate's original module (which only
    the emitter's debug-handle map reads, through the graph) are saved as zero-stride placeholders of the same
    shape and dtype. `program` is left as it was."""
    import hashlib
    import json

    from executorch.exir.serde.serialize import save

    tensors = {**program.state_dict, **program.constants,  # and the placeholders' fake values the emitter reads
               **{n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}}
    grad = sorted(k for k, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad)
    named: dict[str, list[str]] = {}  # delegate module -> sha256 of each of its named-data buffers
    undo: list = []  # (container, key, value) restored after saving
    for module_name, lowered in _delegates(program):
        out = lowered.named_data_store_output
        if out is not None and out.buffers:
            named[module_name] = []
            for buffer in out.buffers:
                data = buffer if isinstance(buffer, (bytes, bytearray)) else bytes(buffer)
                named[module_name].append(digest := hashlib.sha256(data).hexdigest())
                _write_once(path.parent / f"{digest}{NAMED_DATA_SUFFIX}", data)
            undo.append((out, "buffers", out.buffers))
            out.buffers = [b""] * len(out.buffers)
        original = lowered.original_module
        for table in (original.state_dict, original.constants):
            for key, t in list(table.items()):
                if type(t) in (torch.Tensor, nn.Parameter) and t.numel() > 1:
                    undo.append((table, key, t))
                    stub = torch.zeros((), dtype=t.dtype).expand(t.shape)
                    table[key] = nn.Parameter(stub, requires_grad=False) if isinstance(t, nn.Parameter) else stub
    tmp = path.with_name(path.name + ".tmp")
    try:
        with quiet.muted(SERDE_LOGGER):
            save(program, str(tmp), extra_files={"versions": _lowered_version(), "requires_grad": json.dumps(grad),
                                                 "named_data": json.dumps(named)})
    finally:
        for container, key, value in reversed(undo):
            if isinstance(container, dict):
                container[key] = value
            else:
                setattr(container, key, value)
    tmp.replace(path)


def load_lowered(path: Path, named_data: dict | None = None):
    """The lowered method saved at `path` as it was before saving (its delegates' original modules hold
    placeholders), or None when there is none, other library versions wrote it, or a named-data file is
    missing or damaged (then the method is lowered again). `named_data` (sha256 -> bytes) caches the buffers
    read, so methods that share weights hold one copy."""
    import hashlib
    import json

    from executorch.exir.serde.serialize import load

    if not path.is_file():
        return None
    missing = "no named-data index"
    extra = {"versions": "", "requires_grad": "[]", "named_data": missing}
    try:
        with quiet.muted(SERDE_LOGGER):
            program = load(str(path), extra_files=extra)
    except Exception as e:  # written atomically, so only a damaged disk gets here: lower it again
        log.warning("%s is not a readable lowered method (%s: %s): lowering it again", path, type(e).__name__, e)
        return None
    if extra["versions"] != _lowered_version() or extra["named_data"] == missing:
        log.info("%s was lowered by %s, not %s: lowering it again", path.name,
                 extra["versions"] if extra["named_data"] != missing else "an older format", _lowered_version())
        return None
    cache = {} if named_data is None else named_data
    delegates = dict(_delegates(program))
    for module_name, digests in json.loads(extra["named_data"]).items():
        for digest in digests:
            if digest not in cache:
                blob = path.parent / f"{digest}{NAMED_DATA_SUFFIX}"
                data = blob.read_bytes() if blob.is_file() else b""
                if hashlib.sha256(data).hexdigest() != digest:
                    log.warning("%s is %s: lowering %s again", blob, "damaged" if data else "missing", path.name)
                    return None
                cache[digest] = data
        delegates[module_name].named_data_store_output.buffers = [cache[d] for d in digests]
    grad = set(json.loads(extra["requires_grad"]))
    for table in (program.state_dict, program.constants):
        for name in grad & set(table):
            table[name] = nn.Parameter(table[name], requires_grad=True)
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in grad:
            node.meta["val"].requires_grad_(True)
    return program


def share_weights(program, seen: dict) -> int:
    """Point `program`'s state dict and constants at the tensors of earlier methods where the name, shape, dtype
    and values agree (`seen`: name -> tensor, filled as it goes). Methods lowered or loaded one by one each hold
    their own copy of the same parameters, and the emitter writes one copy of equal tensors anyway; Gemma 3's
    fp32 target holds 1.3 GB a method. -> the bytes no longer held twice."""
    freed = 0
    for table in (program.state_dict, program.constants):
        for name, tensor in list(table.items()):
            if not isinstance(tensor, torch.Tensor):
                continue
            first = seen.setdefault(name, tensor)
            if first is not tensor and first.shape == tensor.shape and first.dtype == tensor.dtype \
                    and type(first) is type(tensor) and torch.equal(first, tensor):
                table[name] = first
                freed += tensor.numel() * tensor.element_size()
    return freed


# --- lowering in parallel ------------------------------------------------------------------------------
def lowering_workers() -> int:
    """Processes that lower methods at once: the cores this process may use, at most 4 (each holds one method's
    lowered copy: about 4 GB for Gemma 3 270M's fp32 target methods)."""
    from models.threads import usable_cores

    return max(1, min(usable_cores(), 4))


def _lowering_cost(name: str) -> int:
    """A method's lowering time in draft steps' worth (measured on the embedded default: a target method of 8
    layers ~20 s, a draft step ~4.5 s), so the longest start first and the workers finish together."""
    if name.startswith("draft_chain_"):
        return 1 + int(name.rsplit("_", 1)[1])
    return 2 if name in ("draft_decode", "target_decode") else 4


_fork_work = None  # lower_in_forks' function: set before the fork, so the workers inherit it and nothing is pickled


def _fork_init() -> None:
    """A lowering worker: torch at one thread (lowering is Python), and no warnings of its own: the parent has
    already shown any that matter, and a worker's third-party deprecation notices would print once per worker."""
    import warnings

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def _in_fork(name: str):
    _, took = _fork_work(name)
    return took


def lower_in_forks(lower, names: list[str], workers: int):
    """Yield the timings of `lower(name)` for every name, run in `workers` forked processes at once (each lowering
    one method at a time, longest first, and saving it to the scratch dir, which the caller then loads). A fork
    inherits the traced modules as they are, so nothing is pickled; each worker runs torch at one thread
    (lowering is Python). A failed method raises here, naming it."""
    import multiprocessing
    import warnings

    global _fork_work
    _fork_work = lower
    try:
        with warnings.catch_warnings():  # "use of fork() may lead to deadlocks": the workers start no threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_fork_init)
        with pool:
            yield from pool.imap_unordered(_in_fork, names)
    finally:
        _fork_work = None


def export_pte(speculator: nn.Module, *, max_m: int, default_chain: int, max_prefill_chunk: int,
               min_prefill_chunk: int, backend: str = "xnnpack", quant: str = "fp32", group_size: int = 32,
               out_path: Path | str, manifest_hash: str, progress: bool = True, draft_chains: bool = True,
               attention: str = "llama_ops", fc_norms: bool = True, scratch: Path | None = None,
               weight_types: dict[str, str] | None = None) -> dict:
    """Lower `speculator` (a models.Speculator) into one .pte at `out_path`; return a JSON-able report.

    quant="8da4w_offsets" quantizes `speculator` IN PLACE, "8da4w_draft" its draft (the stage loads a fresh one;
    copy first to keep fp32); "8da_file" its target at the precision of the GGUF that `weight_types` (the target
    artifact's models.gguf.WEIGHT_TYPES) records, refused without one.
    `attention` is the cached path the methods are traced with (`pick_attention`), `fc_norms` makes every
    RMSNorm's mean a linear (RMSNorm.set_fc_mean); the speculator's caches are reallocated empty, the target's
    windowed layers on rings for the widest target call, max(max_prefill_chunk, max_m) rows (Transformer.setup_cache).
    The report gives the ring's slots (`ring_slots`, None: flat) and the target's K/V bytes by layer kind
    (`kv_cache_bytes`). Every argument is checked before tracing starts (ValueError with the offending value).

    `scratch` (the export stage's scratch dir): each method, once lowered, is saved there
    (`<method>.lowered.pt2`, its delegates' weights beside it in one file per distinct buffer, which the methods
    share: save_lowered) and the program is emitted from the saved methods, so a run that was killed
    lowers again only the methods it had not saved, and its .pte is byte for byte the one an uninterrupted
    run writes (both emit from the same files; a method is the unit: to_edge_transform_and_lower and the
    partitioner run per method, and exir's serde keeps a lowered one with its delegate payloads). With a scratch
    dir the methods are lowered `lowering_workers()` at a time, each in a forked process (`lower_in_forks`):
    lowering is single-threaded Python, and the draft_chain_<k> make it most of an export. Without one, a
    temporary dir carries them over (and is removed), so a direct caller lowers in parallel too.
    """
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.program._program import EdgeProgramManager

    target, draft = speculator.target, speculator.draft
    max_seq_len = target.cfg.max_seq_len
    check_export_args(max_m=max_m, default_chain=default_chain, min_prefill_chunk=min_prefill_chunk,
                      max_prefill_chunk=max_prefill_chunk, max_seq_len=max_seq_len, backend=backend,
                      quant=quant, group_size=group_size, draft_chains=draft_chains)
    if draft.cfg.max_seq_len < max_seq_len:
        raise ValueError(f"draft cache max_seq_len={draft.cfg.max_seq_len} < target max_seq_len={max_seq_len}: "
                         f"draft_decode would run past its cache; load the draft with the target's max_seq_len")
    if not (isinstance(manifest_hash, str) and len(manifest_hash) == 64
            and all(c in "0123456789abcdef" for c in manifest_hash)):
        raise ValueError(f"manifest_hash must be 64 lowercase hex chars (a sha256), got {manifest_hash!r}")

    attention = pick_attention(speculator, attention)
    t_start = time.perf_counter()
    # the windowed layers' ring caches, sized for the widest target call (models.target, `ring_slots`)
    max_t = max(max_prefill_chunk, max_m)
    target.setup_cache(max_t=max_t)
    report: dict = {"backend": backend, "quant": quant, "attention": attention, "fc_norms": fc_norms, "max_m": max_m,
                    "default_chain": default_chain, "draft_chains": draft_chains,
                    "min_prefill_chunk": min_prefill_chunk, "max_prefill_chunk": max_prefill_chunk,
                    "max_seq_len": max_seq_len, "manifest_hash": manifest_hash,
                    "ring_slots": ring_slots(target.cfg, max_seq_len, max_t),
                    "kv_cache_bytes": kv_cache_bytes(target.cfg, max_seq_len, target.lm_head.weight.dtype, max_t)}
    speculator.eval()
    if quant != "fp32":
        report["group_size"] = group_size
        report["fp32_linears"] = quantize(speculator, quant, group_size, weight_types)
        bits = collections.Counter(linear_bits(target).values())
        report["target_linears_by_bits"] = {str(b): bits[b] for b in sorted(bits)}
        if quant in ("8da4w_offsets", "8da_file"):
            grouped = [m for m in target.modules() if isinstance(m, GroupOffsetLinear)]
            report["grid_group_share"] = round(sum(m.grid_share for m in grouped) / max(len(grouped), 1), 4)
            log.info("%s: %.1f%% of the target's 4-bit weight groups are 4-bit grids (a 4-bit GGUF's blocks), "
                     "kept as they are", quant, 100 * report["grid_group_share"])
        log.info("%s (group %d) applied; linears left fp32: %s", quant, group_size, report["fp32_linears"] or "none")

    specs = method_specs(max_m=max_m, min_prefill_chunk=min_prefill_chunk, max_prefill_chunk=max_prefill_chunk,
                         hidden=draft.cfg.hidden_size, draft_chains=draft_chains)
    report["t_range"] = {name: list(spec[3]) for name, spec in specs.items()}
    compile_config = EdgeCompileConfig(_check_ir_validity=False)
    lowered, timings, resumed = {}, {}, []
    handover = None  # no scratch dir: the parallel lowering hands the methods over through a temporary one
    if scratch is None and lowering_workers() > 1 and len(specs) > 1:
        handover = tempfile.TemporaryDirectory(prefix="lowered-")  # removed when the export ends, or fails
        scratch = handover.name
    saved = {name: Path(scratch) / f"{name}{LOWERED_SUFFIX}" for name in specs} if scratch is not None else {}
    partitioners = _partitioners(backend)
    bar = tqdm(total=2 * len(specs), desc=f"export {backend}/{quant}", disable=not progress, leave=False)
    # A method is the unit: lowered on its own (in `lowering_workers()` forked processes at once when there is a
    # scratch dir to hand them over through), censused, and what a killed export resumes from; the edge programs
    # are then joined into one manager, whose to_executorch plans the shared buffers across all of them.

    def lower(name: str):
        """torch.export and lower one method (saved to the scratch dir when there is one) -> (program, timings)."""
        wrap, args, dynamic_shapes, (lo, hi) = specs[name]
        t0 = time.perf_counter()
        ep = export(wrap(speculator), args, dynamic_shapes=dynamic_shapes, strict=False)
        took = {f"export_{name}_s": time.perf_counter() - t0}
        log.info("torch.export %s (T in [%d, %d]): %.1f s", name, lo, hi, took[f"export_{name}_s"])
        t0 = time.perf_counter()
        program = to_edge_transform_and_lower(
            {name: ep}, partitioner={name: partitioners} if partitioners else None,
            compile_config=compile_config).exported_program(name)
        took[f"lower_{name}_s"] = time.perf_counter() - t0
        if saved:
            save_lowered(program, saved[name])
        return program, took

    with _tracing_mode(speculator), _export_graph(speculator, attention, fc_norms):
        todo = [name for name in specs if not (saved and saved[name].is_file())]
        workers = min(lowering_workers(), len(todo)) if saved else 1
        if workers > 1:  # each method lowered in a forked process into the scratch dir; the loop below loads them
            bar.set_postfix_str(f"lowering {len(todo)} methods in {workers} processes")
            for took in lower_in_forks(lower, sorted(todo, key=_lowering_cost, reverse=True), workers):
                timings.update(took)
                bar.update(2)
            report["lowering_processes"] = workers
        for name in specs:
            if saved and (program := load_lowered(saved[name])) is not None:
                if name not in todo:  # saved by an earlier, killed export
                    resumed.append(name)
                    bar.update(2)
            else:
                bar.set_postfix_str(f"lower {name}")
                program, took = lower(name)
                timings.update(took)
                bar.update(2)
            delegates, outside = graph_ops(program)
            listing = [f"{op} x{n}" for op, n in outside.items()]
            report.setdefault("delegate_calls", {})[name] = delegates
            report.setdefault("n_ops_outside_delegate", {})[name] = sum(outside.values())
            report.setdefault("ops_outside_delegate", {})[name] = listing  # strings: kept out of the metrics
            log.info("lowered %s: %s, %d delegate calls, %d ops outside the delegate%s", name,
                     f"{timings[f'lower_{name}_s']:.1f} s" if f"lower_{name}_s" in timings else f"resumed from {saved[name]}",
                     delegates, sum(outside.values()),
                     " (portable kernels: no delegate)" if backend == "portable" else
                     ": " + (", ".join(listing) or "none"))
            # A saved method waits on disk, so one lowered method is in memory while the next one lowers
            # (Gemma 3's fp32 target: each holds its packed weights, about 1 GB, and lowering copies them).
            lowered[name] = None if saved else program
            del program
            gc.collect()
    bar.close()
    report["methods_resumed"] = resumed
    # every method is emitted from its saved file, as a resumed run does, so both write the same bytes; each
    # saved file holds its own copy of the weights, so one copy is kept as they load
    shared: dict[str, torch.Tensor] = {}
    named_data: dict[str, bytes] = {}
    report["weights_shared_bytes"] = 0
    for name, program in lowered.items():
        lowered[name] = program if program is not None else load_lowered(saved[name], named_data)
        report["weights_shared_bytes"] += share_weights(lowered[name], shared)
        gc.collect()
    if report["weights_shared_bytes"]:
        log.info("%.2f GB of weights the methods share held once", report["weights_shared_bytes"] / 1e9)

    constants = constant_methods(speculator, max_m=max_m, default_chain=default_chain,
                                 max_prefill_chunk=max_prefill_chunk, min_prefill_chunk=min_prefill_chunk,
                                 manifest_hash=manifest_hash, backend=backend, quant=quant)
    t0 = time.perf_counter()
    edge = EdgeProgramManager(lowered, constant_methods=constants, compile_config=compile_config)
    config = ExecutorchBackendConfig(
        emit_mutable_buffer_names=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=True),
    )
    buffer = edge.to_executorch(config).buffer
    del edge, lowered
    timings["to_executorch_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered_bytes = len(buffer)
    buffer, shared = share_constant_bytes(buffer, segment_alignment=config.segment_alignment,
                                          constant_tensor_alignment=config.constant_tensor_alignment,
                                          delegate_alignment=config.delegate_alignment)
    timings["share_s"] = time.perf_counter() - t0
    layout = data_layout(buffer)
    report["pte_constant_bytes"] = layout["constant"]
    report["pte_named_data_bytes"] = layout["named_data"]
    report["pte_shared_bytes"] = layout["named_data_shared"]
    log.info("%d named-data entries (%.2f MB) read from the constant segment instead of a copy of their own%s",
             len(shared), sum(n for _, n in shared) / 1e6, "" if shared else " (no byte-identical tables)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(buffer)
    timings["total_s"] = time.perf_counter() - t_start
    report["timings"] = {k: round(v, 2) for k, v in timings.items()}
    report["pte_bytes"] = out_path.stat().st_size
    log.info("wrote %s (%.2f MB; %.2f MB before sharing) in %.1f s", out_path, report["pte_bytes"] / 1e6,
             lowered_bytes / 1e6, timings["total_s"])
    if handover is not None:
        handover.cleanup()
    return report
