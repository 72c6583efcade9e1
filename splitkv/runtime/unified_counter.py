"""The unified max's fallback counter on the device: how many CTAs left phi's band and fell back
to the running max (``core.unified_max``), zeroed by each ``plan(unified_max=)``."""

from __future__ import annotations

import numpy as np


class FallbackCounter:
    """One uint32 on the device, made at its first zeroing."""

    def __init__(self):
        self._count = None

    @property
    def ptr(self) -> int:
        return self._count.data.ptr

    def zero(self, stream) -> None:
        """Zero it on ``stream``, before the plan's upload event is recorded: a run on another
        stream waits for that event, so its counts follow the zeroing."""
        import cupy

        with stream:
            if self._count is None:
                self._count = cupy.zeros(1, np.uint32)
            else:
                self._count.fill(0)

    def read(self) -> int:
        """The count, after every run enqueued so far (waits for the device)."""
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        return int(self._count.get()[0])
