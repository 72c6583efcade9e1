"""A profile's file, below its fields: bounded reading, the seal that detects a copy cut short,
the YAML document's shape, and atomic writes. ``profiles.Profile`` checks the fields.

A profile is a few KiB, so the bounds refuse a damaged file before it costs memory or recursion
(values are counted through YAML aliases: a few lines must not stand for millions). A sealed
file's first line holds the byte count and SHA-256 of the text after it (line ends ``\\n``):
because the seal comes first, every prefix of a sealed file is refused. Unsealed files (older,
or written by hand) are read as they are.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import secrets
from pathlib import Path

import yaml

MAX_PROFILE_BYTES, MAX_YAML_DEPTH, MAX_VALUES = 1 << 20, 32, 10_000
SEAL_PREFIX = "# splitkv profile seal: "
SEAL_LINE = re.compile(r"# splitkv profile seal: (\d+) bytes, sha256 ([0-9a-f]{64})(?: .*)?")


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, not valid YAML, wrong fields, or made
    for another device."""


def sealed(body: str) -> str:
    """``body`` with the seal line in front."""
    data = body.encode("utf-8")
    return (f"{SEAL_PREFIX}{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()} "
            "(of the lines below; delete this line to keep a hand edit)\n" + body)


def write_atomically(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, and
    threads or processes writing at once each leave a whole file: each call writes its own
    temporary file, flushed to disk, then renames it over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    try:
        with open(tmp, "xb") as f:        # a new file of this call's own (the umask applies)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_bytes(path) -> bytes:
    """A profile file's bytes, at most one more than ``MAX_PROFILE_BYTES``; ``ProfileError``
    naming the file if it cannot be read."""
    try:
        with open(Path(path), "rb") as f:
            return f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ProfileError(f"profile {path}: cannot read it ({e.strerror or e})") from e


def read_document(data: bytes, origin: str):
    """The YAML document in a profile file's bytes, its seal checked; ``ProfileError`` naming
    ``origin`` and what is wrong (too large, binary, cut short, not YAML, nested too deep)."""
    def bad(msg):
        return ProfileError(f"profile {origin}: {msg}")

    if len(data) > MAX_PROFILE_BYTES:
        raise bad(f"more than {MAX_PROFILE_BYTES:,} bytes; a profile is a few KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8 text (a binary or damaged file: {e.reason} at byte {e.start})") \
            from None
    if text.startswith(SEAL_PREFIX):
        first, _, text = text.partition("\n")
        seal = SEAL_LINE.fullmatch(first.rstrip("\r"))
        if seal is None or not text:
            raise bad(f"its seal (first line) is malformed or cut short: {first[:120]!r}")
        body = text.replace("\r\n", "\n").encode("utf-8")
        size = int(seal.group(1))
        if len(body) != size or hashlib.sha256(body).hexdigest() != seal.group(2):
            what = "cut short (a write or copy interrupted)" if len(body) < size else "damaged"
            raise bad(f"{what}, or edited since it was written: {len(body)} bytes where its "
                      f"seal (first line) records {size} and their SHA-256 (delete the seal "
                      "line to keep a hand edit)")
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as e:
        # a ValueError: an impossible date (2026-13-45); a RecursionError: a deep nesting
        raise bad(f"not valid YAML ({yaml_problem(e)})") from None


def yaml_problem(e: Exception) -> str:
    """What a YAML parse failed on, in one line: where and what (PyYAML's marks are 0-based)."""
    if isinstance(e, RecursionError):
        return "nested too deep"
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def record_problem(data) -> str | None:
    """What is wrong with a document's shape, else None: YAML's plain values in mappings and
    lists, at most ``MAX_YAML_DEPTH`` deep, ``MAX_VALUES`` values (aliases counted each time
    they are used); the fields' own checks come after."""
    plain, stack = (str, int, float, bool, type(None), datetime.date), [(data, 1, "")]
    for _ in range(MAX_VALUES):
        if not stack:
            return None
        value, depth, where = stack.pop()
        for k, v in value.items() if isinstance(value, dict) else \
                enumerate(value) if isinstance(value, list) else ():
            at = f"{where}.{k}" if where else str(k)
            if depth >= MAX_YAML_DEPTH or not isinstance(k, plain) \
                    or not isinstance(v, (*plain, dict, list)):
                return (f"{at}: expected plain values in mappings and lists at most "
                        f"{MAX_YAML_DEPTH} deep, got {type(v).__name__} {v!r:.40}")
            stack.append((v, depth + 1, at))
    return f"more than {MAX_VALUES:,} values" if stack else None
