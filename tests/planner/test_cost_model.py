"""The cost model: features with a physical meaning, a fit that recovers known parameters."""

import numpy as np
import pytest

from splitkv import DecodeProblem, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts
from splitkv.planner.cost_model import CostModel
from splitkv.planner.features import FEATURE_NAMES, critical_path, plan_features, waves
from splitkv.planner.profiles import roofline_prior

H200 = dict(num_sms=132, ctas_per_sm=2, bandwidth_gbps=4460.0, clusters=True)
# A "GPU" unlike the prior in every parameter the prior sets (and any feature added later).
TRUTH = {name: 1.5 * value + 0.05 for name, value in roofline_prior(132, 4460.0).items()}
# stream_us (0 in the prior) overlaps kv_us on full grids: a truth the size of kv_us's keeps it
# identifiable from the lone and ragged plans, where the two differ
TRUTH["stream_us"] = 0.4
LAUNCHES, KV_US = FEATURE_NAMES.index("launches"), FEATURE_NAMES.index("kv_us")


def feature(x, name):
    return x[FEATURE_NAMES.index(name)]


def problem(lens, hq=32, hk=8, d=128):
    return DecodeProblem(np.asarray(lens), hq, hk, d, 16)


def test_waves_and_critical_path_worked_example():
    assert waves(264, 264) == 1 and waves(265, 264) == 2 and waves(0, 264) == 0
    # one 32k request, 8 kv heads: 1024-token chunks = 256 items in one wave
    assert critical_path(32 * 1024 * 8, 1024, 256, 264) == 1024
    # 512-token chunks: 512 items, 2 waves of 512 tokens: the same critical path
    assert critical_path(64 * 512 * 8, 512, 512, 264) == 1024
    # 768-token chunks: 43 chunks x 8 = 344 items, 2 waves of a mean chunk
    assert critical_path(32768 * 8, 768, 344, 264) == pytest.approx(2 * 32768 / 43)
    # vectorised over candidates
    np.testing.assert_allclose(critical_path(np.array([8.0, 600.0]), np.array([1.0, 1.0]),
                                             np.array([8, 600]), 264), [1.0, 3.0])


def test_features_have_physical_units():
    p = problem([32768])
    single = plan_from_chunk_counts(p, [1], "single")
    split = plan_chunk_tokens(p, 1024, "split_merge", align=64)
    fused = plan_chunk_tokens(p, 1024, "fused", align=64)
    xs, xm, xf = (CostModel(**H200).features(q) for q in (single, split, fused))
    # all K and V at 4460 GB/s: 128 MiB -> 30.1 us
    for x in (xs, xm, xf):
        assert feature(x, "kv_us") == pytest.approx(p.kv_bytes / 4460e3)
    # unsplit: 8 CTAs, each alone on its SM; the busiest SM reads 16 MiB at 4460/132 GB/s
    assert feature(xs, "crit_us") == pytest.approx(32768 * 512 / (4460e3 / 132))
    assert feature(xs, "tail_us") == 0                  # one chunk size: no scheduling tail
    assert feature(xs, "waves") == 1 and feature(xs, "launches") == 1
    assert feature(xs, "partial_us") == 0 and feature(xs, "fused_merges") == 0
    # 32 chunks of 1024 tokens: 256 CTAs, one wave of slots; the busiest SM runs 2 of them,
    # 2048 tokens (the same time as one 1024-token CTA at one slot's share of the bandwidth)
    assert feature(xm, "waves") == 1
    assert feature(xm, "crit_us") == pytest.approx(2048 * 512 / (4460e3 / 132))
    assert feature(xm, "crit_tiles") == 32
    assert feature(xm, "crit_tile_rows") == 32 * 4
    assert feature(xm, "tail_us") == 0
    assert feature(xm, "launches") == 2 and feature(xf, "launches") == 1
    partial = 32 * 32 * (128 + 1) * 4 * 2       # written, then read back
    assert feature(xm, "partial_us") == pytest.approx(partial / 4460e3)
    assert feature(xm, "fused_tail_us") == 0
    assert feature(xf, "fused_merges") == 1
    assert feature(xf, "fused_tail_us") == pytest.approx(32 * 4 * 129 * 4 / (4460e3 / 264))


