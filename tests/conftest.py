"""Shared fixtures: seeded randomness and random paged decode batches, built on the host.

Tests marked ``gpu`` are skipped, with the reason, when ``splitkv.runtime.gpu_available()``
says there is no usable GPU (or the runtime cannot be imported).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from helpers.batches import build_batch
from helpers.notices import logged

# The tests choose their caches themselves (XDG_CACHE_HOME or SPLITKV_CACHE_DIR in a temporary
# folder): a cache folder set in the environment that runs them must not leak in.
os.environ.pop("SPLITKV_CACHE_DIR", None)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def make_batch(rng):
    """``make_batch(kv_lens, **kwargs)``: ``build_batch`` with this test's seeded generator."""
    return lambda kv_lens, **kwargs: build_batch(rng, kv_lens, **kwargs)


@pytest.fixture
def notices(caplog):
    """``with notices(match) as said:``: the ``splitkv`` logger's records in the block
    (helpers.notices.logged); ``match`` asks for one whose message matches."""
    return functools.partial(logged, caplog)


# NVRTC's register and spill report of each kernel variant the compile tests built
# (test_kernels_compile.py), printed after a verbose run (pytest -v) only: a plain run is quiet.
REGISTER_REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter, config):
    if REGISTER_REPORT and config.option.verbose > 0:
        terminalreporter.section(f"NVRTC register report ({len(REGISTER_REPORT)} builds)")
        for line in REGISTER_REPORT:
            terminalreporter.write_line(line)


def _skip_unless(items, marker: str, check) -> None:
    """Skip ``items`` marked ``marker``, with the reason, unless ``check()`` says (True, _)."""
    marked = [item for item in items if item.get_closest_marker(marker)]
    if not marked:
        return
    try:
        ok, reason = check()
    except Exception as exc:   # no runtime, no CuPy, no driver: all mean "not usable here"
        ok, reason = False, f"splitkv.runtime unusable: {type(exc).__name__}: {exc}"
    if not ok:
        skip = pytest.mark.skip(reason=reason)
        for item in marked:
            item.add_marker(skip)


def _gpu_check():
    from splitkv.runtime import gpu_available
    ok, reason = gpu_available()
    return ok, f"no usable GPU: {reason}"


def _nvrtc_check():
    from splitkv.runtime import nvrtc_available
    ok, reason = nvrtc_available()
    return ok, f"no NVRTC: {reason}"


def pytest_collection_modifyitems(config, items):
    _skip_unless(items, "gpu", _gpu_check)
    _skip_unless(items, "nvrtc", _nvrtc_check)
