"""What the command lines of runner/ share (`python -m runner`, `python -m runner.serve`): every refusal reads as
one line and exits with its status, never a traceback.

A value the command line gets wrong (out of range, not a number, nan) is refused by the parser before anything
loads: `prog: error: argument --x: ...`, exit 2 (argparse's status, without its usage block: `--help` has it).
A file that is missing or is not what it should be (a tokenizer, a truncated .pte), and any other refusal the
code raises as a ValueError: `error: ...`, exit 2 (EXIT_REFUSED). What the system refuses (a port in use, a
directory that cannot be written): `error: ...`, exit 1 (EXIT_FAILED). A fault of ours still shows its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path

EXIT_REFUSED = 2  # the command line or its files are wrong
EXIT_FAILED = 1  # the system refused (an address in use, a permission)
NATIVE_LINE = re.compile(r"^\[[\w.]+:\d+\] ?")  # how ExecuTorch's runtime prefixes what it writes to stderr


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (the usage is --help's)."""

    def error(self, message: str):
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {message}\n")


def number(lo: float | None = None, hi: float | None = None):
    """An argparse type: a finite number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected a finite number in [{'-inf' if lo is None else f'{lo:g}'}, "
                                             f"{'inf' if hi is None else f'{hi:g}'}], got {text!r}")
        return v
    return parse


def integer(lo: int | None = None, hi: int | None = None):
    """An argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected an integer in [{'-inf' if lo is None else lo}, "
                                             f"{'inf' if hi is None else hi}], got {v}")
        return v
    return parse


def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file, or a one-line refusal naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def load_tokenizer(path: Path):
    """A tokenizer.json, or a one-line refusal naming it (tokenizers raises a bare Exception)."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a tokenizer.json that tokenizers reads ({e})") from None


def load_pte(path: Path, tokenizer: Path | None = None, *, verified: bool = False):
    """runner.engine.PteEngine over `path`, then `tokenizer` checked against it (runner.engine.check_tokenizer),
    in that order: the .pte's own refusals come first. `verified`: the caller (the store) has re-hashed the file
    against its manifest, so it is not hashed again. A program the runtime cannot load (a truncated or
    damaged file: a RuntimeError after a native message on stderr) is refused in one line carrying the message,
    and so is a tokenizer file that is missing or unreadable."""
    from runner.engine import PteEngine, check_tokenizer

    if not path.is_file():
        raise FileNotFoundError(f"no .pte at {path}")
    native: list[str] = []
    try:
        with held_stderr(native):
            engine = PteEngine(path, verified=verified)
    except RuntimeError as e:
        said = "; ".join([*(NATIVE_LINE.sub("", line) for line in native), str(e)])
        raise ValueError(f"{path} is not a program the ExecuTorch runtime can load ({said}): a truncated or "
                         "damaged file? Export it again (python -m pipeline +stage=export)") from None
    if tokenizer is not None:
        load_tokenizer(tokenizer)
        check_tokenizer(engine.path, engine.meta, tokenizer)
    return engine


@contextlib.contextmanager
def held_stderr(native: list[str]):
    """Hold what is written to file descriptor 2 in the block and write it back at the end, except, when the
    block raises, the native lines (NATIVE_LINE), which go to `native` for the caller's one-line error."""
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines = f.read().decode(errors="replace").splitlines(keepends=True)
            if not ok:
                native += [line.strip() for line in lines if NATIVE_LINE.match(line)]
                lines = [line for line in lines if not NATIVE_LINE.match(line)]
            if lines:
                sys.stderr.write("".join(lines))
                sys.stderr.flush()


def run(main) -> None:
    """The `if __name__ == "__main__"` of a runner command: logging at WARNING, then `main()`'s status, or a
    refusal in one line (module doc)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        code = main()
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    sys.exit(code)
