"""The model transform: a models/ Transformer on the INT4 GEMM, split-K SDPA and the RMSNorm/RoPE/SwiGLU kernels
agrees with the same model carrying the dequantised weights, on both sides of the dispatch threshold; it
exports with a dynamic T.
CPU runs use Triton's interpreter (see kernels/_jit.py)."""

import copy
import dataclasses

import pytest
import torch

from kernels import rule
from models.quantize import dequantize_w4
from kernels.transform import Int4Linear, to_kernels
from models.config import TargetConfig
from models.target import Transformer

MAX_M = 4


CFG = TargetConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=64, tap_layers=(0, 1, 2), sliding_window=[None, 9])


def with_dequantised_weights(ref, kern):
    """ref's linears get the dequantised weights kern's kernels use (fused weights split back by rows)."""
    weights = {}
    for name, m in kern.named_modules():
        if isinstance(m, Int4Linear):
            weights[name] = dequantize_w4(m.packed, m.scale_zero, m.group, torch.bfloat16)
    for name, lin in ref.named_modules():
        if not isinstance(lin, torch.nn.Linear):
            continue
        if name in weights:
            lin.weight.data = weights[name]
            continue
        parent, leaf = name.rsplit(".", 1)
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if leaf in names:
                fused = weights[parent + "." + "_".join(n.split("_")[0] for n in names) + "_fused.fused"]
                sizes = [getattr(ref.get_submodule(parent), n).out_features for n in names]
                lin.weight.data = fused.split(sizes)[names.index(leaf)]
    return ref


@pytest.fixture(scope="module", params=["ours", "torch"])
def gemm(request):
    """Which INT4 GEMM the tiny shapes take: ours (the size rule moved below them) or torch's (the size rule
    as shipped: kernels.rule.TORCH_INT4_BELOW)."""
    shipped = rule.TORCH_INT4_BELOW
    rule.TORCH_INT4_BELOW = 0 if request.param == "ours" else shipped
    yield request.param
    rule.TORCH_INT4_BELOW = shipped


@pytest.fixture(scope="module", params=[False, True], ids=["separate", "fused"])
def models(request, gemm):
    """(kernel model, reference model with the dequantised weights), tiny, bf16, random init, on `gemm`."""
    ref = Transformer(CFG).to(torch.bfloat16).eval()
    kern = to_kernels(copy.deepcopy(ref), max_m=MAX_M, group=32, fuse=request.param)
    return kern, with_dequantised_weights(ref, kern)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@torch.no_grad()
def test_cached_forward_matches_dequantised_model(interpret, models, gemm):
    kern, ref = models
    tokens = torch.randint(0, 256, (1, 24))
    for m in (kern, ref):
        m.reset_cache()
    pos = 0
    for T in (12, 1, 3, 4, 2):  # a prefill above max_m (dense path), then verify-sized calls
        args = (tokens[:, pos:pos + T], torch.arange(pos, pos + T))
        assert rel_err(kern(*args), ref(*args)) < 2e-2, f"T={T}"
        pos += T
    linears = [m for m in kern.modules() if isinstance(m, Int4Linear)]
    # torch's GEMM keeps a copy of the weights in its own layout; ours keeps none
    assert all((m._tinygemm is not None) == (gemm == "torch") for m in linears), gemm


@torch.no_grad()
def test_stateless_forward_keeps_the_models_attention(interpret, models):
    kern, ref = models
    tokens = torch.randint(0, 256, (2, 10))
    assert rel_err(kern(tokens), ref(tokens)) < 2e-2


