"""The names of the run-time choices, written once: the config's validation (pipeline/validate.py), the command
lines (runner/__main__.py, runner/serve.py), the engine factory (runner/build.py) and the code that acts on a
choice all read them here, so a name offered is a name served.

- ENGINES: the engines an `engine=<kind>` config (conf/engine/<kind>.yaml) builds (runner.build.build_engine):
  `pte` runs the exported program, `eager` models.Speculator in PyTorch, `cuda` CUDA graphs on one GPU.
- POLICIES: how a round picks its chain length K (runner.policy).
- CUDA_QUANTS: the cuda engine's weights (`engine.quant`), each name mapped to the INT4 kernels' options
  (runner.cuda_engine.CudaEngine's `group` and `dense`; None: bf16 weights, no kernels): `bf16`; `w4_g32`
  (weight-only 4-bit in groups of 32, the lm_head bf16); `w4_g128` (groups of 128, the lm_head 4-bit too);
  `w4_file` (as w4_g32 on the draft; on the target only the linears its GGUF holds in 4 bits or fewer, the rest
  bf16: `file` takes them from the target artifact's weight_types.json, models.quantize.file_bits).
- CUDA_COMPILES: how the cuda engine's calls are compiled before capture (`engine.compile`).
- PROMPT_FORMATS: the prompts the taps and eval stages cut (`data.prompt_format`; pipeline.prompts.cut).
- EXPORT_BACKENDS: the .pte's backend (`export.backend`, conf/export/<backend>.yaml; pipeline.export_pte).
- EXPORT_QUANTS: the .pte's weights (`export.quant`; models.quantize applies them): `fp32`; `8da4w_draft` (the
  draft's linears int8 dynamic activations x int4 weights in symmetric groups of export.group_size, the target
  fp32); `8da4w_offsets` (every linear 8da4w, the target's groups with a float offset each); `8da_file` (the
  draft as 8da4w_draft; each target linear at its GGUF's precision: the file's 4-bit tensors 8da4w with offsets,
  its 5- to 8-bit ones 8da8w, its float ones fp32; a target=gguf target only).
- SERVED_QUANTS: the target's weights while the taps stage runs it (`taps.target_quant`;
  models.quantize.quantize_served): `none` (float) or the target's scheme in the program that serves the draft.
- RENAMED: the names these lists used before, each mapped to the name that replaced it, so that validation
  refuses an old name naming the new one instead of reading it as something else.

Standard library only (models/ is the floor every layer stands on, and validation runs before torch loads).
"""

from __future__ import annotations

ENGINES = ("pte", "eager", "cuda")

POLICIES = ("static", "adaptive")

# On both real targets (docs/results.md, "GPU: the real presets against transformers and llama.cpp") `w4_g32` keeps the GGUF's 4-bit blocks and the
# lm_head in bf16, within 0.002 (SmolLM2's Q4_1) and 0.15 nats (Gemma 3's Q4_K_M, part 6-bit) of the file;
# `w4_g128` quantises the lm_head too: a faster K = 0 (by 12-18%), 0.13-0.85 nats from the file.
CUDA_QUANTS = {"bf16": None, "w4_g32": {"group": 32, "dense": ("lm_head",)}, "w4_g128": {"group": 128, "dense": ()},
               "w4_file": {"group": 32, "dense": ("lm_head",), "file": True}}

# none: the captured calls as written | inductor: the dense (bf16) engine's calls through torch.compile
CUDA_COMPILES = ("none", "inductor")

PROMPT_FORMATS = ("plain", "chat")

EXPORT_BACKENDS = ("portable", "xnnpack")

EXPORT_QUANTS = ("fp32", "8da4w_draft", "8da4w_offsets", "8da_file")

# none: the float target | a scheme of EXPORT_QUANTS or CUDA_QUANTS that quantises the target
SERVED_QUANTS = ("none", "8da4w_offsets", "8da_file", "w4_g32", "w4_g128", "w4_file")

RENAMED = {"export.quant": {"none": "fp32", "int4_draft": "8da4w_draft", "int4": "8da4w_offsets"},
           "engine.quant": {"none": "bf16", "int4": "w4_g32", "int4_g128": "w4_g128"}}
