"""Profiles: where they are looked up, and what happens when one is broken or foreign."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from splitkv import DecodeProblem
from splitkv.planner import choose_plan, profile_lookup, profiles
from splitkv.planner.features import FEATURE_NAMES
from splitkv.planner.profile_lookup import default_profile, load_profile
from splitkv.planner.profiles import (PROFILE_ENV, Profile, ProfileError, device_slug,
                                      prior_profile, read_profile)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No $SPLITKV_PROFILE, an empty user cache, the one-time warning not yet given."""
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.delenv(profiles.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profile_lookup, "_warned_prior", set())
    monkeypatch.setattr(profiles, "_warned_files", set())
    monkeypatch.setattr(profile_lookup, "_default", {})


def make_profile(device="NVIDIA H200", num_sms=132, launches=7.0, source="calibrated"):
    coef = dict(profiles.roofline_prior(num_sms, 4460.0), launches=launches)
    return Profile(device_name=device, num_sms=num_sms, bandwidth_gbps=4460.0, coef=coef,
                   fit_error=0.03, heldout_error=0.05, date="2026-11-29",
                   splitkv_version="0.1.0", source=source, sweep={"name": "test", "points": 3})


def cache_file(tmp_path, device="NVIDIA H200"):
    path = tmp_path / "cache" / "splitkv" / "profiles" / f"{device_slug(device)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_shipped_h200_profile_loads_and_says_what_it_is(notices):
    with notices() as said:
        p = load_profile(device_name="NVIDIA H200", num_sms=132)
    assert not said.messages                           # a shipped profile needs no notice
    assert p.device_name == "NVIDIA H200" and p.num_sms == 132
    assert p.origin == "splitkv:nvidia-h200.yaml"
    assert set(p.coef) == set(FEATURE_NAMES)
    assert p.splitkv_version and p.date
    if p.is_prior:
        assert p.source == "prior, not yet calibrated"
    assert load_profile().device_name == "NVIDIA H200"      # the reference device by default


def test_profile_fitted_before_a_feature_reads_it_as_zero(tmp_path):
    """A profile without lone_cta_us (fitted before the feature) predicts as it did."""
    p = make_profile()
    path = p.save(tmp_path / "old.yaml")
    data = yaml.safe_load(path.read_text())
    del data["coef"]["lone_cta_us"]
    path.write_text(yaml.safe_dump(data))
    assert read_profile(path).coef == {**p.coef, "lone_cta_us": 0.0}


def test_round_trip(tmp_path):
    p = make_profile()
    path = p.save(tmp_path / "a" / "p.yaml")
    q = read_profile(path)
    assert q == p and q.origin == str(path)
    ones = np.ones(len(FEATURE_NAMES))
    assert q.cost_model().predict(ones) == pytest.approx(sum(p.coef.values()))
    assert "splitkv cost-model profile" in path.read_text()


def test_lookup_order(tmp_path, monkeypatch, notices):
    explicit = make_profile(launches=1.0).save(tmp_path / "explicit.yaml")
    env = make_profile(launches=2.0).save(tmp_path / "env.yaml")
    make_profile(launches=3.0).save(cache_file(tmp_path))
    monkeypatch.setenv(PROFILE_ENV, str(env))
    assert load_profile(explicit).coef["launches"] == 1.0
    assert load_profile().coef["launches"] == 2.0
    monkeypatch.delenv(PROFILE_ENV)
    assert load_profile().coef["launches"] == 3.0              # user cache
    cache_file(tmp_path).unlink()
    assert load_profile().origin == "splitkv:nvidia-h200.yaml"  # shipped
    with notices("splitkv calibrate"):
        p = load_profile(device_name="Acme GPU 9000", num_sms=80)   # last: the prior
    assert p.is_prior and p.num_sms == 80 and p.device_name == "Acme GPU 9000"


