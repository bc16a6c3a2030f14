"""Known third-party log messages that say nothing about the user's run, dropped where they are logged.

Each entry names where the message comes from and a pattern of it; everything else still reaches the
screen. The Python ones (loggers, warnings) are filtered from the moment `runner` or `pipeline` is
imported, before torchao is; the native ones (ExecuTorch's C++ runtime writes to file descriptor 2) are
filtered around the one call that prints them (`native_stderr`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings

KNOWN = {
    # torchao's CPU wheel ships CUDA-only extensions (cutlass, mxfp8) and logs each failed load.
    "torchao": re.compile(r"Failed to load .*torchao/_C[^/]*\.so"),
    # torchao registers an Enum as a pytree constant, which torch 2.13 deprecates with a warning per import.
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
    # ExecuTorch logs each constant it duplicates while lowering, on the root logger.
    "root": re.compile(r"^Copying constant nodes "),
}
KNOWN_WARNINGS = (
    # torch.export pickles pytree specs through an API torch 2.13 deprecates, a warning per lowered method.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # ExecuTorch notes that a mutated buffer's initial value is not serialised: the KV caches are meant so
    # (every slot is written before the causal mask lets it be read; pipeline/export_pte.py).
    (r"Mutation on a buffer in the model is detected", UserWarning),
)
# XNNPACK's CPU probe, on the first delegate call of a process, reports ARM-only files it cannot find.
KNOWN_NATIVE = re.compile(r"^\[cpuinfo_utils\.cpp:\d+\]")


class _DropKnown(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def install() -> None:
    """Add each KNOWN filter to its logger and each KNOWN_WARNINGS filter, once (idempotent)."""
    for name, pattern in KNOWN.items():
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(pattern))
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


@contextlib.contextmanager
def native_stderr(drop: re.Pattern = KNOWN_NATIVE):
    """Hold what is written to file descriptor 2 inside the block and write back the lines `drop` does not
    match when it ends (native code writes there directly, past Python's logging)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not drop.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
