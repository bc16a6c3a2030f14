"""Triton kernels whose compile-or-interpret choice is made at launch, not at import.

Triton 3.6 reads `TRITON_INTERPRET` when `@triton.jit` decorates a function (triton/runtime/jit.py:
`jit()` checks `knobs.runtime.interpret` inside the decorator). Decorating at import would freeze the
choice at whichever moment `kernels` was first imported, so a test suite in which another module imports
it first would run GPU-compiled kernels on CPU tensors. `LazyJit` keeps the plain function and decorates
it on first launch in each mode; a compiled launch goes through `torch.library.wrap_triton` so it traces
into graphs (an interpreted one is launched directly, as torch 2.13 itself does and 2.11 refuses to).
`compiled()` says which mode a launch is in (GPU-only launch options hang on it), `sm_count(device)` the GPU's
SM count that launch grids size their waves by, and `pdl_capable` / `note_launch` / `last_launch_triggers`
what programmatic dependent launch (PDL) may do.

Interpreter shims (CPU tests only; they change nothing when kernels are compiled):
- the 3.6 interpreter keeps scalars as 1-element numpy arrays and converts them with `int(array)`, which
  numpy >= 2.4 refuses for 1-d arrays, so `range()` over any run-time value fails: read the one element;
- it stores bfloat16 as uint16 bit patterns and `tl.dot` multiplies those patterns as integers: widen
  bfloat16 operands to float32 (exact) before the product;
- it converts float32 to bfloat16 by truncation, where the GPU's `.to(tl.bfloat16)` rounds to nearest
  even: round to nearest even, so kernels that repeat torch's bf16 roundings can be checked bit for bit;
- triton's own standard library (`tl.zeros`, `tl.sum`, `tl.cdiv`, ...) is `@jit`-decorated when triton is
  imported, so it is compiled-mode when the variable was set later; for the duration of each interpreted
  launch (the interpreter's own patch scope, restored afterwards) those functions are swapped for
  interpreted ones, whose calls restore the language builtins they patch (3.6's do not, so every compiled
  launch after an interpreted one in the same process would fail).
"""

from __future__ import annotations

import functools

import torch
import triton
from torch.library import wrap_triton

TUNED_SMS = 132  # the H200 the launch rules were tuned on; what they assume where there is no GPU


def compiled() -> bool:
    """Whether launches now compile for the GPU (False under TRITON_INTERPRET=1): GPU-only launch options
    (programmatic dependent launch, compiler flags, inline PTX) apply only then."""
    return not triton.knobs.runtime.interpret


def pdl_capable(device) -> bool:
    """Compiled launches on a GPU with griddepcontrol (sm_90+), where kernels may take part in programmatic
    dependent launch."""
    return compiled() and torch.device(device).type == "cuda" and capability(device)[0] >= 9


# Per CUDA stream: whether our last launch on it lets the next kernel launch early (griddepcontrol.
# launch_dependents at its start). A kernel that may start a call is launched as a programmatic dependent only
# then: after a kernel that does not trigger, that costs time instead of saving it (0.7-2.6 us a call on the
# H200, docs/results.md). Kernels launched by others (torch's) are not seen: a caller that runs them
# between two of ours says so with note_launch(device, False).
_TRIGGERS: dict[int, bool] = {}


def note_launch(device, triggers: bool) -> None:
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        _TRIGGERS[torch.cuda.current_stream(device).cuda_stream] = triggers


def last_launch_triggers(device) -> bool:
    return torch.device(device).type == "cuda" and _TRIGGERS.get(torch.cuda.current_stream(device).cuda_stream,
                                                                   False)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device) -> tuple[int, int]:
    """The compute capability of `device`'s GPU (a CUDA device)."""
    return _capability(_index(torch.device(device)))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of `device`'s GPU (TUNED_SMS off the GPU): launch grids size waves by it."""
    device = torch.device(device)
    if device.type != "cuda":
        return TUNED_SMS
    return _sm_count(_index(device))


def _fix_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_eagle3_fixed", False):
        return
    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    from triton.runtime.jit import JITFunction

    class ScopedInterpreted(interpreter.InterpretedFunction):
        """A device-function call (tl.sum inside a kernel) patches triton.language for itself and, in 3.6,
        never restores it: every later compiled kernel in the process then meets interpreter builtins
        ("inline_asm not supported in interpreter mode"). This one restores them when the call returns."""

        def __call__(self, *args, **kwargs):
            scope = interpreter._patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
            finally:
                scope.restore()

    interpreted = {}
    patch_lang = interpreter._patch_lang

    def patched_lang(fn):
        scope = patch_lang(fn)
        for module in (tl, tl.standard, tl.math):
            for name, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    if id(value) not in interpreted:  # (a JITFunction hashes by compiling its cache key)
                        interpreted[id(value)] = ScopedInterpreted(value.fn)
                    scope.set_attr(module, name, interpreted[id(value)])
        return scope

    interpreter._patch_lang_tensor = patched_tensor
    interpreter._patch_lang = patched_lang
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.InterpreterBuilder.cast_impl = patched_cast
    interpreter._eagle3_fixed = True


class LazyJit:
    def __init__(self, fn, **jit_kwargs):
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._by_mode = {}

    def get(self):
        mode = not compiled()
        if mode not in self._by_mode:
            if mode:
                _fix_interpreter()
            self._by_mode[mode] = triton.jit(self.fn, **self.jit_kwargs)
        return self._by_mode[mode]

    def __getitem__(self, grid):
        # torch 2.13 passes an interpreted kernel through wrap_triton unwrapped; 2.11 refuses it. Only a
        # compiled kernel can trace into a graph, so only that one is wrapped.
        kernel = self.get()
        return wrap_triton(kernel)[grid] if compiled() else kernel[grid]


def lazy_jit(fn=None, **jit_kwargs):
    """@lazy_jit or @lazy_jit(do_not_specialize=[...]) like @triton.jit."""
    if fn is None:
        return lambda f: LazyJit(f, **jit_kwargs)
    return LazyJit(fn, **jit_kwargs)
