"""First use on a GPU splitkv has no profile for (the shipped one hidden, an empty user cache):
the first wrapper to plan times the probes once, says so once and caches the model; the next
wrapper plans with the cached model, silently; the plans it chooses compute the right answer."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.testing import scattered_page_table

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

HQ, HK, D, PAGE = 32, 8, 128, 16


@pytest.fixture
def unknown_gpu(tmp_path, monkeypatch):
    """This GPU as one splitkv knows nothing of, with first-use probing on."""
    from splitkv.planner import first_use, kin, profile_lookup, profiles

    monkeypatch.setattr(profile_lookup, "shipped_profile", lambda slug: None)
    monkeypatch.setattr(kin, "shipped_profiles", lambda: [])   # no kin of its architecture
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
    monkeypatch.setenv(first_use.FIRST_USE_ENV, "probe")
    monkeypatch.setattr(first_use, "_state", first_use._State())
    return tmp_path


def batch(seed: int, lens):
    rng = np.random.default_rng(seed)
    table, pool = scattered_page_table(np.asarray(lens), PAGE, rng, 2)
    q = rng.standard_normal((len(lens), HQ, D)).astype(np.float16)
    k = rng.standard_normal((pool, PAGE, HK, D)).astype(np.float16)
    v = rng.standard_normal((pool, PAGE, HK, D)).astype(np.float16)
    return table, q, k, v


def test_a_gpu_without_a_profile_is_probed_once_then_plans_from_the_cache(unknown_gpu,
                                                                           notices):
    from splitkv import BatchDecodeWrapper
    from splitkv.planner import first_use

    table, q, k, v = batch(0, [5000, 64, 1, 700, 20000])
    want = reference_decode(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                            table)[0]
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "float16")
    with notices("timed its first-use probes") as said:
        w.plan(table)
    assert len([m for m in said.messages if "first-use" in m]) == 1
    assert w.profile.source == first_use.FIRST_USE_SOURCE
    cached = list((unknown_gpu / "splitkv" / "profiles" / "first-use").glob("*.yaml"))
    assert len(cached) == 1
    coef = w.profile.coef
    assert all(np.isfinite(list(coef.values()))) and min(coef.values()) >= 0.0

    out = cupy.asnumpy(w.run(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)))
    np.testing.assert_allclose(out.astype(np.float64), want, atol=2e-3, rtol=2e-3)

    with notices() as said:
        again = BatchDecodeWrapper(HQ, HK, D, PAGE, "float16")
        again.plan(table)
    assert not said.messages                        # the cached model: no probes, no notice
    assert again.profile.coef == coef
    assert again.current_plan.strategy == w.current_plan.strategy
    assert again.current_plan.num_splits == w.current_plan.num_splits
