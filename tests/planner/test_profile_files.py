"""Profile files as a user's disk and a crash leave them: a broken file in the user cache is
skipped with one notice naming it, a broken file the caller names is an error naming it and
the field, a file cut short is refused, every number is checked, saves from several threads
at once each land whole, and $SPLITKV_CACHE_DIR moves the cache."""

import os
import re
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from splitkv import DecodeProblem
from splitkv.planner import choose_plan, profile_files, profile_lookup, profiles
from splitkv.planner.cost_model import CostModel
from splitkv.planner.profile_lookup import default_profile, load_profile
from splitkv.planner.profiles import (CACHE_DIR_ENV, PROFILE_ENV, Profile, ProfileError,
                                      device_slug, prior_profile, read_profile,
                                      user_profile_path)

SHIPPED = "splitkv:nvidia-h200.yaml"
PROBLEM = DecodeProblem(np.array([32768, 100]), 32, 8, 128, 16)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No $SPLITKV_PROFILE or $SPLITKV_CACHE_DIR, an empty user cache, no notice given yet."""
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profile_lookup, "_warned_prior", set())
    monkeypatch.setattr(profiles, "_warned_files", set())
    monkeypatch.setattr(profile_lookup, "_default", {})


def make_profile(launches=7.0, **changes):
    coef = dict(profiles.roofline_prior(132, 4460.0), launches=launches)
    fields = dict(device_name="NVIDIA H200", num_sms=132, bandwidth_gbps=4460.0, coef=coef,
                  fit_error=0.03, date="2026-11-29", splitkv_version="0.1.0",
                  source="calibrated", sweep={"name": "test", "points": 3})
    return Profile(**{**fields, **changes})


def sealed_text() -> str:
    return make_profile().to_yaml()


def unsealed(text: str) -> str:
    return text.split("\n", 1)[1]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def billion_laughs() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


# What a disk, a crash or a stray write leaves, as bytes, and a word of what the error says.
BROKEN = {
    "binary": (bytes(range(256)) * 4, "not UTF-8"),
    "zeros": (b"\0" * 700, "not valid YAML"),
    "empty": (b"", "got nothing"),
    "bad date": (unsealed(sealed_text()).replace("date: '2026-11-29'", "date: 2026-13-45")
                 .encode(), "day|month"),
    "bad quoted date": (unsealed(sealed_text()).replace("2026-11-29", "2026-13-45").encode(),
                        "date: expected a date"),
    "deep nesting": (f"sweep: {nested(5000)}\n".encode(), "not valid YAML"),
    "nesting past the bound": (f"sweep: {{x: {nested(40)}}}\n".encode(), "deep"),
    "alias bomb": (unsealed(sealed_text()).replace("sweep:\n", "sweep:\n  bomb: *a8\n")
                   .replace("schema: 2\n", "schema: 2\n" + billion_laughs()).encode(),
                   "values|unknown fields"),
    "half-written": (sealed_text()[:len(sealed_text()) // 2].encode(), "cut short"),
    "cut mid-number": (sealed_text()[:sealed_text().index("launches: 7.0") + 11].encode(),
                       "cut short"),
    "num_sms -1": (unsealed(sealed_text()).replace("num_sms: 132", "num_sms: -1").encode(),
                   "num_sms"),
    "bandwidth fast": (unsealed(sealed_text()).replace("bandwidth_gbps: 4460.0",
                                                       "bandwidth_gbps: fast").encode(),
                       "bandwidth_gbps"),
    "infinite coefficient": (unsealed(sealed_text()).replace("launches: 7.0", "launches: .inf")
                             .encode(), "coef.launches"),
    "huge integer": (unsealed(sealed_text()).replace("launches: 7.0", "launches: 1" + "0" * 400)
                     .encode(), "coef.launches"),
}


def cache_file(device="NVIDIA H200") -> Path:
    path = user_profile_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def notices_naming(said, path) -> list[str]:
    return [m for m in said.messages if str(path) in m]


# ------------------------------------------------------------------ broken files in the cache

@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_cache_file_is_skipped_with_one_notice(case, notices):
    """load_profile() and choose_plan's default plan with the shipped profile; the one notice
    names the file and what is wrong, and is not repeated."""
    data, what = BROKEN[case]
    path = cache_file()
    path.write_bytes(data)
    with notices() as caught:
        assert load_profile().origin == SHIPPED
        assert load_profile(device_name="NVIDIA H200", num_sms=132).origin == SHIPPED
        plan = choose_plan(PROBLEM)
    assert plan.predicted_us > 0
    said = notices_naming(caught, path)
    assert len(said) == 1 and len(caught) == 1, caught.messages
    assert caught[0].levelno == logging.WARNING
    assert "ignoring it" in said[0]
    assert re.search(what, said[0]), said[0]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_file_the_caller_names_is_an_error_naming_it(tmp_path, monkeypatch, case):
    data, what = BROKEN[case]
    path = tmp_path / "mine.yaml"
    path.write_bytes(data)
    for call in (lambda: load_profile(path), lambda: read_profile(path),
                 lambda: choose_plan(PROBLEM, str(path))):
        with pytest.raises(ProfileError, match=what) as e:
            call()
        assert str(path) in str(e.value)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    with pytest.raises(ProfileError, match=f"{PROFILE_ENV}") as e:
        load_profile()
    assert str(path) in str(e.value)


def test_an_unreadable_cache_folder_is_skipped(tmp_path, notices):
    folder = cache_file().parent
    make_profile(launches=3.0).save(cache_file())
    os.chmod(folder, 0)
    try:
        if os.access(folder, os.R_OK):
            pytest.skip("chmod does not take a folder's access away here (running as root)")
        with notices("cannot read it"):
            assert load_profile().origin == SHIPPED
    finally:
        os.chmod(folder, 0o755)


def test_a_folder_in_place_of_a_file(tmp_path, notices):
    """In the cache: no file there, the next source answers; named by the caller: an error."""
    cache_file().mkdir()
    with notices() as said:
        assert load_profile().origin == SHIPPED
    assert not said.messages
    with pytest.raises(ProfileError, match=f"profile {tmp_path}: cannot read it"):
        load_profile(tmp_path)


# ------------------------------------------------------------------ the seal

def test_every_prefix_of_a_saved_file_is_refused(tmp_path):
    """A file cut short anywhere (a crash, a full disk, an interrupted copy) never loads with
    other values: the seal's byte count and digest fail, or nothing is left to read."""
    p = make_profile().with_kv_fp8(make_profile(launches=1.0))
    full = p.save(tmp_path / "p.yaml").read_bytes()
    assert read_profile(tmp_path / "p.yaml") == p
    cut = tmp_path / "cut.yaml"
    for n in range(len(full)):
        cut.write_bytes(full[:n])
        with pytest.raises(ProfileError, match="cut.yaml"):
            read_profile(cut)


