"""First-use planning without a GPU: the probe plans, the model derived from synthetic probe
timings, the cache, $SPLITKV_FIRST_USE, and where load_profile puts the first-use model."""

import math
import logging
import os

import numpy as np
import pytest

from splitkv import DecodeProblem
from splitkv.core.architectures import GPU_SMS, device_properties
from splitkv.planner import choose_plan, first_use, profile_lookup, profiles
from splitkv.planner.cost_model import CostModel
from splitkv.planner.features import FEATURE_NAMES
from splitkv.planner.first_use import (FIRST_USE_ENV, ProbeError, ProbeResults, cache_key,
                                       derive_profile, first_use_mode, first_use_path,
                                       probe_cases, probe_ctas_per_sm, probe_model,
                                       read_first_use, save_first_use)
from splitkv.planner.profile_lookup import load_profile
from splitkv.planner.profiles import PROFILE_ENV, Profile, user_profile_dir

# A made-up device model the probes are synthesised from: every free column non-zero, of
# the size a decode kernel's costs could be, and no GPU's fit.
KNOWN = {"launches": 0.9, "kv_us": 0.3, "crit_us": 0.0, "crit_tiles": 0.25,
         "crit_tile_rows": 0.01, "waves": 2.0, "partial_us": 2.0, "fused_tail_us": 0.4,
         "fused_merges": 1.2, "merge_chain": 0.1, "tail_us": 0.0, "cluster_merges": 0.3,
         "lone_cta_us": 0.0, "stream_us": 0.5, "wide_waves": 1.5, "merge_grid": 0.15}
BANDWIDTH = 1500.0


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setenv(FIRST_USE_ENV, "probe")
    monkeypatch.delenv(profiles.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profile_lookup, "_warned_prior", set())
    monkeypatch.setattr(profiles, "_warned_files", set())
    monkeypatch.setattr(first_use, "_state", first_use._State())


def known_model(name, coef=None, bandwidth=BANDWIDTH):
    d = device_properties(name)
    coef = dict(coef or KNOWN)
    if d.cc < 90:
        coef["cluster_merges"] = 0.0
    return CostModel.from_coef(coef, num_sms=d.num_sms, ctas_per_sm=probe_ctas_per_sm(d),
                               bandwidth_gbps=bandwidth, clusters=d.cc >= 90)


def synthetic(name, model=None, noise=0.0, seed=0, scale=1.0, driver="12040"):
    """ProbeResults whose decode times are ``model``'s predictions (x ``scale``, with relative
    ``noise``), the empty kernel its launches, the read its bandwidth."""
    d = device_properties(name)
    model = model or known_model(name)
    rng = np.random.default_rng(seed)
    decode = {c.name: scale * model.predict(c.plan.with_execution(clusters=model.clusters))
              * (1.0 + noise * rng.standard_normal())
              for c in probe_cases(d.num_sms, model.ctas_per_sm)}
    return ProbeResults(name, d.num_sms, d.cc, d.shared_per_block_optin, d.shared_per_sm, driver,
                        empty_graph_us=scale * model.coef_dict()["launches"], empty_eager_us=3.0,
                        read_gbps={"4x512x4": model.bandwidth_gbps, "8x256x4": 0.97 *
                                   model.bandwidth_gbps, "1x512x4": 0.3 * model.bandwidth_gbps},
                        full_read_keys=("4x512x4", "8x256x4"), decode_us=decode, seconds=2.5)


def problems():
    rng = np.random.default_rng(3)
    out = []
    for _ in range(30):
        b = int(rng.choice([1, 2, 8, 32, 128, 256]))
        n = int(np.exp(rng.uniform(np.log(64), np.log(65536))))
        g, d = int(rng.choice([1, 4, 8])), int(rng.choice([64, 128, 128, 256]))
        lens = np.maximum(16, rng.lognormal(np.log(n), 0.5, b).astype(int)) if b > 1 and \
            rng.random() < 0.4 else np.full(b, n)
        out.append(DecodeProblem(lens, 8 * g, 8, d, 16))
    return out


