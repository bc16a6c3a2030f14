"""The pipeline's stages, in order. Each is a module `pipeline/stages/<name>.py` with

    SCHEMA_VERSION: int           bump when the artifact's format or meaning changes (enters the cache key)
    UPSTREAM: tuple[str, ...]     stages whose artifacts `run` reads (must come earlier in ORDER)
    CONFIG_KEYS: tuple[str, ...]  top-level config subtrees that enter the cache key
    def run(cfg, upstream: dict[str, Artifact], out: Path) -> dict   (the report: JSON-able numbers/facts)

and optionally `CONTENT_ADDRESSED = False` (the eval stage: runs every time, `out` is the Hydra job dir),
`key_extra(cfg) -> dict` (facts outside the config that must enter the key, e.g. an input dir fingerprint) and
`upstream_for(cfg) -> tuple` (the part of UPSTREAM this config reads: the eval stage on the CUDA engine
reads no .pte, so the export stage is not run for it) and `estimate_bytes(cfg, upstream) -> int | None` (the
most its build writes, artifact and scratch: checked against the free space before it starts).

`serve` is a stage outside ORDER: `+stage=serve` runs the stages up to export, then serves their artifacts
(pipeline/stages/serve.py) until it is stopped, in place of the eval stage. A plain `python -m pipeline`
never reaches it, so it never blocks.
"""


from __future__ import annotations

import importlib
from types import ModuleType

ORDER = ("target", "taps", "draft", "export", "eval")
SERVE = "serve"
PACKAGE = "pipeline.stages"
INTERFACE = ("SCHEMA_VERSION", "UPSTREAM", "CONFIG_KEYS", "run")
PARAM_BYTES = 4  # every artifact stores weights in float32


def until(name: str) -> tuple[str, ...]:
    """The stages a job that ends with stage `name` runs, in order (serve: those up to export, then serve)."""
    if name == SERVE:
        return ORDER[: ORDER.index("export") + 1] + (SERVE,)
    if name not in ORDER:
        raise ValueError(f"unknown stage {name!r}; choose one of {', '.join(ORDER + (SERVE,))}")
    return ORDER[: ORDER.index(name) + 1]


def load(name: str, package: str = PACKAGE) -> ModuleType:
    """Import a stage module and check its interface."""
    earlier = until(name)[:-1]
    mod = importlib.import_module(f"{package}.{name}")
    missing = [a for a in INTERFACE if not hasattr(mod, a)]
    if missing:
        raise TypeError(f"stage module {mod.__name__} lacks {', '.join(missing)}")
    bad = [u for u in mod.UPSTREAM if u not in earlier]
    if bad:
        raise ValueError(f"stage {name}: UPSTREAM {bad} must name stages that run before it, of {earlier}")
    return mod


def content_addressed(mod: ModuleType) -> bool:
    return getattr(mod, "CONTENT_ADDRESSED", True)


def upstream(mod: ModuleType, cfg) -> tuple[str, ...]:
    """The stages whose artifacts this stage reads under `cfg`: `upstream_for(cfg)`, else UPSTREAM."""
    chosen = tuple(mod.upstream_for(cfg)) if hasattr(mod, "upstream_for") else tuple(mod.UPSTREAM)
    extra = [u for u in chosen if u not in mod.UPSTREAM]
    if extra:
        raise ValueError(f"stage module {mod.__name__}: upstream_for names {extra}, which UPSTREAM lacks")
    return chosen


def param_count(make) -> int:
    """Parameters of the module `make()` builds, counted on the meta device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in make().parameters())
