"""Calibration on the CPU: the sweep, the fit and the command, with a simulated GPU whose
latencies come from a known cost model."""

import argparse

import numpy as np
import pytest

from splitkv.calibration.calibrate import QUICK_TIMING
from splitkv.core.problem import DecodeProblem
from splitkv.calibration.fit import decisions, fit_profile, split_heldout
from splitkv.calibration.sweep import (MAX_KV_BYTES, candidate_plans, measure, sweep_points,
                                       sweep_shapes)
from splitkv.cli import calibrate as calibrate_cli
from splitkv.planner import CostModel, profile_lookup, profiles
from splitkv.planner.profiles import prior_profile, read_profile

# The simulated GPU: unlike the prior the sweep is drawn under, in every parameter.
TRUE_COEF = {name: 1.5 * value + 0.05
             for name, value in profiles.roofline_prior(132, 4460.0).items()}
DEVICE = {"name": "NVIDIA H200", "num_sms": 132, "l2_bytes": 62914560, "cc": "90"}


@pytest.fixture
def fake_gpu():
    """time_plan_us of a GPU that follows TRUE_COEF with 1% noise."""
    truth = CostModel.from_coef(TRUE_COEF, clusters=True)   # DEVICE is sm_90
    rng = np.random.default_rng(7)
    calls = []

    def time_plan_us(plan, page_table, **timing):
        assert np.array_equal(page_table.kv_lens, plan.problem.kv_lens)
        calls.append(timing)
        return truth.predict(plan) * (1 + 0.01 * rng.standard_normal())

    time_plan_us.calls = calls
    return time_plan_us


@pytest.fixture(scope="module")
def prior_model():
    return prior_profile("NVIDIA H200", 132).cost_model()


def test_full_sweep_covers_the_space():
    shapes = sweep_shapes()
    problems = [s.problem for s in shapes]
    batches = {p.batch_size for p in problems}
    assert {1, 256} <= batches
    lens = np.concatenate([p.kv_lens for p in problems])
    assert lens.min() <= 16 and lens.max() >= 128 * 1024
    assert {p.group_size for p in problems} >= {1, 2, 4, 8, 16, 32}   # groups 16 and 32 too
    assert any(p.head_dim == 256 and p.group_size == 2 for p in problems)
    assert {p.head_dim for p in problems} == {64, 128, 256}
    assert any(len(set(p.kv_lens.tolist())) > 1 for p in problems)        # ragged ones
    assert all(p.kv_bytes <= MAX_KV_BYTES for p in problems)
    assert len({s.name for s in shapes}) == len(shapes)
    quick = sweep_shapes(quick=True)
    assert len(quick) < len(shapes) / 4
    again = sweep_shapes()                                                # deterministic
    assert [s.name for s in again] == [s.name for s in shapes]
    for a, b in zip(again, shapes):
        np.testing.assert_array_equal(a.problem.kv_lens, b.problem.kv_lens)


def test_candidate_plans_span_good_and_bad(prior_model):
    shape = next(s for s in sweep_shapes(quick=True) if s.name == "b1_n32768")
    plans = candidate_plans(shape.problem, prior_model, max_decompositions=5)
    labels = [label for label, _ in plans]
    assert labels[0] == "no split" and len(labels) == 9 and len(set(labels)) == 9
    assert sum(label.endswith("fused") for label in labels) == 4
    best = min(plans, key=lambda lp: lp[1].predicted_us)
    assert best[1].predicted_us == pytest.approx(prior_model.predict(best[1]))


def test_candidate_plans_time_each_cut_of_the_requests_once(prior_model):
    # 8 requests of 8192 tokens: num splits 4, chunk tokens 2048 and 2304 cut them alike; the
    # sweep times that cut once and spends its other slots on different ones
    problem = DecodeProblem(np.full(8, 8192), 16, 8, 256, 16)
    plans = candidate_plans(problem, prior_model, max_decompositions=5)
    cuts = {(p.strategy, p.chunk_request.tobytes() + p.chunk_start.tobytes()) for _, p in plans}
    assert len(cuts) == len(plans) == 9