class FakeProbes:
    """A first_use source with no GPU: synthetic probes, a calibration that returns a profile."""

    def __init__(self, name="NVIDIA L40S", driver="12040", fail=False):
        self.name, self.driver_version, self.fail = name, driver, fail
        self.probed = self.calibrated = 0

    def probe(self):
        self.probed += 1
        if self.fail:
            raise RuntimeError("no kernel today")
        return synthetic(self.name, driver=self.driver_version)

    def calibrate(self):
        self.calibrated += 1
        return profiles.prior_profile(self.name, device_properties(self.name).num_sms)


# ---------------------------------------------------------------- the probes and the derivation

@pytest.mark.parametrize("name", sorted(GPU_SMS))
def test_probe_cases_price_every_column_they_name(name):
    d = device_properties(name)
    cases = probe_cases(d.num_sms, probe_ctas_per_sm(d))
    assert len({c.name for c in cases}) == len(cases)
    priced = {col for c in cases for col in c.prices}
    assert priced <= set(FEATURE_NAMES)
    free = set(FEATURE_NAMES) - set(first_use.ZERO_COLUMNS) - set(first_use.MEASURED_COLUMNS)
    assert free - {"cluster_merges"} <= priced
    # a wave is the device's slots: the short probes of one wave give no SM a second round
    wave = next(c for c in cases if c.name == "wave_tile").plan
    assert wave.num_work_items <= d.num_sms * probe_ctas_per_sm(d)


def test_occupancy_comes_from_shared_memory():
    # 164 KiB (A100) and 100 KiB (sm_86/89/120) an SM hold one head_dim-128 CTA of ~96 KiB
    assert probe_ctas_per_sm(device_properties("NVIDIA A100-SXM4-80GB")) == 1
    assert probe_ctas_per_sm(device_properties("NVIDIA L40S")) == 1
    assert probe_ctas_per_sm(device_properties("NVIDIA B200")) == 2
    assert probe_ctas_per_sm(device_properties("NVIDIA B200").__class__(148)) == 2


@pytest.mark.parametrize("name", sorted(GPU_SMS))
def test_recovers_a_known_model_exactly(name):
    truth = known_model(name)
    model, info = probe_model(synthetic(name, truth))
    assert info["rank"] == len(info["free"])           # the probes tell every column apart
    np.testing.assert_allclose(model.coef_, truth.coef_, rtol=1e-6, atol=1e-9)
    assert model.fit_error_ < 1e-9
    assert (model.num_sms, model.ctas_per_sm, model.clusters) == (
        truth.num_sms, truth.ctas_per_sm, truth.clusters)


@pytest.mark.parametrize("name", ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3",
                                  "NVIDIA GeForce RTX 4090"])
def test_noisy_probes_plan_close_to_the_known_model(name):
    """Probes timed 2% apart from the model still choose plans that the model itself prices
    within a few percent of its own best."""
    truth = known_model(name)
    ratios = []
    for seed in range(3):
        model, _ = probe_model(synthetic(name, truth, noise=0.02, seed=seed))
        for p in problems():
            mine = choose_plan(p, model).with_execution(clusters=truth.clusters)
            ratios.append(truth.predict(mine) / choose_plan(p, truth).predicted_us)
    ratios = np.array(ratios)
    assert np.exp(np.mean(np.log(ratios))) < 1.02
    assert np.mean(ratios <= 1.05) >= 0.9


def test_coefficients_are_finite_non_negative_and_in_consistent_units():
    name = "NVIDIA L40S"
    profile = derive_profile(synthetic(name, noise=0.05, seed=4))
    coef = np.array([profile.coef[k] for k in FEATURE_NAMES])
    assert np.all(np.isfinite(coef)) and np.all(coef >= 0)
    for k in first_use.ZERO_COLUMNS:
        assert profile.coef[k] == 0.0
    assert profile.coef["launches"] == pytest.approx(KNOWN["launches"])
    assert profile.bandwidth_gbps == BANDWIDTH            # the best full-occupancy read
    assert profile.source == first_use.FIRST_USE_SOURCE and not profile.is_prior
    # every time twice as long: every coefficient twice as large (they are microseconds)
    doubled = derive_profile(synthetic(name, noise=0.05, seed=4, scale=2.0))
    for k in FEATURE_NAMES:
        assert doubled.coef[k] == pytest.approx(2 * profile.coef[k], rel=1e-6, abs=1e-12)