def test_unknown_gpu_warns_once_and_plans_with_the_prior(notices):
    with notices("no calibrated profile for 'Acme GPU'") as said:
        p = load_profile(device_name="Acme GPU", num_sms=40)
    assert len(said.at(logging.WARNING)) == 1, said.messages       # a fallback: a WARNING
    with notices() as said:
        load_profile(device_name="Acme GPU", num_sms=40)          # once per device
    assert not said.messages
    assert p.coef == profiles.roofline_prior(40, p.bandwidth_gbps)
    assert p.bandwidth_gbps == profiles.DEFAULT_BANDWIDTH_GBPS
    plan = choose_plan(DecodeProblem(np.array([32768]), 32, 8, 128, 16), p)
    assert plan.num_splits > 1
    # a fraction of a known GPU (a MIG slice) is not the shipped profile's device
    with notices("no calibrated profile for 'NVIDIA H200' with 16 SMs"):
        mig = load_profile(device_name="NVIDIA H200", num_sms=16)
    assert mig.is_prior and mig.num_sms == 16 and mig.bandwidth_gbps == 4460.0


BROKEN = {
    "not yaml": "device_name: [unclosed\n",
    "not a mapping": "- 1\n- 2\n",
    "python object": "!!python/object/apply:os.system ['echo hi']\n",
    "missing field": "device_name: X\nnum_sms: 1\nbandwidth_gbps: 1.0\n",
    "wrong coef": "device_name: X\nnum_sms: 1\nbandwidth_gbps: 1.0\ncoef: {launches: 1.0}\n",
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_explicit_profile_is_a_clear_error(tmp_path, case):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN[case])
    with pytest.raises(ProfileError, match="broken.yaml"):
        load_profile(path)


@pytest.mark.parametrize("case", ["missing", *sorted(BROKEN)])
def test_a_wrappers_profile_path_is_read_when_the_wrapper_is_made(tmp_path, case):
    """Not at the first plan(): a typo in a path fails where it was written (no GPU needed)."""
    from splitkv import BatchDecodeWrapper

    path = tmp_path / "broken.yaml"
    if case != "missing":
        path.write_text(BROKEN[case])
    with pytest.raises(ProfileError, match="broken.yaml"):
        BatchDecodeWrapper(32, 8, 128, 16, profile=path)
    with pytest.raises(ProfileError, match="broken.yaml"):
        BatchDecodeWrapper(32, 8, 128, 16, profile=str(path))


def test_a_wrapper_takes_a_good_profile_path_without_a_gpu():
    from splitkv import BatchDecodeWrapper

    shipped = Path(profiles.__file__).with_name("profiles") / "nvidia-h200.yaml"
    assert BatchDecodeWrapper(32, 8, 128, 16, profile=shipped) is not None


def test_bad_fields_name_the_field(tmp_path):
    good = make_profile().to_dict()
    for key, value, message in [("num_sms", 0, "num_sms"), ("bandwidth_gbps", -1, "bandwidth"),
                                ("schema", 99, "schema"), ("extra", 1, "unknown fields"),
                                ("device_name", "", "device_name"), ("sweep", [1], "sweep"),
                                ("coef", dict(good["coef"], waves=-1.0), "coef.waves")]:
        data = dict(good, **{key: value})
        with pytest.raises(ProfileError, match=message):
            Profile.from_dict(data, origin="x.yaml")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.yaml")


def test_the_schema_is_written_and_a_newer_one_refused():
    """Saved profiles carry the format's schema; a file without one reads as the schema
    before it; a newer schema, or one that is not a version, is refused by name."""
    from splitkv.planner.profiles import SCHEMA

    good = make_profile().to_dict()
    assert good["schema"] == SCHEMA
    older = {k: v for k, v in good.items() if k != "schema"}
    assert Profile.from_dict(older) == Profile.from_dict(good)
    assert Profile.from_dict(dict(good, schema=SCHEMA - 1)) == Profile.from_dict(good)
    with pytest.raises(ProfileError, match=f"schema {SCHEMA + 1} is newer than this splitkv "
                                           f"reads \\(up to {SCHEMA}\\)"):
        Profile.from_dict(dict(good, schema=SCHEMA + 1), origin="x.yaml")
    for bad in ("1", -1, True, 1.0):
        with pytest.raises(ProfileError, match="schema: expected an integer >= 0"):
            Profile.from_dict(dict(good, schema=bad), origin="x.yaml")


