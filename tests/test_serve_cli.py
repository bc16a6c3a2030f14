"""The command lines refuse in one line with the right exit status, never a traceback: `python -m runner` and
`python -m runner.serve` (runner.cli) on a truncated .pte without a manifest, a missing file, values out of
range, a broken chat template, a port in use or a host that does not resolve (refused before the program
loads), and `python -m pipeline` on a paths.outputs that cannot hold its files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess per case

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 120) -> tuple[int, list[str], float]:
    """(exit status, stderr's lines other than logged warnings, seconds) of `python *args`."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in (r.stderr + r.stdout).splitlines() if line.strip() and not line.startswith("WARNING:")]
    return r.returncode, lines, time.monotonic() - t0


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_pte):
    """A tokenizer of the tiny .pte's 256 ids, the .pte cut to a tenth in a directory without a manifest, a
    broken chat template and a plain file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("cli")
    tok = Tokenizer(models.WordLevel({"<|eos|>": 0, **{f"w{i}": i for i in range(1, 256)}}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "cut").mkdir()
    data = tiny_pte.path.read_bytes()
    (d / "cut" / "model.pte").write_bytes(data[:len(data) // 10])
    (d / "broken.jinja").write_text("{% for message in messages %}{{ message['content'] }")
    (d / "a_file").write_text("not a directory\n")
    return d


@pytest.mark.parametrize("module", ["runner", "runner.serve"])
@pytest.mark.parametrize("case, says, code", [
    ("cut", "is not a program the ExecuTorch runtime can load (", 2),
    ("no pte", "no .pte at ", 2),
    ("no tokenizer", "no tokenizer at ", 2),
    ("temperature nan", "argument --temperature: expected a finite number", 2),
])
def test_a_refusal_is_one_line_and_exit_2(files, tiny_pte, module, case, says, code):
    pte = {"cut": files / "cut" / "model.pte", "no pte": files / "none.pte"}.get(case, tiny_pte.path)
    tok = files / ("none.json" if case == "no tokenizer" else "tokenizer.json")
    extra = ["--temperature", "nan"] if case == "temperature nan" else []
    args = ["--prompt", "w5"] if module == "runner" else ["--port", "0"]
    status, lines, _ = run("-m", module, "--pte", str(pte), "--tokenizer", str(tok), *args, *extra)
    assert status == code and len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize("args, says", [
    (["-m", "runner", "--prompt", "w5", "--max-new-tokens", "-5"], "argument --max-new-tokens: expected an integer in"),
    (["-m", "runner.serve", "--port", "0", "--temperature", "5"],
     "argument --temperature: expected a finite number in [0, 2]"),
    (["-m", "runner.serve", "--port", "0", "--chat-template", "BROKEN"], "the chat template fails on a plain user"),
    (["-m", "runner.serve", "--host", "no-such-host.invalid"], "host 'no-such-host.invalid' does not resolve"),
])
def test_a_bad_value_is_refused_in_one_line_before_anything_runs(files, tiny_pte, args, says):
    args = [str(files / "broken.jinja") if a == "BROKEN" else a for a in args]
    status, lines, _ = run(*args, "--pte", str(tiny_pte.path), "--tokenizer", str(files / "tokenizer.json"))
    assert status == 2 and len(lines) == 1 and says in lines[0], lines


def test_a_port_in_use_is_refused_in_one_line_before_the_program_loads(files):
    """Exit 1 (the system refused), naming the address; the .pte given is a truncated one, so the refusal
    shows the address is bound before the program is read."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        status, lines, _ = run("-m", "runner.serve", "--pte", str(files / "cut" / "model.pte"), "--tokenizer",
                               str(files / "tokenizer.json"), "--port", str(port))
    assert status == 1 and len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines


@pytest.mark.parametrize("outputs", ["a_file", "a_file/under"])
def test_the_pipeline_refuses_a_paths_outputs_that_cannot_hold_its_files_in_one_line(files, outputs):
    status, lines, _ = run("-m", "pipeline", "+stage=target", f"paths.outputs={files / outputs}", timeout=300)
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"error: paths.outputs={files / outputs} "), lines
