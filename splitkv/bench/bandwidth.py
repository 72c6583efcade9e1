"""Streaming-read bandwidth of the GPU, measured in the same run as the decode cases.

The floor that "% of read bandwidth" is judged against must be the best rate a plain read
reaches, or it flatters the kernel. One launch shape is not enough: a single-shape probe once
read slower than the decode kernel itself sustained (4,275 against 4,333 GB/s on the H200).
So the probe tries a few shapes, including ones that keep four loads in flight per thread, and
keeps the fastest. (A shape's "CTAs per SM" is the grid's size over the SM count; an SM holds at
most 2,048 threads, so 8 x 512 runs as two waves of 4.)
"""

from __future__ import annotations

from ..measure.bandwidth_probe import read_gbps_by_shape

# (grid CTAs per SM, threads per CTA, loads in flight per thread)
PROBE_SHAPES = ((8, 512, 1), (4, 1024, 1), (16, 256, 1), (4, 512, 4), (8, 256, 4))


def read_bandwidth_survey(num_bytes: int = 4 << 30, trials: int = 7,
                          shapes=PROBE_SHAPES) -> dict[str, float]:
    """GB/s of the streaming read over ``num_bytes`` for each of ``shapes`` (median of
    ``trials``), keyed 'ctas_per_sm x threads x loads'."""
    return read_gbps_by_shape(num_bytes, trials, shapes)


def read_bandwidth_gbps(num_bytes: int = 4 << 30, trials: int = 7) -> float:
    """The fastest rate of ``read_bandwidth_survey``, GB/s."""
    return max(read_bandwidth_survey(num_bytes, trials).values())
