"""What one decode call costs on the GPU: a model linear in its parameters, over the features
of ``features`` (each a statistic of the plan times a physical unit), fitted on measured
latencies with non-negative parameters.
"""

from __future__ import annotations

import copy
import math
from numbers import Integral, Real

import numpy as np

from ..core.plan import Plan
from .features import F_MERGE_GRID, FEATURE_NAMES, check_tile_rule, plan_features

# Bounds on the machine a model describes: the device planner's int (kernels_cu/device_plan.cuh)
# holds the SM count; an SM holds at most 32 resident blocks on every NVIDIA GPU.
MAX_NUM_SMS = 2**31 - 1
MAX_CTAS_PER_SM = 32


def check_machine_int(name: str, value, maximum: int) -> int:
    """An SM or CTA count: an integer (not a bool) in 1..maximum, named in the error; a
    negative or fractional count would plan with negative or meaningless predictions."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if not 1 <= value <= maximum:
        raise ValueError(f"{name}: expected an integer in 1..{maximum}, got {value}")
    return int(value)


def check_bandwidth(name: str, value) -> float:
    """A bandwidth in GB/s: a finite number > 0 (every byte column is divided by it)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}: expected a number of GB/s, got {type(value).__name__} "
                        f"{value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite number of GB/s > 0, got {value!r}")
    return float(value)


def check_machine(num_sms, ctas_per_sm, bandwidth_gbps, optional: bool = False) -> tuple:
    """A model's machine checked, as (int, int, float); the errors name the argument. With
    ``optional``, None stands for a value not given and stays None."""
    def check(value, how):
        return None if value is None and optional else how(value)

    return (check(num_sms, lambda v: check_machine_int("num_sms", v, MAX_NUM_SMS)),
            check(ctas_per_sm, lambda v: check_machine_int("ctas_per_sm", v, MAX_CTAS_PER_SM)),
            check(bandwidth_gbps, lambda v: check_bandwidth("bandwidth_gbps", v)))


class NotFittedError(RuntimeError, AttributeError):
    """A CostModel asked to predict before it has parameters. An AttributeError too, so that
    ``hasattr(model, "coef_")`` stays False on an unfitted model."""


def fit_relative(x: np.ndarray, y: np.ndarray, huber_delta: float = 0.1,
                 rounds: int = 4, target=1.0) -> np.ndarray:
    """Non-negative coefficients c minimising the squared relative error of x @ c against y
    (``CostModel.fit``'s arithmetic, for feature matrices of any width): columns scaled to
    unit norm, then ``rounds`` NNLS solves, each re-weighted Huber-wise by the last.
    ``target``: what (x @ c) / y should reach, row by row (1: y itself; a fraction where
    fixed columns explain the rest of y)."""
    from scipy.optimize import nnls              # fitting only: planning needs no SciPy

    a = x / y[:, None]                           # relative error: (x @ c - y) / y
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0                      # a feature that never varies stays at 0
    a = a / scale
    weights = np.ones_like(y)
    for _ in range(rounds):
        sw = np.sqrt(weights)
        c, _ = nnls(a * sw[:, None], target * sw, maxiter=50 * a.shape[1])
        resid = a @ c - target
        weights = np.minimum(1.0, huber_delta / np.maximum(np.abs(resid), 1e-12))
    return c / scale


