"""Target transformer, EAGLE-3 draft head, the Speculator that defines the exported methods, checkpoints.

No Hydra and no pipeline code here: these are the modules every stage, the exporter and the runner share.
"""

from models.checkpoint import (
    load_speculators,
    load_target,
    read_safetensors_dir,
    save_speculators,
    save_target,
    validate_draft,
)
from models.config import TINY, DraftConfig, TargetConfig, check_taps, default_taps
from models.draft import Eagle3Draft
from models.hf import load_hf_target
from models.speculator import Speculator
from models.target import Transformer
from models.tiny import draft_config_for, tiny_draft, tiny_target

__all__ = [
    "TINY", "DraftConfig", "TargetConfig", "Transformer", "Eagle3Draft", "Speculator",
    "tiny_target", "tiny_draft", "draft_config_for", "load_hf_target", "save_target", "load_target",
    "load_speculators", "save_speculators", "validate_draft", "read_safetensors_dir", "check_taps",
    "default_taps",
]
