"""Whether the profile ``splitkv calibrate`` wrote is the one wrappers then plan with, decided
on the CPU with temporary folders and environment variables, as ``load_profile`` looks."""

from __future__ import annotations

import pytest

from splitkv.calibration.in_use import (PRIOR_ORIGIN, cache_file, previous_profile,
                                        profile_in_use)
from splitkv.planner.profiles import PROFILE_ENV, prior_profile

H200 = ("NVIDIA H200", 132)
OTHER = ("Calibration Test GPU", 100)      # no shipped profile: the lookup ends at the prior


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty user cache and no $SPLITKV_PROFILE."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    return tmp_path / "cache" / "splitkv" / "profiles"


def calibrated(device, path):
    """A profile as calibrate writes one (the prior's parameters, marked calibrated)."""
    from dataclasses import replace

    return replace(prior_profile(*device), source="calibrated").save(path)


def test_written_to_the_user_cache_it_is_the_one_used(cache):
    written = calibrated(H200, cache_file(H200[0]))
    assert written.parent == cache
    found = profile_in_use(written, *H200)
    assert found.ok and found.used == str(written)
    assert found.lines() == [f"splitkv plans with it on this GPU: {written} (the user cache)"]


def test_splitkv_profile_elsewhere_wins_over_the_cache(cache, monkeypatch, tmp_path):
    written = calibrated(H200, cache_file(H200[0]))
    other = calibrated(H200, tmp_path / "team" / "h200.yaml")
    monkeypatch.setenv(PROFILE_ENV, str(other))
    found = profile_in_use(written, *H200)
    assert not found.ok and found.used == str(other)
    assert found.lines() == [
        f"warning: splitkv will not plan with this profile: ${PROFILE_ENV}={other} comes first",
        f"  splitkv plans with: {other} (named by ${PROFILE_ENV})",
        f"  to plan with the new one: unset {PROFILE_ENV}"]


def test_out_named_by_splitkv_profile_is_used(cache, monkeypatch, tmp_path):
    written = calibrated(H200, tmp_path / "mine.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PROFILE_ENV, "mine.yaml")           # relative: the same file
    found = profile_in_use(written, *H200)
    assert found.ok
    assert found.lines() == [f"splitkv plans with it on this GPU: {written} (named by "
                             f"${PROFILE_ENV})"]


def test_splitkv_profile_elsewhere_wins_over_out(cache, monkeypatch, tmp_path):
    written = calibrated(H200, tmp_path / "mine.yaml")
    other = calibrated(H200, tmp_path / "theirs.yaml")
    monkeypatch.setenv(PROFILE_ENV, str(other))
    lines = profile_in_use(written, *H200).lines()
    assert lines[0].endswith(f"${PROFILE_ENV}={other} comes first")
    assert lines[2] == (f"  to plan with the new one: set {PROFILE_ENV}={written} or pass "
                        f"profile=\"{written}\" to the wrapper, or unset {PROFILE_ENV} and "
                        f"copy it to {cache / 'nvidia-h200.yaml'}")


@pytest.mark.parametrize("device, used", [
    (H200, "the profile shipped with splitkv (nvidia-h200.yaml)"),
    (OTHER, "the roofline prior (no calibrated profile for this GPU)")])
def test_out_outside_the_search_path_is_not_used(cache, tmp_path, device, used):
    written = calibrated(device, tmp_path / "elsewhere" / "gpu.yaml")
    found = profile_in_use(written, *device)
    assert not found.ok
    assert found.lines() == [
        "warning: splitkv will not plan with this profile: it is not where splitkv looks",
        f"  splitkv plans with: {used}",
        f"  to plan with the new one: set {PROFILE_ENV}={written} or pass "
        f"profile=\"{written}\" to the wrapper, or copy it to {cache_file(device[0])}"]


def test_a_cached_profile_the_lookup_skips_is_named(cache):
    # made for 114 SMs: on a device of 132 the lookup passes it over with a warning
    written = calibrated(("NVIDIA H200", 114), cache_file("NVIDIA H200"))
    found = profile_in_use(written, *H200)
    assert not found.ok and found.used == "splitkv:nvidia-h200.yaml"
    assert found.lines()[0].startswith("warning: splitkv will not plan with this profile: it "
                                       f"was skipped (profile {written}: made for 114 SMs")


def test_an_unusable_splitkv_profile_is_an_error_wrappers_will_raise(cache, monkeypatch,
                                                                      tmp_path):
    written = calibrated(H200, cache_file(H200[0]))
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "gone.yaml"))
    found = profile_in_use(written, *H200)
    assert not found.ok and found.used is None and "cannot read it" in found.error
    assert found.lines()[0].startswith("warning: splitkv cannot load a profile on this GPU "
                                       "(wrappers raise ProfileError): "
                                       f"profile {tmp_path / 'gone.yaml'}: cannot read it")
    assert found.lines()[1].startswith(f"  to plan with the new one: unset {PROFILE_ENV} or set")


def test_the_previous_profile_is_what_load_profile_answered(cache, monkeypatch, tmp_path,
                                                            notices):
    with notices() as said:
        profile, where = previous_profile(*OTHER)
        assert profile.is_prior and profile.origin == PRIOR_ORIGIN
        assert where == "the roofline prior (no calibrated profile for this GPU)"
        profile, where = previous_profile(*H200)
        assert profile.origin == "splitkv:nvidia-h200.yaml" and "shipped" in where
        written = calibrated(H200, cache_file(H200[0]))
        profile, where = previous_profile(*H200)
        assert profile.origin == str(written) and where == f"{written} (the user cache)"
        monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "broken.yaml"))
        (tmp_path / "broken.yaml").write_text("coef: [1, 2\n")
        profile, where = previous_profile(*H200)
        assert profile.is_prior and where.startswith("the roofline prior (profile ")
        assert "not valid YAML" in where
    assert not said.messages        # the prior's advice to calibrate is not repeated


def test_the_origins_named_are_the_lookups():
    assert prior_profile(*OTHER).origin == PRIOR_ORIGIN
