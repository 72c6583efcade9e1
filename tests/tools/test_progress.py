"""The calibration's progress line, driven by a fake clock and fake streams: redrawn in place
on a terminal, plain periodic lines in a log, nothing when disabled."""

from __future__ import annotations

import io

import pytest

from splitkv.calibration.progress import Progress, format_duration


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Stream(io.StringIO):
    """A stream that says whether it is a terminal, as sys.stderr does."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def run(progress, clock, steps, seconds_each):
    for i in range(steps):
        clock.now += seconds_each
        progress.advance(note=f"item {i}")


def test_durations_read_as_a_wait():
    assert [format_duration(s) for s in (0, 4.6, 59, 60, 185, 3599, 3600, 3725, -3)] == \
        ["0s", "5s", "59s", "1m00s", "3m05s", "59m59s", "1h00m", "1h02m", "0s"]


def test_time_left_leaves_out_the_first_item():
    clock = Clock()
    p = Progress(10, Stream(False), clock=clock, enabled=False)
    assert p.seconds_left() is None
    clock.now += 30.0                       # the first item compiles the kernels
    p.advance()
    assert p.seconds_left() is None
    clock.now += 2.0
    p.advance()
    assert p.seconds_left() == pytest.approx(2.0 * 8)
    clock.now += 4.0
    p.advance()
    assert p.seconds_left() == pytest.approx(3.0 * 7)   # (2 + 4) / 2 a item since the first
    run(p, clock, 7, 1.0)
    assert p.done == 10 and p.seconds_left() == 0.0


def test_a_terminal_gets_one_line_redrawn_in_place():
    clock, stream = Clock(), Stream(True)
    with Progress(400, stream, label="calibrating", unit="plans", clock=clock, width=120) as p:
        assert p.tty                        # found by asking the stream
        run(p, clock, 100, 0.5)
        out = stream.getvalue()
        assert "\n" not in out and out.startswith("\r")
        last = out.split("\r")[-1]
        assert last.startswith("calibrating [#######.......................] 100/400 plans "
                               "25%, 50s elapsed, ~2m30s left")
        assert last.endswith("left  item 99") and len(last) <= 119
        run(p, clock, 300, 0.5)
    out = stream.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1
    assert out.split("\r")[-1].rstrip(" \n") == (
        "calibrating [##############################] 400/400 plans 100%, 3m20s elapsed"
        "  item 299")


def test_an_80_column_terminal_drops_the_note_not_the_status():
    clock, stream = Clock(), Stream(True)
    p = Progress(1230, stream, label="calibrating", unit="plans", clock=clock, width=80)
    clock.now += 30
    p.advance(note="h32/8_d64_b16_n2048: chunk tokens 512 split_merge")
    for _ in range(411):
        clock.now += 0.5
        p.advance(note="h32/8_d64_b16_n2048: chunk tokens 512 split_merge")
    line = stream.getvalue().split("\r")[-1]
    assert line == "calibrating [###.......] 412/1230 plans 33%, 3m56s elapsed, ~6m49s left"
    p.width = 100                           # a wider one has room for it, cut
    clock.now += 0.5
    p.advance(note="h32/8_d64_b16_n2048: chunk tokens 512 split_merge")
    line = stream.getvalue().split("\r")[-1]
    assert line == ("calibrating [#####...........] 413/1230 plans 33%, 3m56s elapsed, "
                    "~6m48s left  h32/8_d64_b16_n20...")


def test_the_bar_keeps_its_width_from_the_first_line_to_the_last():
    # the status shortens as it ends ('estimating' at first, no time left at 100%): the bar
    # must not grow or shrink with it
    clock, stream = Clock(), Stream(True)
    with Progress(90, stream, label="calibrating", unit="plans", clock=clock, width=80) as p:
        run(p, clock, 90, 0.2)
    bars = {line.split("[")[1].split("]")[0] for line in stream.getvalue().split("\r")
            if "[" in line}
    assert len({len(b) for b in bars}) == 1 and "#" * len(next(iter(bars))) in bars


def test_a_terminal_is_redrawn_at_most_every_tenth_of_a_second():
    clock, stream = Clock(), Stream(True)
    p = Progress(1000, stream, clock=clock, width=80)
    run(p, clock, 1000, 0.01)               # 10 s of items, 1000 of them
    draws = stream.getvalue().count("\r")
    assert 85 <= draws <= 101               # about ten a second, and the last one
    assert "1000/1000" in stream.getvalue().split("\r")[-1]


def test_a_shorter_line_covers_the_longer_one_before_it():
    clock, stream = Clock(), Stream(True)
    p = Progress(10, stream, clock=clock, width=120)
    clock.now += 1
    p.advance(note="a long note about the first item")
    clock.now += 1
    p.advance(note="")
    first, second = stream.getvalue().split("\r")[1:]
    assert len(second) == len(first) and second.endswith(" ")


def test_a_line_is_cut_to_the_terminal_width():
    clock, stream = Clock(), Stream(True)
    p = Progress(10, stream, clock=clock, width=60)
    clock.now += 1
    p.advance(note="x" * 200)
    line = stream.getvalue().split("\r")[-1]
    assert len(line) == 59 and "x" not in line       # cut: no room for the note


def test_lines_printed_meanwhile_clear_the_bar_and_draw_it_again():
    clock, stream, out = Clock(), Stream(True), io.StringIO()
    p = Progress(10, stream, clock=clock, width=80)
    clock.now += 1
    p.advance()
    drawn = len(stream.getvalue()) - 1
    p.write("b1_n1024  no split  5.20 us", out)
    assert out.getvalue() == "b1_n1024  no split  5.20 us\n"
    line = stream.getvalue().split("\r")[-1]
    assert stream.getvalue().endswith("\r" + " " * drawn + "\r\r" + line)
    assert line.startswith("progress [") and len(line) == drawn


def test_a_log_gets_a_plain_line_every_30_seconds():
    clock, stream = Clock(), Stream(False)
    with Progress(100, stream, label="calibrate", unit="plans", clock=clock) as p:
        assert not p.tty
        run(p, clock, 100, 2.0)             # 200 s
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    # the first once the time left can be estimated (2 items), then each 30 s, then the end
    assert lines[0] == "calibrate: 2/100 plans (2%), 4s elapsed, about 3m16s left"
    assert lines[1] == "calibrate: 17/100 plans (17%), 34s elapsed, about 2m46s left"
    assert lines[-1] == "calibrate: 100/100 plans (100%), 3m20s elapsed"
    assert len(lines) == 8


def test_a_log_says_where_a_run_cut_off_stopped():
    clock, stream = Clock(), Stream(False)
    with pytest.raises(KeyboardInterrupt):
        with Progress(100, stream, label="calibrate", clock=clock) as p:
            run(p, clock, 5, 1.0)
            raise KeyboardInterrupt
    assert stream.getvalue().splitlines()[-1] == (
        "calibrate: stopped at 5/100 items (5%), 5s elapsed, about 1m35s left")


def test_a_terminal_line_cut_off_ends_with_a_newline():
    clock, stream = Clock(), Stream(True)
    with pytest.raises(RuntimeError):
        with Progress(100, stream, clock=clock, width=80) as p:
            run(p, clock, 5, 1.0)
            raise RuntimeError("the device went away")
    assert stream.getvalue().endswith("\n") and "5/100" in stream.getvalue().split("\r")[-1]


def test_disabled_it_writes_nothing():
    clock = Clock()
    for tty in (True, False):
        stream = Stream(tty)
        with Progress(50, stream, clock=clock, enabled=False) as p:
            run(p, clock, 50, 1.0)
            p.write("a line still goes out", io.StringIO())
        assert stream.getvalue() == ""


def test_a_closed_stream_turns_it_off_quietly():
    clock, stream = Clock(), Stream(True)
    p = Progress(10, stream, clock=clock)
    stream.close()
    run(p, clock, 10, 1.0)
    p.close()
    assert not p.enabled