def test_a_bandwidth_read_off_still_fits_the_probes():
    """The bandwidth is the byte columns' unit, so a read probe that is off mostly rescales
    their coefficients (``stream_us``'s lone term is priced at a fixed lone-CTA rate, so not
    exactly): the probes are still fitted within a few percent, and the plans stay close."""
    name = "NVIDIA A100-SXM4-80GB"
    truth = known_model(name)
    ratios = []
    for factor in (0.5, 2.0):
        r = synthetic(name, truth)
        r.read_gbps = {k: factor * v for k, v in r.read_gbps.items()}
        model, _ = probe_model(r)
        assert model.fit_error_ < 0.05
        assert np.all(np.isfinite(model.coef_)) and np.all(model.coef_ >= 0)
        for p in problems():
            ratios.append(truth.predict(choose_plan(p, model)) / choose_plan(p, truth).predicted_us)
    assert np.exp(np.mean(np.log(ratios))) < 1.05


@pytest.mark.parametrize("spoil", ["missing", "nan", "zero", "no_read"])
def test_unusable_probes_raise(spoil):
    r = synthetic("NVIDIA L40S")
    if spoil == "missing":
        del r.decode_us["lone_16k"]
    elif spoil == "nan":
        r.decode_us["wave_tile"] = float("nan")
    elif spoil == "zero":
        r.empty_graph_us = 0.0
    else:
        r.full_read_keys = ()
    with pytest.raises(ProbeError, match="first-use probes"):
        derive_profile(r)


def test_the_path_holds_no_reference_gpu_figure():
    """Nothing in the derivation reads the shipped profiles or the prior's guesses."""
    from pathlib import Path

    probes = Path(first_use.__file__).parents[1] / "measure" / "first_use_probes.py"
    source = open(first_use.__file__).read() + probes.read_text()
    for word in ("roofline_prior", "guess_bandwidth", "REFERENCE_DEVICE", "nvidia-h200",
                 "4460", "LONE_CTA_GBPS"):
        assert word not in source, word


# ---------------------------------------------------------------- the cache and the option

def test_cache_key_names_gpu_driver_and_version():
    key = cache_key("NVIDIA L40S", 12040, "0.1.0")
    assert key == "nvidia-l40s-driver-12040-splitkv-0-1-0"
    assert len({cache_key("NVIDIA L40S", 12040, "0.1.0"), cache_key("NVIDIA L4", 12040, "0.1.0"),
                cache_key("NVIDIA L40S", 12050, "0.1.0"),
                cache_key("NVIDIA L40S", 12040, "0.2.0")}) == 4
    path = first_use_path("NVIDIA L40S", "12040")
    assert path.parent == user_profile_dir() / "first-use"


def test_cached_profile_round_trips_with_its_probes(notices):
    results = synthetic("NVIDIA L40S", noise=0.01)
    profile = derive_profile(results)
    path = save_first_use(profile, first_use_path("NVIDIA L40S", "12040"))
    back = read_first_use(path, "NVIDIA L40S", profile.num_sms)
    assert back.coef == pytest.approx(profile.coef)
    assert (back.num_sms, back.ctas_per_sm, back.clusters, back.bandwidth_gbps) == (
        profile.num_sms, profile.ctas_per_sm, profile.clusters, profile.bandwidth_gbps)
    again = ProbeResults.from_dict(back.sweep["probes"])
    assert again == results
    assert derive_profile(again).coef == pytest.approx(profile.coef)
    # another device, or another SM count (a MIG slice), is not this cache's
    assert read_first_use(path, "NVIDIA L4", None) is None
    assert read_first_use(path, "NVIDIA L40S", profile.num_sms - 2) is None
    path.write_text("coef: [1, 2")
    with notices("probing again") as said:
        assert read_first_use(path, "NVIDIA L40S", None) is None
    assert said.at(logging.WARNING) == said.messages


@pytest.mark.parametrize("value, mode", [(None, "probe"), ("", "probe"), ("off", "off"),
                                         ("probe", "probe"), (" Calibrate ", "calibrate")])
def test_the_option(monkeypatch, value, mode):
    monkeypatch.delenv(FIRST_USE_ENV, raising=False)
    if value is not None:
        monkeypatch.setenv(FIRST_USE_ENV, value)
    assert first_use_mode() == mode


