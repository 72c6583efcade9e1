"""splitkv's notices to the people who run it: one logger, ``logging.getLogger("splitkv")``.

What the library has to tell an operator (a profile, first-use model or precompiled kernel
skipped as broken, a GPU probed or calibrated on first use, a cache it cannot write, planning
with the roofline prior) is a record of this logger: WARNING where something is wrong or a
fallback was taken, INFO where all went as designed. An engine routes and silences them as it
does its own logs (a ``warnings.warn`` repeats in every worker process and cannot be routed).
The package adds a ``NullHandler`` to it (``splitkv/__init__.py``), so nothing prints until the
application configures logging. ``caught_notices`` gathers them instead, for the command line,
which prints them its own way.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

LOGGER_NAME = "splitkv"
logger = logging.getLogger(LOGGER_NAME)


@contextmanager
def caught_notices(level: int = logging.INFO):
    """The records logged to the ``splitkv`` logger inside the block, in a list, and passed to
    no handler (``warnings.catch_warnings(record=True)``'s counterpart): every record of
    ``level`` or above, whatever level the logger is set to. Like ``catch_warnings`` it is not
    thread-safe: a notice another thread logs meanwhile is caught too."""
    caught: list[logging.LogRecord] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.levelno >= level:
            caught.append(record)
        return False                  # no handler of this logger or its parents sees it

    saved = logger.level
    logger.addFilter(keep)
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield caught
    finally:
        logger.removeFilter(keep)
        logger.setLevel(saved)