def test_an_edit_under_the_seal_is_refused_and_without_it_read():
    text = sealed_text()
    edited = text.replace("launches: 7.0", "launches: 8.0")           # same length
    with pytest.raises(ProfileError, match="seal"):
        profiles.parse_profile(edited.encode(), "x.yaml")
    assert profiles.parse_profile(unsealed(edited).encode(), "x.yaml").coef["launches"] == 8.0
    # line ends turned to CRLF by a copy still match the seal
    assert profiles.parse_profile(text.replace("\n", "\r\n").encode(), "x.yaml") == make_profile()


def test_files_without_a_seal_still_load():
    """Older and hand-written files have no seal: read as they are (the shipped one too)."""
    assert profiles.parse_profile(unsealed(sealed_text()).encode(), "x.yaml") == make_profile()
    shipped = Path(profiles.__file__).with_name("profiles") / "nvidia-h200.yaml"
    assert not shipped.read_text().startswith(profile_files.SEAL_PREFIX)
    assert read_profile(shipped) == load_profile()


# ------------------------------------------------------------------ numbers

@pytest.mark.parametrize("key, value, error", [
    ("num_sms", -1, ValueError), ("num_sms", 0, ValueError), ("num_sms", "fast", TypeError),
    ("num_sms", 1.5, TypeError), ("num_sms", True, TypeError),
    ("bandwidth_gbps", -1, ValueError), ("bandwidth_gbps", 0.0, ValueError),
    ("bandwidth_gbps", "fast", TypeError), ("bandwidth_gbps", float("nan"), ValueError),
    ("bandwidth_gbps", float("inf"), ValueError),
])
def test_the_machine_is_checked_wherever_it_is_given(key, value, error):
    """load_profile's and prior_profile's arguments, a Profile and a CostModel made in code:
    an error naming the argument, never a negative prediction or a TypeError deep inside."""
    for call in (lambda: load_profile(device_name="Acme GPU", **{key: value}),
                 lambda: prior_profile("Acme GPU", **{key: value}),
                 lambda: make_profile(**{key: value}),
                 lambda: CostModel(**{key: value})):
        with pytest.raises(error, match=key):
            call()
    data = make_profile().to_dict()
    data[key] = value
    with pytest.raises(ProfileError, match=key):
        Profile.from_dict(data, origin="x.yaml")


def test_ctas_per_sm_is_checked():
    for bad in (0, 33, "2", 2.0):
        with pytest.raises((TypeError, ValueError), match="ctas_per_sm"):
            CostModel(ctas_per_sm=bad)
        with pytest.raises(ProfileError, match="ctas_per_sm"):
            Profile.from_dict(dict(make_profile().to_dict(), ctas_per_sm=bad), origin="x.yaml")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), -1.0, "1", True,
                                   pytest.param(10 ** 400, id="10**400"), None])
