"""Profiles: the fitted cost model of one kind of GPU, as a small YAML file.

A profile holds the device name, SM count, the bandwidth the features are measured against,
the fitted parameters, the fit error, the date, the splitkv version and the sweep it came from;
optionally (``kv_fp8``) a second fit of the same features, timed over fp8 K/V
(``splitkv calibrate --kv-dtype``), which fp8 caches plan with, and (``kv_fp8_graph_stable``) a
third, timed with every CTA at 4 warps (``--kv-dtype ... --graph-stable``): the build a
graph-stable fp8 wrapper's one captured grid runs, where per-shape plans of few CTAs run 8 warps
(``core.builds.plan_warps``).
``splitkv calibrate`` writes one to the user cache; a few ship with the package.

Here: the ``Profile`` and every check of its fields, where profiles live (the user cache under
``$SPLITKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitkv``, else ``~/.cache/splitkv``; the shipped
ones in ``splitkv/planner/profiles/``), the roofline prior, and the one notice a process gives
for each broken file skipped. Which profile planning uses, in which order, is
``profile_lookup.load_profile``'s. ``to_yaml`` seals the file (its first line: the byte count
and SHA-256 of the rest), so one cut short is refused, not read with other coefficients;
unsealed files (older, or written by hand) are read as they are. Nothing is read at import.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path

import yaml

from .._log import logger
from .cost_model import MAX_CTAS_PER_SM, MAX_NUM_SMS, CostModel, check_machine, check_machine_int
from .features import FEATURE_NAMES
from .profile_files import ProfileError, read_bytes, read_document, record_problem, sealed, \
    write_atomically

PROFILE_ENV = "SPLITKV_PROFILE"
CACHE_DIR_ENV = "SPLITKV_CACHE_DIR"    # splitkv's cache folder (profiles/, profiles/first-use/,
                                       # kernels/)
REFERENCE_DEVICE = "NVIDIA H200"       # what plans made without a device are made for
# The profile format's version, written by ``Profile.to_dict``. A file without one is read as
# the version before it (written by hand, or before the field); a newer one is refused.
# 2: no `const` column (schema 1's is dropped on load: a constant per call moves no decision).
SCHEMA = 2
PRIOR_SOURCE = "prior, not yet calibrated"

# Streaming-read bandwidth guesses (GB/s) for the prior, by a substring of the device name.
# H200: measured (a streaming read of 4 GiB, 16-byte loads, 528-2112 CTAs: 4,457-4,497 GB/s).
# The others: ~90% of the spec sheet, to be calibrated (the first key a name holds counts:
# the H100 PCIe's 2.0 TB/s and NVL's 3.9 before the SXM's 3.35).
BANDWIDTH_GUESS_GBPS = {"h200": 4460.0, "h100 pcie": 1800.0, "h100 nvl": 3500.0, "h100": 3000.0,
                        "a100": 1800.0, "l40": 780.0}
DEFAULT_BANDWIDTH_GBPS = 2000.0
DEFAULT_NUM_SMS = 132


# what a profile's kv_fp8 and kv_fp8_graph_stable mappings may hold
FP8_FIELDS = {"coef", "fit_error", "heldout_error", "measured_bandwidth_gbps", "date", "sweep",
              "tile_rule"}
# Cost-model features a profile written before them may lack (lone_cta_us, stream_us,
# wide_waves, merge_grid, added in that order): read as 0, the model that profile was fitted as.
FEATURES_ADDED_LATER = ("lone_cta_us", "stream_us", "wide_waves", "merge_grid")
FP8_FITS = ("kv_fp8", "kv_fp8_graph_stable")
# the tile rules a profile's fits may hold (features.TILE_RULES less the multi-token one,
# which CostModel.for_multi_token derives)
PROFILE_TILE_RULES = ("", "fp8")


MAX_DEVICE_NAME = 256


def device_slug(device_name: str) -> str:
    """File name stem for a device: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


# Where a loaded profile came from (``Profile.origin``), besides a file's path
PRIOR_ORIGIN = "roofline prior"
SHIPPED_ORIGIN_PREFIX = "splitkv:"     # then the shipped file's name: 'splitkv:nvidia-h200.yaml'


def cache_root() -> Path:
    """splitkv's cache folder: the one place its location is decided, so that the profiles
    (``user_profile_dir``) and the precompiled kernels (``runtime.cubin_cache``) move together.
    ``$SPLITKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitkv``, else ``~/.cache/splitkv``."""
    own = os.environ.get(CACHE_DIR_ENV)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.expanduser(own)) if own else Path(base) / "splitkv"


