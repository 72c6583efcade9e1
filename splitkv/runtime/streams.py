"""The order of one wrapper's work across streams: a plan's upload after the previous plan's
stream and after the last run elsewhere, a run after its plan's upload, and runs after one
another (they share the workspace). None of it applies inside a graph capture: an event recorded
outside it would pull outside work into the graph, and the replay's order is the caller's."""

from __future__ import annotations

import contextlib

_NO_CHAIN = contextlib.nullcontext()     # a captured run: no ordering across streams


class StreamChain:
    """Orders the uses of one wrapper's buffers across streams: its runs share the workspace
    (partials, ticket counters) and its plans rewrite the records. After each run an event is
    recorded on the run's stream; a later run, or a plan's upload, on another stream first
    waits for it. So two runs on two streams never overlap on the GPU and a plan never rewrites
    what a run elsewhere still reads. (An event per run, on the stream in use: a stream given
    earlier may be gone by the next call.) Held across a run's launch (``use``), under a lock:
    run() may be called from several threads. Streams are told apart by handle, so threads
    sharing a wrapper each pass their own stream, not the per-thread default stream (one handle
    for a different stream in each thread)."""

    def __init__(self):
        import threading

        self._event = None              # recorded after the last run, on its stream
        self._last = None               # that stream's handle
        self._lock = threading.Lock()

    def _wait(self, stream) -> None:
        if self._event is not None and self._last != stream.ptr:
            stream.wait_event(self._event)

    def follow(self, stream) -> None:
        """A plan's upload about to be queued on ``stream``: after the last run."""
        with self._lock:
            self._wait(stream)

    @contextlib.contextmanager
    def use(self, stream):
        """A run: ``with chain.use(s): launch()`` queues it after the last run (on another
        stream) and, if the launch raised nothing, records the event after it."""
        import cupy

        with self._lock:
            self._wait(stream)
            yield
            if self._event is None:
                self._event = cupy.cuda.Event(disable_timing=True)
            self._event.record(stream)
            self._last = stream.ptr


def follow_previous_plan_stream(previous, s) -> None:
    """A plan on another stream than the last one's (``previous``): order it after the work
    queued on that stream (the runs there may still read the buffers this plan rewrites)."""
    if previous is None or previous.ptr == s.ptr or s.is_capturing() or previous.is_capturing():
        return           # (an event recorded in a capture would pull this stream into it)
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(previous)
    s.wait_event(event)


class PlanStreams:
    """A wrapper's streams: ``plan_stream``, the stream of the last plan (or plan_on_device),
    and the ``StreamChain`` of its runs."""

    def __init__(self):
        self.plan_stream = None
        self.chain = StreamChain()

    def before_plan(self, s, follow_runs: bool = True) -> None:
        """A plan about to be queued on ``s``: after the previous plan's stream and, with
        ``follow_runs``, after the last run on another stream (it may still read the buffers)."""
        follow_previous_plan_stream(self.plan_stream, s)
        if follow_runs:
            self.chain.follow(s)

    def wait_for_plan(self, s, ready) -> None:
        """A run on ``s``: after the plan's upload (``ready``, the event after it; None: none),
        unless ``s`` is the plan's stream or capturing. Not inside a graph capture: a wait on an
        event recorded outside it would pull outside work into the graph, and a host wait is
        what the default (global) capture mode forbids. A captured run reads the records when
        the graph replays, so the replay is what must follow plan()'s upload, as any work
        queued after it on the plan's stream does."""
        foreign = s.ptr != self.plan_stream.ptr and not s.is_capturing()
        if foreign and ready is not None:
            s.wait_event(ready)

    def run_order(self, s):
        """The context a run's launch goes in: runs share the workspace (partials, ticket
        counters) and plans rewrite the records, so a run on another stream than the last use's
        waits for it. Not inside a capture (as above): the replay's order is the caller's."""
        return self.chain.use(s) if not s.is_capturing() else _NO_CHAIN


def stream_pool_array(size: int, dtype, stream, replacing_from: int | None = None):
    """An uninitialised device array from ``stream``'s part of CuPy's pool.

    CuPy's pool hands a freed block again only to allocations made for the stream it was
    freed from, without waiting for that stream's work still in flight: a buffer made on the
    current stream but written on another one (the plan's copy, a run) can be a block that a
    kernel queued on the current stream (a caller's random fill, say) writes after the copy
    landed, and a run then reads garbage page indices. A block taken for ``stream`` is ordered
    after everything enqueued there before.

    ``replacing_from``: the stream (handle) the buffer this one supersedes was made for, which
    runs may still read. Made for this plan's stream, its block goes back to this stream's
    part of the pool, whose next work already waits for the runs elsewhere
    (``PlanStreams.before_plan``); made for another, the device is waited for first (a
    regrowth on another plan stream: rare)."""
    import cupy

    if replacing_from is not None and replacing_from != stream.ptr:
        cupy.cuda.runtime.deviceSynchronize()
    with stream:
        return cupy.empty(size, dtype=dtype)
