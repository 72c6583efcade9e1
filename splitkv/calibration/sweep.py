"""What the calibration times: decode shapes, and for each a few candidate plans.

Shapes: batch 1..256, lengths 16..128k tokens, equal and ragged (log-normal around the mean,
as serving batches are), GQA groups 1..32, head dims 64..256; none holds more than 1 GiB of
K and V. Plans: for each shape, no split plus the decompositions the planner ranks best under
the prior and a few it ranks worse (the fit must see bad plans to learn what makes them bad),
each as 'split_merge' and as 'fused'. ``--quick`` keeps a small subset.

Timing goes through ``splitkv.measure.timing.time_plan_us`` (imported when measuring), so the
calibration measures exactly what the benchmark measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import csv
from pathlib import Path

import numpy as np

from ..core.plan import Plan
from ..core.problem import DecodeProblem
from ..planner.cost_model import CostModel
from ..planner.planner import NO_SPLIT, Candidate, rank_candidates

MAX_KV_BYTES = 1 << 30
PAGE_SIZE = 16


@dataclass(frozen=True)
class SweepShape:
    name: str
    problem: DecodeProblem


@dataclass(frozen=True)
class SweepPoint:
    """One plan of one shape to time."""

    shape: str
    label: str              # e.g. 'chunk tokens 1024 fused'
    plan: Plan


@dataclass(frozen=True)
class Measurement:
    shape: str
    label: str
    plan: Plan
    measured_us: float


def ragged_lengths(batch: int, mean: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal lengths (sigma 0.8) around ``mean``, at least 1 token, at most 8x the mean."""
    lens = rng.lognormal(np.log(mean) - 0.32, 0.8, batch)
    return np.clip(np.round(lens), 1, 8 * mean).astype(np.int64)


def _shape(name, lens, hq=32, hk=8, d=128) -> SweepShape:
    return SweepShape(name, DecodeProblem(np.asarray(lens, dtype=np.int64), hq, hk, d, PAGE_SIZE))


