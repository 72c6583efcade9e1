"""splitkv's notices (records of the ``splitkv`` logger) as a test sees them, through pytest's
``caplog``: the ``notices`` fixture (conftest.py) is ``logged`` bound to it."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager


class Said(list):
    """The records logged inside a ``logged`` block, oldest first."""

    @property
    def messages(self) -> list[str]:
        return [record.getMessage() for record in self]

    def at(self, level: int) -> list[str]:
        return [record.getMessage() for record in self if record.levelno == level]


@contextmanager
def logged(caplog, match: str | None = None, level: int = logging.INFO):
    """The records of ``level`` or above that the ``splitkv`` logger (or a child of it) gave
    inside the block, filled in at its end. With ``match``, at least one message must match
    it (``re.search``), as ``pytest.warns(match=)`` asks of a warning; without, nothing is
    asked (``assert not said`` asks for quiet)."""
    said = Said()
    with caplog.at_level(level, logger="splitkv"):
        start = len(caplog.records)
        yield said
        said.extend(r for r in caplog.records[start:]
                    if r.name == "splitkv" or r.name.startswith("splitkv."))
    if match is not None:
        assert any(re.search(match, m) for m in said.messages), (
            f"no splitkv notice matched {match!r}; said: {said.messages}")
