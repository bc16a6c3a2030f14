"""Shared test fixtures. Expensive ones (an exported .pte) are session-scoped: build once, reuse everywhere."""

import hashlib
import os
import types

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on the shared 2-core machine: one torch thread is ~10x faster than two contended ones.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_speculator():
    """A tiny target + draft (2 layers, vocab 256, a 192-token draft vocab with a real d2t); same weights on
    every call (seeded), so a fresh eager copy matches the exported one."""
    import torch

    from models import Speculator, tiny_draft, tiny_target

    target = tiny_target(seed=0, n_layers=2, max_seq_len=64)
    draft = tiny_draft(target, seed=1, draft_vocab_size=192)
    draft.set_vocab_map(torch.cat([torch.arange(128), torch.arange(128, 256, 2)]))
    return Speculator(target, draft).eval()


@pytest.fixture(scope="session")
def tiny_pte(tmp_path_factory):
    """One exported .pte of `_tiny_speculator()` (portable backend), shared by every test that needs one:
    `.path`, `.speculator()` (a fresh eager copy with the same weights) and the export arguments."""
    from pipeline.export_pte import export_pte

    args = dict(max_m=6, default_chain=3, max_prefill_chunk=16, min_prefill_chunk=8, backend="portable")
    path = tmp_path_factory.mktemp("tiny_pte") / "model.pte"
    report = export_pte(_tiny_speculator(), out_path=path, manifest_hash=hashlib.sha256(b"tiny").hexdigest(),
                        progress=False, **args)
    return types.SimpleNamespace(path=path, speculator=_tiny_speculator, report=report, **args)


def _text_target(root, code: str, chunk: int, overlap: int, vocab_size: int):
    """Under `root`: a text corpus of six overlapping slices of `code` (code[i*chunk : (i+1)*chunk + overlap])
    and a tiny 3-layer target artifact with a BPE tokenizer trained on its train split.
    -> (target module, target Artifact, data config dict)."""
    from models import save_target, tiny_target
    from pipeline import data
    from pipeline.store import Artifact

    (root / "corpus").mkdir()
    for i in range(6):
        (root / "corpus" / f"m{i}.py").write_text(code[i * chunk : (i + 1) * chunk + overlap])
    data_cfg = {"kind": "text", "paths": [str(root / "corpus" / "*.py")], "held_out_fraction": 0.3}
    docs = data.documents(data_cfg)
    target = tiny_target(seed=0, n_layers=3, vocab_size=vocab_size, max_seq_len=64)
    tdir = root / "target"
    save_target(target, tdir)
    data.train_tokenizer(data.split(docs, "train"), vocab_size=vocab_size).save(str(tdir / "tokenizer.json"))
    return target, Artifact(stage="target", key="t" * 64, path=tdir, manifest={}), data_cfg


@pytest.fixture(scope="session")
def text_target():
    """`_text_target`, for the stage tests' module fixtures (taps, draft)."""
    return _text_target


@pytest.fixture
def interpret(monkeypatch):
    """Triton kernels on the CPU: `kernels` decides compile-or-interpret at launch (kernels/_jit.py), so
    setting TRITON_INTERPRET here is enough even after another module imported triton."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def seed():
    """A fresh seed per test (randomised checks never reuse inputs); returned so a failure can name it."""
    import torch

    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s
