"""The bench's streaming-read probe: the floor that '% of read bandwidth' is judged against."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_every_probe_shape_reads_at_a_physical_rate():
    """Each launch shape reports a rate, and none beyond what HBM can deliver: a rate past
    ~10 TB/s would mean the compiler dropped the loads and the floor is fiction. 512 MiB is
    far past L2, so the reads come from DRAM."""
    from splitkv.bench.bandwidth import PROBE_SHAPES, read_bandwidth_gbps, read_bandwidth_survey

    survey = read_bandwidth_survey(512 << 20, trials=3)
    assert list(survey) == [f"{c}x{t}x{l}" for c, t, l in PROBE_SHAPES]
    assert all(100.0 < gbps < 10_000.0 for gbps in survey.values()), survey
    assert 100.0 < read_bandwidth_gbps(512 << 20, trials=3) < 10_000.0
