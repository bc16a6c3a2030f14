"""`CudaEngine`: `models.Speculator` on one CUDA device, every call of the decode loop a CUDA-graph replay.

It serves the engine interface of runner/engine.py unchanged, so runner/generate.py runs on it as on a .pte.

At load the Speculator moves to the device (bfloat16, or float32 for exactness checks). With `kernels=True`
the target and the draft go on the GPU kernels (kernels.transform: INT4 group `group` GEMMs, split-K SDPA,
fused norms and RoPE), built for `max_m`, the same number that sizes the .pte's verify window, so the dispatch
rule and the exported range cannot disagree. The draft's K-1 steps per round read its weights K-1 times, so
it gains from INT4 as the target does.

The windowed layers keep ring caches as the .pte's do (models.target: window + the widest call slots), with the
kernels too: sdpa_midm reads a ring through the target's slot positions, walking each row's positions in the
order and splits a flat cache would give them, so a ring changes no bit of a row.

INT4: the weights are quantised as loaded (float32 from the loaders: a GGUF's dequantised values) and only
then cast, because models.quantize.quantize_w4 keeps a GGUF's 4-bit blocks exactly only where it sees
them unrounded; bf16 rounding hides the grid and every block is quantised again. `dense` names linears kept
in bf16: at group 32 with a bf16 lm_head the INT4 target stays closest to the file (docs/results.md);
`target_dense` names more of the target's (engine.quant=w4_file: those its GGUF holds in 5 to 8 bits or in
float, which 4 bits would round a second time, so only the file's 4-bit tensors take the kernels). The
config's schemes (`engine.quant`) are these options under their names (models.choices.CUDA_QUANTS), and
runner.build builds this engine from the target and draft artifacts.

Then one graph is captured per call shape the loop makes: target_decode at T = 1, target_verify at every
T in [2, max_m], draft_decode at every T in [1, max_m] (seeding after a round takes a+1 <= max_m rows).
Any K in [1, max_m - 1] is then served without a recapture. A call copies its token ids and positions into
the graph's static input buffer in one host-to-device copy, replays, and copies the ids back: the ids are
what the loop decides on, so each call costs one host synchronisation. Features, g and logits stay on the
device as views of the graph's output buffers (valid until that graph's next replay, which the loop never
reaches before it has consumed them). Prefill runs eagerly: it happens once per prompt, at any length.

Rounds: for greedy decoding at a static K the loop hands the engine whole rounds (`speculate`), one graph per
K in [0, max_m - 1]: K-1 draft steps from the proposal and g the last round left on the device, target_verify
of [anchor] + proposals, the accepted length a as the leading run of matches, and the draft reseeded with all
K+1 verified rows, of which row a gives the next round's first proposal. The graph ends by copying a and the
verified ids to pinned host memory, so a round costs one launch and one synchronisation. K = 0, the
baseline, is a graph of the same kind around target_decode, so speedups compare like with like. Reseeding K+1 rows
instead of a+1 is what keeps the graph static: the rows past a sit at draft positions the next round's chain
overwrites before its causal mask could show them. Sampling and the adaptive policy use the per-call path.

Exact (`exact=True`): in bf16 a row's logits depend on the width of the call it is in, because the GEMM and
attention kernels are chosen by the number of rows and round differently; on a trained model a near tie then
takes the other token, and a K>0 output leaves the K=0 one (measured on the `gpu` preset: one prompt of three at
token 216). With exact, every target call, decode included, runs target_verify at the one width max_m: the
call's rows, then copies of its last token at the next positions. Each row's arithmetic is then the same in
every call, so every K gives K=0's tokens bit for bit. The padding rows write cache slots past the call's last
position, which a later call rewrites before any query can see them; the engine reports max_m - 1 fewer
positions (`meta["max_seq_len"]`) so that they stay inside the cache. The price is K=0's decode at width max_m
(and its taps). exact=False decodes at T = 1 and verifies at T = K+1.

Compile (`compile="inductor"`, `engine.compile`): the dense engine's per-width calls go through
`torch.compile` before capture, so each graph replays inductor's fused kernels instead of ~40 unfused ops a
layer; the compilation (a handful of graphs whatever max_m: `compiled`) is paid at load. Exact mode holds as
it does without: every call of a width runs the same compiled graph. The draft's compiled rounds accept as
the uncompiled ones do on Gemma 3 and 7-15% less on SmolLM2 (docs/results.md, "GPU: the real presets").

The draft's cache-gap guard reads positions on the host, which a graph cannot do: it is off here, and the
loop's own bookkeeping (runner.generate) keeps writes contiguous.

`graphs=False` runs the same buffers and calls eagerly; on a CPU that is how the tests check this engine
against `EagerEngine` without a GPU.
"""