def test_lone_cta_pays_only_when_no_sm_holds_two_and_the_chunk_is_long():
    """lone_cta_us repeats crit_us for grids of at most one CTA per SM with chunks of 1024
    tokens or more, and is 0 otherwise."""
    model = CostModel(**H200)
    mha = problem([32768], 32, 32)
    lone = model.features(plan_fixed_splits(mha, 4, "fused", align=64))     # 128 CTAs of 8k
    paired = model.features(plan_fixed_splits(mha, 8, "fused", align=64))   # 256 CTAs of 4k
    assert feature(lone, "lone_cta_us") == feature(lone, "crit_us") > 0
    assert feature(paired, "lone_cta_us") == 0
    assert feature(paired, "crit_us") == pytest.approx(feature(lone, "crit_us"))
    # 132 CTAs are still one per SM; 133 put two on one SM
    at_limit = model.features(plan_fixed_splits(problem([132 * 1024], 8, 1), 132, "fused"))
    past = model.features(plan_fixed_splits(problem([133 * 1024], 8, 1), 133, "fused"))
    assert feature(at_limit, "lone_cta_us") > 0 and feature(past, "lone_cta_us") == 0
    # short chunks: start-up bound, no lone-CTA term
    short = model.features(plan_fixed_splits(problem([8 * 1023]), 8, "fused"))
    assert feature(short, "lone_cta_us") == 0


def test_partial_tile_costs_a_tile_but_only_its_bytes():
    p = problem([65])
    x = plan_features(p, [65], [1], "single", **H200)
    assert feature(x, "crit_tiles") == 2                # 64 + 1 tokens: two tiles of compute
    assert feature(x, "crit_us") == pytest.approx(65 * 512 / (4460e3 / 132))


def test_unequal_chunks_pay_a_tail():
    p = problem([1000, 200])
    x = plan_features(p, [1000, 200], [1, 1], "single", **H200)
    # largest 1000 tokens, mean 600: 400 tokens of one kv head at one slot's bandwidth
    assert feature(x, "tail_us") == pytest.approx(400 * 512 / (4460e3 / 264))


def test_stream_us_is_the_largest_cta_alone_or_the_full_grids_bytes():
    """stream_us: a lone CTA streams at LONE_CTA_GBPS; a full grid of equal chunks reads at the
    device's bandwidth (kv_us); a full grid with one long chunk reads its share of that chunk
    at the device's rate and the rest alone."""
    from splitkv.planner.features import LONE_CTA_GBPS

    lone = plan_features(problem([32768], 32, 8), [32768], [1], "single", **H200)
    assert feature(lone, "stream_us") == pytest.approx(32768 * 512 / (LONE_CTA_GBPS * 1e3))
    full = plan_features(problem([512] * 300, 32, 8), [512] * 300, [1] * 300, "single", **H200)
    assert feature(full, "stream_us") == pytest.approx(feature(full, "kv_us"))
    lens = [512] * 299 + [8192]
    ragged = plan_features(problem(lens, 32, 8), lens, [1] * 300, "single", **H200)
    w, slots = sum(lens) * 8, 264                     # tokens of every CTA; 2 CTAs an SM
    alone = 8192 - w / slots
    assert feature(ragged, "stream_us") == pytest.approx(
        (w + 4460 / LONE_CTA_GBPS * alone) * 512 / 4460e3)


def test_wide_waves_count_head_dim_256s_start_ups_again():
    """wide_waves: waves x (head_dim / 128 - 1): the wave count itself at head_dim 256 (one CTA
    an SM, so 8 requests x 4 chunks x 8 kv heads = 256 CTAs are 2 waves on 132 slots), 0 at
    128 and 64, whatever their waves."""
    lens, chunks = [8192] * 8, [2048] * 32
    d256 = plan_features(problem(lens, 16, 8, 256), chunks, [4] * 8, "split_merge", **H200)
    assert feature(d256, "waves") == 2.0 and feature(d256, "wide_waves") == 2.0
    for head_dim in (64, 128):
        x = plan_features(problem(lens, 16, 8, head_dim), chunks, [4] * 8, "split_merge", **H200)
        assert feature(x, "waves") == 1.0 and feature(x, "wide_waves") == 0.0


