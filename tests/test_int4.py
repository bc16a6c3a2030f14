"""models.quantize: the .pte's 8da4w weights (offset_groups, GroupOffsetLinear): a group that holds at most 16
equally spaced values (a Q4_1 or Q4_K block of a GGUF target) comes back exactly, up to its scale's bf16 rounding;
any other group is rounded asymmetrically, within half a step; and a linear on those weights computes what the
dense linear computes, up to the int8 rounding of its input, where symmetric groups are far off on skewed blocks.
Both quantisers (8da4w and the CUDA kernels' w4) keep the groups the one detector, grid_4bit, finds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.quantize import (GroupOffsetLinear, dequantize_w4, grid_4bit, offset_groups, quantize_8da4w,
                             quantize_8da4w_offsets, quantize_w4)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GROUP = 32


def gguf_like(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Q4_1-style blocks: w = d * q + m, q in 0..15, d > 0 and m drawn per block of GROUP inputs."""
    d = torch.rand(n, k // GROUP, 1, generator=g) * 0.02 + 1e-3
    m = -torch.rand(n, k // GROUP, 1, generator=g) * 0.1
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    return (d * q + m).reshape(n, k)


def rebuild(q, d, o):
    return q.double() * d.double().repeat_interleave(GROUP, 1) + o.double().repeat_interleave(GROUP, 1)


def test_a_16_level_group_comes_back_within_its_scale_rounding(seed):
    g = torch.Generator().manual_seed(seed)
    w = gguf_like(24, 4 * GROUP, g)
    q, d, o, on_grid = offset_groups(w, GROUP)
    assert on_grid.all() and q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(d, d.to(torch.bfloat16).float()), "the scales are what XNNPACK keeps (bf16)"
    bound = (2.0 ** -8) * d.double() * 7.5 + 1e-7  # |d - bf16(d)| * half the code range
    err = (rebuild(q, d, o) - w.double()).abs().reshape(24, 4, GROUP).amax(-1)
    assert (err <= bound).all(), float((err / bound).max())


def test_any_other_group_is_rounded_within_half_its_step(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 3 * GROUP, generator=g)
    q, d, o, on_grid = offset_groups(w, GROUP)
    assert not on_grid.any()
    blocks = w.double().reshape(16, 3, GROUP)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    err = (rebuild(q, d, o) - w.double()).abs().reshape(16, 3, GROUP).amax(-1)
    assert (err <= step / 2 * 1.01 + step * 2.0 ** -8 * 7.5).all()


def test_the_offset_linear_is_the_dense_linear_where_symmetric_groups_are_not(seed):
    g = torch.Generator().manual_seed(seed)
    dense = nn.Linear(4 * GROUP, 48, bias=True)
    with torch.no_grad():
        dense.weight.copy_(gguf_like(48, 4 * GROUP, g))
        dense.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(2, 5, 4 * GROUP, generator=g)
    ref = dense(x)
    ours = GroupOffsetLinear(dense, GROUP)
    symmetric = nn.Sequential(nn.Linear(4 * GROUP, 48, bias=True))
    symmetric[0].load_state_dict(dense.state_dict())
    quantize_8da4w(symmetric, GROUP)
    with torch.no_grad():
        err_ours = (ours(x) - ref).abs().max().item()
        err_sym = (symmetric(x) - ref).abs().max().item()
    assert ours.grid_share == 1.0
    assert err_ours < 0.02 * ref.abs().max().item(), err_ours  # the int8 rounding of x alone
    assert err_ours * 4 < err_sym, (err_ours, err_sym)


def test_quantize_8da4w_offsets_replaces_every_eligible_linear_and_names_the_rest():
    model = nn.Sequential(nn.Linear(2 * GROUP, 8), nn.ReLU(), nn.Linear(8, 4))
    assert quantize_8da4w_offsets(model, GROUP) == ["2"]
    assert isinstance(model[0], GroupOffsetLinear) and isinstance(model[2], nn.Linear)
    assert F.linear(torch.ones(1, 2 * GROUP), model[0].group_sums).tolist() == [[float(GROUP)] * 2]


def test_both_quantisers_keep_a_grid_whose_codes_do_not_reach_both_ends(seed):
    """One detector (grid_4bit) for both paths: a Q4_1 block whose codes span only 2..12 is a grid of step d, not
    of (max - min) / 15, and the 8da4w offsets and the kernels' w4 both give it back within their bf16 rounding."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(8, 4, 1, generator=g) * 0.02 + 1e-3
    m = -torch.rand(8, 4, 1, generator=g) * 0.1
    q = torch.randint(2, 13, (8, 4, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 2, 12
    w = (d * q + m).reshape(8, 4 * GROUP)
    on_grid, lo, step = grid_4bit(w.double().reshape(8, 4, GROUP))
    assert on_grid.all() and torch.allclose(step, d.double().squeeze(-1), rtol=1e-5)
    # bf16 rounds the step and the offset each by up to 2^-8 of itself: a code q <= 12 errs by (q d + |m|) 2^-8
    bound = (2.0 ** -8) * (d * 20 + m.abs()).expand(8, 4, GROUP).reshape(8, 4 * GROUP) + 1e-6
    q8, d8, o8, kept = offset_groups(w, GROUP)
    assert kept.all() and ((rebuild(q8, d8, o8) - w.double()).abs() <= bound).all()
    w4 = dequantize_w4(*quantize_w4(w, GROUP), GROUP, torch.float32)
    assert ((w4 - w).abs() <= bound).all()


def test_a_group_off_every_grid_is_no_grid():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.5], [0.0, 1.0, 2.0, 17.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    on_grid, _, step = grid_4bit(x)
    assert on_grid.tolist() == [False, False, False] and not torch.isfinite(step[2])
