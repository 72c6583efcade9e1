"""The one device call ``splitkv.distributed``'s CuPy group makes outside its communicator: an
event to poll, so that a wait on a collective is bounded by the group's timeout."""

from __future__ import annotations

from .arrays import as_cupy_stream


def record_event(stream=None):
    """An event (without timing) recorded on ``stream`` (anything ``as_cupy_stream`` takes),
    for the host to poll with ``.done``."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(as_cupy_stream(stream))
    return event
