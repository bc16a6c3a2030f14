"""Text around the token loop: prompt files and stop tokens (shared by `python -m runner` and the eval stage)."""

from __future__ import annotations

import json
from pathlib import Path

# End-of-text tokens of our tokenizer (<|eos|>) and common HF ones, in the order pipeline.data looks for them.
EOS_TOKENS = ("<|eos|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<|end_of_text|>")


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per line, or .jsonl with a "prompt" (or "text") field per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file {path}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for i, line in enumerate(lines):
        record = json.loads(line)
        if "prompt" not in record and "text" not in record:
            raise KeyError(f"{path}:{i + 1}: a .jsonl prompt needs a 'prompt' or 'text' field")
        prompts.append(str(record["prompt"] if "prompt" in record else record["text"]))
    return prompts


def stop_ids(tokenizer, extra=()) -> list[int]:
    """The tokenizer's end-of-text token plus `extra` stop tokens (token strings, or ids as ints/digits)."""
    eos = next((i for i in map(tokenizer.token_to_id, EOS_TOKENS) if i is not None), None)
    ids = [] if eos is None else [eos]
    for s in extra or ():
        tid = int(s) if str(s).isdigit() else tokenizer.token_to_id(str(s))
        if tid is None:
            raise ValueError(f"stop token {s!r} is not a single token of this tokenizer")
        ids.append(tid)
    return ids
