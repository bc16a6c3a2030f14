"""Text facts of a target: its end tokens, its chat template, and the prompt files a user hands in.

Every layer reads them: the data and taps stages (which tokens end a document or an answer), the eval and serve
stages and the runner (stop tokens, chat prompts), the target stage (writing the template beside the tokenizer).
So they live here, on the floor the pipeline and the runner both stand on, and import nothing of either.
"""

from __future__ import annotations

import json
from pathlib import Path

# End-of-text tokens of our tokenizer (<|eos|>) and common HF ones, in the order they are looked for (Gemma's
# vocabulary holds "</s>" as plain text beside its "<eos>", so "<eos>" comes first); the end-of-turn tokens of
# chat templates (<|im_end|>, <end_of_turn>, <|eot_id|>) end a generation as well.
EOS_TOKENS = ("<|eos|>", "<|endoftext|>", "<eos>", "</s>", "<|end_of_text|>")
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")
CHAT_TEMPLATE = "chat_template.jinja"  # beside a target artifact's tokenizer.json, when its source has one


def eos_id(tokenizer) -> int | None:
    """The id of the first of EOS_TOKENS the tokenizer has, or None: what ends a document of the corpus."""
    return next((i for i in map(tokenizer.token_to_id, EOS_TOKENS) if i is not None), None)


def end_ids(tokenizer) -> list[int]:
    """Every token of EOS_TOKENS and END_OF_TURN_TOKENS the tokenizer has: each one ends a generation, so a
    chat model's answer stops at its end-of-turn token and a base model's text at its end-of-text token."""
    ids = (tokenizer.token_to_id(t) for t in EOS_TOKENS + END_OF_TURN_TOKENS)
    return list(dict.fromkeys(i for i in ids if i is not None))


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per line, or .jsonl with a "prompt" (or "text") field per line; a file that is not UTF-8
    text or holds a line that is not such a JSON object is refused naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if "\x00" in text:
        raise ValueError(f"prompt file {path} is not UTF-8 text (it holds NUL bytes)")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt file {path}: line {n} is not JSON ({e.msg})") from None
        if not isinstance(record, dict) or ("prompt" not in record and "text" not in record):
            raise ValueError(f"prompt file {path}: line {n} needs a 'prompt' or 'text' field")
        prompts.append(str(record["prompt"] if "prompt" in record else record["text"]))
    return prompts


def stop_ids(tokenizer, extra=()) -> list[int]:
    """The tokenizer's end tokens (`end_ids`) plus `extra` stop tokens (token strings, or ids as ints/digits)."""
    ids = end_ids(tokenizer)
    for s in extra or ():
        tid = int(s) if str(s).isdigit() else tokenizer.token_to_id(str(s))
        if tid is None:
            raise ValueError(f"stop token {s!r} is not a single token of this tokenizer")
        ids.append(tid)
    return ids


def render_chat(template: str, messages: str | list[dict], tokenizer) -> str:
    """The chat template rendered around `messages` ({"role", "content"} dicts; a str is one user message),
    with the generation prompt, as transformers renders it; the tokenizer supplies the bos/eos tokens the
    template may name. The taps and eval stages' chat prompts and the server's chat requests come from here."""
    from transformers.utils.chat_template_utils import render_jinja_template

    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    specials = {}
    for name, text in (("bos_token", "<bos>"), ("bos_token", "<|bos|>"), ("bos_token", "<s>"),
                       ("eos_token", "<eos>"), ("eos_token", "<|im_end|>"), ("eos_token", "</s>")):
        if name not in specials and tokenizer.token_to_id(text) is not None:
            specials[name] = text
    rendered = render_jinja_template([list(messages)], chat_template=template, add_generation_prompt=True,
                                     **specials)
    return rendered[0][0] if isinstance(rendered, tuple) else rendered[0]


def write_chat_template(out, template: str | None) -> bool:
    """Write `template` as CHAT_TEMPLATE in the target artifact `out`; nothing when there is none."""
    if not template:
        return False
    (Path(out) / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
    return True


def load_chat_template(target_dir) -> str | None:
    """The chat template of a target artifact (a Jinja template as transformers renders it), or None."""
    path = Path(target_dir) / CHAT_TEMPLATE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def hf_chat_template(checkpoint_dir) -> str | None:
    """The chat template of a Hugging Face checkpoint directory: its chat_template.jinja (what
    transformers >= 4.43 saves), else tokenizer_config.json's chat_template (a string, or a list of named
    templates of which "default" is the one transformers applies), else None."""
    d = Path(checkpoint_dir)
    if (d / CHAT_TEMPLATE).is_file():
        return (d / CHAT_TEMPLATE).read_text(encoding="utf-8")
    cfg_file = d / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        template = json.loads(cfg_file.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{cfg_file}: not a JSON object ({e})") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None
