"""The runtime: the speculative loop (runner.generate) over an Engine (the .pte, or the eager modules)."""

from runner.engine import EagerEngine, Engine, PteEngine
from runner.generate import GenerationResult, generate, resolve_chain

__all__ = ["Engine", "PteEngine", "EagerEngine", "generate", "GenerationResult", "resolve_chain"]