def user_profile_dir() -> Path:
    """Where calibrated profiles are cached (first-use ones in its ``first-use`` folder):
    ``profiles`` in ``cache_root()``."""
    return cache_root() / "profiles"


def user_profile_path(device_name: str) -> Path:
    """The device's file in the user cache: where ``splitkv calibrate`` writes by default and
    ``load_profile`` looks after ``$SPLITKV_PROFILE``."""
    return user_profile_dir() / f"{device_slug(device_name)}.yaml"


def guess_bandwidth_gbps(device_name: str) -> float:
    """Streaming-read bandwidth to scale the features by, before anything is measured."""
    low = device_name.lower()
    return next((bw for key, bw in BANDWIDTH_GUESS_GBPS.items() if key in low),
                DEFAULT_BANDWIDTH_GBPS)


def roofline_prior(num_sms: int, bandwidth_gbps: float) -> dict:
    """Parameters before any calibration, from the physics measured on an H200 (2026-11-29).

    launches: an empty kernel inside a CUDA graph. kv_us, crit_us (0.81 per slot, doubled as
    the critical path is counted per SM: the same predictions for those grids) and waves: the
    least-squares fit of this model to the plain read kernel over 4, 32 and 128 MiB with 528 or
    132 CTAs (2.73 ... 57.1 us; the fit: docs/design/cost-model.md, the roofline prior), less
    its 0.5 us a call (a constant moves no decision). The rest are guesses of the right size:
    a tile's non-memory work (0.02 us, +0.005 us per query head), partials at full bandwidth,
    the fused tail at one CTA's bandwidth plus ~1 us for the ticket atomic and fences, a tenth
    of the largest chunk's excess over the mean as a scheduling tail, and a lone CTA streaming
    3% slower than its SM's share (about what was measured: docs/design/cost-model.md).
    stream_us 0: crit_us carries the critical path until a calibration fits both; wide_waves 0:
    waves counts every start-up alike until then; merge_grid 0: launches carries the merge
    kernel until then.
    The parameters do not depend on the SM count or bandwidth: the features scale with them.
    """
    del num_sms, bandwidth_gbps
    return {"launches": 0.52, "kv_us": 0.24, "crit_us": 1.62, "crit_tiles": 0.02,
            "crit_tile_rows": 0.005, "waves": 0.6, "partial_us": 1.0, "fused_tail_us": 1.0,
            "fused_merges": 1.0, "merge_chain": 0.05, "tail_us": 0.1, "cluster_merges": 0.3,
            "lone_cta_us": 0.05, "stream_us": 0.0, "wide_waves": 0.0, "merge_grid": 0.0}