def sweep_shapes(quick: bool = False, seed: int = 0) -> list[SweepShape]:
    """The shapes to time, in a fixed order (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    shapes = []
    if quick:
        batches, lengths, ragged_means = (1, 8, 64), (256, 4096, 32768), (2048,)
        heads = [(32, 32, 128), (64, 8, 128), (32, 8, 64)]
        head_grid = [(1, 8192), (16, 2048)]
    else:
        batches = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        lengths = (16, 64, 256, 1024, 4096, 16384, 32768, 131072)
        ragged_means = (256, 1024, 4096, 16384)
        heads = [(32, 32, 128), (32, 16, 128), (64, 8, 128), (32, 8, 64), (16, 4, 256)]
        head_grid = [(1, 1024), (1, 8192), (1, 32768), (8, 8192), (64, 2048), (16, 4096)]
    for b in batches:
        for n in lengths:
            shapes.append(_shape(f"b{b}_n{n}", [n] * b))
        if b > 1:
            for mean in ragged_means:
                shapes.append(_shape(f"ragged_b{b}_mean{mean}", ragged_lengths(b, mean, rng)))
    for hq, hk, d in heads:
        for b, n in head_grid:
            shapes.append(_shape(f"h{hq}/{hk}_d{d}_b{b}_n{n}", [n] * b, hq, hk, d))
        shapes.append(_shape(f"h{hq}/{hk}_d{d}_ragged_b16", ragged_lengths(16, 4096, rng),
                             hq, hk, d))
    if not quick:
        # the classes of shape the cost model describes (rows a CTA, head_dim): GQA groups 16
        # and 32, and head_dim 256 with group 2 (Gemma-like); a few shapes each, appended so that
        # the shapes above keep their ragged lengths
        for hq, hk, d in [(128, 8, 128), (64, 2, 128), (16, 8, 256)]:
            for b, n in [(1, 8192), (8, 8192), (32, 2048)]:
                shapes.append(_shape(f"h{hq}/{hk}_d{d}_b{b}_n{n}", [n] * b, hq, hk, d))
        # and the kinds of shape the planner evaluation (docs/design/cost-model.md) found the fit
        # furthest from, with sizes of their own (the evaluation's held-out shapes stay unseen):
        # hundreds of short requests, a large batch of which a few requests are long
        # (split_merge splits only those), many waves at head_dim 64 and 256, a batch-1
        # request of a few thousand tokens
        shapes.append(_shape("short_ragged_b384_mean160", ragged_lengths(384, 160, rng)))
        shapes.append(_shape("few_long_b256", [300] * 250 + [6000] * 6))
        shapes.append(_shape("h32/8_d64_b64_n4096", [4096] * 64, 32, 8, 64))
        shapes.append(_shape("h16/8_d256_b16_n6000", [6000] * 16, 16, 8, 256))
        shapes.append(_shape("b1_n4500", [4500]))
    return [s for s in shapes if s.problem.kv_bytes <= MAX_KV_BYTES]


def candidate_plans(problem: DecodeProblem, model: CostModel,
                    max_decompositions: int = 5) -> list[tuple[str, Plan]]:
    """No split, then up to ``max_decompositions - 1`` split decompositions: the best ranked
    by ``model`` and a spread of worse ones, no two cutting the requests alike; each split one
    as 'split_merge' and 'fused'."""
    ranked = rank_candidates(problem, model)
    no_split = next(c for c in ranked if c.kind == NO_SPLIT)
    decomps, cuts = [], {_chunk_cuts(no_split.build(problem))}
    for c in ranked:
        if c.kind == NO_SPLIT or (c.kind, c.value) in decomps:
            continue
        # several decompositions often cut the requests alike (num splits 4 and chunk tokens
        # 2048 over 8k tokens): time one of them, so the sweep's points are distinct plans
        cut = _chunk_cuts(c.build(problem))
        if cut not in cuts:
            cuts.add(cut)
            decomps.append((c.kind, c.value))
    want = max_decompositions - 1
    if len(decomps) > want:
        best = decomps[: (want + 1) // 2]
        rest = decomps[len(best):]
        step = len(rest) / (want - len(best))
        decomps = best + [rest[int(i * step)] for i in range(want - len(best))]
    by_key = {(c.kind, c.value, c.strategy): c for c in ranked}
    chosen = [no_split]
    chosen += [by_key[(kind, value, strategy)] for kind, value in decomps
               for strategy in ("split_merge", "fused")]
    return [(c.label, c.build(problem, clusters=model.clusters)) for c in chosen]


def _chunk_cuts(plan: Plan) -> bytes:
    """Where ``plan`` cuts its requests: equal for plans that differ only in how they were
    asked for."""
    return plan.chunk_request.tobytes() + plan.chunk_start.tobytes()


def sweep_points(model: CostModel, quick: bool = False, seed: int = 0) -> list[SweepPoint]:
    """Every (shape, plan) to time."""
    per_shape = 3 if quick else 5
    return [SweepPoint(shape.name, label, plan)
            for shape in sweep_shapes(quick, seed)
            for label, plan in candidate_plans(shape.problem, model, per_shape)]


def measure(points, time_fn=None, progress=None, seed: int = 0, **timing) -> list[Measurement]:
    """Time every point. ``time_fn(plan, page_table, **timing)`` defaults to
    ``measure.timing.time_plan_us``; ``progress(i, n, point, us)`` is called after each point.
    One page table (pages scattered at random) per shape."""
    from ..testing import scattered_page_table

    if time_fn is None:
        from ..measure.timing import time_plan_us as time_fn
    rng = np.random.default_rng(seed)
    shape, table = None, None
    out = []
    for i, point in enumerate(points):
        if point.shape != shape:
            p = point.plan.problem
            shape, table = point.shape, scattered_page_table(p.kv_lens, p.page_size, rng)[0]
        us = float(time_fn(point.plan, table, **timing))
        out.append(Measurement(point.shape, point.label, point.plan, us))
        if progress is not None:
            progress(i, len(points), point, us)
    return out


CSV_COLUMNS = ["shape", "plan", "batch", "num_qo_heads", "num_kv_heads", "head_dim",
               "total_tokens", "num_chunks", "measured_us", "predicted_us", "page_size", "kv_lens"]


def _csv_row(m: Measurement, predicted: float) -> list:
    p = m.plan.problem
    return [m.shape, m.label, p.batch_size, p.num_qo_heads, p.num_kv_heads, p.head_dim,
            p.total_tokens, m.plan.num_chunks, f"{m.measured_us:.3f}", f"{predicted:.3f}",
            p.page_size, " ".join(map(str, p.kv_lens.tolist()))]


class MeasurementLog:
    """``write_measurements``' CSV, a row at a time as each plan is timed (flushed), with the
    prior's prediction: a sweep cut off before its fit still leaves what it measured, which
    ``read_measurements`` reads back to fit it without the GPU (benchmarks/refit_profile.py)."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = open(self.path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_COLUMNS)
        self._file.flush()

    def append(self, point: SweepPoint, us: float) -> None:
        prior = point.plan.predicted_us
        m = Measurement(point.shape, point.label, point.plan, float(us))
        self._writer.writerow(_csv_row(m, float("nan") if prior is None else prior))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_measurements(path, measurements, model: CostModel) -> Path:
    """One CSV row per measurement, with ``model``'s prediction and the request lengths, so
    ``read_measurements`` can rebuild every plan without re-running the sweep's selection."""
    path = Path(path)
    predicted = model.predict([m.plan for m in measurements])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for m, pred in zip(measurements, predicted):
            w.writerow(_csv_row(m, pred))
    return path


def read_measurements(path, quick: bool = False, seed: int = 0) -> list[Measurement]:
    """Measurements back from ``write_measurements``' CSV, plans rebuilt from their labels: to
    refit after the cost model changes, with no GPU. A CSV without the ``kv_lens`` column
    (written by splitkv before it had one) finds its shapes by name in
    ``sweep_shapes(quick, seed)``."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    shapes = None
    out = []
    for i, r in enumerate(rows):
        if r.get("kv_lens"):
            problem = DecodeProblem(np.array(r["kv_lens"].split(), dtype=np.int64),
                                    int(r["num_qo_heads"]), int(r["num_kv_heads"]),
                                    int(r["head_dim"]), int(r["page_size"]))
        else:
            if shapes is None:
                shapes = {s.name: s.problem for s in sweep_shapes(quick, seed)}
            if r["shape"] not in shapes:
                raise ValueError(f"{path}: row {i + 2}: shape {r['shape']!r} is not in the "
                                 f"{'quick' if quick else 'full'} sweep of seed {seed}")
            problem = shapes[r["shape"]]
        plan = Candidate.from_label(r["plan"]).build(problem)
        if plan.num_chunks != int(r["num_chunks"]):
            raise ValueError(f"{path}: row {i + 2}: {r['plan']!r} of {r['shape']} rebuilds "
                             f"with {plan.num_chunks} chunks, the CSV says {r['num_chunks']}")
        out.append(Measurement(r["shape"], r["plan"], plan, float(r["measured_us"])))
    return out