def test_the_fp8_tile_rule_counts_128_token_tiles_where_the_builds_run_them():
    """Under tile_rule 'fp8' a 100-token request split in two runs a partial 128-token tile in
    each of two CTAs where one CTA ran one: an SM's tiles double (512 -> 1,024 CTAs, 4 -> 8
    waves of one tile). Counted in 64-token tiles the two cuts tie (2 tiles a CTA, or 1).
    Multi-token plans ('fp8_multi_token') keep 64-token tiles unless the grid is lone."""
    d128 = problem([100] * 64, 32, 8)             # 64 x 8 = 512 CTAs unsplit: not lone
    fp8 = dict(H200, tile_rule="fp8")
    one = plan_features(d128, [100] * 64, [1] * 64, "single", **fp8)
    two = plan_features(d128, [64, 36] * 64, [2] * 64, "fused", **fp8)
    assert (feature(one, "crit_tiles"), feature(two, "crit_tiles")) == (8.0, 16.0)
    plain_one = plan_features(d128, [100] * 64, [1] * 64, "single", **H200)
    plain_two = plan_features(d128, [64, 36] * 64, [2] * 64, "fused", **H200)
    assert feature(plain_one, "crit_tiles") == feature(plain_two, "crit_tiles") == 8.0
    multi = dict(H200, tile_rule="fp8_multi_token")
    assert (plan_features(d128, [64, 36] * 64, [2] * 64, "fused", **multi)
            == plain_two).all()
    lone = problem([100] * 4, 32, 8)               # 4 x 8 = 32 CTAs: lone, 128-token tiles
    assert feature(plan_features(lone, [100] * 4, [1] * 4, "single", **multi), "crit_tiles") \
        == feature(plan_features(lone, [64, 36] * 4, [2] * 4, "fused", **multi), "crit_tiles")
    assert CostModel(tile_rule="fp8").for_multi_token().tile_rule == "fp8_multi_token"
    assert CostModel().for_multi_token().tile_rule == ""
    with pytest.raises(ValueError, match="tile_rule: expected one of"):
        CostModel(tile_rule="128")


def test_the_tiles_a_rule_counts_are_the_builds_the_runtime_compiles():
    """build_tile_units asks core.builds (the runtime's decision) which tiles a plan's build
    streams: fp8 runs 128 tokens in every grid at head_dim 128 with one row tile (4 warps x
    32) and in lone grids elsewhere (8 warps x 16); multi-token fp8 only in lone grids; the
    chunks' length does not matter to fp8. '' reads no build. Against the builds themselves,
    for every head_dim, group and grid on either side of one CTA an SM."""
    from splitkv.core.builds import DeviceProperties, PlanGrid, decode_build, row_tiles_for
    from splitkv.core.variants import KernelVariant
    from splitkv.core.geometry import rows_per_cta
    from splitkv.planner.features import PLAIN_TILES, build_tile_units

    assert build_tile_units("fp8", 32, 8, 128, 16, 132) == (2, 2, 2, 2)
    assert build_tile_units("fp8", 32, 8, 64, 16, 132) == (1, 1, 2, 2)
    assert build_tile_units("fp8", 64, 2, 128, 16, 132) == (1, 1, 2, 2)        # 2 row tiles
    assert build_tile_units("fp8_multi_token", 32, 8, 128, 16, 132) == (1, 1, 2, 2)
    assert build_tile_units("", 32, 8, 128, 1, 132) == PLAIN_TILES
    for head_dim in (64, 128, 256):
        for group in (1, 4, 8, 16, 17, 32, 64, 128):
            for rule, multi_token in (("fp8", False), ("fp8_multi_token", True)):
                units = build_tile_units(rule, 2 * group, 2, head_dim, 16, 132)
                for ctas, lone in ((133, 0), (5000, 0), (132, 1), (1, 1)):
                    grid = PlanGrid(ctas, 512.0, row_tiles=row_tiles_for(rows_per_cta(group)),
                                    variant=KernelVariant(multi_token=multi_token))
                    build = decode_build("bfloat16", head_dim, group, 16, "float8_e5m2", grid,
                                         DeviceProperties(132))
                    assert 64 * units[2 * lone] == build.tile_tokens, (head_dim, group, ctas)


