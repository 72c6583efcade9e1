"""The first-use probes on the GPU: what ``planner.first_use`` derives a cost model from when a
device has no profile (docs/design/first-use.md). Everything is timed with the one timing
routine (``measure.timing``): an empty kernel in a CUDA graph and launched alone
(``runtime.probe_kernels``), the streaming read at full occupancy and at one and two CTAs an SM
(``measure.bandwidth_probe``), and the decode plans of ``planner.first_use.probe_cases`` run by
a wrapper. The decode plans' builds compile first, all at once over the CPU's cores, into
splitkv's cache of compiled kernels (``compile_probe_builds``), where each wrapper then loads
its build. 1.8 s on the H200 once compiled, 7.9 s with the kernels' first compiles (one after
another) where no cache held them yet.

A wrapper reaches ``DeviceProbes`` without the runtime importing this package:
``splitkv/__init__.py`` installs it as the first-use source a wrapper asks for
(``splitkv._first_use_source``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from ..planner.first_use import ProbeResults, ProbesDeferred, probe_cases, probe_ctas_per_sm
from ..planner.profiles import ProfileError, read_profile, user_profile_path
from ..runtime import device_info, driver_version

# Kernels a graph of the empty-kernel probe holds: the graph's own launch spread thin, as the
# timing routine's graphs of one decode call a layer do.
EMPTY_LAYERS = 32
# The streaming read's launch shapes (CTAs per SM, threads, 16-byte loads in flight a
# thread): two at full occupancy, whose best is the device's bandwidth, then one and two
# CTAs an SM (what a lone grid streams; recorded beside the model).
READ_FULL = ((4, 512, 4), (8, 256, 4))
READ_BY_SM = ((1, 512, 4), (2, 512, 4))
# Fewer and shorter trials than the bench's: the probes price a model, not a table of record.
PROBE_TIMING = {"trials": 3, "min_trial_ms": 5.0}
# The probes' buffers: several times the L2, so that each layer's K/V comes from DRAM.
L2_MULTIPLE = 4
MIN_PROBE_BYTES = 64 << 20


def probe_bytes(l2_bytes: int) -> int:
    return max(MIN_PROBE_BYTES, L2_MULTIPLE * int(l2_bytes)) // 16 * 16


def time_empty_kernel(trials: int, min_trial_ms: float) -> tuple[float, float]:
    """(microseconds an empty kernel takes inside a CUDA graph, launched alone)."""
    from ..runtime.cupy_timers import cupy_timer, current_stream
    from ..runtime.probe_kernels import empty_kernel_launch
    from .timing import median_us_per_call, time_graph_us

    launch = empty_kernel_launch()
    graph_us = time_graph_us(lambda layer, stream: launch(), EMPTY_LAYERS, trials=trials,
                             min_trial_ms=min_trial_ms)
    stream = current_stream()
    launch()
    eager_us = median_us_per_call(cupy_timer(launch, stream), trials=trials,
                                  min_trial_ms=min_trial_ms)
    return graph_us, eager_us


def time_cases(cases, min_total_bytes: int, trials: int, min_trial_ms: float,
               seed: int = 0) -> dict[str, float]:
    """Microseconds of each ``ProbeCase``'s plan, run by a wrapper on random K/V over a page
    table with its pages scattered; cases of one problem share their layers."""
    from ..testing import scattered_page_table
    from .timing import make_layers, time_plan_us

    rng = np.random.default_rng(seed)
    out, problem, table, data = {}, None, None, None
    for case in cases:
        p = case.plan.problem
        if p is not problem:
            problem, data = p, None                # free the last shape's layers first
            table = scattered_page_table(p.kv_lens, p.page_size, rng)[0]
            data = make_layers(table, p.num_qo_heads, p.num_kv_heads, p.head_dim, p.dtype,
                               min_total_bytes=min_total_bytes)
        out[case.name] = float(time_plan_us(case.plan, table, data=data, trials=trials,
                                            min_trial_ms=min_trial_ms))
    return out


def probe_modules(cases, device) -> list[tuple[str, str, tuple, str]]:
    """(label, source, options, arch) of each build the probe ``cases`` run on ``device`` (its
    ``DeviceProperties``): the build a default wrapper's ``plan(plan=)`` picks for each, as
    ``modules.load_module`` looks it up; one entry a build, in the cases' order."""
    from ..core.variants import PLAIN
    from ..runtime.compiled_builds import base_build, per_shape_build
    from ..runtime.experiments import DecodeExperiments
    from ..runtime.kernel_source import NVRTC_OPTIONS
    from ..runtime.per_shape import plan_grid_size

    experiments, builds = DecodeExperiments(), {}
    for case in cases:
        # as a default wrapper runs it there (use_clusters=None: where the GPU has them)
        plan = case.plan.with_execution(clusters=device.cc >= 90)
        p = plan.problem
        base = base_build(p.dtype, p.head_dim, p.num_qo_heads // p.num_kv_heads, p.page_size,
                             None, experiments)
        _, ctas, row_tiles = plan_grid_size(plan, p.num_qo_heads, p.num_kv_heads, experiments)
        build = per_shape_build(base, plan, ctas, row_tiles, page_size=p.page_size,
                                experiments=experiments, variant=PLAIN, device=device)
        builds.setdefault(build, None)
    return [(b.name, b.source(), NVRTC_OPTIONS, f"sm_{device.cc}") for b in builds]