from __future__ import annotations

import torch

from models import Speculator
from runner.engine import Engine, exact_calls, speculator_meta

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class _Call:
    """One method at one width T: static inputs, the outputs of its last run, and its graph (if captured)."""

    def __init__(self, fn, T: int, feature_dim: int | None, device: torch.device, dtype: torch.dtype):
        self.fn, self.T = fn, T
        pinned = device.type == "cuda"
        self.host_in = torch.zeros(2 * T, dtype=torch.long, pin_memory=pinned)  # tokens, then positions
        self.dev_in = torch.zeros(2 * T, dtype=torch.long, device=device)
        self.feature = None if feature_dim is None else torch.zeros(1, T, feature_dim, device=device, dtype=dtype)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, ...] = ()

    def _forward(self):
        tokens, pos = self.dev_in[: self.T].view(1, self.T), self.dev_in[self.T:]
        return self.fn(tokens, pos) if self.feature is None else self.fn(tokens, self.feature, pos)

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.out = self._forward()

    def run(self) -> None:
        """The staged inputs to the device in one copy, then the graph (or, without one, the eager calls)."""
        self.dev_in.copy_(self.host_in, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self._forward()

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, feature: torch.Tensor | None = None):
        self.host_in[: self.T].copy_(tokens.reshape(-1))
        self.host_in[self.T:].copy_(input_pos.reshape(-1))
        if feature is not None:
            self.feature.copy_(feature)
        self.run()
        ids = self.out[0].to("cpu")  # the one synchronisation of the call
        return (ids, *self.out[1:])


class _Round(_Call):
    """One greedy round at chain k, all on the device (module doc, "Rounds"). Input: the anchor and P; state
    kept on the device between rounds: the next first proposal and its g; output (to pinned host memory,
    inside the graph): [a, vids[0], ..., vids[k]], so new = vids[:a+1]."""

    def __init__(self, k: int, state: dict, device: torch.device, dtype: torch.dtype, target_decode, target_verify,
                 draft_decode):
        super().__init__(None, 1, None, device, dtype)
        self.k, self.state = k, state
        self.target_decode, self.target_verify, self.draft_decode = target_decode, target_verify, draft_decode
        self.host_out = torch.zeros(k + 2, dtype=torch.long, pin_memory=device.type == "cuda")

    def _forward(self):
        k, state = self.k, self.state
        anchor, P = self.dev_in[0:1].view(1, 1), self.dev_in[1]
        if k == 0:  # the baseline's step, with the same launch and synchronisation as a round
            ids, _ = self.target_decode(anchor, P.view(1))
            self.host_out.copy_(torch.cat((torch.zeros_like(ids[0]), ids[0])), non_blocking=True)
            return ()
        tok, g = state["next_id"], state["g"]
        props = [tok]
        for j in range(1, k):  # chain step j pairs proposal j-1 with the last g, at draft position P + j - 1
            ids, g, _ = self.draft_decode(props[-1], g, (P + (j - 1)).view(1))
            props.append(ids)
        props = torch.cat(props, dim=1)  # [1, k]
        pos = P + torch.arange(k + 1, device=P.device)
        vids, fv, _ = self.target_verify(torch.cat((anchor, props), dim=1), pos)
        a = (props == vids[:, :k]).long().cumprod(dim=1).sum(dim=1)  # [1]: the leading run of matches
        # reseed with all k+1 rows: rows <= a are the confirmed ones; the rows past a sit at positions the next
        # round's chain overwrites before its causal mask could show them
        ids, g_all, _ = self.draft_decode(vids, fv, pos)
        state["next_id"].copy_(ids.gather(1, a.view(1, 1)))
        state["g"].copy_(g_all.gather(1, a.view(1, 1, 1).expand(1, 1, g_all.shape[-1])))
        self.host_out.copy_(torch.cat((a, vids[0])), non_blocking=True)
        return ()

    def __call__(self, anchor: int, P: int) -> list[int]:
        self.host_in[0], self.host_in[1] = anchor, P
        self.run()
        if self.host_out.is_pinned():
            torch.cuda.current_stream(self.dev_in.device).synchronize()  # the one synchronisation of the round
        out = self.host_out.tolist()
        return out[1 : out[0] + 2]


