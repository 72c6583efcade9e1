"""``records.StreamChain``, with stand-in streams and events (no GPU): a run or a plan on a
stream other than the last run's waits for the event recorded after that run; uses on one
stream wait for nothing; a failed launch records nothing; the lock is released either way."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy", reason="StreamChain records CuPy events")

from splitkv.runtime.streams import StreamChain  # noqa: E402


class Event:
    def __init__(self, **_):
        self.recorded_on = []

    def record(self, stream):
        self.recorded_on.append(stream.ptr)


class Stream:
    def __init__(self, ptr):
        self.ptr, self.waited = ptr, []

    def wait_event(self, event):
        self.waited.append(list(event.recorded_on))


def test_uses_on_other_streams_wait_for_the_last_run(monkeypatch):
    monkeypatch.setattr(cupy.cuda, "Event", Event)
    chain = StreamChain()
    a, b, p = Stream(1), Stream(2), Stream(3)
    chain.follow(p)                       # no run yet: nothing to wait for
    with chain.use(a):
        pass
    with chain.use(a):                    # the same stream: stream order suffices
        pass
    assert a.waited == [] and p.waited == []
    with chain.use(b):                    # after A's last run
        pass
    assert b.waited == [[1, 1]]
    chain.follow(p)                       # a plan after B's run
    assert p.waited == [[1, 1, 2]]
    with pytest.raises(RuntimeError):
        with chain.use(a):                # A waits for B; the launch fails: nothing recorded
            raise RuntimeError("launch failed")
    assert a.waited == [[1, 1, 2]]
    with chain.use(b):                    # the last run is still B's
        pass
    assert b.waited == [[1, 1]]
    assert chain._lock.acquire(blocking=False)
