"""The speculative loop on a real exported program: one .pte for every K, the same tokens as greedy decoding,
the same tokens as the eager engine, and clear refusals.

A random tiny draft is almost never right: `Oracle` (tests/oracle.py) drives the accepted paths through the
real target methods.
"""

import os
from pathlib import Path

import pytest
import torch

from runner.engine import EagerEngine, PteEngine
from runner.generate import generate

from oracle import Oracle

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # an exported program, subprocesses

PROMPT = [(7 * i + 3) % 200 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def pte(tiny_pte):
    return PteEngine(tiny_pte.path)


@pytest.fixture(scope="module")
def eager(tiny_pte, pte):
    m = pte.meta
    return EagerEngine(tiny_pte.speculator(), max_m=m["max_m"], default_chain=m["default_chain"],
                       max_prefill_chunk=m["max_prefill_chunk"], min_prefill_chunk=m["min_prefill_chunk"])


def prompt_lengths(meta):
    """Short of the prefill minimum, one token, exactly one chunk, a chunk plus a one-token tail, several."""
    lo, hi = meta["min_prefill_chunk"], meta["max_prefill_chunk"]
    return sorted({1, 2, max(lo - 1, 1), lo, hi, hi + 1, min(2 * hi + 3, 40)})


def test_every_k_equals_greedy_from_one_pte(pte):
    """One loaded program, every K in [1, max_m-1], prompts shorter and longer than the prefill chunk."""
    max_m = pte.meta["max_m"]
    for n in prompt_lengths(pte.meta):
        base = generate(pte, PROMPT[:n], chain=0, max_new_tokens=16)
        assert base.rounds == 15  # one target_decode per token after the prefill bonus
        for k in range(1, max_m):
            assert generate(pte, PROMPT[:n], chain=k, max_new_tokens=16).output_ids == base.output_ids, (n, k)


def test_baseline_is_the_targets_own_greedy_decoding(pte, tiny_pte):
    target = tiny_pte.speculator().target
    seq = PROMPT[:9]
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(target(torch.tensor([seq]))[0, -1].argmax()))
    assert generate(pte, PROMPT[:9], chain=0, max_new_tokens=12).output_ids == seq[9:]


