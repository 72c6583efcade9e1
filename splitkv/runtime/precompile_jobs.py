"""What ``splitkv precompile`` compiles, without a GPU: for one wrapper configuration and one
architecture, the modules its ``warmup()`` would compile there
(``compiled_builds.reachable_kernel_builds``, and a graph-stable wrapper's planning kernel), each
with the source, options and name the runtime looks it up by (``modules.load_module``),
compiled into the cubin cache."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ..core import fp8
from ..core import validation as V
from ..core import variants as VA
from ..core.architectures import ARCHITECTURES, architecture_properties
from ..core.builds import DeviceProperties
from .compiled_builds import reachable_kernel_builds, base_build
from .cubin_cache import precompile_module
from .experiments import DecodeExperiments
from .kernel_source import NVRTC_OPTIONS
from .modules import PLANNER_LABEL
_ARCH = re.compile(r"(?:sm_(\d+)|(\d+)|(\d+)\.(\d))")


@dataclass(frozen=True)
class Configuration:
    """A wrapper's constructor and ``warmup()`` arguments that decide its builds (defaults as
    theirs; ``clusters`` None: where the architecture has them, as ``use_clusters=None``)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    soft_cap: bool = False           # warmup(logits_soft_cap=True): with and without the cap
    max_q_len: int = 1
    unified_max: bool = False
    graph_stable: bool = False
    clusters: bool | None = None
    alibi: bool = False              # warmup(alibi=True): plans take alibi_slopes

    def __post_init__(self):
        qo, kv = V.check_heads(self.num_qo_heads, self.num_kv_heads)
        checked = {"num_qo_heads": qo, "num_kv_heads": kv,
                   "head_dim": V.check_head_dim(self.head_dim),
                   "page_size": V.check_int("page_size", self.page_size, 1),
                   "dtype": V.check_dtype("dtype", self.dtype),
                   "kv_dtype": fp8.fp8_format("kv_dtype", self.kv_dtype),
                   "max_q_len": V.check_int("max_q_len", self.max_q_len, 1, VA.MAX_Q_LEN,
                                            "MAX_Q_LEN")}
        V.check_head_dim_for_kv(checked["head_dim"], checked["kv_dtype"])
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        for name in ("soft_cap", "unified_max", "graph_stable", "alibi"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.clusters is not None and not isinstance(self.clusters, bool):
            raise TypeError(f"clusters: expected None, True or False, got {self.clusters!r}")
        if self.num_qo_heads * self.max_q_len > V.MAX_HEADS:
            raise ValueError(f"max_q_len: {self.max_q_len} query rows x {self.num_qo_heads} "
                             f"heads exceed MAX_HEADS={V.MAX_HEADS} rows a kv head can hold")
        if self.unified_max and self.graph_stable:
            raise ValueError("unified_max: graph-stable wrappers do not take it (their plans "
                             "refuse it)")

    def describe(self) -> str:
        text = (f"{self.num_qo_heads}/{self.num_kv_heads} heads, head_dim {self.head_dim}, "
                f"page {self.page_size}, {self.dtype}")
        text += f", {self.kv_dtype} K/V" if self.kv_dtype else ""
        text += ", with and without the soft cap" if self.soft_cap else ""
        text += f", up to {self.max_q_len} query rows" if self.max_q_len > 1 else ""
        text += ", unified max" if self.unified_max else ""
        text += ", ALiBi" if self.alibi else ""
        text += ", graph-stable" if self.graph_stable else ""
        text += ", no clusters" if self.clusters is False else ""
        return text

    def to_dict(self) -> dict:
        return asdict(self)


def parse_arch(text: str) -> int:
    """The compute capability of ``sm_90``, ``90`` or ``9.0`` (as major x 10 + minor)."""
    m = _ARCH.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"--arch: expected an architecture like sm_90 (or 90, 9.0), got "
                         f"{text!r}")
    if m.group(3) is not None:
        return int(m.group(3)) * 10 + int(m.group(4))
    return int(m.group(1) or m.group(2))


def known_arches() -> str:
    return ", ".join(f"sm_{cc}" for cc in sorted(ARCHITECTURES))


def arch_properties(cc: int, current: DeviceProperties | None = None) -> DeviceProperties:
    """What the build rules read of a GPU of compute capability ``cc``: ``current`` (this
    machine's GPU) where it is one, else ``core.architectures``' (shared memory decides the
    builds; the SM count only where a grid outnumbers it, which both sides of are built)."""
    if current is not None and current.cc == cc:
        return current
    if cc not in ARCHITECTURES:
        raise ValueError(f"--arch: expected one of {known_arches()} (or this machine's GPU's), "
                         f"got sm_{cc}")
    return architecture_properties(cc)


def modules_for(config: Configuration, device: DeviceProperties) -> list[tuple[str, str, tuple]]:
    """(label, source, options) of each module a wrapper of ``config`` compiles in ``warmup()``
    on ``device``, as ``modules.load_module`` is given them; sorted by label."""
    experiments = DecodeExperiments()
    base = base_build(config.dtype, config.head_dim, config.num_qo_heads // config.num_kv_heads,
                         config.page_size, config.kv_dtype, experiments)
    clusters = device.cc >= 90 if config.clusters is None else config.clusters
    builds = reachable_kernel_builds(
        base, experiments, device=device, page_size=config.page_size,
        group_size=config.num_qo_heads // config.num_kv_heads,
        soft_caps=(False, True) if config.soft_cap else (False,), max_q_len=config.max_q_len,
        unified_max=config.unified_max, clusters=clusters,
        graph_stable=config.graph_stable, alibi=config.alibi)
    found = [(b.name, b.source(), NVRTC_OPTIONS) for b in builds]
    if config.graph_stable:
        from .device_planner import PLAN_NVRTC_OPTIONS, source

        found.append((PLANNER_LABEL, source(), PLAN_NVRTC_OPTIONS))
    return sorted(found, key=lambda m: m[0])


def unnamed(jobs: list[tuple[str, str, tuple, str]]) -> list[dict]:
    """The records of a dry run without NVRTC: each (label, source, options, arch) once, in
    order, with no path (a file's name hashes the NVRTC build) and status "would compile"."""
    return [{"label": label, "arch": arch, "path": None, "status": "would compile", "bytes": 0,
             "seconds": 0.0} for label, _, _, arch in dict.fromkeys(jobs)]


def precompile(jobs: list[tuple[str, str, tuple, str]], folder=None, dry_run: bool = False,
               workers: int = 1) -> list[dict]:
    """``cubin_cache.precompile_module`` of each (label, source, options, arch), the same one
    once, over ``workers`` threads (NVRTC compiles without the GIL); records in order."""
    unique = list(dict.fromkeys(jobs))

    def one(job):
        label, source, options, arch = job
        return precompile_module(label, source, options, arch, folder, dry_run)

    if workers <= 1 or len(unique) <= 1:
        return [one(job) for job in unique]
    with ThreadPoolExecutor(min(workers, len(unique))) as pool:
        return list(pool.map(one, unique))
