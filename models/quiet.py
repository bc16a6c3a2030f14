"""Third-party output that says nothing about the user's run, muted in one place.

Three kinds, one helper each, for every package here (models, runner, pipeline, bench) to use:
- `install`: known log messages and warnings (KNOWN, KNOWN_WARNINGS) dropped where they are logged, from the
  moment `runner` or `pipeline` is imported, before torchao is; every other message of the same loggers stays;
- `native_stderr`: what native code writes to file descriptor 2 (ExecuTorch's C++ runtime, XNNPACK's CPU
  probe), held around the one call that prints it and written back without the known lines;
- `muted` and `quiet_transformers`: a library's chatter about its own internals (a logger's warnings, Python
  warnings, transformers' progress bars) silenced for the duration of one call into it, then restored.
It lives in models/, the floor every other package stands on, and imports nothing of this project.
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
    # ExecuTorch logs each constant it duplicates while lowering, and where it finds its custom ops library
    # when a process first loads it, on the root logger.
    "root": re.compile(r"^(Copying constant nodes |Looking for libcustom_ops_aot_lib\.so|Loading custom ops library: )"),
}
KNOWN_WARNINGS = (
    # torch.export pickles pytree specs through an API torch 2.13 deprecates, a warning per lowered method.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # ExecuTorch notes that a mutated buffer's initial value is not serialised: the KV caches are meant so
    # (every slot is written before the causal mask lets it be read; pipeline/export_pte.py).
    (r"Mutation on a buffer in the model is detected", UserWarning),
    # llama::update_cache's meta function (executorch 1.5.1) calls the deprecated torch._check_is_size on every trace.
    (r"_check_is_size will be removed", FutureWarning),
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


@contextlib.contextmanager
def muted(*loggers: str, level: int = logging.ERROR):
    """Inside the block the named loggers pass only records at `level` or above and Python warnings are dropped;
    both are restored after."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, lvl in saved.items():
            logging.getLogger(name).setLevel(lvl)


@contextlib.contextmanager
def quiet_transformers(progress: bool = True, desc: str = "target: dequantise"):
    """transformers' logging at ERROR, its progress bars off and Python warnings dropped inside the block
    (each restored after); its GGUF dequantisation loop shows our tqdm bar instead of its own (none when
    `progress` is false)."""
    from tqdm import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    saved_tqdm = getattr(gguf_utils, "tqdm", None)

    def bar(iterable=None, *args, **kwargs):
        return tqdm(iterable, desc=desc, unit="tensor", mininterval=1.0, dynamic_ncols=True, leave=False,
                    disable=not progress)

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if saved_tqdm is not None:
        gguf_utils.tqdm = bar
    try:
        with muted("gguf"):
            yield
    finally:
        if saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
