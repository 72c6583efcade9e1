"""First use on a GPU whose architecture has a shipped profile (an H100 beside the H200's): the
shipped fits, this GPU's SMs and streaming read, after a read probe only; other GPUs probe."""

import pytest

from splitkv import DecodeProblem
from splitkv.planner import choose_plan, first_use, profiles
from splitkv.planner.first_use import FIRST_USE_ENV, first_use_path, resolve
from splitkv.planner.kin import KIN_SOURCE, kin_of, kin_profile, shipped_profiles
from splitkv.planner.profiles import PROFILE_ENV, read_profile

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setenv(FIRST_USE_ENV, "probe")
    monkeypatch.delenv(profiles.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(first_use, "_state", first_use._State())


class ReadOnlyProbes:
    """A device that can only be read-probed: timing its decode probes fails the test."""

    def __init__(self, cc=90, num_sms=132, gbps=3030.0, driver="13000"):
        self.cc, self.num_sms, self.gbps, self.driver_version = cc, num_sms, gbps, driver
        self.reads = 0

    def read_bandwidth(self):
        self.reads += 1
        return self.gbps

    def probe(self):
        raise AssertionError("a GPU of a known architecture must not run the decode probes")


def test_a_gpu_finds_the_shipped_profile_of_its_architecture_only():
    assert {H100, H200} <= {p.device_name for p in shipped_profiles()}
    assert kin_of(H100, 90).device_name == H200      # its own is not a kin
    assert kin_of(H200, 90).device_name == H100
    assert kin_of("NVIDIA L40S", 89) is None and kin_of("NVIDIA B200", 100) is None
    assert kin_of(H100, None) is None


def test_of_several_kins_the_nearest_in_streaming_bandwidth_is_taken():
    # an H100 PCIe (2 TB/s) is nearer the H100 SXM's 3.1 TB/s, an H200 NVL (4.8) the H200's
    assert kin_of("NVIDIA H100 PCIe", 90, 2000.0).device_name == H100
    assert kin_of("NVIDIA H200 NVL", 90, 4800.0).device_name == H200
    assert kin_of("NVIDIA H100 PCIe", 90).device_name == H100   # without a read: by file name


def test_without_the_gpu_its_name_gives_the_kin_at_a_guessed_bandwidth():
    from splitkv.planner.kin import kin_by_name

    pcie = kin_by_name("NVIDIA H100 PCIe")
    assert (pcie.num_sms, pcie.bandwidth_gbps, pcie.sweep["from"]) == (114, 1800.0, H100)
    assert pcie.kv_fp8 is not None and "guessed 1,800 GB/s" in pcie.origin
    assert kin_by_name("NVIDIA H200 NVL").sweep["from"] == H200
    assert kin_by_name("NVIDIA L40S") is None and kin_by_name("Acme GPU 9000") is None


def test_first_use_reads_before_it_picks_among_kins():
    source = ReadOnlyProbes(num_sms=114, gbps=2000.0)
    profile = resolve("NVIDIA H100 PCIe", 114, source)
    assert source.reads == 1 and profile.sweep["from"] == H100 and profile.num_sms == 114


def test_the_kin_keeps_every_fit_and_takes_this_gpus_bandwidth():
    h200 = kin_of(H100, 90)
    kin = kin_profile(h200, H100, 132, 3030.0, seconds=0.3)
    assert (kin.device_name, kin.num_sms, kin.bandwidth_gbps) == (H100, 132, 3030.0)
    assert kin.coef == h200.coef and kin.kv_fp8 == h200.kv_fp8
    assert kin.kv_fp8_graph_stable == h200.kv_fp8_graph_stable
    assert kin.source == KIN_SOURCE and kin.sweep["from"] == H200
    # streaming costs what it costs on the slower memory; a launch what it costs on the SM
    long = DecodeProblem([131072], 32, 8, 128, 16)
    short = DecodeProblem([64], 32, 8, 128, 16)
    ratio_long = choose_plan(long, kin).predicted_us / choose_plan(long, h200).predicted_us
    ratio_short = choose_plan(short, kin).predicted_us / choose_plan(short, h200).predicted_us
    assert 1.2 < ratio_long < 4460.0 / 3030.0 + 0.01 and ratio_short < 1.1


def test_first_use_on_a_known_architecture_reads_bandwidth_caches_and_reuses(notices):
    source = ReadOnlyProbes()
    with notices("took the profile of NVIDIA H200") as said:
        profile = resolve(H100, 132, source)
    assert source.reads == 1 and profile.source == KIN_SOURCE and len(said) == 1
    assert profile.bandwidth_gbps == 3030.0 and profile.coef == kin_of(H100, 90).coef
    path = first_use_path(H100, source.driver_version)
    assert read_profile(path).coef == profile.coef
    again = resolve(H100, 132, ReadOnlyProbes(gbps=1.0))
    assert again.bandwidth_gbps == 3030.0               # the cached model, no second read


def test_a_gpu_of_another_architecture_still_probes():
    class Probes(ReadOnlyProbes):
        probed = 0

        def probe(self):
            Probes.probed += 1
            raise RuntimeError("no kernel here")

    assert resolve("NVIDIA L40S", 142, Probes(cc=89, num_sms=142)) is None   # the prior
    assert Probes.probed == 1
