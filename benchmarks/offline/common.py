"""Offline study helpers: rebuild the eval_planner shapes and measured candidate plans from the
session-12 JSON files, compute features under variants of the cost model, fit, and score the
planner's choices. No GPU; nothing in splitkv is modified (variants are built here)."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from eval_planner import heldout_class_shapes, heldout_shapes  # noqa: E402
from splitkv.core.geometry import ctas_per_kv_head  # noqa: E402
from splitkv.core.plan import plan_chunk_tokens  # noqa: E402
from splitkv.planner import choose_plan  # noqa: E402
from splitkv.planner.cost_model import (FEATURE_NAMES, CostModel, fit_relative,  # noqa: E402
                                        plan_features)
from splitkv.planner.planner import rank_candidates  # noqa: E402
from splitkv.planner.profiles import load_profile  # noqa: E402
from splitkv.runtime.kernel_source import row_tiles_for  # noqa: E402
from splitkv.calibration.sweep import read_measurements  # noqa: E402

LONE = FEATURE_NAMES.index("lone_cta_us")   # its column (stream_us follows it since session 13)
RESULTS = ROOT / "benchmarks" / "results"
PROFILE = ROOT / "splitkv" / "planner" / "profiles" / "nvidia-h200.yaml"
NUM_SMS, BW = 132, 4460.0
HYPER = dict(num_sms=NUM_SMS, ctas_per_sm=2, bandwidth_gbps=BW, clusters=True)


def shipped_model() -> CostModel:
    return load_profile(path=PROFILE).cost_model(None)


@dataclass
class Cand:
    label: str          # 'fused/4'
    chunk: object       # int, 'planner' or 'single'
    plan: object        # Plan, with the execution it ran with on the H200 (clusters)
    us: float
    pred_json: float


@dataclass
class Shape:
    name: str
    problem: object
    cands: list

    @property
    def best_us(self):
        return min(c.us for c in self.cands)

    @property
    def cls(self):
        return self.name.split("_")[0] if not self.name.startswith("b1_few") else "b1_few_k"


class eval_time_slots:
    """The planner as the evaluation ran it (dee7c27): one slot count for every head_dim.
    The library's slots follow the head_dim since (``cost_model.resident_ctas``); the
    evaluation's "planner" candidates were chosen before that."""

    def __enter__(self):
        import splitkv.planner.cost_model as cm
        import splitkv.planner.planner as pl

        self._saved = dict(cm.RESIDENCY_VS_HEAD_DIM_128)
        cm.RESIDENCY_VS_HEAD_DIM_128.clear()
        self._clear = lambda: (cm.feature_constants.cache_clear(),
                               pl._pair_features.cache_clear())
        self._clear()
        return self

    def __exit__(self, *exc):
        import splitkv.planner.cost_model as cm

        cm.RESIDENCY_VS_HEAD_DIM_128.update(self._saved)
        self._clear()


def load_set(which: str) -> list:
    """'standard' or 'classes': shapes with every measured candidate rebuilt; checks that each
    rebuilt plan's label and chunk count match the JSON."""
    path = RESULTS / ("h200-planner-standard-s12.json" if which == "standard"
                      else "h200-planner-classes.json")
    data = json.load(open(path))
    problems = dict(heldout_shapes() if which == "standard" else heldout_class_shapes())
    shipped = shipped_model()
    out = []
    for row in data["shapes"]:
        prob = problems[row["shape"]]
        assert prob.batch_size == row["batch"] and prob.total_tokens == row["tokens"], row["shape"]
        cands = []
        for c in row["candidates"]:
            if c["chunk_tokens"] == "planner":
                with eval_time_slots():
                    p = choose_plan(prob, shipped)
            elif c["chunk_tokens"] == "single":
                p = plan_chunk_tokens(prob, 1 << 30, "single")
            else:
                p = plan_chunk_tokens(prob, c["chunk_tokens"], c["plan"].split("/")[0], align=64)
            p = p.with_execution(clusters=True)      # as the wrapper ran it on the H200
            lab = f"{p.strategy}/{p.num_splits}"
            assert lab == c["plan"] and p.num_chunks == c["num_chunks"], (row["shape"], c, lab,
                                                                          p.num_chunks)
            cands.append(Cand(c["plan"], c["chunk_tokens"], p, float(c["us"]),
                              float(c["predicted_us"])))
        out.append(Shape(row["shape"], prob, cands))
    return out