@dataclass(frozen=True)
class Profile:
    """One device's cost model parameters and where they came from."""

    device_name: str
    num_sms: int
    bandwidth_gbps: float                   # streaming-read bandwidth the features are scaled by
    coef: dict                              # feature name -> fitted parameter
    ctas_per_sm: int = 2
    clusters: bool = False                  # suitable fused plans merge in clusters (sm_90+)
    measured_bandwidth_gbps: float | None = None   # best K+V bandwidth a decode reached
    fit_error: float | None = None          # RMS relative error on the fitted measurements
    heldout_error: float | None = None      # mean relative error on held-out shapes
    date: str = ""
    splitkv_version: str = ""
    source: str = ""                        # 'calibrated' or PRIOR_SOURCE
    sweep: dict = field(default_factory=dict)
    # how `coef`'s model counts tiles (features.TILE_RULES): '' (64-token tiles), or 'fp8'
    # for a fit over fp8 K/V that counts its builds' 128-token tiles; written only when set
    tile_rule: str = ""
    # the fit over fp8 K/V: {"coef", "fit_error", "heldout_error", "measured_bandwidth_gbps"
    # (on one-byte codes), "date", "sweep", and "tile_rule" where set}; None: fp8 caches plan
    # with `coef`. A fit without "tile_rule" was made counting 64-token tiles, and plans so.
    kv_fp8: dict | None = None
    # the same, timed with 4-warp CTAs everywhere (graph-stable fp8 wrappers); None: they
    # plan with kv_fp8
    kv_fp8_graph_stable: dict | None = None
    origin: str = field(default="", compare=False)   # where it was loaded from

    def __post_init__(self):
        """The machine checked however the profile was made (a negative SM count would plan
        with negative predictions; text would fail deep inside the planner)."""
        for key, value in zip(("num_sms", "ctas_per_sm", "bandwidth_gbps"), check_machine(
                self.num_sms, self.ctas_per_sm, self.bandwidth_gbps)):
            object.__setattr__(self, key, value)

    @property
    def is_prior(self) -> bool:
        return self.source.startswith("prior")

    def _model_of(self, coef: dict, fit_error, tile_rule: str) -> CostModel:
        model = CostModel.from_coef(coef, num_sms=self.num_sms, ctas_per_sm=self.ctas_per_sm,
                                    bandwidth_gbps=self.bandwidth_gbps, clusters=self.clusters,
                                    tile_rule=tile_rule)
        model.fit_error_ = fit_error
        return model

    @cached_property
    def _model(self) -> CostModel:
        return self._model_of(self.coef, self.fit_error, self.tile_rule)

    @cached_property
    def _fp8_model(self) -> CostModel:
        fit = self.kv_fp8
        return self._model_of(fit["coef"], fit.get("fit_error"), fit.get("tile_rule", ""))

    @cached_property
    def _fp8_graph_stable_model(self) -> CostModel:
        fit = self.kv_fp8_graph_stable
        return self._model_of(fit["coef"], fit.get("fit_error"), fit.get("tile_rule", ""))

    def cost_model(self, kv_dtype: str | None = None, graph_stable: bool = False) -> CostModel:
        """The model to plan with: for an fp8 ``kv_dtype``, the fp8 fit where the profile has
        one (the features count 16-bit bytes either way; that fit's parameters absorb the
        factor), else the 16-bit one; for a graph-stable fp8 wrapper (``graph_stable``), its
        4-warp fit where the profile has one. A graph-stable wrapper's model plans as its one
        captured grid runs (``CostModel.for_graph_stable``: 64-token tiles, no merge_grid),
        cached like the fits."""
        if kv_dtype and graph_stable and self.kv_fp8_graph_stable is not None:
            model = self._fp8_graph_stable_model
        elif kv_dtype and self.kv_fp8 is not None:
            model = self._fp8_model
        else:
            model = self._model
        if not graph_stable:
            return model
        cache = self._graph_stable_models              # by the fit's identity: fits are cached
        if id(model) not in cache:
            cache[id(model)] = model.for_graph_stable()
        return cache[id(model)]

    @cached_property
    def _graph_stable_models(self) -> dict:
        return {}

    def with_kv_fp8(self, fp8: "Profile", graph_stable: bool = False) -> "Profile":
        """This profile with ``fp8`` (a fit over fp8 K/V of the same device) as its kv_fp8, or
        with ``graph_stable`` as its kv_fp8_graph_stable (a fit timed with 4-warp CTAs)."""
        check_device(fp8, self.device_name, self.num_sms)
        fit = {"coef": {k: float(fp8.coef[k]) for k in FEATURE_NAMES},
               "fit_error": fp8.fit_error, "heldout_error": fp8.heldout_error,
               "measured_bandwidth_gbps": fp8.measured_bandwidth_gbps, "date": fp8.date,
               "sweep": fp8.sweep, **({"tile_rule": fp8.tile_rule} if fp8.tile_rule else {})}
        return replace(self, **{"kv_fp8_graph_stable" if graph_stable else "kv_fp8": fit})

    def to_dict(self) -> dict:
        d = {"schema": SCHEMA, **asdict(self)}
        del d["origin"]
        d["coef"] = {k: float(self.coef[k]) for k in FEATURE_NAMES}
        for key in FP8_FITS:
            if d[key] is None:
                del d[key]
        if not self.tile_rule:
            del d["tile_rule"]
        return d

    def to_yaml(self) -> str:
        """The file's text, sealed (``SEAL_PREFIX``): a copy cut short is refused."""
        return sealed(f"# splitkv cost-model profile for {self.device_name} ({self.source}).\n"
                      "# Written by `splitkv calibrate`; read with yaml.safe_load.\n"
                      + yaml.safe_dump(self.to_dict(), sort_keys=False))

    def save(self, path) -> Path:
        """Written atomically: a process planning meanwhile reads the old file or the new one;
        threads or processes writing at once each leave a whole file (each call writes its own
        temporary file, flushed to disk, then renames it over the target)."""
        return write_atomically(path, self.to_yaml().encode("utf-8"))

    @classmethod
    def from_dict(cls, data, origin: str = "<dict>") -> "Profile":
        """Check every field; raise ``ProfileError`` naming the file and the field."""
        def bad(msg):
            return ProfileError(f"profile {origin}: {msg}")

        if not isinstance(data, dict):
            what = "nothing (an empty file, or one cut short)" if data is None \
                else type(data).__name__
            raise bad(f"expected a YAML mapping, got {what}")
        problem = record_problem(data)
        if problem:
            raise bad(problem)
        data = dict(data)
        schema = data.pop("schema", SCHEMA - 1)
        if isinstance(schema, bool) or not isinstance(schema, int) or schema < 0:
            raise bad(f"schema: expected an integer >= 0, got {schema!r}")
        if schema > SCHEMA:
            raise bad(f"schema {schema} is newer than this splitkv reads (up to {SCHEMA}): "
                      "upgrade splitkv, or re-run `splitkv calibrate` with this one")
        known = {f for f in cls.__dataclass_fields__ if f != "origin"}
        unknown = set(data) - known
        if unknown:
            raise bad(f"unknown fields {sorted(unknown, key=repr)}; expected some of "
                      f"{sorted(known)}")
        for key in ("device_name", "num_sms", "bandwidth_gbps", "coef"):
            if key not in data:
                raise bad(f"missing field {key!r}")

        def number(v, where, positive=False, optional=True):
            if v is None and optional:
                return None
            try:
                ok = not isinstance(v, bool) and isinstance(v, (int, float)) \
                    and math.isfinite(v) and (v > 0 if positive else v >= 0)
            except OverflowError:                     # an integer past any float
                ok = False
            if not ok:
                raise bad(f"{where}: expected a finite {'positive' if positive else 'non-negative'}"
                          f" number, got {v!r:.80}")
            return float(v)

        def integer(key, maximum):
            try:
                return check_machine_int(key, data.get(key), maximum)
            except (TypeError, ValueError) as e:
                raise bad(str(e)) from None

        device = data["device_name"]
        if not isinstance(device, str) or not device.strip() or len(device) > MAX_DEVICE_NAME:
            raise bad(f"device_name: expected a non-empty string of at most {MAX_DEVICE_NAME} "
                      f"characters, got {device!r:.80}")
        clusters = data.get("clusters", False)
        if not isinstance(clusters, bool):
            raise bad(f"clusters: expected true or false, got {clusters!r}")

        def tile_rule(value, where):
            if not isinstance(value, str) or value not in PROFILE_TILE_RULES:
                raise bad(f"{where}: expected one of {list(PROFILE_TILE_RULES)}, got {value!r}")
            return value

        def parameters(coef, where):
            if isinstance(coef, dict) and schema < 2:
                # schema 1's `const` (1 a call): the same on every plan of a call, so it moves
                # no decision; dropped
                coef = {k: v for k, v in coef.items() if k != "const"}
            if isinstance(coef, dict) and not clusters and "cluster_merges" not in coef:
                # written before clusters: its model never predicts a cluster merge (the
                # wrapper only ever turns a model's clusters off), so it goes unused
                coef = {**coef, "cluster_merges": 0.0}
            if isinstance(coef, dict):
                # fitted before these features existed: that fit is the model with them 0
                coef = {**{name: 0.0 for name in FEATURES_ADDED_LATER}, **coef}
            if not isinstance(coef, dict) or set(coef) != set(FEATURE_NAMES):
                got = sorted(coef, key=repr) if isinstance(coef, dict) else coef
                raise bad(f"{where}: expected one parameter for each feature "
                          f"{list(FEATURE_NAMES)}, got {got!r:.300}; this profile was made by "
                          "another splitkv version, re-run `splitkv calibrate`")
            # every parameter is a cost: the fit keeps them >= 0, so a negative, infinite or NaN
            # one is a damaged file, not a fit
            return {k: number(coef[k], f"{where}.{k}", optional=False) for k in FEATURE_NAMES}

        def date(value, where):
            if isinstance(value, datetime.date):     # YAML reads 2026-11-29 unquoted as one
                return value.isoformat()
            try:
                if value not in (None, ""):
                    datetime.datetime.fromisoformat(value)     # a date, or a date and time
            except (TypeError, ValueError):
                raise bad(f"{where}: expected a date such as 2026-11-29, got {value!r:.80}") \
                    from None
            return value or ""

        def sweep(value, where):
            if value and not isinstance(value, dict):
                raise bad(f"{where}: expected a mapping, got {type(value).__name__}")
            return value or {}

        def fp8_fit(name):
            fit = data.get(name)
            if fit is None:
                return None
            if not isinstance(fit, dict) or "coef" not in fit:
                raise bad(f"{name}: expected a mapping with a 'coef' mapping, got {fit!r:.200}")
            extra = set(fit) - FP8_FIELDS
            if extra:
                raise bad(f"{name}: unknown fields {sorted(extra, key=repr)}; expected some of "
                          f"{sorted(FP8_FIELDS)}")
            for key in ("fit_error", "heldout_error", "measured_bandwidth_gbps"):
                number(fit.get(key), f"{name}.{key}")
            if "tile_rule" in fit:
                tile_rule(fit["tile_rule"], f"{name}.tile_rule")
            return {**fit, "coef": parameters(fit["coef"], f"{name}.coef"),
                    "date": date(fit.get("date"), f"{name}.date"),
                    **({"sweep": sweep(fit["sweep"], f"{name}.sweep")} if "sweep" in fit else {})}

        coef = parameters(data["coef"], "coef")
        fits = {name: fp8_fit(name) for name in FP8_FITS}
        text = {"date": date(data.get("date"), "date")}
        for key in ("splitkv_version", "source"):
            text[key] = "" if data.get(key) is None else data[key]
            if not isinstance(text[key], str):
                raise bad(f"{key}: expected a string, got {text[key]!r:.80}")
        return cls(device_name=device, num_sms=integer("num_sms", MAX_NUM_SMS),
                   bandwidth_gbps=number(data["bandwidth_gbps"], "bandwidth_gbps", True, False),
                   coef=coef, **fits,
                   ctas_per_sm=integer("ctas_per_sm", MAX_CTAS_PER_SM)
                   if "ctas_per_sm" in data else 2,
                   clusters=clusters,
                   tile_rule=tile_rule(data.get("tile_rule", ""), "tile_rule"),
                   **{key: number(data.get(key), key) for key in
                      ("measured_bandwidth_gbps", "fit_error", "heldout_error")},
                   sweep=sweep(data.get("sweep"), "sweep"), origin=origin, **text)


