"""transformers as a benchmarked system: its model read from a GGUF (set to emit exactly the asked number of new
tokens, greedy), a copy truncated to its first layers as the assistant of assisted generation, and `StreamClock`,
the streamer that times `generate` from outside (the hand-overs after the prompt's are the decoded tokens).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch


class StreamClock:
    """A transformers streamer that records (time, number of tokens) at each hand-over."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []

    def put(self, value):
        self.marks.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def hf_model_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    from models.quiet import quiet_transformers

    with quiet_transformers(progress=False):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    # exactly n new tokens, as every other system: an end id no token has (prompt lookup needs one)
    model.generation_config.eos_token_id = model.config.vocab_size
    model.generation_config.pad_token_id = 0
    for key in ("temperature", "top_p", "top_k"):
        setattr(model.generation_config, key, None)
    return model


def truncated_assistant(model, n_layers: int):
    """A copy of the transformers model keeping its first `n_layers` decoder layers (norm and head kept)."""
    assistant = copy.deepcopy(model)
    assistant.model.layers = assistant.model.layers[:n_layers]
    assistant.config.num_hidden_layers = n_layers
    if getattr(assistant.config, "layer_types", None):
        assistant.config.layer_types = assistant.config.layer_types[:n_layers]
    return assistant.eval()