def test_a_bad_option_is_a_clear_error(monkeypatch, notices):
    monkeypatch.setenv(FIRST_USE_ENV, "yes")
    with pytest.raises(ValueError, match=r"SPLITKV_FIRST_USE: expected one of off, probe, "
                                         r"calibrate, got 'yes'"):
        first_use_mode()
    with pytest.raises(ValueError, match="SPLITKV_FIRST_USE"):
        load_profile(device_name="NVIDIA L40S", num_sms=142, first_use=FakeProbes())
    # without a device to probe the option is not read
    with notices("roofline prior"):
        assert load_profile(device_name="NVIDIA L40S", num_sms=142).is_prior


# ---------------------------------------------------------------- load_profile's order

def load(source, name="NVIDIA L40S"):
    return load_profile(device_name=name, num_sms=device_properties(name).num_sms,
                        first_use=source)


def test_no_profile_probes_once_then_reads_the_cache(notices):
    source = FakeProbes()
    with notices(r"first-use probes in .* cached the model in .*nvidia-l40s-driver-12040") \
            as said:
        profile = load(source)
    assert said.at(logging.INFO) == said.messages, said.messages   # as designed: INFO
    assert profile.source == first_use.FIRST_USE_SOURCE and source.probed == 1
    assert first_use_path("NVIDIA L40S", "12040").is_file()
    with notices() as said:
        again = load(source)
    assert not said.messages                       # said once: the cache answers quietly
    assert source.probed == 1 and again.coef == pytest.approx(profile.coef)
    # another driver is another cache entry: probed again
    other = FakeProbes(driver="12050")
    with notices("12050"):
        load(other)
    assert other.probed == 1


def test_without_a_source_or_with_off_the_prior_plans(monkeypatch, notices):
    save_first_use(derive_profile(synthetic("NVIDIA L40S")),
                   first_use_path("NVIDIA L40S", "12040"))
    with notices("roofline prior"):
        assert load_profile(device_name="NVIDIA L40S", num_sms=142).is_prior
    monkeypatch.setenv(FIRST_USE_ENV, "off")
    source = FakeProbes()
    assert load(source).is_prior and source.probed == 0


def test_a_cached_first_use_profile_is_read_without_probing():
    save_first_use(derive_profile(synthetic("NVIDIA L40S")),
                   first_use_path("NVIDIA L40S", "12040"))
    source = FakeProbes()
    assert load(source).source == first_use.FIRST_USE_SOURCE and source.probed == 0


def test_calibrated_shipped_and_explicit_profiles_come_first(monkeypatch, tmp_path):
    source = FakeProbes(name="NVIDIA H200")
    assert load(source, "NVIDIA H200").source == "calibrated" and source.probed == 0  # shipped
    calibrated = profiles.prior_profile("NVIDIA L40S", 142)
    calibrated = Profile(**{**calibrated.__dict__, "source": "calibrated", "origin": ""})
    calibrated.save(user_profile_dir() / "nvidia-l40s.yaml")
    source = FakeProbes()
    assert load(source).source == "calibrated" and source.probed == 0
    explicit = tmp_path / "mine.yaml"
    calibrated.save(explicit)
    monkeypatch.setenv(PROFILE_ENV, str(explicit))
    assert load(source).origin == str(explicit) and source.probed == 0


def test_calibrate_mode_runs_the_calibration(monkeypatch, notices):
    monkeypatch.setenv(FIRST_USE_ENV, "calibrate")
    source = FakeProbes()
    with notices("quick calibration"):
        load(source)
    assert source.calibrated == 1 and source.probed == 0


def test_failed_probes_fall_back_to_the_prior_once(notices):
    source = FakeProbes(fail=True)
    with notices("no kernel today") as said:
        assert load(source).is_prior
    text = " ".join(said.at(logging.WARNING))
    assert "no kernel today" in text and "roofline prior" in text
    load(source)
    assert source.probed == 1                      # not again in this process


