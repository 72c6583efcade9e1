"""Session-13 offline study helpers (on common.py's, for the session-13 files):
the 68 eval shapes of benchmarks/results/h200-planner.json with every measured candidate
rebuilt (and checked against the JSON's label, chunk count and predicted_us), the sweep CSV
benchmarks/results/calibration/nvidia-h200.csv with fit_profile's held-out split, fitting and
scoring with feature *variants* computed here (nothing in splitkv is modified)."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from eval_planner import heldout_class_shapes, heldout_shapes  # noqa: E402
from splitkv.core.plan import plan_chunk_tokens  # noqa: E402
from splitkv.planner import choose_plan  # noqa: E402
from splitkv.planner.cost_model import fit_relative, plan_features  # noqa: E402
from splitkv.calibration.sweep import read_measurements  # noqa: E402
from splitkv.calibration.fit import split_heldout  # noqa: E402
from splitkv.planner.profiles import load_profile  # noqa: E402

from common import BW, NUM_SMS, RESULTS, Cand, Shape, shipped_model  # noqa: E402,F401

SWEEP_CSV = RESULTS / "calibration" / "nvidia-h200.csv"
EVAL_JSON = RESULTS / "h200-planner.json"
# the profile EVAL_JSON's device run planned with (its 'planner' candidates are rebuilt with it)
EVAL_PROFILE = RESULTS / "calibration" / "nvidia-h200-s15.yaml"


def load_eval_json(path, planned_with) -> tuple[list, str | None]:
    """(shapes, kv dtype) of any eval_planner.py JSON (16-bit or fp8), every measured candidate
    rebuilt and checked against the JSON's label and chunk count. The 'planner' candidate is
    rebuilt with ``planned_with``, the profile the device run planned with (so its time can
    score another profile that picks the same plan); None leaves it out (a run whose profile
    is gone)."""
    data = json.load(open(path))
    kv_dtype = data.get("kv_dtype")
    model = None if planned_with is None else load_profile(path=planned_with).cost_model(kv_dtype)
    problems = dict(heldout_shapes() + heldout_class_shapes())
    out = []
    for row in data["shapes"]:
        prob = problems[row["shape"]]
        assert prob.batch_size == row["batch"] and prob.total_tokens == row["tokens"]
        cands = []
        for c in row["candidates"]:
            if c["chunk_tokens"] == "planner":
                if model is None:
                    continue
                p = choose_plan(prob, model)
            elif c["chunk_tokens"] == "single":
                p = plan_chunk_tokens(prob, 1 << 30, "single").with_execution(clusters=True)
            else:
                p = plan_chunk_tokens(prob, c["chunk_tokens"], c["plan"].split("/")[0],
                                      align=64).with_execution(clusters=True)
            lab = f"{p.strategy}/{p.num_splits}"
            assert lab == c["plan"] and p.num_chunks == c["num_chunks"], (row["shape"], c, lab)
            cands.append(Cand(c["plan"], c["chunk_tokens"], p, float(c["us"]),
                              float(c["predicted_us"])))
        out.append(Shape(row["shape"], prob, cands))
    return out, kv_dtype


def load_eval() -> list:
    """The shapes of EVAL_JSON (the 16-bit eval on record)."""
    return load_eval_json(EVAL_JSON, EVAL_PROFILE)[0]


def sweep(csv=None):
    """(all, train, heldout) lists of (shape, plan, us) of a sweep CSV (default SWEEP_CSV),
    plans as they ran (clusters), with fit_profile's split (20% of shapes, seed 0)."""
    ms = read_measurements(csv or SWEEP_CSV, quick=False, seed=0)
    ms = [replace(m, plan=m.plan.with_execution(clusters=True)) for m in ms]
    train, held = split_heldout(ms, 0.2, 0)
    t = lambda L: [(m.shape, m.plan, m.measured_us) for m in L]
    return t(ms), t(train), t(held)