def compiled(spec: Speculator, backend: str, max_m: int):
    """(target_decode, target_verify, draft_decode) of `spec`, each through `torch.compile(backend=backend)`
    unless the backend is "none", so the engine's CUDA graphs replay inductor's fused kernels (docs/results.md:
    on SmolLM2 616 against 287 tokens/s at K = 0). Dynamo's automatic dynamic shapes: a function's first
    width compiles static, its second once with the row count symbolic, which serves every later width, so
    the 2 * max_m captured widths compile a handful of graphs (six at most in tests/test_runner_cuda_engine.py)
    instead of one each (about 27 s apiece on Gemma 3). The prompt's wider calls stay eager (once per prompt).
    The recompile limit is raised to the widths captured, in case a backend specialises each one."""
    fns = (spec.target_decode, spec.target_verify, spec.draft_decode)
    if backend == "none":
        return fns
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * max_m)
    return tuple(torch.compile(fn, backend=backend) for fn in fns)


class CudaEngine(Engine):
    """The engine interface over a Speculator on `device`, with one CUDA graph per call shape (module doc)."""

    def __init__(self, speculator: Speculator, *, max_m: int, default_chain: int, max_prefill_chunk: int,
                 min_prefill_chunk: int = 1, device: str | torch.device = "cuda", dtype: str = "bfloat16",
                 kernels: bool = False, group: int = 128, dense: tuple[str, ...] = (),
                 target_dense: tuple[str, ...] = (), graphs: bool = True,
                 exact: bool, compile: str = "none", manifest_hash: str = ""):
        from kernels.rule import check_max_m

        if dtype not in DTYPES:
            raise ValueError(f"CudaEngine dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}; pass graphs=False")
        if compile != "none" and kernels:
            raise ValueError(f"compile={compile!r} takes the dense engine (kernels off): inductor around the INT4 "
                             "kernels is not built")
        if kernels and (self.device.type != "cuda" or dtype != "bfloat16"):
            raise ValueError(f"the GPU kernels take bfloat16 on CUDA; got dtype={dtype} on {self.device}")
        check_max_m(max_m)
        self.dtype = DTYPES[dtype]
        spec = speculator.to(self.device).eval()
        spec.target.setup_cache(max_t=max(max_prefill_chunk, max_m))  # rings (module doc), before the kernels swap
        if kernels:  # quantised from the weights as loaded (module doc, "INT4"), then the rest to bf16
            from kernels.transform import to_kernels

            to_kernels(spec.target, max_m=max_m, group=group, dense=tuple(dense) + tuple(target_dense))
            to_kernels(spec.draft, max_m=max_m, group=group, dense=dense)
        spec = spec.to(self.dtype)
        spec.draft.check_gaps = False
        self.spec = spec
        self.meta = speculator_meta(spec, max_m=max_m, default_chain=default_chain,
                                    max_prefill_chunk=max_prefill_chunk, min_prefill_chunk=min_prefill_chunk,
                                    manifest_hash=manifest_hash)
        target_decode, target_verify, draft_decode = compiled(spec, compile, max_m)
        decode, verify = exact_calls(target_verify, max_m) if exact else (target_decode, target_verify)
        if exact:  # the width every target call runs at, as runner.engine.ExactEngine reports it (the eval's metric)
            self.meta["max_seq_len"] -= max_m - 1  # the padding rows' slots
            self.meta["exact_width"] = max_m
        H = spec.draft.cfg.hidden_size
        self.decode = _Call(decode, 1, None, self.device, self.dtype)
        self.verify = {T: _Call(verify, T, None, self.device, self.dtype) for T in range(2, max_m + 1)}
        self.draft = {T: _Call(draft_decode, T, H, self.device, self.dtype) for T in range(1, max_m + 1)}
        self.state = {"next_id": torch.zeros(1, 1, dtype=torch.long, device=self.device),
                      "g": torch.zeros(1, 1, H, device=self.device, dtype=self.dtype)}
        self.rounds = {k: _Round(k, self.state, self.device, self.dtype, decode, verify, draft_decode)
                       for k in range(0, max_m)}
        self.graphs = graphs
        with torch.no_grad():
            if graphs:
                self._capture()
            self.reset()

    def calls(self) -> list[_Call]:
        return [self.decode, *self.verify.values(), *self.draft.values(), *self.rounds.values()]

    def _capture(self) -> None:
        """Run every call once eagerly on a side stream (the kernels compile and allocate their counters
        there), then capture each into a graph sharing one memory pool (replays never overlap)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for call in self.calls():
                call._forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for call in self.calls():
            call.capture(pool, stream)
        torch.cuda.synchronize(self.device)

    def _window(self, table: dict, tokens: torch.Tensor, method: str) -> _Call:
        T = tokens.shape[-1]
        if T not in table:
            raise ValueError(f"{method} takes T in [{min(table)}, {max(table)}] rows (max_m={self.meta['max_m']}); "
                             f"got T={T}")
        return table[T]

    @torch.no_grad()
    def prefill(self, tokens, input_pos):
        next_id, feature, logits = self.spec.prefill(tokens.to(self.device), input_pos.to(self.device))
        return next_id.to("cpu"), feature, logits

    @torch.no_grad()
    def target_verify(self, tokens, input_pos):
        return self._window(self.verify, tokens, "target_verify")(tokens, input_pos)

    @torch.no_grad()
    def target_decode(self, tokens, input_pos):
        if tokens.shape[-1] != 1:
            raise ValueError(f"target_decode takes T=1; got T={tokens.shape[-1]}")
        return self.decode(tokens, input_pos)

    @torch.no_grad()
    def draft_decode(self, tokens, feature, input_pos):
        if tokens.shape[-1] in self.draft:
            return self.draft[tokens.shape[-1]](tokens, input_pos, feature)
        # seeding with a prompt's features: wider than any round, once per prompt, so eager
        ids, g, logits = self.spec.draft_decode(tokens.to(self.device), feature.to(self.device, self.dtype),
                                                input_pos.to(self.device))
        return ids.to("cpu"), g, logits

    # --- rounds on the device (the Engine protocol's optional capability: runner.generate uses them for
    # greedy decoding with a static K) ----------------------------------------------------------------------
    device_rounds = True

    def begin_rounds(self, first_id: int, g: torch.Tensor) -> None:
        """The first proposal after seeding the draft with the prompt, and the g it came with."""
        self.state["next_id"].fill_(int(first_id))
        self.state["g"].copy_(g.reshape(1, 1, -1))

    @torch.no_grad()
    def speculate(self, k: int, anchor: int, P: int) -> list[int]:
        """One greedy round at chain k from the anchor at P: -> new = props[:a] + [correction or bonus]
        (k = 0: the target's next token alone)."""
        if k not in self.rounds:
            raise ValueError(f"speculate takes k in [0, {max(self.rounds)}] (max_m={self.meta['max_m']}); got k={k}")
        return self.rounds[k](anchor, P)

    def reset(self) -> None:
        self.spec.reset()
