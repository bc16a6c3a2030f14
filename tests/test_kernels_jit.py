"""kernels/_jit.py: an interpreted launch leaves triton.language as it found it, so compiled kernels launched
later in the same process (the GPU tests after the CPU ones) still compile."""

import torch
import triton.language as tl

from kernels import int4_gemm as G
from models.quantize import quantize_w4


def builtins():
    return {(mod.__name__, name): getattr(mod, name) for mod in (tl, tl.core, tl.math)
            for name in dir(mod) if tl.core.is_builtin(getattr(mod, name))}


def test_interpreted_launch_restores_the_language(interpret):
    before = builtins()
    packed, scale_zero = quantize_w4(torch.randn(64, 128), 32)
    G.launch_int4_mm(torch.randn(3, 128).to(torch.bfloat16), packed, scale_zero, 32)  # tl.sum: a device call
    after = builtins()
    changed = sorted(f"{m}.{n}" for (m, n), f in before.items() if after.get((m, n)) is not f)
    assert not changed, f"left patched after the launch: {changed[:8]}"
