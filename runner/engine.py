"""The engine interface the speculative loop is written against, and two of its implementations (the third,
CUDA graphs on the GPU kernels, is runner/cuda_engine.py).

An engine exposes the methods of the exported program under the same names, with the same inputs, outputs and
caches (described once, in pipeline/export_pte.py's docstring): prefill, target_decode, target_verify,
target_verify_exact (the .pte and eager engines), draft_decode, and draft_chain(k, ...) for the program's
draft_chain_<k>. A caller never rolls back: a later call at the same positions overwrites stale slots.

`meta` holds what the loop needs to pick and check its windows: max_m (largest verify window), default_chain
(default K), max_seq_len, vocab_size, draft_vocab_size, max_prefill_chunk, min_prefill_chunk (the exported
prefill range), sliding_window (smallest window of any layer, or None), manifest_hash, d2t (LongTensor[Vd]).

- `PteEngine`: a .pte through `executorch.runtime` (what ships). The runtime accepts T below a method's
  exported minimum without complaint, so the loop (runner.generate) enforces the bounds itself. A .pte with
  a manifest.json beside it (the export artifact's) is loaded only when its sha256 is the one the manifest's
  `files` records (`check_pte`); one without a manifest is loaded unchecked, with a warning saying so. A file
  that is not an ExecuTorch program (`check_program_file`), or a tokenizer that does not fit the program
  (`check_tokenizer`), is refused naming both.
- `EagerEngine`: `models.Speculator` in PyTorch on CPU or CUDA (the same module the .pte was traced from).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Protocol

import torch

from models import quiet
from models.speculator import chain_methods

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"  # the store's (pipeline/store.py): {"files": {relative path: sha256}, ...}

CONSTANT_METHODS = {
    "max_m": "get_max_m",
    "default_chain": "get_chain_len",
    "max_seq_len": "get_max_seq_len",
    "vocab_size": "get_vocab_size",
    "draft_vocab_size": "get_draft_vocab_size",
    "max_prefill_chunk": "get_max_prefill_chunk",
    "min_prefill_chunk": "get_min_prefill_chunk",
    "sliding_window": "get_sliding_window",  # 0 = no sliding-window layer
}
PROGRAM_METHODS = ("prefill", "target_verify", "target_verify_exact", "target_decode", "draft_decode")


class Engine(Protocol):
    """The methods above, `meta`, and two optional capabilities: chain calls and device rounds.

    An engine whose `draft_chains` is True drafts a greedy round's K proposals in one `draft_chain` call (the
    .pte's draft_chain_<k>, the eager Speculator.draft_chain); the loop then reseeds the draft in that call.

    An engine whose `device_rounds` is True runs a whole greedy round at a static K itself, on its device with
    one synchronisation (runner.cuda_engine): `begin_rounds(first_id, g)` once after the draft is seeded with
    the prompt, then `speculate(k, anchor, P)` per round, which returns `new` as runner.generate's round would.
    The engines here subclass Engine, so every other one inherits `device_rounds = False` and the two refusals
    below, and the loop drives its rounds call by call.
    """

    meta: dict
    draft_chains: bool = False
    device_rounds: bool = False

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor): ...
    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor): ...
    def target_decode(self, tokens: torch.Tensor, input_pos: torch.Tensor): ...
    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor): ...
    def reset(self) -> None: ...

    def draft_chain(self, k: int, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor):
        raise NotImplementedError(f"{type(self).__name__} makes no chain calls (draft_chains is False)")

    def begin_rounds(self, first_id: int, g: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs no device rounds (device_rounds is False)")

    def speculate(self, k: int, anchor: int, P: int) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} runs no device rounds (device_rounds is False)")


def _scalar(value):
    """A constant method's output as a Python int (a 0-d/1-element tensor, or an int)."""
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0].item())
    return int(value)


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def check_pte(path: str | pathlib.Path) -> bool:
    """Check the .pte (and its .ptd, when the manifest lists one) against the sha256 that the manifest.json in
    its directory records; True when checked, False (after one warning) when there is no manifest. Raises
    ValueError naming the file and both hashes on a mismatch, or when the manifest does not list the .pte."""
    path = pathlib.Path(path)
    manifest_path = path.parent / MANIFEST
    if not manifest_path.is_file():
        log.warning("no manifest beside %s: its contents are not checked", path)
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{manifest_path} beside {path} is not a readable manifest ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or path.name not in files:
        raise ValueError(f"{manifest_path} does not list {path.name} in its files: it is not the manifest of {path}")
    for f in (path, path.with_suffix(".ptd")):
        if f.name in files:
            if not f.is_file():
                raise ValueError(f"{manifest_path} lists {f.name}, but there is no {f}")
            actual = _sha256(f)
            if actual != files[f.name]:
                raise ValueError(f"{f} has sha256 {actual}, but {manifest_path} records {files[f.name]}: the file "
                                 f"changed after export; rebuild it (python -m pipeline.store repair, then rerun "
                                 f"the pipeline) or put the exported file back")
    return True


