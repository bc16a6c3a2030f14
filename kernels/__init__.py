"""GPU kernels for verify-sized calls (M <= max_m rows), each beside its PyTorch reference.

- rule: the dispatch rule, M <= max_m -> these kernels, else the dense path (standard library only);
- dispatch: the rule applied to a linear layer and to cached attention;
- int4_gemm: INT4 weight-only GEMM, weight-stationary for M <= 16 (`int4_mm`, `int4_mm_reference`; the weights
  as models.quantize.quantize_w4 writes them), in Triton; on a Hopper GPU `int4_mm` runs the tuned and the large group-128 shapes on
  int4_gluon, the same arithmetic warp-specialised in Gluon (a TMA producer warp feeding one consumer
  warpgroup); int4_launch holds what the two share at launch (the row limit, the PDL switch, the split-K
  counters);
- sdpa_midm: split-K attention for M <= 16 query rows over a long GQA KV cache (`sdpa_midm`,
  `sdpa_reference`);
- norm_rope: the model's RMSNorm, RoPE and SwiGLU product in one launch each, equal to models/layers.py
  (`rms_norm`, `rope`, `swiglu`);
- transform: `to_kernels(model)` puts a models/ Transformer on them (CUDA; CPU under TRITON_INTERPRET=1);
- _jit: the compile-or-interpret choice made at launch, and which launches may start early (programmatic
  dependent launch).
All ops are `torch.library.triton_op`s (eagle3::int4_mm, eagle3::sdpa_midm, eagle3::rms_norm,
eagle3::rope, eagle3::swiglu) with fake implementations, so they trace into torch.export graphs.
This package imports nothing itself, so `import kernels.rule` loads neither torch nor triton.
Benchmarks and notes: bench/kernels.py, docs/results.md.
"""