def test_merge_grid_counts_the_whole_batchs_merge_ctas_for_split_merge_only():
    """merge_grid: the merge kernel's CTAs (a thread per request, query head and 4 dims, 128 a
    CTA) per SM, for a split_merge plan that splits anything: 256 requests x 32 heads x 128
    dims / 512 = 2,048 CTAs, 15.5 an SM, whether one request splits or all do; 0 for fused,
    single and a split_merge plan that splits nothing."""
    lens = [384] * 256
    all_split = plan_features(problem(lens, 32, 8), [192] * 512, [2] * 256, "split_merge", **H200)
    one_split = plan_features(problem(lens, 32, 8), [192] * 2 + [384] * 255, [2] + [1] * 255,
                              "split_merge", **H200)
    assert feature(all_split, "merge_grid") == feature(one_split, "merge_grid") == 2048 / 132
    for strategy in ("fused", "single"):
        chunks, counts = ([192] * 512, [2] * 256) if strategy == "fused" else (lens, [1] * 256)
        x = plan_features(problem(lens, 32, 8), chunks, counts, strategy, **H200)
        assert feature(x, "merge_grid") == 0.0
    none = plan_features(problem(lens, 32, 8), lens, [1] * 256, "split_merge", **H200)
    assert feature(none, "merge_grid") == 0.0


def test_large_groups_launch_head_tiles():
    x64 = plan_features(problem([4096], 64, 1), [4096], [1], "single", **H200)
    x128 = plan_features(problem([4096], 128, 1), [4096], [1], "single", **H200)
    assert feature(x128, "crit_tile_rows") == feature(x64, "crit_tile_rows")   # 64 heads a CTA
    assert feature(x128, "crit_us") == feature(x64, "crit_us")
    assert feature(x128, "kv_us") == feature(x64, "kv_us")      # the same bytes from DRAM


def synthetic_plans():
    rng = np.random.default_rng(0)
    plans = []
    for hq, hk, d in [(32, 32, 128), (32, 8, 128), (64, 8, 64), (16, 4, 256)]:
        for lens in ([1024], [32768], [200] * 4, [8192] * 8, [2048] * 64,
                     rng.integers(1, 8000, 24), rng.integers(1, 300, 100)):
            p = problem(lens, hq, hk, d)
            plans.append(plan_from_chunk_counts(p, np.ones(p.batch_size, int), "single"))
            for c in (16, 64, 256, 1024):
                if c < max(lens):
                    for s in ("split_merge", "fused"):
                        plans.append(plan_chunk_tokens(p, c, s, align=min(c, 64)))
            for s in (3, 33):
                plans.append(plan_fixed_splits(p, s, "fused", align=64))
    return [plan.with_execution(clusters=True) for plan in plans]    # as an H200 runs them


@pytest.fixture(scope="module")
def plans():
    return synthetic_plans()


def test_fit_recovers_known_parameters(plans):
    truth = CostModel.from_coef(TRUTH, **H200)
    rng = np.random.default_rng(1)
    y = truth.predict(plans) * (1 + 0.002 * rng.standard_normal(len(plans)))
    model = CostModel(**H200).fit(zip(plans, y))
    np.testing.assert_allclose(model.coef_, truth.coef_, rtol=0.15)
    assert model.fit_error_ < 0.005 and model.fit_mape_ < 0.005
    assert model.n_samples_ == len(plans)
    assert np.all(model.coef_ >= 0)
    assert model.predict(plans[5]) == pytest.approx(truth.predict(plans[5]), rel=0.01)


def test_fit_is_robust_to_a_few_bad_measurements(plans):
    truth = CostModel.from_coef(TRUTH, **H200)
    y = truth.predict(plans)
    y[::25] *= 3.0                                       # e.g. a trial hit by another process
    model = CostModel(**H200).fit(zip(plans, y))
    good = np.ones(len(plans), bool)
    good[::25] = False
    pred = model.predict(plans)
    assert np.median(np.abs(pred[good] / y[good] - 1)) < 0.02


def test_fit_keeps_parameters_physical():
    # a feature that never varies, or would fit negative, stays at zero
    x = np.zeros((40, len(FEATURE_NAMES)))
    x[:, LAUNCHES] = 1
    x[:, KV_US] = np.linspace(1, 100, 40)
    y = 2.0 + 1.1 * x[:, KV_US]
    model = CostModel().fit(zip(x, y))
    assert model.coef_[LAUNCHES] == pytest.approx(2.0) and model.coef_[KV_US] == pytest.approx(1.1)
    assert np.all(model.coef_ >= 0)