@pytest.mark.parametrize("where", ["coef", "kv_fp8.coef"])
def test_non_finite_or_negative_coefficients_name_their_field(where, value):
    data = make_profile().with_kv_fp8(make_profile(launches=1.0)).to_dict()
    (data["coef"] if where == "coef" else data["kv_fp8"]["coef"])["waves"] = value
    with pytest.raises(ProfileError, match=f"{where}.waves: expected a finite non-negative"):
        Profile.from_dict(data, origin="x.yaml")


@pytest.mark.parametrize("key, value", [
    ("date", "2026-13-45"), ("date", "yesterday"), ("date", 20261129),
    ("fit_error", float("nan")), pytest.param("fit_error", 10 ** 400, id="fit_error-10**400"),
    ("measured_bandwidth_gbps", -1.0),
    ("splitkv_version", 1.5), ("source", ["calibrated"]), ("device_name", "x" * 300),
    ("sweep", {"a": {1, 2}}), ("sweep", {"a": b"bytes"}),
])
def test_every_field_is_checked_by_name(key, value):
    data = make_profile().to_dict()
    data[key] = value
    with pytest.raises(ProfileError, match=key):
        Profile.from_dict(data, origin="x.yaml")
    fp8 = make_profile().with_kv_fp8(make_profile(launches=1.0)).to_dict()
    if key in profiles.FP8_FIELDS:
        fp8["kv_fp8"][key] = value
        with pytest.raises(ProfileError, match=f"kv_fp8.{key}"):
            Profile.from_dict(fp8, origin="x.yaml")


def test_dates_are_read_as_iso_text():
    for value in ("2026-11-29", "2026-11-29T10:30:00", ""):
        assert Profile.from_dict(dict(make_profile().to_dict(), date=value)).date == value
    assert Profile.from_dict(yaml.safe_load("date: 2026-11-29\n") | {
        k: v for k, v in make_profile().to_dict().items() if k != "date"}).date == "2026-11-29"


# ------------------------------------------------------------------ saves

def save_in_threads(profiles_to_save, path, times: int) -> list:
    """Each profile saved ``times`` to ``path`` from a thread of its own, all at once; the
    exceptions the saves raised."""
    errors = []

    def save(p):
        try:
            for _ in range(times):
                p.save(path)
        except Exception as e:          # noqa: BLE001 - reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=save, args=(p,)) for p in profiles_to_save]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_threads_saving_at_once_both_land_and_leave_one_whole_file(tmp_path, monkeypatch):
    """Both threads reach the rename with their files written (a barrier holds them there):
    each save succeeds, the file is one of the two, whole, and no temporary file is left."""
    path = tmp_path / "p.yaml"
    mine = [make_profile(launches=1.0), make_profile(launches=2.0)]
    barrier = threading.Barrier(2, timeout=10)
    rename = os.replace

    def replace_together(src, dst):
        barrier.wait()
        rename(src, dst)

    monkeypatch.setattr(profiles.os, "replace", replace_together)
    assert save_in_threads(mine, path, times=1) == []
    assert read_profile(path) in mine
    assert [f.name for f in tmp_path.iterdir()] == ["p.yaml"]


def test_many_threads_saving_leave_a_whole_file(tmp_path):
    path = tmp_path / "p.yaml"
    mine = [make_profile(launches=float(i)) for i in range(8)]
    errors = save_in_threads(mine, path, times=10)
    assert errors == [] and read_profile(path) in mine
    assert [f.name for f in tmp_path.iterdir()] == ["p.yaml"]


def test_a_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profiles.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        make_profile().save(tmp_path / "p.yaml")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ arguments and the cache path

def test_an_empty_path_is_an_error_naming_path():
    with pytest.raises(ValueError, match="path: expected a profile file's path"):
        load_profile(path="")
    with pytest.raises(ValueError, match="path"):
        choose_plan(PROBLEM, "")
    with pytest.raises(TypeError, match="path"):
        load_profile(path=5)


def test_splitkv_cache_dir_moves_the_cache(tmp_path, monkeypatch):
    """$SPLITKV_CACHE_DIR, read before $XDG_CACHE_HOME: where calibrations are found, where the
    first-use cache lies, and what the remembered default profile follows."""
    from splitkv.planner.first_use import first_use_path

    own = tmp_path / "own"
    monkeypatch.setenv(CACHE_DIR_ENV, str(own))
    assert user_profile_path("NVIDIA H200") == own / "profiles" / "nvidia-h200.yaml"
    assert first_use_path("NVIDIA L40S", "12040").parent == own / "profiles" / "first-use"
    assert default_profile().origin == SHIPPED
    make_profile(launches=3.0).save(own / "profiles" / f"{device_slug('NVIDIA H200')}.yaml")
    assert load_profile().coef["launches"] == 3.0
    monkeypatch.setattr(profile_lookup, "_default", {})
    assert default_profile().coef["launches"] == 3.0
    monkeypatch.setenv(CACHE_DIR_ENV, "")                   # empty: not set
    assert user_profile_path("NVIDIA H200") == \
        tmp_path / "cache" / "splitkv" / "profiles" / "nvidia-h200.yaml"
    assert default_profile().origin == SHIPPED               # remembered per value
