"""Building blocks shared by the target and the draft: RMSNorm, RoPE, attention with a static KV cache, the
gated MLP (SwiGLU, or GeGLU with tanh-GELU for Gemma).

Each Gemma difference is an option whose default is the Llama behaviour (the draft uses none of them):
RMSNorm(unit_offset), Attention(scale, softcap, norm_unit_offset), MLP(act).

Export notes (torch.export with a dynamic T, then ExecuTorch):
- every projection is a plain `nn.Linear` so a quantiser/kernel helper can swap it by type;
- the attention math lives in one method, `Attention.attend(q, k, v, mask)`, so a kernel can replace it;
- the cached path has two implementations of one function, chosen per model by `set_kv_impl` (the seam
  through which the export swaps attention, as ExecuTorch's llama export swaps its SDPA module):
  "index_copy" (the default, the reference): the cache is a registered (non-persistent) buffer
  [B, n_kv_heads, max_seq_len, head_dim] written with `index_copy_` at `input_pos`; attention runs over the
  whole buffer, and the boolean mask (built from `input_pos` and an arange over max_seq_len) hides empty
  and stale slots, so no shape depends on the data.
  "llama_ops" (what the .pte runs): ExecuTorch's own LLM ops. The cache is [B, max_seq_len, n_kv_heads,
  head_dim], written by `llama::update_cache` at start = input_pos[0], and `llama::custom_sdpa` attends
  causally from that start (GQA without copies of K/V, and only over the keys 0..start+T-1) or, on a
  windowed layer, under an additive float mask [T, max_seq_len] built once per call; an exact call
  (`exact`) attends through `eagle3::exact_sdpa` (models.exact_sdpa) instead. Its invariant:
  input_pos is contiguous, arange(start, start+T) (the runner's every call). The ops have CPU kernels in
  torch too, so the eager model runs the same path (tests compare the two implementations).
  The cached path is for inference: its K/V writes are detached (no gradient flows through the cache);
  training uses the stateless path.
- a windowed layer's cache may be a ring (`setup_cache(..., ring=True)`, which models.target decides): its
  slots hold position p in slot p % slots, and the model passes such a layer the slots of the call's rows in
  place of input_pos, with a mask built from the position each slot holds (`cached_mask(..., ring=True)`).
  "index_copy" writes the slots with the same `index_copy_`; "llama_ops" with `llama::update_cache_with_indices`
  and attends over every slot under the float mask; the exact op walks the row's positions in order, each at
  its slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ACTIVATIONS

KV_IMPLS = ("index_copy", "llama_ops")


def load_llama_ops() -> None:
    """Register ExecuTorch's llama:: ops (update_cache, custom_sdpa) with torch, and their kernels with the
    ExecuTorch runtime of this process (executorch's libcustom_ops_aot_lib carries both): needed before
    tracing the "llama_ops" path and before loading a .pte that calls them."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    from models import exact_sdpa, quiet

    quiet.install()  # its KNOWN_WARNINGS hold update_cache's deprecation warning, raised on every trace
    exact_sdpa.load_kernel()  # and ours: eagle3::exact_sdpa, the exact calls' attention


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale (weight applied in input dtype).

    unit_offset=True is HF Gemma3RMSNorm: normalise in float32, scale by (1 + weight) in float32, then cast
    back; its weight starts at zeros, so a fresh norm scales by 1 in both forms.

    `set_fc_mean(True)` computes the mean of squares as a linear layer with a constant [1, dim] weight of
    1/dim (the same sum in another order: equal to float32 rounding): XNNPACK takes a fully-connected op
    over any leading shape, but a mean only over the last two dims of a 4-D tensor, so with the plain mean
    every norm of an exported method ran outside the delegate and split it in two. The export uses it.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.mean_weight = None

    def set_fc_mean(self, on: bool) -> None:
        w = self.weight
        self.mean_weight = torch.full((1, w.shape[0]), 1.0 / w.shape[0], device=w.device) if on else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x2 = x32.pow(2)
        ms = x2.mean(-1, keepdim=True) if self.mean_weight is None else F.linear(x2, self.mean_weight)
        x32 = x32 * torch.rsqrt(ms + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")


def rope_inv_freq(rot_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (default, linear, llama3)."""
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return inv
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_ctx = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not implemented")


class Rope(nn.Module):
    """cos/sin tables [max_seq_len, rot_dim] (non-persistent buffers), indexed by absolute position.

    rot_dim = int(head_dim * partial_rotary_factor); only the first rot_dim channels of each head rotate
    (HF rotate_half layout), the rest pass through.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, partial_rotary_factor: float = 1.0,
                 rope_scaling: dict | None = None):
        super().__init__()
        self.rot_dim = int(head_dim * partial_rotary_factor)
        self.head_dim = head_dim
        inv = rope_inv_freq(self.rot_dim, theta, rope_scaling)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.int64).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[pos], self.sin[pos]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) of the two halves, taken as slices (XNNPACK takes slice_copy, not the split of chunk)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, hd], cos/sin [T, rot_dim] (float32 tables, cast to x's dtype)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def start_position(input_pos: torch.Tensor, length: int):
    """input_pos[0] as an int (a symbol under export, checked in [0, length - T]) for the llama ops' start."""
    start = input_pos[0].item()
    torch._check(start >= 0)
    torch._check(start < length)
    torch._check(start + input_pos.shape[0] <= length)
    return start


def rotate_half_weight(dim: int) -> torch.Tensor:
    """[dim, dim] W with F.linear(x, W) == rotate_half(x) exactly (one +-1 per row: every product but one is
    a zero): XNNPACK takes a linear over a dynamic T, but not the slices (or the split) of rotate_half."""
    half = dim // 2
    w = torch.zeros(dim, dim)
    w[torch.arange(half), torch.arange(half) + half] = -1.0
    w[torch.arange(half) + half, torch.arange(half)] = 1.0
    return w


class Attention(nn.Module):
    """Grouped-query attention with optional qkv/o bias, per-head QK-norm (Qwen3, Gemma 3) and a static KV cache.

    `scale` multiplies q.k (None: head_dim ** -0.5); `softcap` soft-caps the scaled scores,
    tanh(s / softcap) * softcap, before the mask (None: off); `norm_unit_offset` makes the QK-norms Gemma's.

    `forward(x, cos, sin, mask, input_pos)`:
      input_pos None -> stateless: keys are this call's keys (any batch), mask [T, T];
      input_pos [T]  -> K/V written into the cache at input_pos, then attention over the whole cache,
                        mask [T, cache length]; the batch is the cache's (1 unless `setup_cache` says).
    """

    def __init__(self, in_dim: int, out_dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 max_seq_len: int, *, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
                 eps: float = 1e-6, scale: float | None = None, softcap: float | None = None,
                 norm_unit_offset: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        self.q_proj = nn.Linear(in_dim, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, out_dim, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps, norm_unit_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, norm_unit_offset) if qk_norm else None
        self.kv_impl = "index_copy"
        # a buffer, not a plain attribute: a graph that runs the layer several times (a draft chain) lifts it
        # under one name, which the lowered program finds as a buffer
        self.register_buffer("rotate_weight", None, persistent=False)
        self.setup_cache(1, max_seq_len)

    def setup_cache(self, batch_size: int, length: int, ring: bool = False) -> None:
        """(Re)allocate the cache as zeros (non-persistent): [batch_size, n_kv_heads, length, head_dim] for
        "index_copy", [batch_size, length, n_kv_heads, head_dim] for "llama_ops". `ring`: the `length` slots
        are a ring (module docstring): the layer is given slots, not positions, and writes there."""
        self.ring = ring
        like = self.q_proj.weight
        shape = ((batch_size, self.n_kv_heads, length, self.head_dim) if self.kv_impl == "index_copy" else
                 (batch_size, length, self.n_kv_heads, self.head_dim))
        self.register_buffer("k_cache", torch.zeros(shape, dtype=like.dtype, device=like.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=like.dtype, device=like.device), persistent=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, in] -> q [B, h, T, hd], k, v [B, kv, T, hd] with RoPE applied to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(softcap(q k^T * scale), masked) v.  q [B,h,T,hd], k/v [B,kv,S,hd], mask bool [T,S] -> [B,h,T,hd].

        The one place the attention math lives (a kernel may replace it). Soft-capping (when set) comes
        before the mask and the softmax runs in float32, as in HF's eager attention.
        """
        B, h, T, hd = q.shape
        kv, S, rep = k.shape[1], k.shape[2], q.shape[1] // k.shape[1]
        if is_tracing():  # export: the repeated cache (splitting the symbolic T into rep * T rows breaks its guards)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:  # eager: the rep query heads of a KV head as one block of rep * T rows, the cache never copied
            q = q.reshape(B, kv, rep * T, hd)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(B, h, T, S).masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        if not is_tracing():
            p = p.view(B, kv, rep * T, S)
        return torch.matmul(p, v).view(B, h, T, hd)

    def cache_size(self) -> tuple[int, int]:
        """(batch, length) of the cache, whatever its layout."""
        return self.k_cache.shape[0], self.k_cache.shape[2 if self.kv_impl == "index_copy" else 1]

    def set_kv_impl(self, impl: str) -> None:
        """Switch the cached path's implementation (module docstring); the cache is reallocated empty, same
        batch and length. "llama_ops" has no soft-cap: a soft-capped layer is refused."""
        if impl not in KV_IMPLS:
            raise ValueError(f"kv_impl {impl!r}: supported are {KV_IMPLS}")
        if impl == "llama_ops" and self.softcap is not None:
            raise ValueError("kv_impl 'llama_ops' has no attention soft-cap (llama::custom_sdpa); keep 'index_copy'")
        if impl == "llama_ops":
            load_llama_ops()
        self.rotate_weight = rotate_half_weight(self.head_dim).to(self.q_proj.weight) if impl == "llama_ops" else None
        batch, length = self.cache_size()
        self.kv_impl = impl
        self.setup_cache(batch, length, self.ring)

    def forward_llama_ops(self, x, cos, sin, mask, input_pos):
        """The cached path on ExecuTorch's llama ops (`input_pos`: the positions [T], or the start position
        as an int, which the models compute once per call with `start_position`; on a ring, the rows' slots
        [T]): q/k/v stay [B, T, heads, hd] (the ops' layout, no transposes), RoPE broadcasts over the heads, K/V
        go into the cache at start = input_pos[0] (a ring: at the slots, and start 0), and custom_sdpa attends
        causally from start (mask None) or under the additive float mask [T, S]."""
        B, T, _ = x.shape  # views name T as -1: XNNPACK takes a reshape with one inferred dim, none with a symbol
        q = self.q_proj(x).view(B, -1, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, -1, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, -1, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rot] (the models pass them so, once per call)
        if cos.shape[-1] == self.head_dim:  # rotate_half as a linear (rotate_half_weight)
            c, s_ = cos.to(q.dtype), sin.to(q.dtype)
            q = q * c + F.linear(q, self.rotate_weight) * s_
            k = k * c + F.linear(k, self.rotate_weight) * s_
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not is_tracing():
            k, v = k.detach(), v.detach()
        if self.ring:
            start, slots = 0, input_pos.view(1, -1)
            torch.ops.llama.update_cache_with_indices(k, self.k_cache, start, slots)
            torch.ops.llama.update_cache_with_indices(v, self.v_cache, start, slots)
        else:
            start = (input_pos if isinstance(input_pos, (int, torch.SymInt)) else
                     start_position(input_pos, self.k_cache.shape[1]))
            torch.ops.llama.update_cache(k, self.k_cache, start)
            torch.ops.llama.update_cache(v, self.v_cache, start)
        if isinstance(mask, RowPositions):  # exact: each row over its own keys, in one order (models.exact_sdpa)
            out = torch.ops.eagle3.exact_sdpa(q, self.k_cache, self.v_cache, mask.q_pos, mask.window, self.scale,
                                              self.k_cache.shape[1] if self.ring else 0)
        else:
            out = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, start, mask, 0.0, mask is None,
                                              self.scale)
        return self.o_proj(out.view(B, -1, self.n_heads * self.head_dim))

    def forward(self, x, cos, sin, mask, input_pos=None):
        if input_pos is not None and self.kv_impl == "llama_ops":
            return self.forward_llama_ops(x, cos, sin, mask, input_pos)
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if input_pos is not None:
            if not is_tracing():
                # The cached path is inference-only: never let a cache buffer join an autograd graph
                # (it would keep every step's graph alive). Under export the graph has no autograd anyway.
                k, v = k.detach(), v.detach()
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
            k, v = self.k_cache, self.v_cache
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def reset_cache(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()


SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: HF's gelu_pytorch_tanh, F.gelu(x, approximate="tanh"), in float32 as torch's
    kernel computes it, cast back to x's dtype.

    Written out in elementwise ops because ExecuTorch's XNNPACK delegate lowers aten.gelu as the exact (erf)
    GELU whatever its `approximate` argument (up to ~5e-4 apart): spelled out, the exported program and the
    eager module compute the same function.
    """
    x32 = x.float()
    y = 0.5 * x32 * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x32 + 0.044715 * (x32 * x32 * x32))))
    return y.to(x.dtype)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act "silu" is SwiGLU, "gelu_pytorch_tanh" Gemma's GeGLU
    (`gelu_tanh`, HF's GELUTanh)."""

    def __init__(self, dim: int, hidden: int, act: str = "silu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"MLP activation {act!r} is not implemented (supported: {ACTIVATIONS})")
        self.act = act
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.act == "silu" else gelu_tanh(gate)
        return self.down_proj(gate * self.up_proj(x))


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, ring: bool = False) -> torch.Tensor:
    """bool [T, S]: key visible iff k_pos <= q_pos (and k_pos > q_pos - window for a windowed layer); on a ring
    k_pos is the position each slot holds, -1 for a slot never written, which no row sees."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    if ring:
        mask = mask & (k_pos[None, :] >= 0)
    return mask


@dataclass(frozen=True)
class RowPositions:
    """The "mask" of an exact call on the llama ops: each row's position (and the layer's window, 0 = none);
    the layer attends through models.exact_sdpa, each row over its own visible keys in position order."""
    q_pos: torch.Tensor
    window: int


def cached_mask(kv_impl: str, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, *,
                exact: bool = False, ring: bool = False):
    """The mask a cached call's layers of one window take, built once per call and shared by them:
    "index_copy": bool [T, S] (attention_mask); "llama_ops": None for a causal layer (custom_sdpa's own
    causal rule from input_pos[0]), an additive float32 mask [T, S] (0 / -inf) for a windowed one, and with
    `exact` RowPositions: custom_sdpa reduces over start + T keys without a mask and over all S with one,
    so only the exact op keeps a row's arithmetic independent of where its call starts at the context's cost.
    `ring`: k_pos is the ring's slot positions (attention_mask)."""
    if kv_impl == "index_copy":
        return attention_mask(q_pos, k_pos, window, ring)
    if exact:
        return RowPositions(q_pos, window or 0)
    if window is None:
        return None
    return torch.where(attention_mask(q_pos, k_pos, window, ring), 0.0, float("-inf")).to(torch.float32)


def set_fc_mean(model: nn.Module, on: bool) -> int:
    """RMSNorm.set_fc_mean on every norm of `model`; -> how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.set_fc_mean(on)
    return len(norms)


def set_kv_impl(model: nn.Module, impl: str) -> int:
    """Switch every Attention in `model` to `impl` (caches reallocated empty); -> how many."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.set_kv_impl(impl)
    return len(layers)


def is_capturing() -> bool:
    """True while a CUDA graph is being captured: a host read of a device value (a guard) must skip."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def is_tracing() -> bool:
    """True under torch.compile / torch.export (strict or not): data-dependent Python checks must skip."""
    compiler = torch.compiler
    if compiler.is_compiling():
        return True
    is_exporting = getattr(compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())