PTE_IDENTIFIER = re.compile(rb"ET[0-9a-zA-Z]{2}")  # a .pte's flatbuffer file identifier, bytes 4-8


def check_program_file(path: pathlib.Path) -> None:
    """Refuse a file that is not an ExecuTorch program (its flatbuffer identifier), before the runtime reads it."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not PTE_IDENTIFIER.fullmatch(head[4:8]):
        raise ValueError(f"{path} is not an ExecuTorch program (bytes 4-8 are {head[4:8]!r}, where a .pte has "
                         f"its identifier b'ET..'): pass the model.pte the export stage wrote")


def check_tokenizer(path: pathlib.Path, meta: dict, tokenizer: str | pathlib.Path) -> None:
    """Refuse a tokenizer.json that does not fit the loaded program (`meta`): by its sha256 against the
    pairing facts behind `get_manifest_hash` where those are found (the export artifact's manifest beside the
    .pte, or an export artifact of the store holding the tokenizer's target artifact), by its size against
    `get_vocab_size` where not. The ValueError names both sides."""
    tokenizer = pathlib.Path(tokenizer)
    facts = _pairing_facts(path, meta["manifest_hash"], tokenizer)
    if facts is not None and facts[1].get("tokenizer_sha256"):
        where, pairing = facts
        actual = _sha256(tokenizer)
        if actual != pairing["tokenizer_sha256"]:
            raise ValueError(f"tokenizer {tokenizer} (sha256 {actual}) is not the one {path} was exported with: "
                             f"{where} records tokenizer sha256 {pairing['tokenizer_sha256']} for its manifest hash "
                             f"{meta['manifest_hash']}; pass the tokenizer.json of that target artifact")
        return
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    if size != meta["vocab_size"]:
        raise ValueError(f"tokenizer {tokenizer} has {size} tokens but {path} was exported for a vocabulary of "
                         f"{meta['vocab_size']} (get_vocab_size): it belongs to another target; pass the "
                         f"tokenizer.json of the target the .pte was exported from")


def _pairing_facts(path: pathlib.Path, manifest_hash: str, tokenizer: pathlib.Path) -> tuple[pathlib.Path, dict] | None:
    """(manifest, report.pairing) of an export artifact whose report's manifest_hash is the program's: the one
    beside the .pte, else one in the store whose target artifact holds the tokenizer (<store>/target/<key>/)."""
    candidates = [path.parent / MANIFEST]
    target_manifest = tokenizer.parent / MANIFEST
    if target_manifest.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads(target_manifest.read_text()).get("stage") == "target":
                candidates += sorted((tokenizer.parent.parent.parent / "export").glob(f"*/{MANIFEST}"))
    for manifest in candidates:
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            report = json.loads(manifest.read_text()).get("report") or {}
            if report.get("manifest_hash") == manifest_hash and isinstance(report.get("pairing"), dict):
                return manifest, report["pairing"]
    return None


_POOL_SIZED = False


def set_threads(n: int | None = None) -> int:
    """The CPU threads a .pte runs on: `n`, or the cores this process may use; set before the first program
    loads (size_runtime_pool takes torch's count then). -> the count."""
    from models.threads import usable_cores

    n = n or usable_cores()
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n
_POOL_NATIVE = re.compile(r"^\[(cpuinfo_utils\.cpp|threadpool\.cpp):\d+\]")  # the CPU probe, the resize


def size_runtime_pool() -> None:
    """Size ExecuTorch's CPU threadpool, which XNNPACK's kernels run on, to torch's thread count in this thread
    (what the pipeline's `threads` and the runner's `--threads` set), once per process, before its first
    program is loaded. A .pte's speed follows this pool (SmolLM2's decode on 2 cores: 38.7 ms with 1 pool
    thread, 21.4 ms with 2), and the runtime sizes it to the machine's cores on its own. Resizing it after a
    program has run is unsafe (`_unsafe_reset_threadpool`), so later loads keep it. While a program runs, torch's
    own count is one (`PteEngine._run`; models/threads.py says why)."""
    global _POOL_SIZED
    if _POOL_SIZED:
        return
    from executorch.extension.pybindings import portable_lib

    threads = torch.get_num_threads()
    with quiet.native_stderr(_POOL_NATIVE):  # the pool's creation probes the CPU
        if portable_lib._threadpool_get_thread_count() != threads:
            portable_lib._unsafe_reset_threadpool(threads)
    if threads > 1 and os.environ.get("OMP_NUM_THREADS") != "1":
        log.warning("OMP_NUM_THREADS is %s, not 1, since torch loaded before runner/: the program's custom ops "
                    "will open OpenMP teams beside the runtime's %d threads, and a verify call runs up to 3.7x "
                    "slower (models/threads.py); set OMP_NUM_THREADS=1 before Python starts, or import runner "
                    "before torch", os.environ.get("OMP_NUM_THREADS", "unset"), threads)
    _POOL_SIZED = True


class PteEngine(Engine):
    """One loaded ExecuTorch program. Its methods share the mutable KV caches, so one PteEngine serves any
    number of generations in sequence: every generation rewrites the cache from position 0. The file is
    checked against the manifest beside it before it is loaded (`check_pte`)."""

    def __init__(self, path: str | pathlib.Path, *, verified: bool = False, tokenizer: str | pathlib.Path | None = None):
        """`verified=True`: the caller has already checked the file against its manifest (the store does when
        it loads an artifact), so it is not hashed a second time. `tokenizer`: the tokenizer.json the caller
        encodes with, checked against the program (`check_tokenizer`)."""
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no .pte at {self.path}")
        check_program_file(self.path)
        self.checked = verified or check_pte(self.path)

        from executorch.runtime import Runtime

        from models.layers import load_llama_ops

        load_llama_ops()  # the llama:: kernels the program calls
        size_runtime_pool()

        ptd = self.path.with_suffix(".ptd")
        self.program = Runtime.get().load_program(
            self.path, data_path=ptd if ptd.is_file() else None
        )
        names = self.program.method_names
        missing = [m for m in (*PROGRAM_METHODS, *CONSTANT_METHODS.values(), "get_manifest_hash", "get_d2t")
                   if m not in names]
        if missing:
            raise ValueError(f"{self.path} lacks the methods {missing} (it has {sorted(names)}); "
                             f"re-export it with the export stage")
        self.meta = {key: _scalar(self._constant(method)[0]) for key, method in CONSTANT_METHODS.items()}
        chains = chain_methods(self.meta["max_m"])
        self.draft_chains = all(m in names for m in chains)  # export.draft_chains
        methods = PROGRAM_METHODS + (chains if self.draft_chains else ())
        with quiet.native_stderr():  # the first delegate init probes the CPU and reports ARM-only files
            self._methods = {name: self.program.load_method(name) for name in methods}
        self._calls = {name: method._method for name, method in self._methods.items()}  # the pybind methods
        self.meta["manifest_hash"] = str(self._constant("get_manifest_hash")[0])  # 64 hex chars (sha256)
        self.meta["d2t"] = self._constant("get_d2t")[0].to(torch.long).clone()
        self.meta["sliding_window"] = self.meta["sliding_window"] or None
        if tokenizer is not None:
            check_tokenizer(self.path, self.meta, tokenizer)

    def _constant(self, name: str):
        return self.program.load_method(name).execute([])

    def _run(self, name: str, *inputs):
        """One call of a method, its outputs copied out (the inputs are copied in: the caller may refill
        them), with this thread's OpenMP team at one: the program's custom ops would otherwise open a team of
        torch's size beside the runtime's pool (models/threads.py). The pybind method is called directly:
        the loop pays every µs between calls (bench.round)."""
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._calls[name](inputs)
        finally:
            torch.set_num_threads(n)

    def prefill(self, tokens, input_pos):
        return self._run("prefill", tokens, input_pos)

    def target_verify(self, tokens, input_pos):
        return self._run("target_verify", tokens, input_pos)

    def target_verify_exact(self, tokens, input_pos):
        return self._run("target_verify_exact", tokens, input_pos)

    def target_decode(self, tokens, input_pos):
        return self._run("target_decode", tokens, input_pos)

    def draft_decode(self, tokens, feature, input_pos):
        return self._run("draft_decode", tokens, feature, input_pos)

    def draft_chain(self, k, tokens, feature, input_pos):
        return self._run(f"draft_chain_{k}", tokens, feature, input_pos)[0]

    def reset(self) -> None:
        """Nothing to do: the loop writes every position it attends to, from 0, before reading it, and the mask
        hides slots beyond the query. (A fresh cache would need a second load_program.)"""


def exact_calls(target_verify, width: int):
    """Exact mode's target calls: (target_decode, target_verify) that run every call through `target_verify` (one
    whose rows do not depend on the call's start: the .pte's target_verify_exact, the CUDA engine's
    target_verify) at `width` rows: the call's rows, then copies of its last token at the next positions, whose
    outputs are dropped. In a call of one width a row's arithmetic is the same whichever row it is and whatever
    the call's other rows hold, so every K gives K=0's tokens bit for bit (`ExactEngine`). The padding rows write
    cache slots past the call's last position, which a later call rewrites before any query can see them."""

    def verify(tokens: torch.Tensor, input_pos: torch.Tensor):
        T, n = tokens.shape[-1], width - tokens.shape[-1]
        if n:
            tokens = torch.cat((tokens, tokens[:, -1:].expand(1, n)), dim=1)
            input_pos = torch.cat((input_pos, input_pos[-1:] + torch.arange(1, n + 1, device=input_pos.device)))
        ids, feature, logits = target_verify(tokens, input_pos)
        return ids[:, :T], feature[:, :T], logits[:, :T]

    def decode(tokens: torch.Tensor, input_pos: torch.Tensor):
        ids, _, logits = verify(tokens, input_pos)
        return ids, logits

    return decode, verify


class ExactEngine(Engine):
    """Exact mode (`engine.exact`) over the .pte or the eager modules: every K gives K=0's tokens bit for bit.

    A row's logits otherwise depend on the call it is in, in two ways, and an int4 target (8da4w rounds every
    linear's input to int8 per row) turns a 1e-7 difference into a whole step, so near ties flip:
    - the width: XNNPACK's GEMM takes other paths for other numbers of rows. After the prefill (the same
      call for every K) every target call, decode included, is one of `width` rows (`exact_calls`);
    - the key length: llama::custom_sdpa reduces over start + T keys, and the order of its sums follows
      that length. Every call is a `target_verify_exact`, whose attention (eagle3::exact_sdpa) runs each row
      over its own keys in one order.
    A row's arithmetic then depends on its position, its tokens and the cache alone. K is at most width - 1
    (`meta["max_m"]` = width), and the padding rows' slots take width - 1 positions of the cache
    (`meta["max_seq_len"]`). The price: K=0 decodes `width` rows instead of one."""

    def __init__(self, engine, width: int):
        max_m = engine.meta["max_m"]
        if not 2 <= width <= max_m:
            raise ValueError(f"exact width {width}: a target_verify of this program takes T in [2, {max_m}]")
        self.inner, self.width = engine, width
        self.meta = {**engine.meta, "max_m": width, "max_seq_len": engine.meta["max_seq_len"] - (width - 1),
                     "default_chain": min(engine.meta["default_chain"], width - 1), "exact_width": width}
        self.target_decode, self.target_verify = exact_calls(engine.target_verify_exact, width)
        self.draft_chains = engine.draft_chains

    def prefill(self, tokens, input_pos):
        return self.inner.prefill(tokens, input_pos)

    def draft_decode(self, tokens, feature, input_pos):
        return self.inner.draft_decode(tokens, feature, input_pos)

    def draft_chain(self, k, tokens, feature, input_pos):
        return self.inner.draft_chain(k, tokens, feature, input_pos)

    def reset(self) -> None:
        self.inner.reset()


def speculator_meta(speculator, *, max_m: int, default_chain: int, max_prefill_chunk: int, min_prefill_chunk: int,
                    manifest_hash: str = "") -> dict:
    """The `meta` of an engine over a models.Speculator: the windows given, the rest read off the modules."""
    target_cfg = speculator.target.cfg
    windows = [w for w in (target_cfg.sliding_window or []) if w]
    return {
        "max_m": max_m,
        "default_chain": default_chain,
        "max_seq_len": target_cfg.max_seq_len,
        "vocab_size": target_cfg.vocab_size,
        "draft_vocab_size": int(speculator.draft.d2t.numel()),
        "max_prefill_chunk": max_prefill_chunk,
        "min_prefill_chunk": min_prefill_chunk,
        "sliding_window": min(windows) if windows else None,
        "manifest_hash": manifest_hash,
        "d2t": speculator.draft.d2t.detach().to("cpu", torch.long).clone(),
    }


class EagerEngine(Engine):
    """`models.Speculator` run eagerly on `device` (CPU, or CUDA where the kernels plug in). Inputs and
    outputs are CPU tensors, like the .pte's. The prefill/verify bounds default to the export stage's."""

    draft_chains = True

    def __init__(self, speculator, *, max_m: int, default_chain: int, max_prefill_chunk: int,
                 min_prefill_chunk: int = 1, device: str | torch.device = "cpu", manifest_hash: str = ""):
        self.device = torch.device(device)
        self.spec = speculator.to(self.device).eval()
        self.spec.target.setup_cache(max_t=max(max_prefill_chunk, max_m))  # rings as the .pte's (models.target)
        self.meta = speculator_meta(speculator, max_m=max_m, default_chain=default_chain,
                                    max_prefill_chunk=max_prefill_chunk, min_prefill_chunk=min_prefill_chunk,
                                    manifest_hash=manifest_hash)

    @torch.no_grad()
    def _run(self, fn, *inputs):
        outputs = fn(*(x.to(self.device) for x in inputs))
        return tuple(out.to("cpu") for out in outputs)

    def prefill(self, tokens, input_pos):
        return self._run(self.spec.prefill, tokens, input_pos)

    def target_verify(self, tokens, input_pos):
        return self._run(self.spec.target_verify, tokens, input_pos)

    def target_verify_exact(self, tokens, input_pos):
        return self._run(self.spec.target_verify_exact, tokens, input_pos)

    def target_decode(self, tokens, input_pos):
        return self._run(self.spec.target_decode, tokens, input_pos)

    def draft_decode(self, tokens, feature, input_pos):
        return self._run(self.spec.draft_decode, tokens, feature, input_pos)

    def draft_chain(self, k, tokens, feature, input_pos):
        return self._run(lambda *x: (self.spec.draft_chain(*x, k),), tokens, feature, input_pos)[0]

    def reset(self) -> None:
        self.spec.reset()
