"""Target transformer, EAGLE-3 draft head, the Speculator that defines the exported methods, checkpoints; and the
facts every layer shares: a target's text (models.text), the names of the run-time choices (models.choices) and
the muting of third-party noise (models.quiet).

No Hydra and no pipeline code here: these are the modules every stage, the exporter and the runner share. The
package itself imports nothing: each name below loads its module on first use, so `import models.quiet` or
`import models.text` (which `import runner` and `import pipeline` do) costs no torch import.
"""

import importlib

_HOMES = {
    "load_speculators": "models.checkpoint", "load_target": "models.checkpoint",
    "read_safetensors_dir": "models.checkpoint", "save_speculators": "models.checkpoint",
    "save_target": "models.checkpoint", "validate_draft": "models.checkpoint",
    "TINY": "models.config", "DraftConfig": "models.config", "TargetConfig": "models.config",
    "check_taps": "models.config", "default_taps": "models.config",
    "Eagle3Draft": "models.draft", "load_hf_target": "models.hf", "Speculator": "models.speculator",
    "Transformer": "models.target", "draft_config_for": "models.tiny", "tiny_draft": "models.tiny",
    "tiny_target": "models.tiny",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
