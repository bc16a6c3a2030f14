"""Put a models/ transformer on the GPU kernels: INT4 small-M GEMM for every linear, split-K SDPA for
cached attention with T <= max_m.

`to_kernels(model, max_m, group)` works in place and returns the model:
- every `nn.Linear` becomes an `Int4Linear` (packed weights + per-group scale/zero buffers, bias kept);
  its forward is `dispatch.int4_linear`, i.e. the kernel for <= max_m rows, dequantise + dense above;
  with fuse=True (the default) the linears that read one input (q/k/v, gate/up) share one GEMM; a linear named
  in `dense` (by its name in the model: "lm_head", "layers.3.mlp.down_proj") keeps its weights, and the
  linears it shares an input with are then not fused (one GEMM holds one precision);
- every `models.layers.Attention` gets a subclass whose `forward` records `input_pos` for the duration of
  the call and whose `attend` runs `dispatch.attention` (sdpa_midm for T <= max_m, torch SDPA above) on
  the cached path; the stateless path (input_pos None) keeps the model's own attention. A ring layer
  (models.target: the windowed layers after `setup_cache(max_t=...)`, called before this transform) is given
  its rows' slots; it reads their positions and every slot's from its Transformer's `slot_pos`, which the model
  has written for the call (write_slots) before any layer runs;
- with norm_rope=True (the default) every `RMSNorm` (Gemma's (1 + w) ones too), the attention's RoPE of q
  and k and the MLP's gated product (SwiGLU, or Gemma's GeGLU) run as one launch each (kernels.norm_rope: the same values, 5 launches where the model's code makes
  30 per layer).
The model's own code (cache writes, masks, the layer loop) is untouched: only the math behind `attend`,
the linears, the norms, RoPE and the gated product changes (Gemma 3's other options, QK-norm, the attention
scale, the embedding scale and the per-layer RoPE bases, are the model's own code around these calls). Move the model to CUDA in bfloat16 before or
after; the kernels need bf16 activations.
Run one eager forward before capturing a CUDA graph: it compiles the kernels and allocates the split-K
arrival counters (kernels.int4_launch.counters) outside the capture.
Out of scope: embeddings stay bf16; batch > 1 on the cached path (the model refuses it anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from kernels._jit import note_launch
from kernels.int4_gemm import to_tinygemm
from kernels.norm_rope import geglu, rms_norm, rope, swiglu
from kernels.rule import check_max_m, torch_int4_rows
from models.layers import MLP, Attention, RMSNorm, gelu_tanh
from models.quantize import quantize_w4


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group: int, max_m: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a width the asked-for group does not divide (SmolLM2's 576) takes the finer group 32
        group = group if linear.in_features % group == 0 else 32
        self.group, self.max_m = group, check_max_m(max_m)
        packed, scale_zero = quantize_w4(linear.weight.detach(), group)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)
        # a shape that torch's int4 GEMM serves at some M <= max_m (kernels.rule.TORCH_INT4) also keeps the
        # weights in its layout, which depends on the device: built at the first call on the current one
        self.torch_rows = {m for m in torch_int4_rows(self.in_features, self.out_features, group) if m <= max_m}
        self._tinygemm = None

    def tinygemm(self):
        if not self.torch_rows:
            return None
        if self._tinygemm is None or self._tinygemm[0].device != self.packed.device:
            self._tinygemm = to_tinygemm(self.packed, self.scale_zero, self.group)
        return self._tinygemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.int4_linear(x, self.packed, self.scale_zero, self.group, self.max_m, self.bias,
                                    self.tinygemm())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group}, max_m={self.max_m}"


class SharedInputInt4(nn.Module):
    """One INT4 GEMM for linears that read the same input (q/k/v; gate/up): weights concatenated along N
    (quantisation is per output row, so each member's weights are exactly what it would get alone). The
    first member called with an input computes every output; each member returns its slice, and a member
    called with a different input recomputes, so the result never depends on call order."""

    def __init__(self, linears: list[nn.Linear], group: int, max_m: int):
        super().__init__()
        cat = nn.Linear(linears[0].in_features, sum(l.out_features for l in linears),
                        bias=linears[0].bias is not None, device=linears[0].weight.device,
                        dtype=linears[0].weight.dtype)
        with torch.no_grad():
            cat.weight.copy_(torch.cat([l.weight for l in linears]))
            if cat.bias is not None:
                cat.bias.copy_(torch.cat([l.bias for l in linears]))
        self.fused = Int4Linear(cat, group, max_m)
        self.sizes = [l.out_features for l in linears]
        self._x, self._parts = None, None

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x is not self._x:
            self._x, self._parts = x, list(self.fused(x).split(self.sizes, dim=-1))
        out = self._parts[i]
        self._parts[i] = None
        if all(p is None for p in self._parts):  # every member served: drop the references
            self._x, self._parts = None, None
        return out


class _Member(nn.Module):
    def __init__(self, shared: SharedInputInt4, i: int):
        super().__init__()
        object.__setattr__(self, "shared", shared)  # registered once, on the parent, not per member
        self.i = i

    def forward(self, x):
        return self.shared.part(x, self.i)

    def extra_repr(self) -> str:
        return f"part {self.i} of a shared INT4 GEMM"


_SHARED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fuse_shared_inputs(module: nn.Module, group: int, max_m: int, dense: set[str] = frozenset()) -> None:
    """The _SHARED linears of `module` as one SharedInputInt4 each, unless one of them is in `dense` (their names
    in `module`)."""
    for names in _SHARED:
        linears = [getattr(module, n, None) for n in names]
        if all(isinstance(l, nn.Linear) for l in linears) and not dense.intersection(names):
            shared = SharedInputInt4(linears, group, max_m)
            module.add_module("_".join(n.split("_")[0] for n in names) + "_fused", shared)
            for i, n in enumerate(names):
                setattr(module, n, _Member(shared, i))


class KernelRMSNorm(RMSNorm):
    """RMSNorm as one launch (bf16 input and weight; other dtypes keep the model's code)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps, self.unit_offset)


class KernelMLP(MLP):
    """The SwiGLU product as one launch (`kernel_swiglu`, set by `to_kernels`; bf16), which lets the down
    projection's GEMM start during it. With torch's product instead, the launch record is told that kernels
    not ours ran since our last launch, so that GEMM does not wait on a launch that never lets it start
    (kernels._jit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.kernel_swiglu and gate.dtype == torch.bfloat16 and up.dtype == torch.bfloat16:
            return self.down_proj((swiglu if self.act == "silu" else geglu)(gate, up))
        h = (F.silu(gate) if self.act == "silu" else gelu_tanh(gate)) * up
        note_launch(h.device, False)
        return self.down_proj(h)


class _KernelAttention:
    """Mixin over an Attention class; `kernel_window` (0 = none), `max_m`, `kernel_rope` and `kernel_target` (the
    Transformer whose `slot_pos` a ring layer reads; None outside one) are set by `to_kernels`."""

    def project(self, x, cos, sin):
        if not self.kernel_rope or self.q_norm is not None or x.dtype != torch.bfloat16:
            return super().project(x, cos, sin)  # (QK-norm sits between projection and RoPE)
        B, T, _ = x.shape
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return rope(self.q_proj(x), cos, sin, self.n_heads), rope(self.k_proj(x), cos, sin, self.n_kv_heads), v

    def forward(self, x, cos, sin, mask, input_pos=None):
        self._q_pos = input_pos
        try:
            return super().forward(x, cos, sin, mask, input_pos)
        finally:
            self._q_pos = None

    def attend(self, q, k, v, mask):
        q_pos = getattr(self, "_q_pos", None)
        if q_pos is None:
            return super().attend(q, k, v, mask)
        slot_pos = None
        if self.ring:  # the model passes a ring layer its rows' slots (models.target); slot_pos holds their positions
            slot_pos = self.kernel_target.slot_pos
            q_pos = slot_pos.index_select(0, q_pos)
        return dispatch.attention(q, k, v, q_pos, self.max_m, self.kernel_window, self.scale, k_pos=slot_pos)


_KERNEL_CLASSES: dict[type, type] = {}


def _kernel_class(cls: type) -> type:
    if cls not in _KERNEL_CLASSES:
        _KERNEL_CLASSES[cls] = type(f"Kernel{cls.__name__}", (_KernelAttention, cls), {})
    return _KERNEL_CLASSES[cls]


def to_kernels(model: nn.Module, max_m: int = 8, group: int = 128, fuse: bool = True,
               norm_rope: bool = True, dense: tuple[str, ...] = ()) -> nn.Module:
    """In place: linears -> Int4Linear, attention -> sdpa_midm for T <= max_m. Returns the model.
    fuse=True: q/k/v and gate/up each become one GEMM over concatenated weights (SharedInputInt4), as
    vLLM's QKV and gate|up layers do (fewer, larger launches: faster at T <= max_m, docs/results.md).
    norm_rope=True: RMSNorm, RoPE and the SwiGLU product as one launch each (kernels.norm_rope).
    dense: names in `model` of linears that keep their weights ("lm_head": the output layer is where 4 bits cost a
    real model most, docs/results.md; engine.quant=w4_file adds those its GGUF holds in more than 4 bits)."""
    check_max_m(max_m)
    windows = {}
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "attn_logit_softcap", None) is not None:
        # sdpa_midm computes uncapped attention (Gemma 3 sets the cap but transformers never applies it)
        raise NotImplementedError(f"to_kernels: attn_logit_softcap={cfg.attn_logit_softcap} is not implemented "
                                  f"by the kernels (attention without soft-cap)")
    for i, layer in enumerate(getattr(model, "layers", [])):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and cfg is not None and hasattr(cfg, "window"):
            windows[id(attn)] = cfg.window(i) or 0
    for prefix, module in list(model.named_modules()):
        here = {n[len(prefix) + 1:] if prefix else n for n in dense if not prefix or n.startswith(prefix + ".")}
        if fuse:
            _fuse_shared_inputs(module, group, max_m, here)
        if isinstance(module, Attention) and not isinstance(module, _KernelAttention):
            module.__class__ = _kernel_class(type(module))
            module.max_m = max_m
            module.kernel_window = windows.get(id(module), 0)
            module.kernel_rope = norm_rope
            module.kernel_target = None
        if norm_rope and type(module) is RMSNorm:
            module.__class__ = KernelRMSNorm
        if type(module) is MLP:
            module.__class__ = KernelMLP
            module.kernel_swiglu = norm_rope
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name not in here:
                setattr(module, name, Int4Linear(child, group, max_m))
    for owner in model.modules():
        if "slot_pos" in owner._buffers:  # a Transformer: its ring layers read its slot positions
            for attn in owner.modules():
                if isinstance(attn, _KernelAttention):
                    object.__setattr__(attn, "kernel_target", owner)  # not a submodule: no cycle in modules()
    return model