def test_a_schema_1_profiles_const_is_dropped_and_plans_the_same(tmp_path, notices):
    """Schema 1 had a `const` column (1 a call): a user's calibration of that schema loads with
    it dropped, in every fit, and plans as the same profile without it (a constant added to
    every plan of a call changes no choice). In schema 2 it is an unknown column."""
    new = make_profile().with_kv_fp8(make_profile(launches=1.0))
    old = new.to_dict()
    old["schema"] = 1
    old["coef"] = {"const": 3.0, **old["coef"]}
    old["kv_fp8"]["coef"] = {"const": 0.5, **old["kv_fp8"]["coef"]}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    with notices() as said:
        loaded = read_profile(path)
    assert not said.messages
    assert loaded == new
    assert Profile.from_dict({k: v for k, v in old.items() if k != "schema"}) == new
    for lens in ([32768], [100] * 64, [5000, 17, 900, 3000, 0]):
        p = DecodeProblem(np.array(lens), 32, 8, 128, 16)
        for kv_dtype in (None, "float8_e4m3fn"):
            a = choose_plan(p, loaded.cost_model(kv_dtype))
            b = choose_plan(p, new.cost_model(kv_dtype))
            assert (a.strategy, a.merge, a.predicted_us) == (b.strategy, b.merge, b.predicted_us)
            np.testing.assert_array_equal(a.chunk_end - a.chunk_start, b.chunk_end - b.chunk_start)
    with pytest.raises(ProfileError, match="expected one parameter for each feature"):
        Profile.from_dict(dict(old, schema=2), origin="x.yaml")


def test_unquoted_date_is_read_as_text(tmp_path):
    """A hand edit of a saved file: its seal line deleted, it is read as written."""
    path = tmp_path / "p.yaml"
    text = make_profile().to_yaml().replace("date: '2026-11-29'", "date: 2026-11-29")
    path.write_text(text.split("\n", 1)[1])
    assert read_profile(path).date == "2026-11-29"


def test_mismatched_explicit_profile_is_an_error(tmp_path, monkeypatch):
    path = make_profile(device="NVIDIA A100-SXM4-80GB", num_sms=108).save(tmp_path / "a100.yaml")
    with pytest.raises(ProfileError, match="made for 'NVIDIA A100-SXM4-80GB'"):
        load_profile(path, device_name="NVIDIA H200")
    with pytest.raises(ProfileError, match="108 SMs"):
        load_profile(path, num_sms=132)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    with pytest.raises(ProfileError, match=PROFILE_ENV):
        load_profile(device_name="NVIDIA H200")
    assert load_profile(path).num_sms == 108          # no device given: not checked


def test_corrupt_or_foreign_cache_profile_warns_and_falls_back(tmp_path, notices):
    cache_file(tmp_path).write_text("coef: [oops\n")
    with notices("ignoring it") as said:
        p = load_profile(device_name="NVIDIA H200")
    assert said.at(logging.WARNING) == said.messages
    assert p.origin == "splitkv:nvidia-h200.yaml"
    make_profile(num_sms=100).save(cache_file(tmp_path))
    with notices("100 SMs"):
        p = load_profile(device_name="NVIDIA H200", num_sms=132)
    assert p.origin == "splitkv:nvidia-h200.yaml"


def test_default_profile_follows_the_environment(tmp_path, monkeypatch):
    assert default_profile() is default_profile()          # remembered
    path = make_profile(launches=5.0).save(tmp_path / "env.yaml")
    monkeypatch.setenv(PROFILE_ENV, str(path))
    assert default_profile().coef["launches"] == 5.0


