"""llama.cpp through llama-cpp-python, in a process that need not import torch: loading a GGUF, timed greedy
generation (without drafting, or with its prompt-lookup drafting), and the held-out loss and agreement of every row's
logits. bench.peers times these on the CPU beside our .pte; bench.cuda_engine's `real` mode runs them in a
child process (`python -m bench.llama_run < job.json`), because llama.cpp's CUDA build and torch's CUDA wheels
do not share one: with torch 2.11 imported, its first decode aborts (`free(): invalid pointer`; one H200,
2026-12-05, with and without OpenMP), while the same build decodes in a process of its own.

The job (JSON on stdin): {"path", "prompts": [[ids]], "new_tokens", "gpu_layers", "threads", "pld": [k, ...],
"windows": [[ids]], "agree": [[ids]], "prompt_len"}; the answer (JSON on stdout): {"load_s", "rows": {name:
{"outputs", "tokens_per_s", "decode_tokens_per_s"}}, "quality": {"loss", "greedy_agreement"}} (quality only
where windows are given).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

PLD_K = (2, 4, 8)  # llama.cpp's prompt-lookup draft lengths every bench times


@contextlib.contextmanager
def extra_buffer_types(enabled: bool):
    """llama.cpp's `use_extra_bufts` model parameter (its AMX and repacked-weight buffers) for the models loaded
    inside the block; llama-cpp-python does not expose it, so its default-parameters function is wrapped.

    Off by default here: llama-cpp-python 0.3.36 built with GGML_NATIVE on this CPU (amx_int8) repacks Q4_1 and
    Q8_0 weights into AMX buffers and then segfaults in its first decode; without extra buffers it runs the
    same weights through its AVX-512 kernels."""
    import llama_cpp.llama_cpp as lib

    saved = lib.llama_model_default_params

    def params():
        p = saved()
        p.use_extra_bufts = enabled
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = saved


def load(path: Path, *, threads: int, n_ctx: int, gpu_layers: int = 0, logits_all: bool = False, draft=None,
         extra_bufts: bool = False):
    """llama_cpp.Llama on `path` (gpu_layers -1: every layer on the GPU of a CUDA build), its load chatter
    dropped (verbose=False still prints through native code)."""
    from llama_cpp import Llama

    from models import quiet

    with quiet.native_stderr(drop=re.compile(".")), extra_buffer_types(extra_bufts):
        return Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx,
                     logits_all=logits_all, verbose=False, draft_model=draft, n_gpu_layers=gpu_layers)


def prompt_lookup(k: int):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaPromptLookupDecoding(num_pred_tokens=k)


def timed_generate(llm, prompt: list[int], n: int) -> dict:
    """n greedy tokens after `prompt`: the tokens, the decode clock (from the first token generate() yields,
    i.e. prefill done, to the last; n - 1 tokens) and llama.cpp's own eval counters of the call."""
    import llama_cpp

    llm.reset()
    ctx = llm._ctx.ctx
    llama_cpp.llama_perf_context_reset(ctx)
    out, t0 = [], None
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if t0 is None:
            t0 = time.perf_counter()
        out.append(int(tok))
        if len(out) == n:
            break
    t1 = time.perf_counter()
    p = llama_cpp.llama_perf_context(ctx)  # one-token decodes count as eval, longer batches as prompt
    return {"tokens": out, "decode_tokens": len(out) - 1, "decode_s": t1 - t0,
            "perf": {"eval_ms": p.t_eval_ms, "n_eval": p.n_eval, "batch_eval_ms": p.t_p_eval_ms,
                     "n_batch_tokens": p.n_p_eval}}


def row_logits(llm, ids: list[int]):
    """Every row's logits [len(ids), V] (numpy float32) of one batched eval; `llm` loaded with logits_all."""
    llm.reset()
    llm.eval(ids)
    return llm.scores[: len(ids)].copy()


def nll(logits, targets: list[int]) -> float:
    """Summed -log p(target) over rows of logits [n, V] (float64 log-softmax)."""
    import numpy as np

    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return float((lse - x[np.arange(len(targets)), targets]).sum())


def quality(logits_of, windows: list[list[int]], agree: list[list[int]], prompt_len: int) -> dict:
    """A model's quality from `logits_of(ids)` (every row's logits, numpy [len(ids), V]; `row_logits` for
    llama.cpp): the mean next-token loss over the windows, and the share of the positions after prompt_len in
    `agree` (a reference model's greedy continuations) whose argmax is the reference's token (teacher-forced:
    every position sees the same context)."""
    import numpy as np

    total = sum(nll(logits_of(ids)[:-1], ids[1:]) for ids in windows)
    shares = [float((logits_of(ids)[prompt_len - 1:-1].argmax(axis=1) == np.asarray(ids[prompt_len:])).mean())
              for ids in agree]
    return {"loss": round(total / sum(len(w) - 1 for w in windows), 4),
            "greedy_agreement": round(sum(shares) / len(shares), 4) if shares else math.nan}


def run_job(job: dict) -> dict:
    path, prompts, n = Path(job["path"]), job["prompts"], job["new_tokens"]
    gpu, threads = job.get("gpu_layers", 0), job.get("threads", 4)
    n_ctx = max(map(len, prompts)) + n + 16 + max(PLD_K)
    t = time.perf_counter()
    systems = {path.name: load(path, threads=threads, n_ctx=n_ctx, gpu_layers=gpu)}
    load_s = time.perf_counter() - t
    for k in job.get("pld", PLD_K):
        systems[f"{path.name} pld k={k}"] = load(path, threads=threads, n_ctx=n_ctx, gpu_layers=gpu,
                                                 draft=prompt_lookup(k))
    rows = {}
    for name, llm in systems.items():
        timed_generate(llm, prompts[0], 16)  # warm
        outs, whole, tokens, secs = [], 0.0, 0, 0.0
        for ids in prompts:
            t = time.perf_counter()
            r = timed_generate(llm, ids, n)
            whole += time.perf_counter() - t
            outs.append(r["tokens"])
            tokens, secs = tokens + r["decode_tokens"], secs + r["decode_s"]
        rows[f"llama.cpp {name}"] = {"outputs": outs, "tokens_per_s": sum(map(len, outs)) / whole,
                                     "decode_tokens_per_s": tokens / secs}
    out = {"load_s": round(load_s, 1), "rows": rows}
    if job.get("windows"):
        n_ctx = max(map(len, job["windows"] + job.get("agree", []))) + 16
        llm = load(path, threads=threads, n_ctx=n_ctx, gpu_layers=gpu, logits_all=True)
        out["quality"] = quality(functools.partial(row_logits, llm), job["windows"], job.get("agree", []),
                                 job.get("prompt_len", 0))
    return out


def in_child(job: dict, timeout: float = 900) -> dict:
    """run_job in a fresh Python process that imports llama_cpp and not torch (module doc)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "bench.llama_run"], input=json.dumps(job), capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's child process exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            usage="python -m bench.llama_run < job.json > answer.json").parse_args(argv)
    print(json.dumps(run_job(json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