def test_probes_deferred_by_a_capture_are_asked_for_again(notices):
    """Under a CUDA graph capture the source defers: that plan uses the prior, with no failure
    noted, and the next plan outside the capture probes."""
    source = FakeProbes()
    deferred = []

    def probe():
        if not deferred:
            deferred.append(1)
            raise first_use.ProbesDeferred("a CUDA graph is being captured")
        return synthetic(source.name, driver=source.driver_version)

    source.probe = probe
    with notices("roofline prior") as said:
        assert load(source).is_prior
    assert not any("failed" in m for m in said.messages)
    with notices("timed its first-use probes"):
        assert load(source).source == first_use.FIRST_USE_SOURCE


def test_probing_does_not_reenter_itself(notices):
    """A wrapper the probes build must not start the probes again: it plans with the prior."""
    inner = []

    class Reentrant(FakeProbes):
        def probe(self):
            inner.append(load(self))
            return super().probe()

    source = Reentrant()
    with notices("timed its first-use probes"):
        outer = load(source)
    assert inner[0].is_prior and outer.source == first_use.FIRST_USE_SOURCE
    assert not math.isnan(outer.coef["waves"])


# ---------------------------------------------------------------- broken and unwritable caches

def _cut(text):
    return text[:len(text) // 2]


@pytest.mark.parametrize("spoil", [
    lambda text: bytes(range(256)),                                   # binary
    lambda text: _cut(text).encode(),                                 # half-written
    lambda text: text.split("\n", 1)[1].replace("date: '", "date: 2026-13-45 #'").encode(),
    lambda text: ("sweep: " + "[" * 5000 + "]" * 5000 + "\n").encode(),   # deep nesting
], ids=["binary", "half-written", "bad date", "deep nesting"])
def test_a_broken_first_use_cache_is_probed_again_with_one_notice(spoil, notices):
    """A cached model the disk or a crash spoiled: one notice names the file, the device is
    probed again and the cache rewritten whole."""
    path = first_use_path("NVIDIA L40S", "12040")
    text = save_first_use(derive_profile(synthetic("NVIDIA L40S")), path).read_text()
    path.write_bytes(spoil(text))
    source = FakeProbes()
    with notices() as caught:
        assert load(source).source == first_use.FIRST_USE_SOURCE
    named = [m for m in caught.at(logging.WARNING) if "probing again" in m]
    assert len(named) == 1 and str(path) in named[0], caught.messages
    assert source.probed == 1
    assert profiles.read_profile(path).source == first_use.FIRST_USE_SOURCE


def _probed_twice_without_a_cache(source, notices):
    """The two loads, and the notices of the first (each a WARNING; the second says nothing)."""
    with notices() as caught:
        first = load(source)
    with notices() as quiet:
        second = load(source)
    assert not quiet.messages                         # the kept model answers quietly
    assert caught.at(logging.WARNING) == caught.messages
    return first, second, caught.messages


def test_an_unwritable_cache_keeps_the_probed_model_for_the_process(tmp_path, monkeypatch, notices):
    """The cache folder cannot be made (a file stands in its way: any user, root too): the
    model is probed once, planned with, kept in memory with one notice, and the next wrapper
    in the process does not probe again."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv(profiles.CACHE_DIR_ENV, str(blocker / "cache"))
    source = FakeProbes()
    first, second, said = _probed_twice_without_a_cache(source, notices)
    assert source.probed == 1
    assert first.source == first_use.FIRST_USE_SOURCE and second is first
    assert len([m for m in said if "could not cache" in m]) == 1 and len(said) == 1, said
    assert "keeping it for this process" in said[0] and str(blocker) in said[0]
    # another driver is another model: probed (and kept) too
    other = FakeProbes(driver="12050")
    with notices("could not cache"):
        load(other)
    assert other.probed == 1 and source.probed == 1


def test_a_read_only_cache_keeps_the_probed_model_for_the_process(tmp_path, monkeypatch, notices):
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv(profiles.CACHE_DIR_ENV, str(folder))
    os.chmod(folder, 0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("chmod does not make a folder read-only here (running as root)")
        source = FakeProbes()
        first, _, said = _probed_twice_without_a_cache(source, notices)
        assert source.probed == 1 and first.source == first_use.FIRST_USE_SOURCE
        assert len(said) == 1 and "could not cache" in said[0]
    finally:
        os.chmod(folder, 0o755)
