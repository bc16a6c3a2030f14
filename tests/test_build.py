"""The one engine factory (runner.build): each conf/engine/<kind>.yaml is the arguments of one builder, and a bad
option, an unresolved `auto` or a missing artifact is refused naming it, before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from models.choices import ENGINES
from runner.build import build_engine, options_of

CONF = Path(__file__).resolve().parents[1] / "conf" / "engine"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", ENGINES)
def test_each_engine_config_is_the_arguments_of_its_builder(kind):
    cfg = OmegaConf.load(CONF / f"{kind}.yaml")
    keys = [k for k in cfg if k != "defaults"]
    assert cfg.kind == kind and set(keys) - {"kind"} == set(options_of(kind))


@pytest.mark.parametrize("options, artifacts, named", [
    ({"kind": "gpu"}, {}, "engine.kind='gpu': expected one of pte, eager, cuda"),
    ({"kind": "pte", "quant": "w4_g32"}, {}, "engine=pte takes no quant: its options are exact, exact_width"),
    ({"kind": "pte", "exact": "auto"}, {"pte": "m.pte", "tokenizer": "t.json"},
     "engine.exact='auto': expected a value"),
    ({"kind": "pte", "exact": True, "exact_width": "auto"}, {"pte": "m.pte", "tokenizer": "t.json"},
     "engine.exact_width='auto'"),
    ({"kind": "pte"}, {"tokenizer": "t.json"}, "engine=pte reads pte, tokenizer; missing: pte"),
    ({"kind": "cuda", "max_m": 8, "default_chain": 4, "max_prefill_chunk": 64}, {"target": "t"},
     "engine=cuda reads target, draft; missing: draft"),
    ({"kind": "cuda", "max_m": 8, "default_chain": 4, "max_prefill_chunk": 64, "compile": "max",
      "min_prefill_chunk": None, "device": "cuda", "quant": "bf16", "exact": False, "max_seq_len": 256},
     {"target": "t", "draft": "d"}, "engine.compile='max': expected one of none, inductor"),
    ({"kind": "pte"}, {"pte": "m.pte", "tokenizer": "t.json"}, "engine=pte needs engine.exact, engine.exact_width"),
])
def test_a_bad_engine_option_is_refused_naming_it_before_anything_loads(options, artifacts, named):
    with pytest.raises(ValueError) as e:
        build_engine(options, **artifacts)
    assert named in str(e.value)


def test_exact_width_is_read_only_in_exact_mode(tmp_path):
    """exact=false leaves exact_width `auto` unresolved (pipeline.hardware resolves it only in exact mode)."""
    with pytest.raises(FileNotFoundError, match="no .pte at"):
        build_engine({"kind": "pte", "exact": False, "exact_width": "auto"}, pte=tmp_path / "absent.pte",
                     tokenizer=tmp_path / "tokenizer.json")


@pytest.mark.parametrize("module", ["runner", "runner.serve"])
def test_the_command_lines_refuse_an_engine_without_its_artifacts_in_one_line(module):
    proc = subprocess.run([sys.executable, "-m", module, "--engine", "cuda", "--tokenizer", "t.json",
                           *(["--prompt", "x"] if module == "runner" else [])],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"python -m {module}: error: --engine cuda needs --target --draft --max-m --max-prefill-chunk --chain"]
