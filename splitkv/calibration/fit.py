"""Fit the cost model on measurements, check it on shapes it has not seen, write a profile.

The held-out split is by shape: every plan of a held-out shape is held out, so the held-out
error says how well the model predicts a batch it was not fitted on, which is what the
planner needs. The profile's parameters are then refitted on all measurements.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace

import numpy as np

from .._version import __version__
from ..planner.cost_model import CostModel
from ..planner.profiles import Profile, guess_bandwidth_gbps


@dataclass
class ShapeDecision:
    """What the fitted model would pick among the plans measured for one shape."""

    shape: str
    chosen: str
    chosen_us: float
    best: str
    best_us: float

    @property
    def regret(self) -> float:
        """How much slower the model's pick ran than the best plan measured (0 = the best)."""
        return self.chosen_us / self.best_us - 1.0


@dataclass
class FitReport:
    n_train: int
    n_heldout: int
    fit_error: float                  # RMS relative error, model fitted on all measurements
    fit_mape: float
    heldout_mape: float | None        # model fitted on the training shapes only
    heldout_max_error: float | None
    decisions: list[ShapeDecision] = field(default_factory=list)   # held-out shapes
    heldout_shapes: list[str] = field(default_factory=list)

    @property
    def mean_regret(self) -> float | None:
        return float(np.mean([d.regret for d in self.decisions])) if self.decisions else None

    def lines(self) -> list[str]:
        out = [f"fit: {self.n_train + self.n_heldout} measurements, RMS relative error "
               f"{self.fit_error:.1%}, mean {self.fit_mape:.1%}"]
        if self.heldout_mape is not None:
            out.append(f"held out: {self.n_heldout} measurements of shapes not fitted on, mean "
                       f"relative error {self.heldout_mape:.1%}, "
                       f"worst {self.heldout_max_error:.1%}")
        if self.decisions:
            out.append(f"held-out decisions: the model's pick is {self.mean_regret:.1%} slower "
                       f"than the best plan measured, on average over {len(self.decisions)} shapes")
        return out


def split_heldout(measurements, fraction: float = 0.2, seed: int = 0):
    """(train, heldout): a random ``fraction`` of the shapes, with all their plans, held out."""
    shapes = sorted({m.shape for m in measurements})
    rng = np.random.default_rng(seed)
    n_out = int(round(fraction * len(shapes))) if len(shapes) > 1 else 0
    held = set(rng.choice(shapes, size=n_out, replace=False).tolist()) if n_out else set()
    return ([m for m in measurements if m.shape not in held],
            [m for m in measurements if m.shape in held])


def decisions(model: CostModel, measurements) -> list[ShapeDecision]:
    """Per shape: the plan the model predicts fastest vs the plan that measured fastest."""
    by_shape: dict[str, list] = {}
    for m in measurements:
        by_shape.setdefault(m.shape, []).append(m)
    out = []
    for shape, ms in by_shape.items():
        predicted = model.predict([m.plan for m in ms])
        pick = ms[int(np.argmin(predicted))]
        best = min(ms, key=lambda m: m.measured_us)
        out.append(ShapeDecision(shape, pick.label, pick.measured_us, best.label, best.measured_us))
    return out


def _relative_errors(model, measurements) -> np.ndarray:
    predicted = model.predict([m.plan for m in measurements])
    measured = np.array([m.measured_us for m in measurements])
    return np.abs(predicted / measured - 1.0)


def fit_tile_rule(kv_dtype: str | None, graph_stable: bool) -> str:
    """The tiles a fit counts: fp8's per-shape builds run 128-token tiles where
    ``core.builds`` decides them ('fp8'); the 16-bit builds count 64 (''), and so does the
    graph-stable fp8 fit, as the planner on the device counts them, although its grid at
    head_dim 128 runs 128-token tiles (docs/design/graph-stable.md, fp8 tiles)."""
    return "fp8" if kv_dtype and not graph_stable else ""


def fit_profile(measurements, device: dict, *, heldout_fraction: float = 0.2, seed: int = 0,
                ctas_per_sm: int = 2, bandwidth_gbps: float | None = None,
                sweep: dict | None = None, kv_bytes_per_element: int = 2,
                tile_rule: str = "") -> tuple[Profile, FitReport]:
    """Fit on ``measurements`` (from ``sweep.measure``) for the device ``device``
    (``splitkv.runtime.device_info()``: name, num_sms, ...). ``kv_bytes_per_element``: 1 for
    measurements over fp8 K/V, whose best bandwidth counts one-byte codes. ``tile_rule``: how
    the model counts tiles (``features.TILE_RULES``; ``fit_tile_rule`` says which a sweep's
    builds need)."""
    if bandwidth_gbps is None:
        bandwidth_gbps = guess_bandwidth_gbps(device["name"])
    # sm_90+ runs suitable fused plans as clusters (the wrapper's default): the model knows,
    # and each plan is fitted as it ran there
    hyper = dict(num_sms=int(device["num_sms"]), ctas_per_sm=ctas_per_sm,
                 bandwidth_gbps=float(bandwidth_gbps),
                 clusters=int(device.get("cc", 0)) >= 90, tile_rule=tile_rule)
    measurements = [replace(m, plan=m.plan.with_execution(clusters=hyper["clusters"]))
                    for m in measurements]

    train, heldout = split_heldout(measurements, heldout_fraction, seed)
    heldout_mape = heldout_max = None
    shape_decisions = []
    if heldout:
        model = CostModel(**hyper).fit([(m.plan, m.measured_us) for m in train])
        err = _relative_errors(model, heldout)
        heldout_mape, heldout_max = float(err.mean()), float(err.max())
        shape_decisions = decisions(model, heldout)
    model = CostModel(**hyper).fit([(m.plan, m.measured_us) for m in measurements])
    report = FitReport(len(train), len(heldout), model.fit_error_, model.fit_mape_,
                       heldout_mape, heldout_max, shape_decisions,
                       sorted({m.shape for m in heldout}))

    best_bw = max(m.plan.problem.kv_bytes * kv_bytes_per_element / 2 / m.measured_us / 1e3
                  for m in measurements)
    profile = Profile(device_name=device["name"], coef=model.coef_dict(),
                      measured_bandwidth_gbps=round(best_bw, 1), fit_error=model.fit_error_,
                      heldout_error=heldout_mape, date=datetime.date.today().isoformat(),
                      splitkv_version=__version__, source="calibrated",
                      sweep={**(sweep or {}), "points": len(measurements),
                             "shapes": len({m.shape for m in measurements}),
                             "heldout_shapes": len(report.heldout_shapes)},
                      **hyper)
    return profile, report
