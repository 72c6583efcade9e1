"""A progress line with the time left, for long loops of similar items (the calibration
sweep). On a terminal one line is redrawn in place (``\\r``); anywhere else (a CI log, a
pipe through ``tee``) a plain line is written every ``every_s`` seconds, since a log would
keep every redraw; disabled, nothing at all. The clock, the stream and whether it is a
terminal can be given, so tests drive it without waiting or a terminal.
"""

from __future__ import annotations

import shutil
import sys
import time

# a terminal redraws at most this often: a sweep of fast items would otherwise spend its time
# writing to the terminal
REDRAW_S = 0.1
EVERY_S = 30.0


def format_duration(seconds: float) -> str:
    """'45s', '3m05s', '1h02m': short enough for the line, exact enough for a wait."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):      # no isatty, or a closed stream
        return False


class Progress:
    """``total`` items, ``advance()`` after each; ``close()`` at the end (or use it as a
    context manager, which also ends a line cut off by an exception)."""

    def __init__(self, total: int, stream=None, *, label: str = "progress", unit: str = "items",
                 enabled: bool = True, tty: bool | None = None, width: int | None = None,
                 clock=time.monotonic, every_s: float = EVERY_S, redraw_s: float = REDRAW_S):
        self.total = max(0, int(total))
        self.stream = sys.stderr if stream is None else stream
        self.label, self.unit = label, unit
        self.enabled = enabled and self.stream is not None
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.width = width if width is not None else shutil.get_terminal_size((80, 24)).columns
        self.clock = clock
        self.every_s, self.redraw_s = every_s, redraw_s
        self.done = 0
        self.note = ""
        self.start = clock()
        self._first_done = None        # when the first item ended (see seconds_left)
        self._last_write = None
        self._drawn = 0                # characters of the line on the terminal now
        self._text = ""                # and the line
        self._closed = False

    # -- the numbers ---------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.start

    def seconds_left(self) -> float | None:
        """The mean time of the items since the first, times the items left; None before two
        items are done. The first is left out: it carries the start-up (compiling the
        kernels, the first allocation), which the others do not pay."""
        if self.done >= self.total:
            return 0.0
        if self.done < 2 or self._first_done is None:
            return None
        per_item = (self.clock() - self._first_done) / (self.done - 1)
        return per_item * (self.total - self.done)

    def _parts(self) -> tuple[int, str, float | None, bool]:
        """(percent done, the time elapsed, seconds left or None, whether it is finished)."""
        pct = 100 * self.done // self.total if self.total else 100
        return (pct, format_duration(self.elapsed()), self.seconds_left(),
                self.done >= self.total)

    def status(self) -> str:
        """'412/1230 plans (33%), 2m05s elapsed, about 4m10s left'."""
        pct, elapsed, left, finished = self._parts()
        text = f"{self.done}/{self.total} {self.unit} ({pct}%), {elapsed} elapsed"
        if finished:
            return text
        return text + (", estimating the time left" if left is None
                       else f", about {format_duration(left)} left")

    def line(self) -> str:
        """The terminal's line: label, bar, a shorter status than a log's (a terminal of 80
        columns holds it) and the note, cut to the width, the note first."""
        pct, elapsed, left, finished = self._parts()
        status = f"{self.done}/{self.total} {self.unit} {pct}%, {elapsed} elapsed"
        if not finished:
            status += (", estimating time left" if left is None
                       else f", ~{format_duration(left)} left")
        # one column short of the width: a line that fills it wraps on some terminals
        limit = max(20, self.width - 1)
        # the bar gives up columns (down to 10) to leave about 20 for the note; sized by the
        # longest status of the run, so it keeps its width from the first line to the last
        widest = len(f"{self.total}/{self.total} {self.unit} 100%, 0m00s elapsed, ~0m00s left")
        bar_width = max(10, min(30, limit - len(self.label) - widest - 24))
        filled = bar_width * self.done // self.total if self.total else bar_width
        text = f"{self.label} [{'#' * filled}{'.' * (bar_width - filled)}] {status}"
        room = limit - len(text) - 2
        if self.note and room >= min(len(self.note), 8):
            note = self.note if len(self.note) <= room else self.note[:room - 3] + "..."
            text += f"  {note}"
        return text[:limit]

    # -- output --------------------------------------------------------------------------
    def advance(self, n: int = 1, note: str = "") -> None:
        """``n`` more items done; ``note`` (the last item, say) shows at the line's end."""
        now = self.clock()
        self.done = min(self.total, self.done + n)
        if self._first_done is None and self.done:
            self._first_done = now
        self.note = note
        if not self.enabled:
            return
        finished = self.done >= self.total
        if self.tty:
            if finished or self._last_write is None or now - self._last_write >= self.redraw_s:
                self._draw(now)
        elif finished or (self.seconds_left() is not None and (
                self._last_write is None or now - self._last_write >= self.every_s)):
            # the first line waits for the first estimate of the time left
            self._write(f"{self.label}: {self.status()}\n", now)

    def write(self, text: str, stream=None) -> None:
        """Print a line of ``text`` to ``stream`` (default: this one) without breaking the
        line on the terminal: it is cleared first and drawn again after."""
        stream = self.stream if stream is None else stream
        redraw = self.enabled and self.tty and self._drawn
        if redraw:
            self._clear()
        print(text, file=stream, flush=True)
        if redraw:
            self._draw(self.clock())

    def close(self) -> None:
        """End the output: a terminal's line is ended with a newline (at 100% if every item
        was done); a log gets its last line if the last item's was not written."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self.tty:
            if self._drawn:
                if self.line() != self._text:       # items done since the last redraw
                    self._draw(self.clock())
                self._write("\n", None)
                self._drawn = 0
        elif 0 < self.done < self.total:
            self._write(f"{self.label}: stopped at {self.status()}\n", None)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _draw(self, now: float) -> None:
        text = self.line()
        # spaces over what is left of a longer line drawn before
        pad = " " * max(0, self._drawn - len(text))
        self._write("\r" + text + pad, now)
        self._drawn, self._text = len(text), text

    def _clear(self) -> None:
        self._write("\r" + " " * self._drawn + "\r", None)
        self._drawn = 0

    def _write(self, text: str, now: float | None) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):      # a closed or broken stream: progress is optional
            self.enabled = False
        if now is not None:
            self._last_write = now