def lib_features(plan):
    return plan_features(plan.problem, plan.chunk_end - plan.chunk_start,
                         plan.chunks_per_request, plan.strategy, num_sms=NUM_SMS,
                         ctas_per_sm=2, bandwidth_gbps=BW, merge=plan.merge)


def fit_xy(x, y, huber_delta=0.1):
    """CostModel.fit's arithmetic (``cost_model.fit_relative``) for any number of columns.
    Returns coef."""
    return fit_relative(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64),
                        huber_delta)


def fit_report(featfn, exclude=None, csv=None):
    """Fit on the sweep with a feature function: RMS / mean relative error on all points (fit
    on all), held-out mean / worst error and held-out decisions (fit on train). ``exclude``:
    predicate on (shape, plan) to drop rows from fitting (not used by default)."""
    allm, train, held = sweep(csv)
    if exclude:
        allm = [r for r in allm if not exclude(r)]
        train = [r for r in train if not exclude(r)]
    X = lambda L: np.array([featfn(p) for _, p, _ in L])
    Y = lambda L: np.array([u for _, _, u in L])
    xa, ya = X(allm), Y(allm)
    c_all = fit_xy(xa, ya)
    rel = xa @ c_all / ya - 1
    xt, yt = X(train), Y(train)
    c_tr = fit_xy(xt, yt)
    xh, yh = X(held), Y(held)
    eh = np.abs(xh @ c_tr / yh - 1)
    # held-out decisions (regret)
    regrets = []
    shapes = sorted({s for s, _, _ in held})
    ph = xh @ c_tr
    for s in shapes:
        idx = [i for i, r in enumerate(held) if r[0] == s]
        pick = idx[int(np.argmin(ph[idx]))]
        regrets.append(yh[pick] / yh[idx].min() - 1)
    return dict(coef=c_all, coef_train=c_tr, rms=float(np.sqrt(np.mean(rel ** 2))),
                mape=float(np.mean(np.abs(rel))), held_mape=float(eh.mean()),
                held_max=float(eh.max()), held_regret=float(np.mean(regrets)),
                held_within5=float(np.mean(np.array(regrets) <= 0.05)), n=len(ya),
                n_held=len(yh))


def score_eval(shapes, featfn, coef):
    """Pick = argmin predicted among the measured candidates; ratio = its us / best us."""
    rows = []
    for s in shapes:
        x = np.array([featfn(c.plan) for c in s.cands])
        pred = x @ coef
        i = int(np.argmin(pred))
        rows.append(dict(shape=s.name, pick=s.cands[i], ratio=s.cands[i].us / s.best_us,
                         pred=pred, ape=np.abs(pred / np.array([c.us for c in s.cands]) - 1)))
    r = np.array([x["ratio"] for x in rows])
    return rows, dict(within5=float(np.mean(r <= 1.05)), geomean=float(np.exp(np.mean(np.log(r)))),
                      worst=float(r.max()),
                      mdape=float(np.median(np.concatenate([x["ape"] for x in rows]))))


def label(c):
    return f"{c.label}@{c.chunk}"


def report_variant(name, featfn, shapes, csv=None):
    """Fit ``featfn``'s columns on the sweep (``fit_report``) and score them on ``shapes``
    (``score_eval``); print one line and the shapes over 5%. Returns (fit report, score)."""
    rep = fit_report(featfn, csv=csv)
    rows, sc = score_eval(shapes, featfn, rep["coef"])
    print(f"{name} fit RMS {rep['rms']:.2%} held-out {rep['held_mape']:.2%} regret "
          f"{rep['held_regret']:.2%} | eval {int(round(sc['within5'] * len(rows)))}/{len(rows)} "
          f"within 5%, geomean {sc['geomean']:.4f}, worst {sc['worst']:.3f}")
    for r in rows:
        if r["ratio"] > 1.05:
            print(f"    over 5%: {r['shape']} {label(r['pick'])} {r['ratio']:.3f}")
    return rep, sc