def parse_profile(data: bytes, origin: str) -> Profile:
    """A profile file's bytes checked into a ``Profile``; ``ProfileError`` naming ``origin``
    and what is wrong for anything in them (binary, cut short, not YAML, nested too deep)."""
    return Profile.from_dict(read_document(data, origin), origin=origin)


def read_profile(path) -> Profile:
    """Read and check one profile file; ``ProfileError`` naming it if it cannot be used."""
    return parse_profile(read_bytes(path), str(path))


def check_device(profile: Profile, device_name, num_sms) -> None:
    """``ProfileError`` unless ``profile`` was made for this device name and SM count (either
    None: not checked)."""
    if device_name is not None and device_slug(profile.device_name) != device_slug(device_name):
        raise ProfileError(f"profile {profile.origin}: made for {profile.device_name!r}, "
                           f"not {device_name!r}")
    if num_sms is not None and profile.num_sms != num_sms:
        raise ProfileError(f"profile {profile.origin}: made for {profile.num_sms} SMs, this "
                           f"device has {num_sms} (a MIG slice or another model?)")


def shipped_profile(slug: str) -> Profile | None:
    """The profile splitkv ships for the device of file stem ``slug``, or None."""
    ref = resources.files(__package__).joinpath("profiles", f"{slug}.yaml")
    return parse_profile(ref.read_bytes(), f"{SHIPPED_ORIGIN_PREFIX}{slug}.yaml") \
        if ref.is_file() else None


_warned_files: set = set()      # the notices about broken files given in this process


def warn_skipped(error: Exception, then: str) -> None:
    """One notice (WARNING) a process for each broken file skipped (``error`` names it and the
    fault)."""
    if (message := f"{error}; ignoring it and {then}") not in _warned_files:
        _warned_files.add(message)
        logger.warning(message)


def prior_profile(device_name: str, num_sms: int | None = None,
                  bandwidth_gbps: float | None = None) -> Profile:
    """A profile from the roofline prior, for a device nobody has calibrated."""
    num_sms = DEFAULT_NUM_SMS if num_sms is None else num_sms
    if bandwidth_gbps is None:
        bandwidth_gbps = guess_bandwidth_gbps(device_name)
    from .._version import __version__
    return Profile(device_name=device_name, num_sms=num_sms, bandwidth_gbps=bandwidth_gbps,
                   coef=roofline_prior(num_sms, bandwidth_gbps), splitkv_version=__version__,
                   source=PRIOR_SOURCE, sweep={"name": "none: roofline prior"},
                   origin=PRIOR_ORIGIN)