def compile_probe_builds(cases, device, workers: int | None = None) -> list[dict]:
    """Compile the probes' builds at once, over ``workers`` threads (None: one a CPU core, at
    most one a build), into splitkv's cache of compiled kernels, where the wrapper that times
    each probe loads it instead of compiling one after another (NVRTC compiles without the
    GIL). Those already there are not compiled again. Where this cannot be done (a cache that
    cannot be written, or an NVRTC that has no CUBIN target for this GPU, where CuPy compiles
    for the nearest it has), the wrappers compile as they go: one notice for a cache that
    cannot be written or a failed compile, none for a GPU past NVRTC. Returns
    ``precompile``'s records ([] where nothing was compiled here)."""
    from .._log import logger
    from ..runtime.cubin_cache import cubin_dir
    from ..runtime.kernel_source import nvrtc_archs
    from ..runtime.precompile_jobs import precompile

    supported = nvrtc_archs()
    if supported and device.cc not in supported:
        return []
    folder = cubin_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as exc:
        logger.warning("first-use probes: splitkv's kernel cache cannot be written (%s); each "
                       "probe compiles its build when first run", exc)
        return []
    jobs = probe_modules(cases, device)
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    try:
        return precompile(jobs, folder, workers=workers)
    except (OSError, RuntimeError) as exc:     # a write, or NVRTC, failed: the wrappers retry
        logger.warning("first-use probes: compiling their builds ahead failed (%s); each "
                       "compiles when first run", str(exc).splitlines()[0] if str(exc) else exc)
        return []


def run_probes(trials: int = PROBE_TIMING["trials"],
               min_trial_ms: float = PROBE_TIMING["min_trial_ms"]) -> ProbeResults:
    """Time every first-use probe on the current device."""
    from ..runtime.device_features import device_properties
    from .bandwidth_probe import read_gbps_by_shape

    start = time.perf_counter()
    info = device_info()
    props = device_properties()
    nbytes = probe_bytes(info["l2_bytes"])
    cases = probe_cases(props.num_sms, probe_ctas_per_sm(props))
    marks = [time.perf_counter()]
    compile_probe_builds(cases, props)
    marks.append(time.perf_counter())
    graph_us, eager_us = time_empty_kernel(trials, min_trial_ms)
    marks.append(time.perf_counter())
    read = read_gbps_by_shape(nbytes, trials, READ_FULL + READ_BY_SM)
    marks.append(time.perf_counter())
    full_keys = tuple(f"{c}x{t}x{lo}" for c, t, lo in READ_FULL)
    decode = time_cases(cases, nbytes, trials, min_trial_ms)
    marks.append(time.perf_counter())
    phases = {name: round(b - a, 3) for name, a, b in
              zip(("compile", "empty_kernel", "read", "decode"), marks, marks[1:])}
    return ProbeResults(device_name=info["name"], num_sms=props.num_sms, cc=props.cc,
                        shared_per_block_optin=props.shared_per_block_optin,
                        shared_per_sm=props.shared_per_sm, driver_version=driver_version(),
                        empty_graph_us=graph_us, empty_eager_us=eager_us, read_gbps=read,
                        full_read_keys=full_keys, decode_us=decode,
                        seconds=time.perf_counter() - start, phase_seconds=phases,
                        l2_bytes=info["l2_bytes"])


def run_quick_calibration(device_id: int, name: str):
    """``splitkv calibrate --quick`` on this device, in a child process (the calibration sits
    above the measuring code); its profile goes where ``load_profile`` finds calibrations.
    Returns it."""
    cmd = [sys.executable, "-m", "splitkv", "calibrate", "--quick", "--device", str(device_id)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    path = user_profile_path(name)
    if done.returncode != 0 or not path.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(cmd[1:])}` exited {done.returncode}: "
                           + " | ".join(tail))
    try:
        return read_profile(path)
    except ProfileError as e:
        raise RuntimeError(str(e)) from None


class DeviceProbes:
    """The current device as ``load_profile``'s ``first_use`` source
    (``planner.first_use.resolve``): what a wrapper's ``profile`` passes, through
    ``splitkv._first_use_source``."""

    def __init__(self):
        self.info = device_info()
        self.driver_version = driver_version()
        self.cc = int(self.info["cc"])
        self.num_sms = self.info["num_sms"]

    def read_bandwidth(self) -> float:
        """The device's streaming read (GB/s): the best of the full-occupancy read shapes,
        as the probes' ``bandwidth_gbps``."""
        from .bandwidth_probe import read_gbps_by_shape

        refuse_inside_a_capture()
        trials, nbytes = PROBE_TIMING["trials"], probe_bytes(self.info["l2_bytes"])
        return max(read_gbps_by_shape(nbytes, trials, READ_FULL).values())

    def probe(self) -> ProbeResults:
        refuse_inside_a_capture()
        return run_probes()

    def calibrate(self):
        refuse_inside_a_capture()
        return run_quick_calibration(self.info["device_id"], self.info["name"])


def refuse_inside_a_capture() -> None:
    """The probes synchronize to time kernels, which a CUDA graph capture forbids (and which
    would invalidate the caller's capture): under CuPy's or torch's capture they wait for a
    plan made outside one."""
    from ..runtime.cupy_timers import current_stream_capturing

    if current_stream_capturing():
        raise ProbesDeferred("a CUDA graph is being captured on the current stream")
