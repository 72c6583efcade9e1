"""The CuPy calls of ``splitkv.measure``'s timing: CUDA events around repeated launches, a CUDA
graph captured over layers, the device-wide synchronize, and whether the current stream is
being captured. What to time, how often and which statistic to keep is ``splitkv.measure``'s
(``measure/timing.py``); this module only talks to the device, so that the runtime stays the one
package that imports CuPy. CuPy is imported when a function runs, never at import."""

from __future__ import annotations

import sys
from typing import Callable


def cupy_timer(launch: Callable[[], None], stream) -> Callable[[int], float]:
    """``run_timed(n)`` for ``measure.timing.median_us_per_call``: ``launch()`` repeated n times
    between two CuPy events on ``stream``; returns the elapsed milliseconds."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def run_timed(n: int) -> float:
        start.record(stream)
        for _ in range(n):
            launch()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end)

    return run_timed


def capture_layers(launch_layer: Callable[[int, object], None], num_layers: int,
                   stream=None) -> tuple[Callable[[], None], object]:
    """A CUDA graph of ``launch_layer(layer, stream)`` for each layer in turn, captured on
    ``stream`` (None: a new non-blocking stream) after one eager launch of every layer (it
    compiles, and faults the pages in). Returns (a callable that replays the graph on the
    stream, the stream)."""
    import cupy

    stream = stream or cupy.cuda.Stream(non_blocking=True)
    with stream:
        for layer in range(num_layers):      # eager warm-up: compiles, faults pages in
            launch_layer(layer, stream)
        stream.begin_capture()
        for layer in range(num_layers):
            launch_layer(layer, stream)
        graph = stream.end_capture()

    def replay() -> None:
        graph.launch(stream)

    return replay, stream


def current_stream():
    """CuPy's current stream (what a launch without a stream goes to)."""
    import cupy

    return cupy.cuda.get_current_stream()


def synchronize_device() -> None:
    """Wait until the current device has finished all its work."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def current_stream_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream, CuPy's or (where torch is
    already imported) torch's: work that synchronizes must wait for a call outside it."""
    import cupy

    try:
        capturing = cupy.cuda.get_current_stream().is_capturing()
    except cupy.cuda.runtime.CUDARuntimeError:
        # the legacy default stream cannot be asked while another stream captures: so one does
        capturing = True
    torch = sys.modules.get("torch")
    if not capturing and torch is not None and torch.cuda.is_available():
        capturing = torch.cuda.is_current_stream_capturing()
    return capturing