def test_prior_profile_fields():
    p = prior_profile("NVIDIA H100 80GB HBM3", 132)
    assert p.is_prior and p.bandwidth_gbps == 3000.0 and p.fit_error is None
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_planner_imports_without_cupy():
    import splitkv

    code = ("import sys, splitkv.planner, splitkv.calibration.sweep, splitkv.calibration.fit, "
            "splitkv.calibration.calibrate, splitkv.cli.plan, splitkv.cli.calibrate, "
            "splitkv.cli.demo, splitkv.cli.bench; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    root = str(Path(splitkv.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_shipped_profile_is_plain_yaml():
    from importlib import resources

    text = resources.files("splitkv.planner").joinpath("profiles", "nvidia-h200.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["device_name"] == "NVIDIA H200"


def test_an_fp8_fit_plans_fp8_caches_only(tmp_path):
    """`kv_fp8` holds a second fit: cost_model(kv_dtype) gives it for fp8 caches, the 16-bit
    fit otherwise, and a profile without one plans fp8 with its 16-bit fit. It survives a
    round trip, and a fit made for another device is refused."""
    base = make_profile()
    assert base.cost_model("float8_e4m3fn") is base.cost_model()
    fp8 = make_profile(launches=1.0)
    both = base.with_kv_fp8(fp8)
    assert both.cost_model("float8_e5m2").coef_dict()["launches"] == 1.0
    assert both.cost_model().coef_dict()["launches"] == 7.0
    assert both.cost_model(None) is both.cost_model()
    q = read_profile(both.save(tmp_path / "both.yaml"))
    assert q == both and "kv_fp8" in (tmp_path / "both.yaml").read_text()
    assert "kv_fp8" not in base.to_yaml()
    with pytest.raises(ProfileError, match="made for 'NVIDIA H100'"):
        base.with_kv_fp8(make_profile(device="NVIDIA H100"))


def test_graph_stable_fp8_wrappers_plan_with_their_own_fit(tmp_path):
    """`kv_fp8_graph_stable` (timed with 4-warp CTAs everywhere) is what a graph-stable fp8
    wrapper plans with; per-shape fp8 plans keep kv_fp8; without it both use kv_fp8, and
    16-bit caches never see either. It survives a round trip."""
    fp8 = make_profile().with_kv_fp8(make_profile(launches=1.0))
    assert fp8.cost_model("float8_e4m3fn", graph_stable=True) is fp8.cost_model("float8_e4m3fn")
    all3 = fp8.with_kv_fp8(make_profile(launches=2.0), graph_stable=True)
    assert all3.cost_model("float8_e4m3fn", graph_stable=True).coef_dict()["launches"] == 2.0
    assert all3.cost_model("float8_e4m3fn").coef_dict()["launches"] == 1.0
    assert all3.cost_model(None, graph_stable=True).coef_dict()["launches"] == 7.0
    assert all3.kv_fp8["coef"]["launches"] == 1.0
    assert read_profile(all3.save(tmp_path / "all3.yaml")) == all3
    assert "kv_fp8_graph_stable" not in fp8.to_yaml()
    data = yaml.safe_load(all3.to_yaml())
    data["kv_fp8_graph_stable"]["coef"]["waves"] = float("nan")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="kv_fp8_graph_stable.coef.waves: expected a finite"):
        read_profile(tmp_path / "bad.yaml")


def test_the_shipped_h200_profile_has_both_fp8_fits():
    """Per-shape fp8 plans of few CTAs run 8 warps, which removes the lone-CTA penalty the
    4-warp (graph-stable) fit measured (docs/design/fp8.md)."""
    from importlib import resources

    h200 = read_profile(resources.files("splitkv.planner").joinpath("profiles", "nvidia-h200.yaml"))
    per_shape = h200.cost_model("float8_e4m3fn").coef_dict()
    graph = h200.cost_model("float8_e4m3fn", graph_stable=True).coef_dict()
    assert h200.kv_fp8_graph_stable["sweep"]["graph_stable"] is True
    assert graph["lone_cta_us"] > 10 * per_shape["lone_cta_us"]


def test_an_fp8_fits_tile_rule_travels_with_it(tmp_path):
    """A per-shape fp8 fit counting its builds' 128-token tiles says so (tile_rule 'fp8'), and
    plans so; the 16-bit fit, and a graph-stable wrapper borrowing that fit (the planner on
    the device counts 64-token tiles), do not. A fit without the field counts 64."""
    from dataclasses import replace

    fp8 = replace(make_profile(launches=1.0), tile_rule="fp8")
    both = make_profile().with_kv_fp8(fp8)
    assert both.kv_fp8["tile_rule"] == "fp8"
    assert both.cost_model("float8_e4m3fn").tile_rule == "fp8"
    assert both.cost_model().tile_rule == ""
    borrowed = both.cost_model("float8_e4m3fn", graph_stable=True)
    assert borrowed.tile_rule == "" and borrowed.coef_dict() == both.kv_fp8["coef"]
    q = read_profile(both.save(tmp_path / "both.yaml"))
    assert q == both and q.cost_model("float8_e4m3fn").tile_rule == "fp8"
    assert "tile_rule" not in make_profile().to_yaml()           # written only where set
    old = make_profile().with_kv_fp8(make_profile(launches=1.0))
    assert "tile_rule" not in old.kv_fp8 and old.cost_model("float8_e4m3fn").tile_rule == ""


def test_graph_stable_models_always_count_64_token_tiles():
    """The planner on the device counts 64-token tiles, so a graph-stable wrapper's model does
    too, whichever fit it comes from: a graph-stable fit marked with a rule, or a lone fp8
    profile (the rule at its top level). A profile cannot hold the multi-token rule."""
    from dataclasses import replace

    marked = replace(make_profile(launches=2.0), tile_rule="fp8")
    p = make_profile().with_kv_fp8(marked, graph_stable=True)
    assert p.cost_model("float8_e4m3fn", graph_stable=True).tile_rule == ""
    assert p.cost_model("float8_e4m3fn", graph_stable=True).coef_dict()["launches"] == 2.0
    alone = replace(make_profile(launches=1.0), tile_rule="fp8")
    assert alone.cost_model("float8_e4m3fn").tile_rule == "fp8"
    assert alone.cost_model("float8_e4m3fn", graph_stable=True).tile_rule == ""
    assert (alone.cost_model("float8_e4m3fn", graph_stable=True)
            is alone.cost_model("float8_e4m3fn", graph_stable=True))        # cached
    with pytest.raises(ProfileError, match="tile_rule: expected one of \\['', 'fp8'\\]"):
        Profile.from_dict({**alone.to_dict(), "tile_rule": "fp8_multi_token"})


def test_graph_stable_models_price_no_merge_grid():
    """A graph-stable grid launches the merge kernel over its capacity whatever the strategy,
    so its model holds merge_grid 0 (the rest of the fit as it is); per-shape models keep it."""
    h200 = default_profile()
    per_shape, graph = h200.cost_model(), h200.cost_model(graph_stable=True)
    assert per_shape.coef_dict()["merge_grid"] > 0 and graph.coef_dict()["merge_grid"] == 0
    assert {k: v for k, v in graph.coef_dict().items() if k != "merge_grid"} == \
        {k: v for k, v in per_shape.coef_dict().items() if k != "merge_grid"}
    assert h200.cost_model(graph_stable=True) is graph                  # cached
    assert h200.cost_model().coef_dict()["merge_grid"] > 0              # left as it was


def test_the_shipped_fp8_fits_count_the_tiles_they_were_timed_with():
    h200 = default_profile()
    assert h200.cost_model("float8_e4m3fn").tile_rule == "fp8"
    assert h200.cost_model("float8_e4m3fn", graph_stable=True).tile_rule == ""
    assert h200.cost_model().tile_rule == ""


@pytest.mark.parametrize("change, blamed", [
    (lambda d: d["kv_fp8"].update(tile_rule="128"), "kv_fp8.tile_rule: expected one of"),
    (lambda d: d.update(tile_rule=True), "tile_rule: expected one of"),
    (lambda d: d["kv_fp8"]["coef"].pop("kv_us"), "kv_fp8.coef: expected one parameter"),
    (lambda d: d["kv_fp8"]["coef"].update(kv_us=-1.0), "kv_fp8.coef.kv_us: expected a finite"),
    (lambda d: d["kv_fp8"].update(speed=3), "kv_fp8: unknown fields \\['speed'\\]"),
    (lambda d: d["kv_fp8"].update(fit_error="low"), "kv_fp8.fit_error: expected a finite"),
    (lambda d: d.update(kv_fp8=[1, 2]), "kv_fp8: expected a mapping with a 'coef'"),
])
def test_a_bad_fp8_fit_names_its_field(tmp_path, change, blamed):
    data = yaml.safe_load(make_profile().with_kv_fp8(make_profile(launches=1.0)).to_yaml())
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=blamed):
        read_profile(path)
