"""Prompts of a fixed length for the taps and eval stages: plain corpus windows and chat-templated requests."""

from __future__ import annotations

import random

import pytest

from pipeline import data, prompts
from models.text import end_ids, eos_id

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _source(rng: random.Random, i: int) -> str:
    words = ["return", "the", "value", "of", "each", "item", "in", "a", "list", "sorted", "by", "key", "path",
             "file", "name", "number", "string", "when", "given", "otherwise"]
    funcs = []
    for j in range(4):
        doc = " ".join(rng.choice(words) for _ in range(rng.randint(20, 40)))
        funcs.append(f"def f{i}_{j}(x, y):\n    \"\"\"{doc.capitalize()}.\"\"\"\n    return x\n\n")
    funcs.append(f"def _private{i}():\n    \"\"\"Never a request.\"\"\"\n")
    return "".join(funcs)


@pytest.fixture(scope="module")
def corpus():
    from tokenizers import AddedToken

    rng = random.Random(random.randrange(1 << 30))
    texts = [_source(rng, i) for i in range(30)]
    tok = data.train_tokenizer(texts, vocab_size=400)
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    return texts, tok


def test_docstring_requests_name_public_functions_and_classes():
    src = 'class Box:\n    """Hold one thing."""\n    def put(self, item):\n        """Put  it\n   in."""\n' \
          'def _hidden():\n    """No."""\n'
    assert prompts.docstring_requests(src) == ["Write a Python class `Box`. Hold one thing.",
                                               "Write a Python function `put(self, item)`. Put it in."]
    assert prompts.docstring_requests("this is not python (") == []


def test_plain_prompts_are_seeded_windows_inside_one_document(tmp_path):
    files = []
    for i in range(40):
        f = tmp_path / f"doc{i:02d}.txt"
        f.write_text("".join(f"line {j} of document {i}: value = {i * j}\n" for j in range(30)))
        files.append(str(f))
    cfg = {"kind": "text", "paths": files, "held_out_fraction": 0.3, "max_bytes": None, "text_field": "text"}
    docs = data.documents(cfg)
    tok = data.train_tokenizer(data.split(docs, "train"), vocab_size=300)
    held = data.split(docs, "held_out")
    out = prompts.cut(held, tok, 6, 24, seed=0)
    assert out.shape == (6, 24) and eos_id(tok) not in out
    assert prompts.cut(held, tok, 6, 24, seed=0).tolist() == out.tolist()
    assert prompts.cut(held, tok, 6, 24, seed=1).tolist() != out.tolist()
    assert all(any(tok.decode(p.tolist()) in h for h in held) for p in out), "a window of one held-out document"
    with pytest.raises(ValueError, match="could not cut 6 windows of 100000 tokens"):
        prompts.cut(held, tok, 6, 100_000, seed=0)


def test_chat_prompts_have_the_length_the_template_and_a_whole_word_request(corpus):
    texts, tok = corpus
    n, length = 12, 64
    out = prompts.cut(texts, tok, n, length, seed=3, prompt_format="chat", chat_template=CHATML)
    assert out.shape == (n, length)
    before, _, after = prompts.render_chat(CHATML, "\x00", tok).partition("\x00")
    head = tok.encode(before, add_special_tokens=False).ids
    tail = tok.encode(after, add_special_tokens=False).ids
    requests = [r for t in texts for r in prompts.docstring_requests(t)]
    for row in out.tolist():
        assert row[:len(head)] == head and row[length - len(tail):] == tail
        body = tok.decode(row[len(head):length - len(tail)])
        assert body.startswith("Write a Python function `f") and any(r.startswith(body) for r in requests)
        full = next(r for r in requests if r.startswith(body))
        assert full[len(body)] == " "  # the cut ends on a whole word
    assert len({tuple(r) for r in out.tolist()}) == n
    assert prompts.cut(texts, tok, n, length, 3, "chat", CHATML).tolist() == out.tolist()
    assert prompts.cut(texts, tok, n, length, 4, "chat", CHATML).tolist() != out.tolist()
    for fmt in prompts.PROMPT_FORMATS:  # a split nothing reads: no prompts, the split's shape
        assert prompts.cut(texts, tok, 0, length, 3, fmt, CHATML).shape == (0, length)