def test_fit_input_errors():
    x = np.ones(len(FEATURE_NAMES))
    with pytest.raises(ValueError, match="at least"):
        CostModel().fit([(x, 1.0)] * 3)
    with pytest.raises(ValueError, match="> 0"):
        CostModel().fit([(x, 1.0)] * 20 + [(x, 0.0)])
    with pytest.raises(ValueError, match="length"):
        CostModel().fit([(np.ones(3), 1.0)] * 20)


def test_predict_needs_parameters_and_takes_plans_or_rows(plans):
    with pytest.raises(RuntimeError, match="not fitted"):
        CostModel().predict(plans[0])
    model = CostModel.from_coef(roofline_prior(132, 4460.0))
    one = model.predict(plans[0])
    assert isinstance(one, float)
    many = model.predict(plans[:3])
    assert many.shape == (3,) and many[0] == pytest.approx(one)
    assert model.predict(model.features(plans[0])) == pytest.approx(one)
    assert "crit_us=" in repr(model) and "not fitted" in repr(CostModel())


def test_an_unfitted_model_says_so_wherever_it_is_used(plans):
    """Not an AttributeError from deep inside: a RuntimeError saying what to do, from the
    planner, the graph-stable copy and the parameters alike; hasattr stays False."""
    from splitkv.planner import choose_plan, rank_candidates
    from splitkv.planner.cost_model import NotFittedError

    unfitted = CostModel()
    for call in (lambda: choose_plan(plans[0].problem, unfitted),
                 lambda: rank_candidates(plans[0].problem, unfitted),
                 unfitted.for_graph_stable, unfitted.coef_dict, lambda: unfitted.coef_):
        with pytest.raises(RuntimeError, match="CostModel is not fitted: call fit"):
            call()
    assert issubclass(NotFittedError, RuntimeError) and not hasattr(unfitted, "coef_")
    assert unfitted.fit_error_ is None and unfitted.n_samples_ == 0
    assert CostModel.from_coef(roofline_prior(132, 4460.0)).for_graph_stable() is not None


def test_the_machine_is_checked():
    for kwargs, error in [({"num_sms": -1}, ValueError), ({"num_sms": "fast"}, TypeError),
                          ({"ctas_per_sm": 0}, ValueError), ({"bandwidth_gbps": "fast"}, TypeError),
                          ({"bandwidth_gbps": float("inf")}, ValueError)]:
        with pytest.raises(error, match=next(iter(kwargs))):
            CostModel(**kwargs)
    model = CostModel(num_sms=np.int64(108), bandwidth_gbps=np.float32(1500))
    assert type(model.num_sms) is int and type(model.bandwidth_gbps) is float


def test_from_coef_checks_names():
    with pytest.raises(ValueError, match="missing"):
        CostModel.from_coef({"launches": 1.0})
    with pytest.raises(ValueError, match=r"unknown \['const'\]"):     # no longer a column
        CostModel.from_coef({**dict.fromkeys(FEATURE_NAMES, 0.0), "const": 0.0})
    with pytest.raises(ValueError, match="finite"):
        CostModel.from_coef([np.nan] * len(FEATURE_NAMES))


def test_cluster_merges_replace_the_ticket_exactly_where_the_plan_clusters(plans):
    """cluster_merges is 1 exactly when the plan's execution merges in clusters
    (``execution.decide`` on a GPU with them); such a plan pays no partials and no ticket. The
    planner's closed form (``plan_features`` without a merge, ``execution.clustered``) agrees
    with the rule on every plan."""
    seen = set()
    model = CostModel(**H200)
    for plan in plans:
        on_clusters = plan.with_execution(clusters=True)
        x = model.features(on_clusters)
        x_off = model.features(plan.with_execution(clusters=False))      # the ticket
        clustered = on_clusters.merge == "cluster"
        assert clustered == (on_clusters.cluster_size > 0)
        seen.add(clustered)
        assert feature(x, "cluster_merges") == float(clustered), plan
        assert feature(x_off, "cluster_merges") == 0.0
        closed_form = plan_features(plan.problem, plan.chunk_end - plan.chunk_start,
                                    plan.chunks_per_request, plan.strategy, **H200)
        np.testing.assert_array_equal(closed_form, x)
        if clustered:
            for name in ("partial_us", "fused_tail_us", "fused_merges"):
                assert feature(x, name) == 0.0 and feature(x_off, name) > 0.0, name
        else:
            np.testing.assert_array_equal(x, x_off)
    assert seen == {True, False}
