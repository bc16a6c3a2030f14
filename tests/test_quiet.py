"""What a user sees: the known third-party noise is dropped at import, other messages of the same loggers are not."""

import subprocess
import sys


def test_known_third_party_messages_are_dropped_and_others_kept():
    code = ("import pipeline, logging, torchao, torchao.quantization; "
            "logging.getLogger('torchao').warning('a torchao message that matters')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Failed to load" not in r.stderr and "_pytree" not in r.stderr, r.stderr
    assert "a torchao message that matters" in r.stderr


def test_executorchs_custom_ops_library_lookup_is_dropped_from_the_root_logger():
    code = ("import logging, runner; logging.basicConfig(level=logging.INFO); from models.layers import load_llama_ops; "
            "load_llama_ops(); logging.getLogger().info('a root message that matters')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "custom_ops_aot_lib" not in r.stderr and "a root message that matters" in r.stderr, r.stderr


def test_native_stderr_drops_only_the_known_lines():
    code = ("import os, warnings, runner; from models import quiet\n"
            "with quiet.native_stderr():\n"
            "    os.write(2, b'[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\\nkeep this line\\n')\n"
            "warnings.warn('`isinstance(treespec, LeafSpec)` is deprecated, use ...', FutureWarning)\n"
            "warnings.warn('another future warning', FutureWarning)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cpuinfo_utils" not in r.stderr and "LeafSpec" not in r.stderr, r.stderr
    assert "keep this line" in r.stderr and "another future warning" in r.stderr