def test_code_requests_explain_each_public_definition_dedented():
    src = 'class Box:\n    def put(self, item):\n        return item\n\ndef _hidden():\n    pass\n'
    assert prompts.code_requests(src) == [
        prompts.EXPLAIN + "class Box:\n    def put(self, item):\n        return item",
        prompts.EXPLAIN + "def put(self, item):\n    return item"]
    assert prompts.code_requests("this is not python (") == []


def test_chat_prompts_explain_code_once_the_docstrings_run_out(corpus):
    texts, tok = corpus
    length = 64
    before, _, after = prompts.render_chat(CHATML, "\x00", tok).partition("\x00")
    head = len(tok.encode(before, add_special_tokens=False).ids)
    tail = len(tok.encode(after, add_special_tokens=False).ids)
    room = length - head - tail
    encoded = [tok.encode(r, add_special_tokens=False).ids for t in texts for r in prompts.docstring_requests(t)]
    usable = [ids for ids in encoded if len(ids) > room and prompts._starts_word(tok, ids[room])]
    seed = random.randrange(1000)
    n = len(usable) + random.randint(5, 20)
    out = prompts.cut(texts, tok, n, length, seed, "chat", CHATML)
    bodies = [tok.decode(row[head:length - tail]) for row in out.tolist()]
    kinds = [b.startswith(prompts.EXPLAIN.strip()) for b in bodies]
    assert any(kinds) and not all(kinds)
    assert kinds == sorted(kinds), "every docstring request comes before the first code request"
    code = [r for t in texts for r in prompts.code_requests(t)]
    for body in (b for b, k in zip(bodies, kinds) if k):
        full = next(r for r in code if r.startswith(body))
        assert not (full[len(body) - 1].isalnum() and full[len(body)].isalnum()), "a cut inside a name"
    assert len({tuple(r) for r in out.tolist()}) == n
    assert sum(not k for k in kinds) == len(usable)
    few = prompts.cut(texts, tok, 12, length, seed, "chat", CHATML)
    assert out[:12].tolist() == few.tolist(), "prompts the docstrings fill do not depend on the code requests"


def test_chat_prompts_refuse_what_they_cannot_build(corpus):
    texts, tok = corpus
    with pytest.raises(ValueError, match="needs a target with a chat template"):
        prompts.cut(texts, tok, 4, 64, 0, "chat", None)
    with pytest.raises(ValueError, match="leaves .* tokens for the request"):
        prompts.cut(texts, tok, 4, 10, 0, "chat", CHATML)
    with pytest.raises(ValueError, match="only .* of 500 requests"):
        prompts.cut(texts, tok, 500, 64, 0, "chat", CHATML)
    with pytest.raises(ValueError, match="no public Python function or class"):
        prompts.cut(["just prose, no code at all " * 20], tok, 4, 64, 0, "chat", CHATML)
    with pytest.raises(ValueError, match="prompt_format='markdown'"):
        prompts.cut(texts, tok, 4, 64, 0, "markdown", CHATML)


def test_end_ids_hold_end_of_text_and_end_of_turn(corpus):
    _, tok = corpus
    ids = end_ids(tok)
    assert ids == [tok.token_to_id("<|eos|>"), tok.token_to_id("<|im_end|>")]


def test_a_vocabulary_with_both_eos_and_a_literal_closing_s_ends_documents_with_eos():
    """Gemma 3's vocabulary has "<eos>" (its end of text, id 1) and "</s>" (id 212, plain text)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({"<unk>": 0, "<eos>": 1, "</s>": 212, "<end_of_turn>": 106}, unk_token="<unk>"))
    assert eos_id(tok) == 1
    assert end_ids(tok) == [1, 212, 106]
