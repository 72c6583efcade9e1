"""A wrapper on a GPU with no profile finds the first-use probes through the one hook
(``splitkv._first_use_source``), which ``splitkv/__init__.py`` fills with ``splitkv.measure``'s
``DeviceProbes``: the runtime never imports the measuring code. The device is faked, so this runs
anywhere."""

from __future__ import annotations

import pytest

from splitkv import BatchDecodeWrapper, _first_use_source

INFO = {"name": "NVIDIA Made Up", "num_sms": 100, "cc": "80", "l2_bytes": 40 << 20,
        "shared_per_block_optin": 166912, "shared_per_sm": 167936, "device_id": 0}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU that ``device_info`` describes and ``load_profile`` is asked about: returns what
    each ``load_profile`` call was given."""
    import splitkv.runtime
    from splitkv.measure import first_use_probes
    from splitkv.planner import profile_lookup
    from splitkv.planner.profiles import prior_profile
    from splitkv.runtime import wrapper

    monkeypatch.setattr(wrapper, "require_gpu", lambda what: None)
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda device_id=None: INFO)
    monkeypatch.setattr(first_use_probes, "device_info", lambda device_id=None: INFO)
    monkeypatch.setattr(first_use_probes, "driver_version", lambda: "13000")
    calls = []

    def load_profile(path=None, device_name=None, num_sms=None, first_use=None):
        calls.append({"path": path, "device_name": device_name, "num_sms": num_sms,
                      "first_use": first_use})
        return prior_profile(device_name, num_sms)

    monkeypatch.setattr(profile_lookup, "load_profile", load_profile)
    return calls


def test_a_wrapper_passes_the_probes_installed_by_the_package(fake_gpu):
    from splitkv.measure.first_use_probes import DeviceProbes

    w = BatchDecodeWrapper(32, 8, 128, 16)
    assert w.profile.device_name == "NVIDIA Made Up" and w.profile.num_sms == 100
    [call] = fake_gpu
    source = call["first_use"]
    assert isinstance(source, DeviceProbes)
    assert (source.driver_version, source.cc, source.num_sms) == ("13000", 80, 100)
    assert (call["device_name"], call["num_sms"]) == ("NVIDIA Made Up", 100)


def test_without_a_source_installed_a_wrapper_skips_first_use(fake_gpu, monkeypatch):
    monkeypatch.setattr(_first_use_source, "_factory", None)
    BatchDecodeWrapper(32, 8, 128, 16).profile   # noqa: B018
    assert fake_gpu[0]["first_use"] is None


def test_a_profile_given_asks_no_source(fake_gpu):
    from splitkv.planner.profiles import prior_profile

    given = prior_profile("NVIDIA Made Up", 100)
    assert BatchDecodeWrapper(32, 8, 128, 16, profile=given).profile is given
    assert fake_gpu == []