def test_measure_and_fit_recover_the_simulated_gpu(prior_model, fake_gpu):
    points = sweep_points(prior_model, quick=False)
    seen = []
    ms = measure(points, time_fn=fake_gpu, progress=lambda i, n, p, us: seen.append(i),
                 trials=3)
    assert seen == list(range(len(points))) and fake_gpu.calls[0] == {"trials": 3}
    profile, report = fit_profile(ms, DEVICE, sweep={"name": "full"})
    assert report.fit_error < 0.02
    assert report.heldout_mape < 0.03
    assert report.mean_regret < 0.03
    assert report.n_train + report.n_heldout == len(ms)
    for name in ("crit_us", "kv_us", "waves", "launches", "partial_us", "fused_merges"):
        assert profile.coef[name] == pytest.approx(TRUE_COEF[name], rel=0.25), name
    assert profile.source == "calibrated" and profile.num_sms == 132
    assert profile.bandwidth_gbps == 4460.0 and profile.measured_bandwidth_gbps > 1000
    assert profile.sweep["name"] == "full" and profile.sweep["points"] == len(ms)
    assert any("held out" in line for line in report.lines())


def test_heldout_split_is_by_shape(prior_model, fake_gpu):
    ms = measure(sweep_points(prior_model, quick=True), time_fn=fake_gpu)
    train, held = split_heldout(ms, 0.25, seed=1)
    assert held and train
    assert not {m.shape for m in train} & {m.shape for m in held}
    assert len(train) + len(held) == len(ms)
    model = CostModel.from_coef(TRUE_COEF)
    for d in decisions(model, held):
        assert d.regret >= 0


def run_calibrate(argv):
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    return calibrate_cli.run(parser.parse_args(argv))