@pytest.mark.parametrize("spoil", [None, 0, 1, "alternate"])
def test_forced_acceptance_through_the_pte(pte, spoil):
    """Full acceptance (the bonus path at every T up to max_m), none, partial: always the greedy tokens."""
    n = pte.meta["min_prefill_chunk"]
    base = generate(pte, PROMPT[:n], chain=0, max_new_tokens=30)
    seq = PROMPT[:n] + base.output_ids
    for k in range(1, pte.meta["max_m"]):
        wrong = {None: lambda j: False, 0: lambda j: j == 0, 1: lambda j: j == 1,
                 "alternate": lambda j: j == k // 2}[spoil]
        res = generate(Oracle(pte, seq, wrong), PROMPT[:n], chain=k, max_new_tokens=30)
        assert res.output_ids == base.output_ids, (spoil, k)
        full = [a for c, a in zip(res.chain_per_round, res.accepted) if c == k]
        expect = {None: k, 0: 0, 1: min(1, k), "alternate": k // 2}[spoil]
        assert full and all(a == expect for a in full), (spoil, k, res.accepted)
        if spoil is None:  # k + 1 tokens per round, one target_verify each
            assert res.rounds == -(-29 // (k + 1))


def test_pte_and_eager_engines_give_the_same_tokens(pte, eager):
    for n in (3, pte.meta["max_prefill_chunk"] + 2):
        for k in (0, 1, pte.meta["max_m"] - 1):
            a = generate(pte, PROMPT[:n], chain=k, max_new_tokens=20).output_ids
            assert generate(eager, PROMPT[:n], chain=k, max_new_tokens=20).output_ids == a, (n, k)


class Counted:
    """`engine` with its draft_decode and draft_chain calls counted, and its chain calls off unless `chains`."""

    def __init__(self, engine, chains: bool):
        self.engine, self.meta, self.draft_chains, self.calls = engine, engine.meta, chains, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def draft_decode(self, *inputs):
        self.calls.append("draft_decode")
        return self.engine.draft_decode(*inputs)

    def draft_chain(self, k, *inputs):
        self.calls.append(f"draft_chain_{k}")
        return self.engine.draft_chain(k, *inputs)


def test_a_greedy_round_drafts_in_one_chain_call_proposing_what_single_steps_propose(pte):
    """With the program's draft_chain_<k>, a round's draft is one call (the prompt's seeding aside); every
    round accepts what the round drafted step by step accepts, so the proposals were the same. Prompt
    lengths under, at and past max_m rows (the rows a chain call seeds on)."""
    m = pte.meta["max_m"]
    for n, k in ((3, 1), (m, m - 1), (25, int(torch.randint(2, m, ())))):
        one, steps = Counted(pte, chains=True), Counted(pte, chains=False)
        seq = PROMPT[:n] + generate(pte, PROMPT[:n], chain=0, max_new_tokens=20).output_ids
        got = generate(Oracle(one, seq, wrong=lambda j: j == 2), PROMPT[:n], chain=k, max_new_tokens=20)
        want = generate(Oracle(steps, seq, wrong=lambda j: j == 2), PROMPT[:n], chain=k, max_new_tokens=20)
        assert got.output_ids == want.output_ids == seq[n:] and got.accepted == want.accepted, (n, k)
        chains = [c for c in one.calls if c.startswith("draft_chain")]
        assert len(chains) == got.rounds - (got.chain_per_round[-1] == 0) and set(chains) <= {
            f"draft_chain_{j}" for j in range(1, k + 1)}, (n, k, one.calls)
        chunk = max(pte.meta["max_prefill_chunk"], m)  # the prompt's rows before the last max_m, in chunks
        assert one.calls.count("draft_decode") == -(-max(n - m, 0) // chunk), (n, one.calls)
        assert steps.calls.count("draft_decode") >= got.rounds and "draft_chain_1" not in steps.calls


def test_sampling_on_the_pte_is_seeded(pte):
    run = lambda seed: generate(pte, PROMPT[:8], chain=3, temperature=1.0, seed=seed, max_new_tokens=20).output_ids  # noqa: E731
    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_chain_out_of_range_is_refused_naming_the_range_from_the_pte(pte):
    max_m = pte.meta["max_m"]
    for k in (max_m, -1, max_m + 3):
        with pytest.raises(ValueError, match=rf"K={k} is outside the valid range \[1, {max_m - 1}\]"):
            generate(pte, PROMPT[:5], chain=k)
    assert generate(pte, PROMPT[:5], chain=None, max_new_tokens=5).chain == pte.meta["default_chain"]


def test_prompt_too_long_is_refused_naming_both_lengths(pte):
    n = pte.meta["max_seq_len"]
    with pytest.raises(ValueError, match=rf"prompt of {n + 5} tokens is too long for max_seq_len={n}"):
        generate(pte, [5] * (n + 5), chain=2)


def test_a_pte_without_the_constant_methods_is_refused(tmp_path):
    from executorch.exir import to_edge

    class Add(torch.nn.Module):
        def forward(self, x):
            return x + 1

    program = to_edge(torch.export.export(Add(), (torch.ones(2),))).to_executorch()
    (tmp_path / "bare.pte").write_bytes(program.buffer)
    with pytest.raises(ValueError, match=r"lacks the methods \['prefill', 'target_verify'.*get_max_m"):
        PteEngine(tmp_path / "bare.pte")


def test_outputs_survive_later_calls(pte):
    """The loop keeps prefill/verify features across calls: the engine must not hand out views of its arena."""
    first = pte.target_verify(torch.tensor([[5, 6, 7]]), torch.arange(3))
    kept = [x.clone() for x in first]
    pte.target_verify(torch.tensor([[9, 10]]), torch.arange(3, 5))
    pte.draft_decode(torch.tensor([[1, 2]]), torch.randn(1, 2, first[1].shape[-1]), torch.arange(2))
    assert all(torch.equal(a, b) for a, b in zip(first, kept))


def test_the_command_line_runner_prints_text_tau_and_timings(tiny_pte, tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from runner.__main__ import main

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<|eos|>": 1, **{f"w{i}": i for i in range(2, 256)}}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "prompts.txt").write_text("w5 w6 w7\nw9 w10\n")
    args = ["--pte", str(tiny_pte.path), "--tokenizer", str(tmp_path / "tokenizer.json"), "--max-new-tokens", "12"]
    assert main([*args, "--prompt-file", str(tmp_path / "prompts.txt"), "--chain", "2", "--rounds"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("w5 w6 w7") and out.count("--- chain K=2") == 2
    assert "tau" in out and "tokens/s" in out and "verify_ms" in out
    with pytest.raises(ValueError, match=r"outside the valid range \[1, 5\]"):
        main([*args, "--prompt", "w5", "--chain", "6"])
    main([*args, "--prompt", "w5 w6", "--chain", "0"])
    baseline = capsys.readouterr().out.split("\n")[0]
    assert main([*args, "--prompt", "w5 w6", "--chain", "2", "--exact-width", "3"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == baseline  # fp32: exact mode gives the T = 1 decode's text
    with pytest.raises(ValueError, match=r"outside the valid range \[1, 2\]"):
        main([*args, "--prompt", "w5", "--chain", "3", "--exact-width", "3"])
    # a prompt and its answer share the cache: refused before any prompt decodes, naming both numbers
    max_seq_len = tiny_pte.speculator().target.cfg.max_seq_len
    room = max_seq_len - 12
    (tmp_path / "long.txt").write_text("w5 w6\n" + " ".join(["w7"] * (room + 1)) + "\n")
    with pytest.raises(ValueError, match=rf"prompt 2 has {room + 1} tokens \+ --max-new-tokens 12 = "
                                         rf"{max_seq_len + 1}, more than the {max_seq_len} positions"):
        main([*args, "--prompt-file", str(tmp_path / "long.txt"), "--chain", "2"])
    assert capsys.readouterr().out == ""
    (tmp_path / "long.txt").write_text(" ".join(["w7"] * room) + "\n")
    assert main([*args, "--prompt-file", str(tmp_path / "long.txt"), "--chain", "2"]) == 0


def _pte_with_manifest(tiny_pte, where, files=None):
    """A copy of the tiny .pte in `where`, beside a manifest.json like the export artifact's."""
    import hashlib
    import json
    import shutil

    where.mkdir()
    path = where / "model.pte"
    shutil.copyfile(tiny_pte.path, path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    (where / "manifest.json").write_text(json.dumps({"stage": "export", "files": files or {"model.pte": sha}}))
    return path, sha


def test_a_pte_changed_after_export_is_refused_naming_the_file_and_both_hashes(tiny_pte, tmp_path):
    import hashlib

    path, recorded = _pte_with_manifest(tiny_pte, tmp_path / "export")
    assert PteEngine(path).meta["max_m"] == tiny_pte.max_m, "the recorded sha256 matches: it loads"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(ValueError, match=rf"{path}.*sha256 {actual}.*{tmp_path / 'export' / 'manifest.json'}"
                                         rf".*records {recorded}"):
        PteEngine(path)


def test_a_manifest_that_does_not_list_the_pte_is_refused(tiny_pte, tmp_path):
    path, _ = _pte_with_manifest(tiny_pte, tmp_path / "export", files={"other.bin": "0" * 64})
    with pytest.raises(ValueError, match=r"does not list model.pte"):
        PteEngine(path)


def test_a_pte_without_a_manifest_beside_it_is_loaded_with_one_warning(tiny_pte, caplog):
    with caplog.at_level("WARNING", logger="runner.engine"):
        PteEngine(tiny_pte.path)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"no manifest beside {tiny_pte.path}: its contents are not checked"]


def test_the_command_line_runner_refuses_a_changed_pte(tiny_pte, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path, recorded = _pte_with_manifest(tiny_pte, tmp_path / "export")
    path.write_bytes(path.read_bytes() + b"\0")
    (tmp_path / "tokenizer.json").write_text("{}")  # never read: the .pte is checked first
    res = subprocess.run([sys.executable, "-m", "runner", "--pte", str(path), "--tokenizer",
                          str(tmp_path / "tokenizer.json"), "--prompt", "w5"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"error: {path} has sha256 ") and recorded in res.stderr


@pytest.mark.parametrize("threads", [1, 2])
def test_the_runtime_pool_takes_torchs_thread_count_at_the_first_load(tiny_pte, threads):
    """In a fresh process (the pool is sized once per process): the XNNPACK pool follows torch's count, which
    the pipeline's `threads` sets, and a second load leaves it as the first one sized it."""
    import pathlib
    import subprocess
    import sys

    code = ("import sys, torch; torch.set_num_threads(int(sys.argv[2])); from runner.engine import PteEngine; "
            "from executorch.extension.pybindings import portable_lib as p; PteEngine(sys.argv[1]); "
            "torch.set_num_threads(3); PteEngine(sys.argv[1]); print('pool', p._threadpool_get_thread_count())")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_pte.path), str(threads)], capture_output=True,
                         text=True, check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert out.stdout.strip().splitlines()[-1] == f"pool {threads}"


def _fresh(code: str, *args, drop_omp: bool = False):
    import os
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not (drop_omp and k == "OMP_NUM_THREADS")}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=True,
                          env=env, cwd=pathlib.Path(__file__).resolve().parents[1], timeout=120)


# libgomp's default team for a thread torch never set (as the runtime's workers), read in a new thread
_OMP_DEFAULT = ("import ctypes, pathlib, threading; "
                "lib = ctypes.CDLL(str(pathlib.Path(torch.__file__).parent / 'lib' / 'libgomp.so.1')); seen = []; "
                "t = threading.Thread(target=lambda: seen.append(lib.omp_get_max_threads())); t.start(); t.join(); ")
_LIBGOMP = Path(torch.__file__).parent / "lib" / "libgomp.so.1"


@pytest.mark.skipif(not _LIBGOMP.is_file(), reason="a torch build without libgomp")
def test_threads_torch_never_set_open_teams_of_one_and_a_call_keeps_the_callers_count(tiny_pte):
    """A process that imports runner before torch: libgomp's default team (what a thread torch never set, as
    the runtime's workers, opens) is one, the main thread keeps the count set_threads gave it, and a program
    call leaves that count as it found it; a process that loads torch first keeps the default at all cores
    (models/threads.py)."""
    code = ("import sys; import runner, torch; from runner.engine import PteEngine, set_threads; set_threads(2); "
            + _OMP_DEFAULT + "e = PteEngine(sys.argv[1]); e.target_decode(torch.tensor([[1]]), torch.tensor([0])); "
            "print(seen[0], torch.get_num_threads())")
    assert _fresh(code, tiny_pte.path, drop_omp=True).stdout.split()[-2:] == ["1", "2"]
    first = "import sys, torch; import runner; " + _OMP_DEFAULT + "print(seen[0])"
    assert _fresh(first, tiny_pte.path, drop_omp=True).stdout.split()[-1] == str(len(os.sched_getaffinity(0)))


def test_a_pool_beside_teams_of_all_cores_is_warned_about_naming_the_variable(tiny_pte):
    """torch loaded before runner/ with OMP_NUM_THREADS unset: the first load says what it costs and the fix."""
    code = ("import sys, torch; torch.set_num_threads(2); from runner.engine import PteEngine; PteEngine(sys.argv[1])")
    err = _fresh(code, tiny_pte.path, drop_omp=True).stderr
    assert "OMP_NUM_THREADS is unset, not 1" in err and "import runner before torch" in err
    ok = ("import sys; import runner, torch; torch.set_num_threads(2); from runner.engine import PteEngine; "
          "PteEngine(sys.argv[1])")
    assert "OMP_NUM_THREADS" not in _fresh(ok, tiny_pte.path, drop_omp=True).stderr


# --- the runner checks its inputs (issue 45) ----------------------------------------------------------------
def word_tokenizer(path, n: int, prefix: str = "w"):
    """A tokenizer.json of exactly `n` tokens (ids 0..n-1), at `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|eos|>": 0, **{f"{prefix}{i}": i for i in range(1, n)}}, unk_token=f"{prefix}1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_a_file_that_is_not_a_program_is_refused_naming_it(tmp_path):
    text = tmp_path / "notes.pte"
    text.write_text("this is a text file, not a program\n")
    with pytest.raises(ValueError, match=rf"{text} is not an ExecuTorch program"):
        PteEngine(text)


def test_the_command_line_runner_refuses_a_text_file_as_pte_in_one_line(tmp_path):
    import subprocess
    import sys

    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    tok = word_tokenizer(tmp_path / "tokenizer.json", 256)
    r = subprocess.run([sys.executable, "-m", "runner", "--pte", str(text), "--tokenizer", str(tok), "--prompt", "w3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {text} is not an ExecuTorch program"), r.stderr


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_both(tiny_pte, tmp_path):
    tok = word_tokenizer(tmp_path / "big" / "tokenizer.json", 1000)
    with pytest.raises(ValueError, match=rf"tokenizer {tok} has 1000 tokens but {tiny_pte.path} .* 256"):
        PteEngine(tiny_pte.path, tokenizer=tok)
    assert PteEngine(tiny_pte.path, tokenizer=word_tokenizer(tmp_path / "ok" / "tokenizer.json", 256))


def store_of(tiny_pte, root, tokenizer_sha256):
    """A store holding the tiny .pte as an export artifact whose pairing facts record `tokenizer_sha256`, and
    an empty target artifact directory for a tokenizer."""
    import hashlib
    import json
    import shutil

    export = root / "export" / ("e" * 64)
    export.mkdir(parents=True)
    shutil.copyfile(tiny_pte.path, export / "model.pte")
    report = {"manifest_hash": tiny_pte.report["manifest_hash"], "pairing": {"tokenizer_sha256": tokenizer_sha256}}
    files = {"model.pte": hashlib.sha256((export / "model.pte").read_bytes()).hexdigest()}
    (export / "manifest.json").write_text(json.dumps({"stage": "export", "files": files, "report": report}))
    target = root / "target" / ("t" * 64)
    target.mkdir(parents=True)
    (target / "manifest.json").write_text(json.dumps({"stage": "target", "files": {}}))
    return export / "model.pte", target


def test_a_tokenizer_of_the_same_size_but_another_target_is_refused_by_its_hash(tiny_pte, tmp_path):
    import hashlib
    import shutil

    paired = word_tokenizer(tmp_path / "paired" / "tokenizer.json", 256)
    other = word_tokenizer(tmp_path / "other" / "tokenizer.json", 256, prefix="v")  # same size, other tokens
    sha = hashlib.sha256(paired.read_bytes()).hexdigest()
    pte, target = store_of(tiny_pte, tmp_path / "store", sha)
    shutil.copyfile(other, target / "tokenizer.json")
    other_sha = hashlib.sha256(other.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=rf"{target / 'tokenizer.json'} \(sha256 {other_sha}\) is not the one "
                                         rf"{pte} was exported with: .*manifest.json records tokenizer sha256 {sha}"):
        PteEngine(pte, tokenizer=target / "tokenizer.json")
    shutil.copyfile(paired, target / "tokenizer.json")
    assert PteEngine(pte, tokenizer=target / "tokenizer.json").meta["vocab_size"] == 256
    # the .pte copied out of the store: the facts are found through the tokenizer's store
    loose = tmp_path / "loose.pte"
    shutil.copyfile(pte, loose)
    shutil.copyfile(other, target / "tokenizer.json")
    with pytest.raises(ValueError, match=rf"is not the one {loose} was exported with"):
        PteEngine(loose, tokenizer=target / "tokenizer.json")