def test_exports_with_dynamic_t(interpret, models, gemm):
    kern, _ = models
    T = torch.export.Dim("T", min=2, max=MAX_M)
    ep = torch.export.export(kern, (torch.randint(0, 256, (1, 3)), torch.arange(10, 13)),
                             dynamic_shapes=({1: T}, {0: T}), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    fused = any(name.endswith("_fused") for name, _ in kern.named_modules())
    gemm_op = "eagle3.int4_mm" if gemm == "ours" else "_weight_int4pack_mm"
    assert sum(gemm_op in t for t in targets) == 2 * (4 if fused else 7) + 1  # per layer: qkv, o, gate|up, down
    assert sum("sdpa_midm" in t for t in targets) == 2
    assert sum("rms_norm" in t for t in targets) == 2 * 2 + 1  # per layer: input, post-attention; final
    assert sum("eagle3.rope" in t for t in targets) == 2 * 2  # per layer: q, k
    assert sum("eagle3.swiglu" in t for t in targets) == 2


def test_refuses_what_the_kernels_do_not_compute():
    with pytest.raises(NotImplementedError, match="attn_logit_softcap=50.0"):
        to_kernels(Transformer(TargetConfig(attn_logit_softcap=50.0)))


GEMMA = dataclasses.replace(CFG, n_layers=3, norm_unit_offset=True, output_norms=True, qk_norm=True,
                            hidden_act="gelu_pytorch_tanh", attn_scale=0.2, embed_scale=8.0, rope_local_theta=10000.0,
                            rope_theta=1e6, sliding_window=[9, 9, None])


@torch.no_grad()
def test_gemma3_options_on_the_kernels_match_the_dequantised_model(interpret):
    """Gemma 3's layers: (1 + w) norms before and after each sublayer, QK-norm, GeGLU, the attention scale,
    windowed layers with their own RoPE base."""
    torch.manual_seed(4)
    ref = Transformer(GEMMA).to(torch.bfloat16).eval()
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Module) and getattr(m, "unit_offset", False):
                m.weight.normal_(0.0, 0.3)  # (1 + w) with w != 0, so the offset is exercised
    kern = to_kernels(copy.deepcopy(ref), max_m=MAX_M, group=32)
    ref = with_dequantised_weights(ref, kern)
    tokens = torch.randint(0, 256, (1, 24))
    for m in (kern, ref):
        m.reset_cache()
    pos = 0
    for T in (12, 1, 3, 4, 2):
        args = (tokens[:, pos:pos + T], torch.arange(pos, pos + T))
        assert rel_err(kern(*args), ref(*args)) < 2e-2, f"T={T}"
        pos += T


def test_a_width_the_group_does_not_divide_takes_group_32():
    """SmolLM2's hidden 576 is not a multiple of 128: its linears quantise in groups of 32, the others keep 128."""
    torch.manual_seed(3)
    for in_features, group in ((96, 32), (256, 128)):
        lin = torch.nn.Linear(in_features, 64, bias=False)
        m = Int4Linear(lin, group=128, max_m=MAX_M)
        assert m.group == group
        w = dequantize_w4(m.packed, m.scale_zero, m.group, torch.float32)
        assert (w - lin.weight).norm() / lin.weight.norm() < 0.1  # 4-bit rounding, not a wrong layout


def test_dense_names_keep_their_linears_and_a_grid_survives_when_quantised_before_the_cast():
    """`dense` keeps the named linears as they are; quantised from float32 weights on a 4-bit grid (a GGUF
    block), a group comes back within its bf16 scale's rounding, while the same weights cast to bf16 first
    are quantised again (the CudaEngine's order: to_kernels, then the cast)."""
    torch.manual_seed(0)
    ref = Transformer(CFG).eval()
    with torch.no_grad():  # every 32-group of every linear on 16 levels from a float minimum, as Q4_1's blocks
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear) and m is not ref.lm_head:
                N, K = m.weight.shape
                q = torch.randint(0, 16, (N, K // 32, 32)).float()
                q[..., 0], q[..., 1] = 0, 15  # the block's minimum and maximum are levels
                d = torch.rand(N, K // 32, 1) * 0.01 + 0.001
                lo = -d * (torch.randint(1, 14, (N, K // 32, 1)) + 0.4)  # a float minimum below 0, off the integers
                m.weight.copy_((lo + d * q).reshape(N, K))
    head = ref.lm_head.weight.detach().clone()
    grid = to_kernels(copy.deepcopy(ref), max_m=MAX_M, group=32, dense=("lm_head",))
    cast = to_kernels(copy.deepcopy(ref).to(torch.bfloat16), max_m=MAX_M, group=32, dense=("lm_head",))
    assert type(grid.lm_head) is torch.nn.Linear and torch.equal(grid.lm_head.weight, head)
    w = ref.layers[0].self_attn.o_proj.weight
    steps = w.reshape(w.shape[0], -1, 32).aminmax(dim=-1)
    steps = ((steps.max - steps.min) / 15).repeat_interleave(32, dim=1)
    err = {name: ((dequantize_w4(m.self_attn.o_proj.packed, m.self_attn.o_proj.scale_zero, 32, torch.float32)
                   - w).abs() / steps).max().item() for name, m in (("grid", grid.layers[0]), ("cast", cast.layers[0]))}
    assert err["grid"] < 0.1 < 0.3 < err["cast"], err  # in steps: the stored scale's rounding, against requantising
