"""First-use planning: a cost model for a GPU that has no profile, from a few seconds of probes
instead of a calibration sweep (docs/design/first-use.md says which probe prices which column).

What is here is pure: the probe plans (``probe_cases``, built for the device's SM count and
occupancy, so the GPU times exactly the plans the derivation computes features of), the
derivation of a ``Profile`` from the probes' timings and the device's properties
(``derive_profile``), the cache of that profile per GPU name, driver and splitkv version, and
the ``SPLITKV_FIRST_USE`` option. The timing itself is ``measure.first_use_probes``'; it reaches
``load_profile`` (``profile_lookup``) as a ``first_use`` source (``resolve``'s ``source``), so
the planner imports nothing of the runtime or the measuring code.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .._log import logger
from ..core.builds import DeviceProperties, PlanGrid, decode_build
from ..core.geometry import ctas_per_kv_head, rows_per_cta
from ..core.plan import Plan, plan_chunk_tokens
from ..core.problem import DecodeProblem
from .cost_model import CostModel, fit_relative
from .features import FEATURE_NAMES, resident_ctas
from .kin import kin_of, kin_profile
from .profiles import (CACHE_DIR_ENV, Profile, ProfileError, device_slug, read_profile,
                       user_profile_dir, warn_skipped)

FIRST_USE_ENV = "SPLITKV_FIRST_USE"
FIRST_USE_MODES = ("off", "probe", "calibrate")
# The probes' model plans far closer to the best than the roofline prior on the H200's held-out
# shapes (benchmarks/results/h200-first-use.json), for a pause of a few seconds once a GPU,
# driver and splitkv version; engines that must not pause set it to 'off'.
DEFAULT_MODE = "probe"
FIRST_USE_SOURCE = "first-use probes"
CACHE_FOLDER = "first-use"

# Columns no probe prices apart, and what they hold instead (docs/design/first-use.md):
# stream_us carries the critical path and the ragged tail, so crit_us, tail_us and
# lone_cta_us stay 0, as in the fitted 16-bit models; launches is the empty-kernel probe.
ZERO_COLUMNS = ("crit_us", "tail_us", "lone_cta_us")
MEASURED_COLUMNS = ("launches",)
# CTAs an SM holds at head_dim 128 when shared memory does not bound it lower: the decode
# build's registers (128 threads of more than 128 registers) leave room for at most 2 of them
# in the 65,536 registers every SM splitkv builds for has.
REGISTER_BOUND_CTAS = 2
# A block's shared memory the driver reserves (CUDA C++ Programming Guide).
RESERVED_SHARED_BYTES = 1024

# The probes' shape: 32 query heads over 8 kv heads (a group of 4), head_dim 128, 16-token
# pages, bfloat16; a 64-token tile, a 1k and 2k chunk, a 16k request (start-ups, tiles,
# streaming, a lone CTA's streaming, splits).
PROBE_HEADS = (32, 8)
PROBE_HEAD_DIM = 128
PROBE_PAGE = 16
TILE = 64
LONG = 16384


def first_use_mode() -> str:
    """``$SPLITKV_FIRST_USE`` checked: 'probe' (the default: time the first-use probes once,
    cache the model), 'off' (plan with the roofline prior) or 'calibrate' (run the quick
    calibration sweep and fit instead)."""
    value = os.environ.get(FIRST_USE_ENV, "").strip().lower()
    if not value:
        return DEFAULT_MODE
    if value not in FIRST_USE_MODES:
        raise ValueError(f"${FIRST_USE_ENV}: expected one of {', '.join(FIRST_USE_MODES)}, "
                         f"got {os.environ[FIRST_USE_ENV]!r}")
    return value


@dataclass(frozen=True)
class ProbeCase:
    """One timed decode plan: its name, the plan, and the columns it is there to price."""

    name: str
    plan: Plan
    prices: tuple[str, ...]


def probe_ctas_per_sm(device: DeviceProperties) -> int:
    """CTAs of the head_dim-128 build an SM holds: its shared memory over the build's (with the
    driver's reservation), at most ``REGISTER_BOUND_CTAS``; that bound where the shared memory
    is not known."""
    if not device.shared_per_sm:
        return REGISTER_BOUND_CTAS
    hq, hk = PROBE_HEADS
    build = decode_build("bfloat16", PROBE_HEAD_DIM, hq // hk, PROBE_PAGE, None,
                         PlanGrid(device.num_sms * REGISTER_BOUND_CTAS + 1), device)
    fits = device.shared_per_sm // (build.shared_bytes + RESERVED_SHARED_BYTES)
    return int(max(1, min(REGISTER_BOUND_CTAS, fits)))


def _requests_for_waves(waves: int, num_sms: int, ctas_per_sm: int, hq: int, hk: int,
                        head_dim: int) -> int:
    """Requests of one chunk each that fill ``waves`` waves of the shape's slots."""
    rows = rows_per_cta(hq // hk)
    slots = num_sms * resident_ctas(head_dim, ctas_per_sm, rows)
    per_request = hk * ctas_per_kv_head(hq // hk)
    return max(1, waves * slots // per_request)


def probe_cases(num_sms: int, ctas_per_sm: int) -> list[ProbeCase]:
    """The decode plans the first-use probes time, for a GPU of ``num_sms`` SMs holding
    ``ctas_per_sm`` head_dim-128 CTAs each. Sized by the device (a wave is its slots), so
    the columns they price are apart on every GPU; deterministic, so the runtime and the
    derivation build the same ones."""
    hq, hk = PROBE_HEADS
    d = PROBE_HEAD_DIM

    def problem(lens, q=hq, k=hk, head_dim=d):
        return DecodeProblem(np.asarray(lens, dtype=np.int64), q, k, head_dim, PROBE_PAGE,
                             "bfloat16")

    def wave(n, q=hq, k=hk, head_dim=d):
        return _requests_for_waves(n, num_sms, ctas_per_sm, q, k, head_dim)

    def single(prob):
        return plan_chunk_tokens(prob, 1 << 30, "single")

    def cut(prob, chunk, strategy):
        return plan_chunk_tokens(prob, chunk, strategy, align=TILE)

    long = problem([LONG])
    lone_1k = problem([1024])
    batch8_1k = problem([1024] * 8)
    chunk_for_wave = TILE * math.ceil(LONG / wave(1) / TILE)  # one wave of one request's chunks
    batch = problem([2 * TILE] * wave(2))
    d256 = (16, 8, 256)
    g32 = (64, 2, 128)
    return [
        ProbeCase("lone_tile", single(problem([TILE])), ("waves",)),
        ProbeCase("wave_tile", single(problem([TILE] * wave(1))), ("waves", "crit_tiles")),
        ProbeCase("waves4_tile", single(problem([TILE] * wave(4))), ("waves", "crit_tiles")),
        ProbeCase("wave_1k", single(problem([1024] * wave(1))), ("kv_us", "crit_tiles")),
        ProbeCase("waves3_1k", single(problem([1024] * wave(3))), ("kv_us", "stream_us")),
        ProbeCase("lone_2k", single(problem([2048])), ("stream_us", "crit_tiles")),
        ProbeCase("lone_16k", single(long), ("stream_us",)),
        ProbeCase("split2_16k", cut(long, LONG // 2, "split_merge"),
                  ("partial_us", "merge_chain")),
        ProbeCase("split_wave_16k", cut(long, chunk_for_wave, "split_merge"),
                  ("merge_chain", "partial_us")),
        ProbeCase("fused_wave_16k", cut(long, chunk_for_wave, "fused"),
                  ("fused_tail_us", "fused_merges")),
        ProbeCase("fused4_16k", cut(long, LONG // 4, "fused"),
                  ("fused_merges",)),
        ProbeCase("batch_single", single(batch), ("waves",)),
        ProbeCase("batch_split", cut(batch, TILE, "split_merge"), ("merge_grid", "partial_us")),
        # one short request cut in 4 (a cluster of 4 where the device has clusters) and in 16
        # (ticket merges): the merges of the short calls that clusters and tickets are for
        ProbeCase("lone_fused4_1k", cut(lone_1k, 1024 // 4, "fused"), ("cluster_merges",)),
        ProbeCase("lone_fused16_1k", cut(lone_1k, 1024 // 16, "fused"),
                  ("fused_merges", "fused_tail_us")),
        # eight such requests cut in 4: too wide a grid for clusters, so tickets, many at once
        ProbeCase("batch8_fused4_1k", cut(batch8_1k, 1024 // 4, "fused"),
                  ("fused_merges", "fused_tail_us")),
        ProbeCase("batch_split4", cut(problem([4 * TILE] * wave(1)), TILE, "split_merge"),
                  ("merge_grid", "merge_chain")),
        ProbeCase("d256_tiles", single(problem([TILE] * wave(4, *d256), *d256)),
                  ("wide_waves",)),
        ProbeCase("g32_tiles", single(problem([TILE] * wave(4, *g32), *g32)),
                  ("crit_tile_rows",)),
    ]


@dataclass
class ProbeResults:
    """What the first-use probes measured (microseconds, GB/s) and the device they ran on.

    ``decode_us``: each ``probe_cases`` plan's time, by name; ``read_gbps``: the streaming
    read at a few occupancies, keyed 'CTAs per SM x threads x loads'; ``full_read_keys``:
    those of the full-occupancy shapes, whose best is the device's bandwidth."""

    device_name: str
    num_sms: int
    cc: int
    shared_per_block_optin: int
    shared_per_sm: int
    driver_version: str
    empty_graph_us: float           # an empty kernel, one of many in a CUDA graph
    empty_eager_us: float           # the same launched one at a time
    read_gbps: dict
    full_read_keys: tuple
    decode_us: dict
    seconds: float = 0.0            # wall time of the probes
    phase_seconds: dict = field(default_factory=dict)   # each phase's share, first compiles in
    l2_bytes: int = 0

    @property
    def device(self) -> DeviceProperties:
        return DeviceProperties(self.num_sms, self.shared_per_block_optin, self.shared_per_sm,
                                self.cc, self.device_name)

    @property
    def bandwidth_gbps(self) -> float:
        return max(float(self.read_gbps[k]) for k in self.full_read_keys)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["full_read_keys"] = list(self.full_read_keys)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "ProbeResults":
        data = dict(data)
        data["full_read_keys"] = tuple(data["full_read_keys"])
        return cls(**data)


class ProbeError(ValueError):
    """Probe results a model cannot be derived from (missing, non-finite or non-positive)."""


class ProbesDeferred(RuntimeError):
    """The probes cannot run now (a CUDA graph is being captured): the wrapper asking plans
    with the roofline prior, and the next wrapper to plan asks again."""


def _check(results: ProbeResults, cases) -> None:
    def bad(v):
        return not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0

    for what, v in (("empty_graph_us", results.empty_graph_us),
                    ("bandwidth_gbps", results.bandwidth_gbps if results.full_read_keys
                     else float("nan"))):
        if bad(v):
            raise ProbeError(f"first-use probes: {what} is {v!r}")
    missing = [c.name for c in cases if c.name not in results.decode_us]
    if missing:
        raise ProbeError(f"first-use probes: no time for {missing}")
    for c in cases:
        if bad(results.decode_us[c.name]):
            raise ProbeError(f"first-use probes: {c.name} timed {results.decode_us[c.name]!r}")


def probe_model(results: ProbeResults) -> tuple[CostModel, dict]:
    """The cost model of the probed device: hyperparameters from its properties (SMs,
    clusters from the compute capability, ``probe_ctas_per_sm`` from shared memory) and the
    measured bandwidth; ``MEASURED_COLUMNS`` from the micro-probes, ``ZERO_COLUMNS`` 0, every
    other column the non-negative least squares of relative error over the decode probes,
    each plan's features computed as it ran (clusters where the device has them).
    Returns (model, diagnostics)."""
    device = results.device
    ctas_per_sm = probe_ctas_per_sm(device)
    clusters = device.cc >= 90
    cases = probe_cases(device.num_sms, ctas_per_sm)
    _check(results, cases)
    model = CostModel(num_sms=device.num_sms, ctas_per_sm=ctas_per_sm,
                      bandwidth_gbps=results.bandwidth_gbps, clusters=clusters)
    x = np.array([model.features(c.plan.with_execution(clusters=clusters)) for c in cases])
    y = np.array([float(results.decode_us[c.name]) for c in cases])
    coef = np.zeros(len(FEATURE_NAMES))
    coef[FEATURE_NAMES.index("launches")] = results.empty_graph_us
    fixed = set(ZERO_COLUMNS) | set(MEASURED_COLUMNS)
    free = [i for i, name in enumerate(FEATURE_NAMES)
            if name not in fixed and np.any(x[:, i] != 0)]
    rest = y - x @ coef                           # what the free columns must explain
    coef[free] = fit_relative(x[:, free], y, rounds=1, target=rest / y)
    model.coef_ = coef
    predicted = x @ coef
    rel = predicted / y - 1.0
    model.fit_error_ = float(np.sqrt(np.mean(rel ** 2)))
    model.fit_mape_ = float(np.mean(np.abs(rel)))
    model.n_samples_ = len(y)
    rank = int(np.linalg.matrix_rank(x[:, free] / y[:, None]))
    return model, {"cases": [c.name for c in cases], "free": [FEATURE_NAMES[i] for i in free],
                   "rank": rank, "predicted_us": predicted.tolist(), "measured_us": y.tolist()}


def derive_profile(results: ProbeResults) -> Profile:
    """``probe_model``'s model as a profile of the probed device, the probes in its ``sweep``
    (so a cached profile says what it was derived from)."""
    from .._version import __version__

    model, info = probe_model(results)
    coef = model.coef_dict()
    return Profile(device_name=results.device_name, num_sms=model.num_sms,
                   bandwidth_gbps=float(model.bandwidth_gbps), coef=coef,
                   ctas_per_sm=model.ctas_per_sm, clusters=model.clusters,
                   measured_bandwidth_gbps=round(results.bandwidth_gbps, 1),
                   fit_error=model.fit_error_, date=datetime.date.today().isoformat(),
                   splitkv_version=__version__, source=FIRST_USE_SOURCE,
                   sweep={"name": FIRST_USE_SOURCE, "points": len(info["cases"]),
                          "rank": info["rank"], "seconds": round(results.seconds, 3),
                          "probes": results.to_dict()},
                   origin="first-use probes")


def cache_key(device_name: str, driver_version, version: str | None = None) -> str:
    """The cached model's file stem: the GPU, the driver and splitkv's version, each of which
    changes what the probes measure or what the model means."""
    if version is None:
        from .._version import __version__ as version
    driver = device_slug(str(driver_version)) or "unknown"
    return f"{device_slug(device_name)}-driver-{driver}-splitkv-{device_slug(version)}"


def first_use_path(device_name: str, driver_version, version: str | None = None) -> Path:
    """Where the first-use model of this GPU, driver and version is cached: beside the
    calibrated profiles, in their ``first-use`` folder."""
    return user_profile_dir() / CACHE_FOLDER / f"{cache_key(device_name, driver_version, version)}.yaml"


def save_first_use(profile: Profile, path: Path) -> Path:
    """Write atomically: processes probing the same GPU at once each leave a whole file."""
    return profile.save(path)


def read_first_use(path: Path, device_name: str, num_sms: int | None) -> Profile | None:
    """The cached first-use model at ``path`` for this device, or None (absent, or unusable:
    then it is probed again and rewritten; one notice names the file and what is wrong)."""
    try:
        if not path.is_file():
            return None
        profile = read_profile(path)
    except (OSError, ProfileError) as e:        # OSError: a cache folder that cannot be read
        if not isinstance(e, ProfileError):
            e = ProfileError(f"profile {path}: cannot read it ({e.strerror or e})")
        warn_skipped(e, "probing again")
        return None
    if device_slug(profile.device_name) != device_slug(device_name) or (
            num_sms is not None and profile.num_sms != num_sms):
        return None
    return profile


@dataclass
class _State:
    failed: set = field(default_factory=set)    # keys whose probes failed in this process
    running: set = field(default_factory=set)   # keys being probed (no re-entry)
    # models probed in this process that the cache could not hold (a read-only home): kept by
    # key, so that the next wrapper on the device does not probe again
    kept: dict = field(default_factory=dict)


_state = _State()


def resolve(device_name: str, num_sms: int | None, source) -> Profile | None:
    """The first-use profile of this device, or None for the roofline prior.

    ``source``: what can measure the device (``measure.first_use_probes.DeviceProbes``): its
    ``driver_version``, ``probe()`` -> ``ProbeResults``, ``calibrate()`` -> a calibrated
    ``Profile`` (written where ``load_profile`` finds calibrations). By ``first_use_mode()``:
    'off' -> None; 'probe' -> the cached model, else probe, derive, cache, and say so once
    (an INFO record of the ``splitkv`` logger; WARNING where the cache cannot be written);
    'calibrate' -> ``source.calibrate()``. A failure is a WARNING and gives None (the prior),
    once a process."""
    mode = first_use_mode()
    if mode == "off":
        return None
    path = first_use_path(device_name, source.driver_version)
    key = str(path)
    if mode == "probe":
        kept = _state.kept.get(key)
        if kept is not None and (num_sms is None or kept.num_sms == num_sms):
            return kept
        cached = read_first_use(path, device_name, num_sms)
        if cached is not None:
            return cached
    if key in _state.failed or key in _state.running:
        return None
    _state.running.add(key)
    try:
        if mode == "calibrate":
            profile = source.calibrate()
            logger.info(f"splitkv had no profile for {device_name!r}; ran the quick "
                        f"calibration ({FIRST_USE_ENV}=calibrate) and wrote {profile.origin}")
            return profile
        start = time.perf_counter()
        cc = getattr(source, "cc", None)
        if kin_of(device_name, cc) is not None and hasattr(source, "read_bandwidth"):
            gbps = source.read_bandwidth()
            kin = kin_of(device_name, cc, gbps)
            seconds = time.perf_counter() - start
            profile = kin_profile(kin, device_name, getattr(source, "num_sms", None)
                                  or num_sms or kin.num_sms, gbps, seconds)
            said = (f"splitkv had no profile for {device_name!r}; took the profile of "
                    f"{kin.device_name} (the same architecture) with this GPU's streaming read, "
                    f"{gbps:,.0f} GB/s, measured in {seconds:.1f} s, and ")
        else:
            results = source.probe()
            profile = derive_profile(results)
            said = (f"splitkv had no profile for {device_name!r}; timed its first-use probes "
                    f"in {time.perf_counter() - start:.1f} s and ")
        try:
            save_first_use(profile, path)
        except OSError as e:
            # an unwritable cache must not cost a probe a wrapper: kept for the process
            _state.kept[key] = profile = replace(profile, origin=f"{profile.origin} (kept in "
                                                                 "memory: not cached)")
            logger.warning(f"{said}could not cache the model in {path} ({e.strerror or e}); "
                           f"keeping it for this process. Set ${CACHE_DIR_ENV} to a writable "
                           f"folder to keep it across processes, or {FIRST_USE_ENV}=off to "
                           "plan with the roofline prior.")
            return profile
        logger.info(f"{said}cached the model in {path}. {FIRST_USE_ENV}=off plans with the "
                    "roofline prior instead; `splitkv calibrate` fits a better one.")
        return read_profile(path)
    except ProbesDeferred:
        return None
    except Exception as e:        # any failure leaves the prior, which always plans
        _state.failed.add(key)
        logger.warning(f"splitkv: first-use {mode} for {device_name!r} failed "
                       f"({type(e).__name__}: {e}); planning with the roofline prior")
        return None
    finally:
        _state.running.discard(key)