def test_calibrate_without_a_gpu_exits_1(monkeypatch, capsys):
    import splitkv.runtime

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (False, "no device here"))
    assert run_calibrate(["--quick"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "no device here" in err


def test_calibrate_on_a_device_that_is_not_there_names_it_and_exits_2(monkeypatch, capsys):
    """--device N with no such GPU is the call's mistake (2), not the machine's (1)."""
    import splitkv.runtime

    import sys

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")       # restored after the test
    monkeypatch.delitem(sys.modules, "cupy", raising=False)   # as before CUDA starts
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (False, "no device here"))
    assert run_calibrate(["--quick", "--device", "0"]) == 2
    assert "splitkv calibrate: --device 0: no such CUDA GPU here" in capsys.readouterr().err


def test_calibrate_with_a_simulated_gpu(monkeypatch, tmp_path, capsys, fake_gpu):
    import splitkv.runtime
    import splitkv.measure.timing

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    monkeypatch.setattr(splitkv.measure.timing, "time_plan_us", fake_gpu)
    out = tmp_path / "h200.yaml"
    assert run_calibrate(["--quick", "--plot", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "held out" in text and "plans of the standard cases, previous: " in text
    assert "b1_n32k" in text and f"profile written to {out}" in text
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "h200-decisions.png").exists()
        assert (tmp_path / "h200-predicted-vs-measured.png").exists()
    except ImportError:
        assert "matplotlib is not installed" in text
    assert out.with_suffix(".csv").read_text().startswith("shape,plan,")
    assert not out.with_suffix(".partial.csv").exists()      # removed once the fit is written
    assert fake_gpu.calls[0] == QUICK_TIMING
    profile = read_profile(out)
    assert profile.source == "calibrated" and profile.sweep["name"] == "quick"


@pytest.fixture
def simulated_gpu(monkeypatch, tmp_path, fake_gpu):
    """The simulated GPU behind the command, an empty user cache and no $SPLITKV_PROFILE."""
    import splitkv.runtime
    import splitkv.measure.timing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    monkeypatch.setattr(splitkv.measure.timing, "time_plan_us", fake_gpu)
    return tmp_path / "cache" / "splitkv" / "profiles" / "nvidia-h200.yaml"


def test_calibrate_shows_progress_then_what_the_new_profile_changes(simulated_gpu, capsys):
    """In a log (stderr is no terminal under pytest): plain progress lines with the time left,
    on stderr; then, on stdout, the standard cases' plans against the profile used before (the
    shipped one here) and that splitkv now plans with the profile written to the user cache."""
    from splitkv.bench.cases import STANDARD_CASES

    assert run_calibrate(["--quick"]) == 0
    out, err = capsys.readouterr()
    progress = err.splitlines()
    assert progress[0].startswith("calibrating: 2/90 plans (2%), ") and "left" in progress[0]
    assert progress[-1].startswith("calibrating: 90/90 plans (100%), ")
    assert "\r" not in err and "[   1/" not in out
    table = out[out.index("plans of the standard cases, previous: the profile shipped with "
                          "splitkv (nvidia-h200.yaml)"):].splitlines()
    assert table[1].split()[:3] == ["case", "previous", "plan"]
    for case, line in zip(STANDARD_CASES, table[2:2 + len(STANDARD_CASES)]):
        assert f" {case.name} " in line
    assert "plans changed (*)" in table[2 + len(STANDARD_CASES)]
    assert out.rstrip().endswith(f"splitkv plans with it on this GPU: {simulated_gpu} "
                                 "(the user cache)")


def test_calibrate_quiet_prints_no_progress_and_verbose_each_plan(simulated_gpu, capsys):
    assert run_calibrate(["--quick", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "[   1/90]" not in out and "plans changed" in out
    assert run_calibrate(["--quick", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert "[   1/90] " in out and "[  90/90] " in out and "(prior " in out
    assert err.startswith("calibrating: 2/90 plans")
    # the second run compares with the first, now in the user cache
    assert f"plans of the standard cases, previous: {simulated_gpu} (the user cache)" in out


def test_calibrate_warns_when_another_profile_wins(simulated_gpu, monkeypatch, tmp_path,
                                                   capsys):
    # --out outside the lookup: splitkv goes on with the shipped profile, and says so
    out_path = tmp_path / "mine" / "h200.yaml"
    assert run_calibrate(["--quick", "--quiet", "--out", str(out_path)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "warning: splitkv will not plan with this profile: it is not where splitkv looks",
        "  splitkv plans with: the profile shipped with splitkv (nvidia-h200.yaml)",
        f"  to plan with the new one: set {profiles.PROFILE_ENV}={out_path} or pass "
        f"profile=\"{out_path}\" to the wrapper, or copy it to {simulated_gpu}"]
    # $SPLITKV_PROFILE names that file: a calibration written to the cache does not count
    monkeypatch.setenv(profiles.PROFILE_ENV, str(out_path))
    assert run_calibrate(["--quick", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert f"plans of the standard cases, previous: {out_path} (named by " in out
    assert err.splitlines() == [
        f"warning: splitkv will not plan with this profile: ${profiles.PROFILE_ENV}="
        f"{out_path} comes first",
        f"  splitkv plans with: {out_path} (named by ${profiles.PROFILE_ENV})",
        f"  to plan with the new one: unset {profiles.PROFILE_ENV}"]


def test_a_calibration_cut_off_keeps_what_it_measured(monkeypatch, tmp_path, fake_gpu):
    """Each measurement reaches <profile>.partial.csv as it is taken: a sweep that stops
    before its fit (here the simulated GPU fails at the 11th plan) leaves the 10 it timed, and
    read_measurements rebuilds their plans from it for a fit without the GPU."""
    import splitkv.runtime
    import splitkv.measure.timing
    from splitkv.calibration.sweep import read_measurements

    calls = []

    def failing(plan, table, **timing):
        if len(calls) == 10:
            raise RuntimeError("the device went away")
        calls.append((plan, fake_gpu(plan, table, **timing)))
        return calls[-1][1]

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    monkeypatch.setattr(splitkv.measure.timing, "time_plan_us", failing)
    out = tmp_path / "h200.yaml"
    with pytest.raises(RuntimeError, match="the device went away"):
        run_calibrate(["--quick", "--out", str(out)])
    assert not out.exists()
    partial = out.with_suffix(".partial.csv")
    back = read_measurements(partial, quick=True)
    assert len(back) == 10
    for m, (plan, us) in zip(back, calls):
        assert m.plan.num_chunks == plan.num_chunks
        np.testing.assert_array_equal(m.plan.chunk_end, plan.chunk_end)
        assert m.measured_us == pytest.approx(us, abs=1e-3)


def test_calibrate_writes_to_the_user_cache_by_default(monkeypatch, tmp_path, fake_gpu):
    import splitkv.runtime
    import splitkv.measure.timing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    monkeypatch.setattr(splitkv.measure.timing, "time_plan_us", fake_gpu)
    assert run_calibrate(["--quick"]) == 0
    found = profile_lookup.load_profile(device_name="NVIDIA H200", num_sms=132)
    assert found.source == "calibrated"
    assert found.origin == str(tmp_path / "splitkv" / "profiles" / "nvidia-h200.yaml")


def test_device_selection(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "cupy", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert calibrate_cli._select_device(1) is None
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert "shows 2 device" in calibrate_cli._select_device(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert calibrate_cli._select_device(3) is None
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_measurements_round_trip_through_csv(tmp_path, prior_model, fake_gpu):
    from splitkv.calibration.sweep import read_measurements, write_measurements

    ms = measure(sweep_points(prior_model, quick=True), time_fn=fake_gpu)
    path = write_measurements(tmp_path / "m.csv", ms, prior_model)
    back = read_measurements(path)
    assert [(m.shape, m.label, m.measured_us) for m in back] == \
        [(m.shape, m.label, round(m.measured_us, 3)) for m in ms]
    for a, b in zip(ms, back):
        np.testing.assert_array_equal(a.plan.chunk_end, b.plan.chunk_end)
        assert a.plan.strategy == b.plan.strategy
    # a CSV without kv_lens (older splitkv) finds its shapes by name in the same sweep
    lines = path.read_text().splitlines()
    legacy = tmp_path / "legacy.csv"
    legacy.write_text("\n".join(",".join(line.split(",")[:10]) for line in lines) + "\n")
    assert [m.label for m in read_measurements(legacy, quick=True)] == [m.label for m in ms]
    with pytest.raises(ValueError, match="not in the full sweep"):
        read_measurements(legacy, quick=False)


def test_candidate_labels_round_trip(prior_model):
    from splitkv.planner import Candidate

    for c in rank_candidates_of(prior_model):
        back = Candidate.from_label(c.label)
        assert (back.kind, back.value, back.strategy) == (c.kind, c.value, c.strategy)
    with pytest.raises(ValueError, match="label"):
        Candidate.from_label("chunk tokens many fused")
    assert "n/a" in str(Candidate.from_label("num splits 4 fused"))


def rank_candidates_of(model):
    from splitkv import DecodeProblem
    from splitkv.planner import rank_candidates

    return rank_candidates(DecodeProblem(np.array([100, 5000]), 32, 8, 128, 16), model)


def test_median_host_us_warms_up_then_times_each_call():
    from splitkv.measure.timing import median_host_us

    calls = []
    us = median_host_us(lambda: calls.append(1), 7, warmup=3)
    assert len(calls) == 10 and 0 < us < 1e5


def test_calibrate_kv_dtype_adds_an_fp8_fit_to_the_base_profile(monkeypatch, tmp_path, capsys):
    """`--kv-dtype` times over fp8 K/V (the timing function is told so) and writes the base
    profile unchanged but for its kv_fp8 parameters, which fp8 caches then plan with; the
    fp8 measurements go to <name>.fp8.csv."""
    import splitkv.runtime
    import splitkv.measure.timing

    fp8_coef = dict(TRUE_COEF, kv_us=TRUE_COEF["kv_us"] / 2, crit_us=TRUE_COEF["crit_us"] / 2)
    truth = CostModel.from_coef(fp8_coef, clusters=True)
    seen = []

    def time_plan_us(plan, page_table, **timing):
        seen.append(timing.get("kv_dtype"))
        return truth.predict(plan)

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    monkeypatch.setattr(splitkv.measure.timing, "time_plan_us", time_plan_us)
    base = prior_profile("NVIDIA H200", 132)
    base_path = base.save(tmp_path / "base.yaml")
    out = tmp_path / "with-fp8.yaml"
    assert run_calibrate(["--quick", "--kv-dtype", "fp8_e4m3", "--base", str(base_path),
                          "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "over float8_e4m3fn K/V" in text and "for float8_e4m3fn caches" in text
    assert set(seen) == {"float8_e4m3fn"}
    written = read_profile(out)
    assert written.coef == base.coef and written.kv_fp8 is not None
    assert written.kv_fp8["sweep"]["kv_dtype"] == "float8_e4m3fn"
    fitted = written.cost_model("float8_e4m3fn")
    assert fitted is not written.cost_model() and fitted.coef_dict() == written.kv_fp8["coef"]
    assert out.with_suffix(".fp8.csv").read_text().startswith("shape,plan,")
    assert not out.with_suffix(".csv").exists()


def test_calibrate_graph_stable_times_four_warps_and_fills_its_own_fit(monkeypatch, tmp_path,
                                                                       capsys):
    """`--kv-dtype ... --graph-stable` times every plan with 4-warp CTAs and the tile a warp of
    the graph-stable grid's build (``core.builds.graph_build``: what a graph-stable wrapper
    runs) and writes kv_fp8_graph_stable, leaving kv_fp8 as it was."""
    from splitkv.core.builds import H200, graph_build, shape_build
    from splitkv.core.variants import PLAIN
    import splitkv.runtime
    import splitkv.measure.timing

    truth = CostModel.from_coef(dict(TRUE_COEF, waves=TRUE_COEF["waves"] * 2), clusters=True)
    seen, tiles = [], []

    def time_plan_us(plan, page_table, **timing):
        p, experiments = plan.problem, timing["experiments"](plan.problem)
        group = p.num_qo_heads // p.num_kv_heads
        graph = graph_build(shape_build(p.dtype, p.head_dim, group, p.page_size, "float8_e4m3fn"),
                            variant=PLAIN, rows=group, device=H200)
        seen.append((timing.get("kv_dtype"), experiments.warps))
        tiles.append((experiments.tile_per_warp, graph.tile_per_warp))
        return truth.predict(plan)

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    monkeypatch.setattr(splitkv.measure.timing, "time_plan_us", time_plan_us)
    base = prior_profile("NVIDIA H200", 132).with_kv_fp8(prior_profile("NVIDIA H200", 132))
    base_path = base.save(tmp_path / "base.yaml")
    out = tmp_path / "with-graph.yaml"
    assert run_calibrate(["--quick", "--kv-dtype", "fp8_e4m3", "--graph-stable", "--base",
                          str(base_path), "--out", str(out)]) == 0
    assert "4-warp CTAs" in capsys.readouterr().out
    assert set(seen) == {("float8_e4m3fn", 4)}
    assert all(timed == built for timed, built in tiles) and {t for t, _ in tiles} == {16, 32}
    written = read_profile(out)
    assert written.kv_fp8 == base.kv_fp8 and written.kv_fp8_graph_stable is not None
    assert written.kv_fp8_graph_stable["sweep"]["graph_stable"] is True
    assert out.with_suffix(".fp8-graph-stable.csv").read_text().startswith("shape,plan,")
    assert run_calibrate(["--quick", "--graph-stable"]) == 2
    assert "give --kv-dtype too" in capsys.readouterr().err


def test_calibrate_base_needs_kv_dtype(monkeypatch, tmp_path, capsys):
    import splitkv.runtime

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, DEVICE["name"]))
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: dict(DEVICE))
    path = prior_profile("NVIDIA H200", 132).save(tmp_path / "p.yaml")
    assert run_calibrate(["--base", str(path)]) == 2
    assert "give --kv-dtype too" in capsys.readouterr().err
