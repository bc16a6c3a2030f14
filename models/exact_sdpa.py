"""`eagle3::exact_sdpa`: cached attention whose rows' bits do not depend on the call they are in.

Row t attends the keys of its KV head from max(0, pos[t] - window + 1) (window 0: from 0) to pos[t], one key
after another in position order (on a ring cache of `ring` slots, position j at slot j % ring: the same keys in
the same order as in a flat cache, so a ring changes no bit), so a position gives the same bits in a decode, in
any verify window and in a prefill, which is what the .pte's exact mode needs (docs/design.md §4), and the call costs its context, not the
cache: llama::custom_sdpa gives call-independent rows only under a mask over every cache slot, which cost
SmolLM2's exact call 9.1 of its 24.6 ms (docs/design.md §4).

Two halves, one definition: the op for torch (a PyTorch reference for eager runs and export, a fake for
tracing) and its ExecuTorch kernel (exact_sdpa.cpp), compiled on first use by native.compiler and registered with
this process's runtime by `load_kernel` (runner.engine.PteEngine does it through models.layers.load_llama_ops).
This module holds the op's definition and that registration only; finding a compiler and building the library is
native.compiler's. The reference and the kernel agree to float32 rounding; only the kernel's bits are
call-independent, and only the kernel runs in a .pte.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch.library import Library

from native.compiler import kernel_library

SOURCE = Path(__file__).with_name("exact_sdpa.cpp")

_lib = Library("eagle3", "FRAGMENT")
_lib.define("exact_sdpa(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, int window, float scale, "
            "int ring=0) -> Tensor")
_lib.define("exact_sdpa.out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, int window, float scale, "
            "int ring=0, *, Tensor(a!) out) -> Tensor(a!)")


def reference(q, k_cache, v_cache, input_pos, window: int, scale: float, ring: int = 0) -> torch.Tensor:
    """q [1, T, Hq, D] over the caches [1, S, Hkv, D] -> [1, T, Hq, D]: softmax over the visible keys (`ring` > 0:
    the caches are a ring of S = ring slots, position j at slot j % ring, and window is in [1, ring])."""
    S, G = k_cache.shape[1], q.shape[2] // k_cache.shape[2]
    j = torch.arange(S, device=q.device)
    if ring > 0:  # slot j holds the row's position pos - back, back = (pos - j) % ring
        back = (input_pos[:, None] - j[None, :]) % ring
        visible = (back < window) & (back <= input_pos[:, None])
    else:
        visible = j[None, :] <= input_pos[:, None]
        if window > 0:
            visible = visible & (j[None, :] > input_pos[:, None] - window)
    k = k_cache[0].repeat_interleave(G, dim=1).float()  # [S, Hq, D]
    v = v_cache[0].repeat_interleave(G, dim=1).float()
    s = torch.einsum("thd,shd->hts", q[0].float(), k) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", p, v).unsqueeze(0).to(q.dtype).contiguous()


def _out(q, k_cache, v_cache, input_pos, window, scale, ring=0, *, out):
    out.copy_(reference(q, k_cache, v_cache, input_pos, window, scale, ring))
    return out


_lib.impl("exact_sdpa", reference, "CompositeExplicitAutograd")
_lib.impl("exact_sdpa.out", _out, "CompositeExplicitAutograd")
torch.library.register_fake("eagle3::exact_sdpa")(lambda q, k, v, pos, window, scale, ring=0: torch.empty_like(q))


_loaded: ctypes.CDLL | None = None


def load_kernel() -> None:
    """Register eagle3::exact_sdpa.out with this process's ExecuTorch runtime (once)."""
    global _loaded
    if _loaded is None:
        _loaded = ctypes.CDLL(str(kernel_library(SOURCE)), mode=ctypes.RTLD_GLOBAL)
