"""What the subcommands' arguments may be, checked as argparse parses them: each ``type=``
function here turns one argument's text into its value or raises ``ArgumentTypeError`` saying
what was expected, and ``Parser`` prints that as one line (``splitkv plan: error: argument
--batch: ...``) and exits 2, before any work. Limits of the library itself (head dims, GQA
groups, dtypes) are the library's checks in ``core.validation``, called from here, not copied.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..core import validation as V

INT32_MAX = 2**31 - 1     # lengths, page sizes, heads, splits: the plan and kernel arrays are int32
MAX_BATCH = 2**20         # requests planned from the command line (a batch is one array of lengths)


def one_line(message) -> str:
    """``message`` with its line breaks and other unprintable characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))


def refuse(command: str, message, status: int = 2) -> int:
    """Print why ``splitkv <command>`` cannot go on with the arguments it was given, as one line
    on stderr; the exit status 2 (or ``status``)."""
    print(f"splitkv {command}: {one_line(message)}", file=sys.stderr)
    return status


def unavailable(command: str, message) -> int:
    """``refuse`` for what this machine lacks (a GPU, NVRTC, the GPU runtime): exit status 1,
    the arguments were fine, so a script can tell a wrong call (2) from the wrong machine."""
    return refuse(command, message, 1)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        # argparse quotes most values it names with repr(), not "unrecognized arguments: ..."
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def quote(text: str, limit: int = 60) -> str:
    """``text`` quoted for an error message, cut to about ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text):,} characters)"


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {quote(text)}") from None


def int_range(minimum: int, maximum: int | None = None):
    """A type: an integer in minimum..maximum (no upper limit for None)."""
    what = (f"an integer from {minimum:,} to {maximum:,}" if maximum is not None
            else f"an integer >= {minimum:,}")

    def parse(text: str) -> int:
        value = _int(text, what)
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = int_range(1, INT32_MAX)
non_negative_int = int_range(0)          # seeds: NumPy takes any non-negative integer
batch_size = int_range(1, MAX_BATCH)
tokens = int_range(0, INT32_MAX)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {quote(text)}")
    return value


def lengths(text: str) -> list[int]:
    """'100,2000,30000': one token count per request, at least one, none left empty."""
    parts = text.split(",")
    if len(parts) > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_BATCH:,} lengths, got {len(parts):,}")
    what = "comma-separated token counts like 100,2000,30000"
    out = []
    for i, part in enumerate(parts):
        if not part.strip():
            raise argparse.ArgumentTypeError(f"expected {what}; entry {i} of {quote(text)} is empty")
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what}; entry {i} of {quote(text)} is {quote(part)}") from None
        if not 0 <= value <= INT32_MAX:
            raise argparse.ArgumentTypeError(
                f"entry {i}: expected a token count from 0 to {INT32_MAX:,}, got {value}")
        out.append(value)
    return out


def heads(text: str) -> tuple[int, int]:
    """'32/8': query heads / kv heads, checked as the library checks them."""
    parts = text.split("/")
    what = "QO/KV heads like 32/8"
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected {what}, got {quote(text)}")
    hq, hk = (_int(p, what) for p in parts)
    for name, value in (("query", hq), ("kv", hk)):
        if not 1 <= value <= INT32_MAX:
            raise argparse.ArgumentTypeError(
                f"expected {name} heads from 1 to {INT32_MAX:,}, got {value} in {quote(text)}")
    return _library(lambda: V.check_heads(hq, hk))


def head_dim(text: str) -> int:
    value = _int(text, f"one of {V.SUPPORTED_HEAD_DIMS}")
    return _library(lambda: V.check_head_dim(value))


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        why = "is a directory" if os.path.isdir(text) else "no such file"
        raise argparse.ArgumentTypeError(f"expected an existing file, got {quote(text)} ({why})")
    return text


def output_file(text: str) -> str:
    """A file to write, checked before the run rather than after minutes of measuring: not a
    directory, and its nearest existing folder a folder one may write in (missing folders are
    made when it is written)."""
    path = os.path.abspath(text) if text else ""
    if not text or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"expected a file path to write, got {quote(text)}")
    folder = os.path.dirname(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"cannot write {quote(text)}: {folder!r} is not a folder this user can write in")
    return text


def name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a name, got {quote(text)}")
    return text


def _library(check):
    """The library's check of a value, its TypeError or ValueError as an argument error."""
    try:
        return check()
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fp8_kv_dtype(text: str) -> str:
    """--kv-dtype: an fp8 format, by its ml_dtypes / torch name or vLLM's."""
    from ..core.fp8 import fp8_format

    try:
        return fp8_format("--kv-dtype", text)
    except ValueError as exc:          # the library's message lists every name it takes
        message = str(exc).removeprefix("--kv-dtype: ")
        raise argparse.ArgumentTypeError(message.replace("expected None or an", "expected an")) \
            from None