class CostModel:
    """Predicted microseconds of one decode call = features(plan) @ coef_.

    Hyperparameters (the machine the features are measured against) go to the constructor;
    ``fit`` sets ``coef_`` (one non-negative value per name in ``FEATURE_NAMES``),
    ``fit_error_`` (RMS relative error on the samples), ``fit_mape_`` and ``n_samples_``.

    >>> model = CostModel(num_sms=132).fit([(plan, 31.5), ...])     # doctest: +SKIP
    >>> model.predict(plan)                                         # doctest: +SKIP
    """

    feature_names = FEATURE_NAMES

    def __init__(self, num_sms: int = 132, ctas_per_sm: int = 2, bandwidth_gbps: float = 4460.0,
                 robust: bool = True, clusters: bool = False, tile_rule: str = ""):
        self.num_sms, self.ctas_per_sm, self.bandwidth_gbps = check_machine(
            num_sms, ctas_per_sm, bandwidth_gbps)
        self.clusters = clusters        # the GPU merges suitable fused plans in clusters
        self.robust = robust
        self.tile_rule = check_tile_rule(tile_rule)   # how it counts tiles (TILE_RULES)
        self.fit_error_ = self.fit_mape_ = None        # set by fit
        self.n_samples_ = 0

    @property
    def coef_(self) -> np.ndarray:
        """The parameters, one per name in ``FEATURE_NAMES``; ``NotFittedError`` before
        ``fit`` or ``from_coef`` set them (every prediction reads them)."""
        coef = getattr(self, "_coef", None)
        if coef is None:
            raise NotFittedError("CostModel is not fitted: call fit(), or build one with "
                                 "CostModel.from_coef() or a profile's cost_model()")
        return coef

    @coef_.setter
    def coef_(self, value) -> None:
        self._coef = value

    @classmethod
    def from_coef(cls, coef, **hyperparameters) -> "CostModel":
        """A model with known parameters: a dict by feature name, or a sequence in order."""
        model = cls(**hyperparameters)
        if isinstance(coef, dict):
            missing = set(FEATURE_NAMES) - set(coef)
            extra = set(coef) - set(FEATURE_NAMES)
            if missing or extra:
                raise ValueError(f"coef: expected the features {list(FEATURE_NAMES)}; "
                                 f"missing {sorted(missing)}, unknown {sorted(extra)}")
            coef = [coef[name] for name in FEATURE_NAMES]
        coef = np.asarray(coef, dtype=np.float64)
        if coef.shape != (len(FEATURE_NAMES),) or not np.all(np.isfinite(coef)):
            raise ValueError(f"coef: expected {len(FEATURE_NAMES)} finite values, got {coef}")
        model.coef_ = coef
        model.fit_error_ = None
        model.fit_mape_ = None
        model.n_samples_ = 0
        return model

    def for_multi_token(self) -> "CostModel":
        """This model for multi-token plans (the planner's heads are query rows x heads): an
        'fp8' tile rule becomes 'fp8_multi_token', whose builds run 64-token tiles unless the
        grid is lone; any other model is itself."""
        if self.tile_rule != "fp8":
            return self
        other = copy.copy(self)
        other.tile_rule = "fp8_multi_token"
        return other

    def for_graph_stable(self) -> "CostModel":
        """This model as a graph-stable grid runs: 64-token tiles (the planner on the device
        counts them; an fp8 grid at head_dim 128 runs 128-token tiles, not yet a rule of its
        own) and merge_grid 0 (that grid launches the merge kernel over its capacity
        whatever the strategy); itself where that changes nothing."""
        if not self.tile_rule and not self.coef_[F_MERGE_GRID]:
            return self
        other = copy.copy(self)
        other.tile_rule = ""
        other.coef_ = self.coef_.copy()
        other.coef_[F_MERGE_GRID] = 0.0
        return other

    def with_clusters(self, clusters: bool) -> "CostModel":
        """This model, or a copy of it that predicts for a GPU with (or without) clusters: for
        a caller that turns clusters off, or a device that has none."""
        if clusters == self.clusters:
            return self
        other = copy.copy(self)
        other.clusters = clusters
        return other

    @property
    def slots(self) -> int:
        """CTA slots of the GPU at head_dim 128 (``resident_ctas`` for the others)."""
        return self.num_sms * self.ctas_per_sm

    def features(self, plan: Plan) -> np.ndarray:
        """Feature vector of a built plan, as its execution runs it (``plan.merge``)."""
        return plan_features(plan.problem, plan.chunk_end - plan.chunk_start,
                             plan.chunks_per_request, plan.strategy, num_sms=self.num_sms,
                             ctas_per_sm=self.ctas_per_sm, bandwidth_gbps=self.bandwidth_gbps,
                             merge=plan.merge, tile_rule=self.tile_rule)

    def _design(self, sources) -> np.ndarray:
        """Feature matrix from plans or feature vectors (rows of length len(FEATURE_NAMES))."""
        if isinstance(sources, Plan):
            sources = [sources]
        if isinstance(sources, np.ndarray) and sources.dtype != object:
            x = np.atleast_2d(sources).astype(np.float64)
        else:
            x = np.array([self.features(s) if isinstance(s, Plan)
                          else np.asarray(s, dtype=np.float64) for s in sources])
        if x.ndim != 2 or x.shape[1] != len(FEATURE_NAMES):
            raise ValueError(f"expected plans or feature rows of length {len(FEATURE_NAMES)}, "
                             f"got an array of shape {x.shape}")
        return x

    def fit(self, samples, huber_delta: float = 0.1) -> "CostModel":
        """Fit on ``(plan or feature vector, measured_us)`` pairs.

        Minimises the squared *relative* error (times span 2 us to 1 ms, and a planner needs
        the small ones right as much as the large ones) with non-negative parameters
        (``scipy.optimize.nnls``), so every parameter stays a cost. With ``robust`` a few
        Huber re-weightings keep one bad measurement from steering the fit.
        """
        samples = list(samples)
        if len(samples) < len(FEATURE_NAMES):
            raise ValueError(f"samples: need at least {len(FEATURE_NAMES)} measurements to fit "
                             f"{len(FEATURE_NAMES)} parameters, got {len(samples)}")
        x = self._design([s for s, _ in samples])
        y = np.array([float(t) for _, t in samples])
        if not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ValueError("samples: measured times must be finite and > 0 microseconds")
        self.coef_ = fit_relative(x, y, huber_delta, rounds=4 if self.robust else 1)
        rel = x @ self.coef_ / y - 1.0
        self.fit_error_ = float(np.sqrt(np.mean(rel ** 2)))
        self.fit_mape_ = float(np.mean(np.abs(rel)))
        self.n_samples_ = len(y)
        return self

    def _check_fitted(self) -> np.ndarray:
        return self.coef_              # NotFittedError (a RuntimeError) when not fitted

    def predict(self, sources):
        """Predicted microseconds: a float for one plan or one feature vector, else an array."""
        self._check_fitted()
        one = isinstance(sources, Plan) or (isinstance(sources, np.ndarray)
                                            and sources.ndim == 1)
        y = self._design(sources) @ self.coef_
        return float(y[0]) if one else y

    def coef_dict(self) -> dict:
        self._check_fitted()
        return {name: float(v) for name, v in zip(FEATURE_NAMES, self.coef_)}

    def __repr__(self) -> str:
        head = (f"CostModel(num_sms={self.num_sms}, ctas_per_sm={self.ctas_per_sm}, "
                f"bandwidth_gbps={self.bandwidth_gbps}, clusters={self.clusters}"
                + (f", tile_rule={self.tile_rule!r}" if self.tile_rule else ""))
        if getattr(self, "coef_", None) is None:
            return head + ", not fitted)"
        coef = ", ".join(f"{k}={v:.3g}" for k, v in self.coef_dict().items())
        return head + f"; {coef})"