def calibration_measurements():
    """The shipped profile's own sweep (900 points), plans as they ran (clusters)."""
    ms = read_measurements(RESULTS / "calibration" / "nvidia-h200.csv")
    return [(m.shape, m.plan.with_execution(clusters=True), m.measured_us) for m in ms]


# ---- residency variants -------------------------------------------------------------------

def warps8(plan) -> bool:
    """runtime.features.plan_warps for a 16-bit per-shape plan on the H200 (132 SMs)."""
    p = plan.problem
    group = p.num_qo_heads // p.num_kv_heads
    ctas = plan.num_work_items * ctas_per_kv_head(group)
    if ctas > NUM_SMS or p.head_dim > 128:
        return False
    rt = row_tiles_for(min(group, 64))
    step = max(1, 32 * rt // (p.head_dim * 2 // 16))
    sizes = plan.chunk_end - plan.chunk_start
    mean = float(sizes.mean()) if sizes.size else 0.0
    return (rt >= 2 or p.page_size < step) and mean >= 2048


RESIDENCY = {64: 3, 128: 2, 256: 1}


def ctas_fn(variant: str):
    """Slots per SM of a plan under a variant:
    'base'   2 everywhere (the library);
    'hd'     by head_dim (64: 3, 128: 2, 256: 1);
    'hd8w'   by head_dim, and 1 for plans that run 8-warp CTAs."""
    if variant == "base":
        return lambda plan: 2
    if variant == "hd":
        return lambda plan: RESIDENCY[plan.problem.head_dim]
    if variant == "hd8w":
        return lambda plan: 1 if warps8(plan) else RESIDENCY[plan.problem.head_dim]
    raise ValueError(variant)


def features(plan, variant="base", lone_mode="lib"):
    """features_core, and with a lone_mode ending in '+mrows' one more column: the rows
    (requests x query heads x head_dim / 128, in thousands) the merge kernel's grid covers
    when a 'split_merge' plan splits anything; it visits every request, split or not."""
    if lone_mode.endswith("+mrows"):
        x = features_core(plan, variant, lone_mode[:-len("+mrows")])
        p = plan.problem
        m = plan.strategy == "split_merge" and plan.needs_merge
        return np.append(x, p.batch_size * p.num_qo_heads * p.head_dim / 128 / 1000 if m else 0.0)
    return features_core(plan, variant, lone_mode)


def features_core(plan, variant="base", lone_mode="lib"):
    """Feature vector of a built plan (its execution's merge) under a slots variant.
    lone_mode 'lib': lone_cta_us as the library; 'no8w': 0 for 8-warp plans (their 8 warps
    give a lone CTA the loads two would have)."""
    c = ctas_fn(variant)(plan)
    x = plan_features(plan.problem, plan.chunk_end - plan.chunk_start, plan.chunks_per_request,
                      plan.strategy, num_sms=NUM_SMS, ctas_per_sm=c, bandwidth_gbps=BW,
                      merge=plan.merge)
    if lone_mode == "ext8w":
        # one more column: an 8-warp plan's tiles get their own coefficient (crit_tiles and
        # lone_cta_us move there), so the fit can learn that 8 warps run a tile faster
        w = warps8(plan)
        x = np.append(x, x[4] if w else 0.0)
        if w:
            x[4] = 0.0
            x[LONE] = 0.0
        return x
    if lone_mode in ("no8w", "res1") and warps8(plan):
        x = x.copy()
        x[LONE] = 0.0
    elif lone_mode == "res1" and RESIDENCY[plan.problem.head_dim] == 1:
        # every CTA of a one-per-SM head_dim is alone on its SM: the lone rate whenever the
        # largest chunk is long, whatever the grid size
        sizes = plan.chunk_end - plan.chunk_start
        x = x.copy()
        x[LONE] = x[3] if sizes.size and sizes.max() >= 1024 else 0.0   # crit_us's value
    return x


def fit(samples_xy) -> CostModel:
    """The library's fit (CostModel.fit: NNLS on relative error, Huber re-weighting) on
    (feature vector, us) pairs; for feature vectors longer than the library's (the 'ext8w'
    variant), the same steps copied from CostModel.fit (checked equal on the library's columns)."""
    samples_xy = list(samples_xy)
    if len(samples_xy[0][0]) == len(FEATURE_NAMES):
        return CostModel(**HYPER).fit(samples_xy)
    return fit_copy(samples_xy)


class _Fitted:
    def __init__(self, coef):
        self.coef_ = coef


def fit_copy(samples_xy, huber_delta=0.1):
    """CostModel.fit's arithmetic (``cost_model.fit_relative``), any number of columns."""
    x = np.array([f for f, _ in samples_xy], dtype=np.float64)
    y = np.array([t for _, t in samples_xy], dtype=np.float64)
    return _Fitted(fit_relative(x, y, huber_delta))


# ---- planner choice under a variant --------------------------------------------------------

def planner_choice(problem, model, variant="base", lone_mode="lib", generic=False):
    """The planner's choice: with the base variant, choose_plan itself. Otherwise the planner's
    own candidate list (rank_candidates, enumerated with the head_dim's slots so the
    wave-filling sizes match), each built as it would run (clusters) and rescored with
    per-plan features; argmin (ties: enumeration order)."""
    if variant == "base" and lone_mode == "lib" and not generic and isinstance(model, CostModel):
        return choose_plan(problem, model)
    enum = CostModel.from_coef(model.coef_[:len(FEATURE_NAMES)], **{**HYPER, "ctas_per_sm":
                                                RESIDENCY[problem.head_dim]
                                                if variant != "base" else 2})
    ranked = rank_candidates(problem, enum)
    # enumeration order: fewer splits first (ties keep it in the library)
    seen, plans = set(), []
    for c in ranked:
        key = (c.kind, c.value, c.strategy)
        if key in seen:
            continue
        seen.add(key)
        plans.append(c.build(problem, clusters=True))
    x = np.array([features(p, variant, lone_mode) for p in plans])
    pred = x @ model.coef_
    return plans[int(np.argmin(pred))]


def same_plan(a, b) -> bool:
    return (a.strategy == b.strategy and a.num_chunks == b.num_chunks
            and np.array_equal(a.chunk_start, b.chunk_start)
            and np.array_equal(a.chunk_end, b.chunk_end)
            and np.array_equal(a.chunk_request, b.chunk_request))


def score(shape, plan):
    """(measured us of the plan or its stand-in, how: 'exact' | 'nearest' | None)."""
    for c in shape.cands:
        if same_plan(c.plan, plan):
            return c.us, "exact"
    near = [c for c in shape.cands if c.plan.strategy == plan.strategy
            and c.plan.num_chunks == plan.num_chunks]
    how = "nearest_chunks"
    if not near:
        near = [c for c in shape.cands if c.plan.strategy == plan.strategy
                and c.plan.num_splits == plan.num_splits]
        how = "nearest_splits"
    if not near:
        return None, None
    c = min(near, key=lambda c: abs(c.plan.num_chunks - plan.num_chunks))
    return c.us, how


def evaluate(shapes, model, variant="base", lone_mode="lib"):
    """Planner's free choice scored against the measured candidates, and the model's argmin
    over the measured candidates ('restricted')."""
    rows = []
    for s in shapes:
        p = planner_choice(s.problem, model, variant, lone_mode)
        us, how = score(s, p)
        x = np.array([features(c.plan, variant, lone_mode) for c in s.cands])
        pred = x @ model.coef_
        r = s.cands[int(np.argmin(pred))]
        rows.append(dict(shape=s.name, cls=s.cls, plan=f"{p.strategy}/{p.num_splits}",
                         chunks=p.num_chunks, how=how,
                         ratio=None if us is None else us / s.best_us,
                         restricted=r.us / s.best_us, ape=np.abs(pred / [c.us for c in
                                                                       s.cands] - 1)))
    return rows


def summary(rows):
    r = np.array([x["ratio"] for x in rows if x["ratio"] is not None])
    rr = np.array([x["restricted"] for x in rows])
    ape = np.concatenate([x["ape"] for x in rows])
    hows = [x["how"] for x in rows]
    return dict(n=len(rows), scored=len(r), within5=float(np.mean(r <= 1.05)),
                geomean=float(np.exp(np.mean(np.log(r)))), worst=float(r.max()),
                nearest=sum(h not in ("exact",) for h in hows if h),
                unscored=sum(h is None for h in hows),
                r_within5=float(np.mean(rr <= 1.05)), r_geomean=float(np.exp(np.mean(np.log(rr)))),
                mdape=float(np.median(ape)))


def fmt(s):
    return (f"within5 {s['within5']:.1%} geomean {s['geomean']:.4f} worst {s['worst']:.3f} "
            f"(scored {s['scored']}/{s['n']}, stand-ins {s['nearest']}) | restricted-to-measured: "
            f"within5 {s['r_within5']:.1%} geomean {s['r_geomean']:.4f} | MdAPE {s['mdape']:.1%}")
